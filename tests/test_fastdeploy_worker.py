"""Worker side of the FastDeploy drop-in: persistent state tables indexed by ``request.idx`` (Paddle CPU).

The engine is :class:`tests.test_fastdeploy_rmv1.RMv1` (FastDeploy's ``ResourceManagerV1``
control flow) over the facade; its tasks go to :class:`StateTables` as FastDeploy's runner takes
them in ``insert_tasks_v1``. Swaps are hybridkv's (FastDeploy preempts by recompute only): a swapped
request leaves the running list with a ``SWAP_OUT`` task and comes back with a decode task carrying
its new block ids. The host tier (patches E9, W6): the step's ``tier_copies`` run on torch CPU pools,
every offloaded and onloaded block compared byte for byte, and every prefill chunk's reads checked.
"""

import importlib.util
import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy.facade import FastDeployBlockManager
from hybridkv.integrations.fastdeploy.tensors import to_like, to_numpy
from hybridkv.integrations.fastdeploy.worker import PAD_BLOCK, StateTables, allocate_caches, attach_worker
from tests.test_fastdeploy_rmv1 import RMv1
from tests.test_fastdeploy_world import check_books, make_requests, run_worker_step, tiny_layout

try:
    import paddle
except ImportError:  # the paddle tests skip; the argument checks below run on torch
    paddle = None
needs_paddle = pytest.mark.skipif(paddle is None, reason="paddle is not installed")
FW = "torch" if importlib.util.find_spec("torch") is not None else "paddle"
"""The framework of the host-tier runs: torch where installed (the torch lane), Paddle in the no-torch lane."""

MAX_NUM_SEQS = 6


@dataclass
class SwapOutTask:
    idx: int
    request_id: str
    task_type: str = "SWAP_OUT"


def expected_row(fd: FastDeployBlockManager, request_id) -> np.ndarray:
    width = max(fd.manager.layout.blocks_per_state)
    row = np.full((fd.manager.num_state_groups, width), PAD_BLOCK, dtype=np.int32)
    for g, ids in enumerate(fd.state_block_table(request_id)):
        row[g, : len(ids)] = ids
    return row


@needs_paddle
def test_state_tables_stay_in_place_across_100_steps_of_arrivals_preemptions_and_swaps():
    layout = tiny_layout(25)  # 24 usable blocks: 4 state blocks a request, so preemptions happen
    fd = FastDeployBlockManager(HybridBlockManager(layout, num_host_blocks=48))
    rm = RMv1(fd, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=12)
    caches = allocate_caches(layout, framework="paddle")
    tables = StateTables(layout, MAX_NUM_SEQS, framework="paddle")
    buf, ptr = tables.state_block_tables, tables.state_block_tables.data_ptr()
    assert buf.dtype == paddle.int32 and list(buf.shape) == [2, MAX_NUM_SEQS, 2]
    assert (tables.numpy() == PAD_BLOCK).all()
    forward_meta = SimpleNamespace()

    rng = random.Random(7)
    pending = make_requests(rng, 40, shared_prefix=False)
    swapped: list = []
    seen = {"preempt": 0, "swap_out": 0, "swap_in": 0, "finished": 0}
    for _ in range(100):
        for _ in range(rng.randrange(3)):
            if pending:
                rm.add_request(pending.pop(0))
        tasks, _ = rm.schedule()
        seen["preempt"] += sum(
            getattr(t, "task_type", None) is not None and t.task_type.name == "PREEMPTED" for t in tasks
        )
        # swap a decoding request out, or one back in, now and then
        decoding = [r for r in rm.running if r.num_computed_tokens >= r.need_prefill_tokens and r.output_token_ids]
        if decoding and rng.random() < 0.3:
            req = rng.choice(decoding)
            if fd.can_swap_out(req):
                fd.swap_out(req).commit()  # the executor's block copies would run here
                rm.running.remove(req)
                req.block_tables = []
                swapped.append(req)
                tasks.append(SwapOutTask(req.idx, req.request_id))
                rm.tasks_list[req.idx], rm.stop_flags[req.idx] = None, True  # it leaves the batch
                seen["swap_out"] += 1
        if swapped and rng.random() < 0.5 and True in rm.stop_flags and len(rm.running) < MAX_NUM_SEQS:
            req = swapped[0]
            if fd.can_swap_in(req):
                fd.swap_in(req).commit()
                swapped.pop(0)
                req.idx = rm.get_available_position()  # back into a free batch slot
                rm.tasks_list[req.idx], rm.stop_flags[req.idx] = req, False
                req.block_tables = fd.kv_block_table(req.request_id)
                rm.running.append(req)
                tasks.append(rm._prepare_decode_task(req))
                seen["swap_in"] += 1
        tables.apply(tasks)
        attach_worker(forward_meta, caches, tables)

        # the same tensor, the same memory, every step; rows match the manager
        assert forward_meta.state_block_tables is buf and buf.data_ptr() == ptr
        assert forward_meta.caches is caches.caches and forward_meta.state_layer_slots is caches.layer_slots
        check_books(rm, fd, tuple(r.request_id for r in swapped))
        rows = tables.numpy()
        live = {r.idx: r.request_id for r in rm.running}
        for idx in range(MAX_NUM_SEQS):
            if idx in live:
                assert tables.request_ids[idx] == live[idx]
                np.testing.assert_array_equal(rows[:, idx], expected_row(fd, live[idx]))
            else:
                assert (rows[:, idx] == PAD_BLOCK).all(), f"slot {idx} holds no running request: -1 row"

        done = run_worker_step(rm, tasks, rng)
        for rid in done:
            tables.release(rm.requests[rid].idx)  # the runner marks the slot stopped
        rm.finish_requests(done)
        seen["finished"] += len(done)
    assert seen["preempt"] > 0 and seen["swap_out"] > 0 and seen["swap_in"] > 0 and seen["finished"] > 10, seen
    assert buf.data_ptr() == ptr


@needs_paddle
def test_rows_of_groups_with_fewer_blocks_are_padded_like_block_tables():
    layout = tiny_layout(17)
    tables = StateTables(layout, 3, framework="paddle")
    tables.set_row(1, [[5, 6], [7, 8]], "a")
    rows = tables.numpy()
    assert rows[:, 1].tolist() == [[5, 6], [7, 8]] and (rows[:, [0, 2]] == PAD_BLOCK).all()
    with pytest.raises(ValueError, match="needs 2 block ids"):
        tables.set_row(0, [[5], [7, 8]])
    tables.apply([SimpleNamespace(idx=1, request_id="a", task_type=SimpleNamespace(name="PREEMPTED"))])
    assert (tables.numpy() == PAD_BLOCK).all()


def _state_of(tokens, layer_id: int, nbytes: int) -> np.ndarray:
    """The 'model': the state of a layer after ``tokens`` (any deterministic function of them)."""
    seed = hash((tuple(tokens), layer_id)) % 2**32
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@needs_paddle
@pytest.mark.parametrize(
    # 24 blocks: tight enough to preempt. At 21, FastDeploy 7808a119's own control flow stalls: a prefill
    # chunk that cannot get its block breaks the RUNNING loop before the decode request behind it,
    # which alone could be preempted (_select_preempt_candidate takes RUNNING_DECODE only)
    ("num_blocks", "checkpoint"),
    [(64, "every_n_blocks"), (64, "branch_and_last"), (24, "every_n_blocks")],
)
def test_states_survive_prefix_hits_chunks_and_preemption_through_the_task_copies(num_blocks, checkpoint):
    """Each forward checks that the live state of every request it runs is the state after exactly
    the tokens before its first position, then writes the state after its last one. The copies
    travel in the tasks: prefix-hit fills before the forward, checkpoints right after it."""
    from hybridkv.blockmgr.prefix import PrefixCacheConfig
    from hybridkv.integrations.fastdeploy.state import read_state_bytes, write_state_bytes
    from hybridkv.integrations.fastdeploy.worker import copy_blocks, state_layer_slots
    from tests.test_fastdeploy_world import Request

    layout = tiny_layout(num_blocks)
    fd = FastDeployBlockManager(
        HybridBlockManager(layout, prefix_cache=PrefixCacheConfig(checkpoint=checkpoint, every_n=1))
    )
    rm = RMv1(fd, max_num_seqs=4, max_num_batched_tokens=10, prefix=True)
    caches = allocate_caches(layout, framework="paddle")
    layers = state_layer_slots(caches)
    nbytes = {lid: layout.model.layers[lid].state_bytes for lid in layers}
    rng = random.Random(1)
    pending = make_requests(rng, 16, shared_prefix=True)
    checked = {"initial": 0, "hit": 0}

    def live(rid, lid):
        st = layers[lid]
        return read_state_bytes(st, layout, fd.state_block_table(rid)[st.group], nbytes[lid])

    for _ in range(300):
        if pending and rng.random() < 0.6:
            rm.add_request(pending.pop(0))
        tasks, _ = rm.schedule()
        check_books(rm, fd)
        for t in tasks:
            if hasattr(t, "state_copies"):
                copy_blocks(caches, t.state_copies)  # before the forward
        prefills = {t.request_id: t for t in tasks if isinstance(t, Request)}
        for req in rm.running:
            tokens = req.prompt_token_ids + req.output_token_ids
            if req.request_id in prefills:
                start, end = req.prefill_start_index, req.prefill_end_index
                checked["hit"] += start > 0 and start == req.num_cached_tokens and start % 4 == 0
            elif req.num_computed_tokens >= req.need_prefill_tokens and rm.allocated_slots(req) >= len(tokens):
                start, end = len(tokens) - 1, len(tokens)
            else:
                continue
            for lid in layers:
                if start > 0:
                    np.testing.assert_array_equal(
                        live(req.request_id, lid), _state_of(tokens[:start], lid, nbytes[lid])
                    )
                    checked["initial"] += 1
                st = layers[lid]
                write_state_bytes(
                    st,
                    layout,
                    fd.state_block_table(req.request_id)[st.group],
                    _state_of(tokens[:end], lid, nbytes[lid]),
                )
        for t in tasks:
            if hasattr(t, "checkpoint_copies"):
                copy_blocks(caches, t.checkpoint_copies)  # right after the forward
        done = run_worker_step(rm, tasks, rng)
        rm.finish_requests(done)
        if not pending and not rm.running and not rm.waiting:
            break
    assert not fd.manager.requests and checked["initial"] > 50, checked
    if num_blocks == 64:
        assert checked["hit"] > 0 and not rm.preemptions, checked
    else:  # the tight pool preempts (recompute from 0) and evicts checkpoints instead
        assert sum(rm.preemptions.values()) > 0


# ---- argument checks (torch: they need no paddle) ---------------------------------------------------
# The checks raise BatchSlotError (an IndexError) and BlockIdError (a ValueError); the tests below
# match the base classes and the messages, test_worker_errors_are_typed the classes themselves.
def _torch_tables(max_num_seqs: int = 3):
    layout = tiny_layout(17)  # block ids 1..16 are real; 2 state groups of 2 blocks
    return layout, StateTables(layout, max_num_seqs, framework=FW)


@pytest.mark.parametrize("slot", [-1, -3, 3, 10**6])
def test_set_row_refuses_a_slot_outside_the_batch_and_writes_nothing(slot):
    _, tables = _torch_tables()
    tables.set_row(2, [[5, 6], [7, 8]], "last")
    before = tables.numpy().copy()
    with pytest.raises(IndexError, match=r"batch slot -?\d+ is outside \[0, 3\)"):
        tables.set_row(slot, [[1, 2], [3, 4]], "x")
    np.testing.assert_array_equal(tables.numpy(), before)  # slot -1 used to rewrite slot 2's row
    assert tables.request_ids == [None, None, "last"]


@pytest.mark.parametrize("slot", [True, 1.0, "1", None, np.float64(1)])
def test_set_row_refuses_a_slot_that_is_not_an_integer(slot):
    _, tables = _torch_tables()
    with pytest.raises(TypeError, match="batch slot must be an integer"):
        tables.set_row(slot, [[1, 2], [3, 4]])
    assert (tables.numpy() == PAD_BLOCK).all()


@pytest.mark.parametrize("bad", [0, -9, -1, 17, 10**6, 10**30])
def test_set_row_refuses_block_ids_that_are_no_real_block_of_the_layout(bad):
    _, tables = _torch_tables()
    with pytest.raises(ValueError, match="not a block id|not block ids|too large"):
        tables.set_row(0, [[5, bad], [7, 8]])
    assert (tables.numpy() == PAD_BLOCK).all() and tables.request_ids == [None] * 3


@pytest.mark.parametrize("bad", [True, 2.0, 2.5, "5", None, [5]])
def test_set_row_refuses_block_ids_that_are_not_integers(bad):
    _, tables = _torch_tables()
    with pytest.raises(TypeError, match="not an integer|integer block ids|sequence of block ids|rectangular"):
        tables.set_row(0, [[5, bad], [7, 8]])
    with pytest.raises(TypeError, match="integer block ids"):
        tables.set_row(0, [np.array([5.0, 6.0]), [7, 8]])
    assert (tables.numpy() == PAD_BLOCK).all()


def test_set_row_refuses_a_block_id_twice_and_takes_numpy_ids():
    _, tables = _torch_tables()
    with pytest.raises(ValueError, match=r"\[6\] appear more than once"):
        tables.set_row(0, [[5, 6], [6, 8]])
    tables.set_row(np.int64(1), [np.array([5, 6], dtype=np.int32), [np.int64(7), 8]], "a")
    assert tables.numpy()[:, 1].tolist() == [[5, 6], [7, 8]]


def test_release_and_apply_check_every_slot_and_task_before_writing():
    _, tables = _torch_tables()
    tables.set_row(2, [[5, 6], [7, 8]], "c")
    before = tables.numpy().copy()
    for bad in (-1, 3):
        with pytest.raises(IndexError):
            tables.release(bad)
    with pytest.raises(TypeError):
        tables.release(2.0)
    prefill = SimpleNamespace(idx=0, request_id="a", task_type="PREFILL", state_block_tables=[[1, 2], [3, 4]])
    preempt = SimpleNamespace(idx=2, request_id="c", task_type="PREEMPTED")
    bad_ids = SimpleNamespace(idx=1, request_id="b", task_type="DECODE", state_block_tables=[[9, 0], [3, 4]])
    bad_slot = SimpleNamespace(idx=-1, request_id="d", task_type="DECODE", state_block_tables=[[9, 10], [11, 12]])
    with pytest.raises(ValueError, match="DECODE task of 'b'"):
        tables.apply([prefill, preempt, bad_ids])
    with pytest.raises(IndexError, match="DECODE task of 'd'"):
        tables.apply([prefill, preempt, bad_slot])
    np.testing.assert_array_equal(tables.numpy(), before)  # the good tasks before the bad one wrote nothing
    tables.apply([prefill, preempt])
    assert tables.numpy()[:, 0].tolist() == [[1, 2], [3, 4]] and (tables.numpy()[:, 2] == PAD_BLOCK).all()


def test_worker_constructors_refuse_bad_arguments():
    layout = tiny_layout(17)
    for bad in (0, -1, 2.0, True):
        with pytest.raises((TypeError, ValueError)):
            StateTables(layout, bad, framework=FW)
    with pytest.raises(ValueError, match="framework"):
        StateTables(layout, 2, framework="jax")
    with pytest.raises(ValueError, match="framework"):
        allocate_caches(layout, framework="jax")
    with pytest.raises(ValueError, match="below the model's 3 layers"):
        allocate_caches(layout, num_layers=2, framework=FW)
    with pytest.raises(TypeError):
        allocate_caches(layout, num_layers=3.0, framework=FW)
    caches = allocate_caches(layout, framework=FW)
    other = StateTables(tiny_layout(25), 2, framework=FW)
    with pytest.raises(ValueError, match="different layouts"):
        attach_worker(SimpleNamespace(), caches, other)
    with pytest.raises(TypeError):
        attach_worker(SimpleNamespace(), caches, "tables")


def test_copy_blocks_and_state_bytes_refuse_ids_that_are_no_real_block():
    from hybridkv.integrations.fastdeploy.state import gather_state_bytes, read_state_bytes, write_state_bytes
    from hybridkv.integrations.fastdeploy.worker import copy_blocks

    layout = tiny_layout(17)
    caches = allocate_caches(layout, framework=FW)
    for t in caches.segments[0]:
        t[16] = 9  # the last block: what a -1 index would reach
    tensors = [t for segs in caches.segments for t in segs]
    snapshot = [t.clone() for t in tensors]

    def unchanged():
        return all(bool((a == b).all()) for a, b in zip(snapshot, tensors, strict=True))

    for copies in ([[16], [0]], [[-1], [3]], [[3], [17]], [[3, 4], [5, 5]]):
        with pytest.raises(ValueError):
            copy_blocks(caches, copies)
        assert unchanged(), copies
    with pytest.raises(ValueError, match=r"equal length, got shapes \[1\] and \[2\]"):
        copy_blocks(caches, [[3], [4, 5]])
    with pytest.raises(TypeError):
        copy_blocks(caches, [[3.0], [4]])
    with pytest.raises(TypeError):
        copy_blocks(caches, [[3], [4], [5]])
    assert unchanged()
    copy_blocks(caches, [[16], [3]])
    assert bool((caches.segments[0][0][3] == 9).all())
    snapshot = [t.clone() for t in tensors]

    slot = caches.layer_slots[1]
    nbytes = layout.model.layers[1].state_bytes
    with pytest.raises(ValueError):
        read_state_bytes(slot, layout, [5, -1], nbytes)  # a padded set would read the last block
    with pytest.raises(ValueError):
        gather_state_bytes(slot, layout, np.array([[5, 6], [-1, -1]]), nbytes)
    with pytest.raises(ValueError, match="more than once"):
        write_state_bytes(slot, layout, [5, 5], np.zeros(nbytes, dtype=np.uint8))
    with pytest.raises(ValueError, match="needs 2 block ids"):
        write_state_bytes(slot, layout, [5], np.zeros(nbytes, dtype=np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        write_state_bytes(slot, layout, [5, 6], np.zeros(nbytes, dtype=np.float32))
    with pytest.raises(ValueError, match="exceed the state set"):
        read_state_bytes(slot, layout, [5, 6], 10**6)
    assert unchanged()


def test_worker_errors_are_typed():
    from hybridkv.errors import HybridKVError
    from hybridkv.integrations.fastdeploy.worker import BatchSlotError, BlockIdError

    assert issubclass(BatchSlotError, IndexError) and issubclass(BlockIdError, ValueError)
    assert issubclass(BatchSlotError, HybridKVError) and issubclass(BlockIdError, HybridKVError)
    _, tables = _torch_tables()
    with pytest.raises(BatchSlotError):
        tables.set_row(-1, [[1, 2], [3, 4]])
    with pytest.raises(BlockIdError):
        tables.set_row(0, [[0, 2], [3, 4]])


# ---- the host tier: FastDeploy's call order over real (torch CPU) pools, every byte checked ---------------------
def _pattern(key: int, n: int) -> np.ndarray:
    return np.random.default_rng(key & (2**63 - 1)).integers(0, 256, n, dtype=np.uint8)


def _key(*parts) -> int:
    return hash(parts) & (2**63 - 1)


class ByteWorker:
    """FastDeploy's runner over :class:`FastDeployCaches` and :class:`FastDeployHostCaches`: each step
    runs the batch's ``tier_copies`` (W6), the tasks' ``state_copies``, a forward that writes every
    KV block of the chunk and the live state sets with bytes that follow from the tokens, then the
    ``checkpoint_copies``. Before a prefill chunk it checks every full KV block below the chunk and
    the live state against those bytes; around the tier copies, that every offloaded device block's
    bytes land in its host block and every onloaded host block's bytes in its device block."""

    def __init__(self, fd: FastDeployBlockManager):
        from hybridkv.integrations.fastdeploy.host_tier import allocate_host_caches

        self.fd, self.bs = fd, fd.block_size
        self.caches = allocate_caches(fd.manager.layout, framework=FW)
        self.host = allocate_host_caches(self.caches, fd.manager.host_pool.num_usable, pin_memory=False)
        self.tensors = [t for segs in self.caches.segments for t in segs]
        self.on_host: dict[int, bytes] = {}  # host block -> the bytes an offload put there
        self.moved = {"offload": 0, "onload": 0, "bytes": 0}
        self.prefill_checks = 0

    def block(self, b: int) -> bytes:
        return b"".join(to_numpy(t[b]).tobytes() for t in self.tensors)

    def host_block(self, h: int) -> bytes:
        return to_numpy(self.host.pools.data[h]).tobytes()

    def write(self, b: int, key: int) -> None:
        for i, t in enumerate(self.tensors):
            t[b] = to_like(_pattern(_key(key, i), t.shape[1]), t)

    def expected(self, key: int) -> bytes:
        return b"".join(_pattern(_key(key, i), t.shape[1]).tobytes() for i, t in enumerate(self.tensors))

    def run_tier(self, tasks) -> None:
        from hybridkv.integrations.fastdeploy.host_tier import run_tier_copies

        for task in tasks:
            copies = getattr(task, "tier_copies", None)
            if copies is None:
                continue
            out, back = copies["offload"], copies["onload"]
            before = {h: self.block(d) for d, h in zip(*out, strict=True)}
            moved = run_tier_copies(self.caches, self.host, copies)
            assert moved == (len(out[0]) + len(back[0])) * self.fd.manager.layout.bytes_per_block
            for h, data in before.items():
                assert self.host_block(h) == data  # the offloaded bytes are on the host
            self.on_host.update(before)
            for d, h in zip(*back, strict=True):
                assert self.block(d) == self.on_host[h]  # ... and come back byte for byte
            self.moved["offload"] += len(out[0])
            self.moved["onload"] += len(back[0])
            self.moved["bytes"] += moved

    def step(self, tasks) -> None:
        from hybridkv.integrations.fastdeploy.worker import copy_blocks
        from tests.test_fastdeploy_world import Request

        self.run_tier(tasks)
        prefills = [t for t in tasks if isinstance(t, Request)]
        for t in tasks:
            if getattr(t, "state_copies", None):
                copy_blocks(self.caches, t.state_copies)
        bs = self.bs
        for t in prefills:
            tokens, start, end = tuple(t.prompt_token_ids), t.prefill_start_index, t.prefill_end_index
            states = [b for ids in t.state_block_tables for b in ids]
            for j in range(start // bs):
                assert self.block(t.block_tables[j]) == self.expected(_key("kv", tokens[: (j + 1) * bs])), (t, j)
            if start:
                for i, b in enumerate(states):
                    assert self.block(b) == self.expected(_key("state", tokens[:start], i)), (t.request_id, i)
            self.prefill_checks += 1
            for j in range(start // bs, -(-end // bs)):
                self.write(t.block_tables[j], _key("kv", tokens[: min((j + 1) * bs, end)]))
            for i, b in enumerate(states):
                self.write(b, _key("state", tokens[:end], i))
        for t in prefills:
            if getattr(t, "checkpoint_copies", None) and t.checkpoint_copies[0]:
                copy_blocks(self.caches, t.checkpoint_copies)


def _host_tier_facade(num_blocks: int = 40, host_blocks: int = 400):
    from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig

    cfg = SimpleNamespace(block_size=4, enable_prefix_caching=True, swap_space=None, num_cpu_blocks=host_blocks)
    prefix = PrefixCacheConfig(CheckpointPolicy.EVERY_N_BLOCKS, every_n=2)
    return FastDeployBlockManager.from_cache_config(tiny_layout(num_blocks), cfg, prefix=prefix)


def _host_tier_workload(rng: random.Random):
    """Two 16-token prefixes, used by three requests (the third hits the device), then pushed off
    the device by requests with inputs of their own, then used again: from the host tier."""
    from tests.test_fastdeploy_world import Request

    prefixes = [[rng.randrange(1000) for _ in range(16)] for _ in range(2)]
    waves = []
    for rnd in range(3):
        waves.append([Request(f"p{rnd}.{i}", prefixes[i % 2] + [rng.randrange(1000) for _ in range(5)], 2)
                      for i in range(3)])  # fmt: skip
        waves.append([Request(f"f{rnd}.{i}", [5000 + 100 * (3 * rnd + i) + j for j in range(44)], 2)
                      for i in range(3)])  # fmt: skip
    return waves


@pytest.mark.parametrize("v1_mode", [False, True], ids=["legacy", "v1"])
def test_host_hits_bring_back_every_offloaded_byte_and_their_metrics_match_the_manager(v1_mode):
    fd = _host_tier_facade()
    rm = RMv1(fd, max_num_seqs=2, max_num_batched_tokens=24, v1_mode=v1_mode, prefix=True)
    worker = ByteWorker(fd)
    stats, rng = fd.manager.prefix_cache.stats, random.Random(3)
    waves = _host_tier_workload(rng)
    steps = 0
    while waves or rm.running or rm.waiting:
        if waves and not rm.running and not rm.waiting:
            for r in waves.pop(0):
                rm.add_request(r)
        tasks, _ = rm.schedule()
        worker.step(tasks)
        done = run_worker_step(rm, tasks, rng)
        if done:
            rm.finish_requests(done)
        check_books(rm, fd)
        steps += 1
        assert steps < 500
    fd.begin_step()
    tier = fd.manager.prefix_cache.tier
    assert not rm.swallowed and not rm.over_slots
    assert tier.stats.offloaded_kv and tier.stats.onloaded_kv and worker.moved["onload"] > 0
    # the host hits FastDeploy was told are the manager's, token for token (hit_info -> request.metrics)
    assert stats.hit_tokens_host > 0
    assert rm.main_metrics["prefix_cpu_cache_token_num"] == stats.hit_tokens_host
    assert fd.metrics.total_cpu_matched_token_num == stats.hit_tokens_host
    assert rm.main_metrics["prefix_cache_token_num"] == stats.hit_tokens == fd.metrics.matched_token_num
    assert 0 < fd.metrics.cpu_hit_token_ratio < fd.metrics.hit_token_ratio
    assert fd.metrics.gpu_hit_token_ratio > 0
    # every onloaded block was checked against what its offload wrote; every block is back
    m, moved = fd.manager, worker.moved
    assert moved["onload"] == tier.stats.blocks_in(m.num_state_blocks)
    assert moved["offload"] == tier.stats.blocks_out(m.num_state_blocks)
    assert moved["bytes"] == (moved["onload"] + moved["offload"]) * m.layout.bytes_per_block
    assert worker.prefill_checks > 10
    assert not m.requests and fd.num_free_device_blocks == m.pool.num_usable
    assert m.host_pool.num_free + tier.num_blocks == m.host_pool.num_usable and m.usage().host_used == 0
    m.check_integrity()


def _all_bytes(caches, host) -> list[bytes]:
    out = [to_numpy(t).tobytes() for segs in caches.segments for t in segs]
    out += [to_numpy(t).tobytes() for pair in caches.scales if pair is not None for t in pair]
    out.append(to_numpy(host.pools.data).tobytes())
    return out + [to_numpy(t).tobytes() for pair in host.scales if pair is not None for t in pair]


def test_tier_copies_move_every_segment_and_block_wise_fp8_scale_of_a_block():
    from hybridkv.integrations.fastdeploy.host_tier import allocate_host_caches, run_tier_copies
    from tests.test_fastdeploy import minimax_layout

    layout = minimax_layout("block_wise_fp8", num_blocks=8)
    caches = allocate_caches(layout, framework=FW)
    host = allocate_host_caches(caches, 4, pin_memory=False)
    assert host.bytes_per_block == layout.bytes_per_block  # every segment row and both scale rows
    rng = np.random.default_rng(0)
    tensors = [t for segs in caches.segments for t in segs] + [t for p in caches.scales if p is not None for t in p]
    for t in tensors:  # block 5: random bytes in every allocation (scales as float32 values)
        values = rng.integers(0, 256, tuple(t[5].shape))
        t[5] = to_like(values.astype(np.uint8 if "uint8" in str(t.dtype) else np.float32), t)
    original = [to_numpy(t[5]).copy() for t in tensors]
    moved = run_tier_copies(caches, host, {"offload": [[5], [3]], "onload": [[], []]})
    for t in tensors:
        t[5] = 0
    moved += run_tier_copies(caches, host, {"offload": [[], []], "onload": [[7], [3]]})
    assert moved == 2 * layout.bytes_per_block
    assert all(np.array_equal(to_numpy(t[7]), o) for t, o in zip(tensors, original, strict=True))


@pytest.mark.parametrize(
    ("copies", "error"),
    [
        ({"offload": [[0], [1]], "onload": [[], []]}, ValueError),  # the null block
        ({"offload": [[-1], [1]], "onload": [[], []]}, ValueError),  # the padding
        ({"offload": [[3], [9]], "onload": [[], []]}, ValueError),  # past the host pool
        ({"offload": [[3, 4], [1, 1]], "onload": [[], []]}, ValueError),  # a host block written twice
        ({"offload": [[], []], "onload": [[3, 3], [1, 2]]}, ValueError),  # a device block written twice
        ({"offload": [[3, 4], [1]], "onload": [[], []]}, ValueError),  # unequal lengths
        ({"offload": [[3], [1]], "onload": [[2], [1.0]]}, TypeError),  # not an integer
        ({"offload": [[3], [1]]}, TypeError),  # no onload list
        ({"offload": [[3], [1]], "onload": "2,1"}, TypeError),
    ],
)
def test_run_tier_copies_checks_both_lists_before_moving_a_byte(copies, error):
    from hybridkv.integrations.fastdeploy.host_tier import allocate_host_caches, run_tier_copies

    caches = allocate_caches(tiny_layout(17), framework=FW)
    host = allocate_host_caches(caches, 4, pin_memory=False)
    for i, t in enumerate(t for segs in caches.segments for t in segs):
        shape = tuple(int(d) for d in t.shape)
        t[:] = to_like(((np.arange(int(np.prod(shape))) + i) % 251).astype(np.uint8).reshape(shape), t)
    before = _all_bytes(caches, host)
    with pytest.raises(error):
        run_tier_copies(caches, host, copies)
    assert _all_bytes(caches, host) == before


def test_allocate_host_caches_refuses_bad_arguments():
    from hybridkv.integrations.fastdeploy.host_tier import allocate_host_caches, run_tier_copies

    caches = allocate_caches(tiny_layout(17), framework=FW)
    with pytest.raises(TypeError, match="FastDeployCaches"):
        allocate_host_caches(object(), 4)
    with pytest.raises(ValueError):
        allocate_host_caches(caches, 0)
    with pytest.raises(TypeError):
        allocate_host_caches(caches, 2.0)
    other = allocate_host_caches(allocate_caches(tiny_layout(20), framework=FW), 4, pin_memory=False)
    with pytest.raises(ValueError, match="another layout"):
        run_tier_copies(caches, other, {"offload": [[], []], "onload": [[], []]})

"""Worker side of the FastDeploy drop-in: persistent state tables indexed by ``request.idx`` (Paddle CPU).

The engine is :class:`tests.test_fastdeploy_conformance.RMv1` (FastDeploy's ``ResourceManagerV1``
control flow) over the facade; its tasks go to :class:`StateTables` as FastDeploy's runner takes
them in ``insert_tasks_v1``. Swaps are hybridkv's (FastDeploy preempts by recompute only): a swapped
request leaves the running list with a ``SWAP_OUT`` task and comes back with a decode task carrying
its new block ids.
"""

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.scheduler_adapter.fastdeploy import FastDeployBlockManager
from hybridkv.scheduler_adapter.fastdeploy_worker import PAD_BLOCK, StateTables, allocate_caches, attach_worker
from tests.test_fastdeploy_conformance import (
    RMv1,
    check_books,
    make_requests,
    run_worker_step,
    tiny_layout,
)

paddle = pytest.importorskip("paddle")

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
        tasks = rm.schedule()
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
        assert forward_meta.caches is caches.caches
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

"""FastDeploy facade: the block surface its resource manager calls, and ForwardMeta filling.

``FakeForwardMeta`` has FastDeploy's ``ForwardMeta`` field names (fastdeploy/model_executor/
forward_meta.py), and like it, answers None for attributes it never declared.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hybridkv.blockmgr.errors import RequestStateError
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.presets import preset
from hybridkv.scheduler_adapter import (
    FastDeployBlockManager,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
    attach,
    build_step_metadata,
)
from tests.test_scheduler import tiny_manager

torch = pytest.importorskip("torch")


@dataclass
class FakeForwardMeta:
    ids_remove_padding: Any
    rotary_embs: Any = None
    step_use_cudagraph: bool = False
    attn_backend: Any = None
    seq_lens_encoder: Any = None
    seq_lens_decoder: Any = None
    seq_lens_this_time: Any = None
    batch_id_per_token: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    pre_caches_length: int = 0
    block_tables: Any = None
    caches: Any = None

    def __getattr__(self, name):  # FastDeploy: undeclared attributes read as None
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def torch_slots(layout, fill=0):
    return [
        torch.full((layout.num_segments, layout.num_blocks, layout.segment_bytes), fill, dtype=torch.uint8)
        for _ in range(layout.num_layer_slots)
    ]


# ---- block surface ----------------------------------------------------------------------------------
def test_block_calls_count_state_sets_and_recycle_frees_both():
    m = tiny_manager(32)  # 31 usable; a request holds 4 state blocks besides its KV
    fd = FastDeployBlockManager(m)
    assert fd.num_gpu_blocks == 31 and len(fd.gpu_free_block_list) == fd.available_block_num() == 31
    assert fd.can_allocate_gpu_blocks(27) and not fd.can_allocate_gpu_blocks(28)  # 27 + 4 state = 31
    ids = fd.allocate_gpu_blocks(2, "a")
    assert ids == m.block_table(["a"])[0].tolist() and fd.available_block_num() == 31 - 2 - 4
    more = fd.allocate_gpu_blocks(3, "a")  # an append: no new state sets
    assert m.block_table(["a"])[0].tolist() == ids + more and fd.available_block_num() == 31 - 5 - 4
    assert fd.blocks_needed("a", 3) == 3 and fd.blocks_needed("new", 3) == 3 + 4
    fd.recycle_gpu_blocks(ids, "a")  # part of the request: nothing is freed yet
    assert "a" in m.requests
    fd.recycle_gpu_blocks(more)  # old signature (no req_id): the owner is looked up
    assert "a" not in m.requests and fd.available_block_num() == 31
    m.check_integrity()
    with pytest.raises(RequestStateError, match="req_id"):
        fd.allocate_gpu_blocks(1)


def test_request_level_path_and_trigger_preempt_like_resource_manager_v1():
    m = tiny_manager(25)  # 24 usable
    fd = FastDeployBlockManager(m)

    def request(rid):
        return SimpleNamespace(request_id=rid, block_tables=[], num_computed_tokens=0, num_cached_blocks=0)

    running = [request(i) for i in range(3)]
    for r in running:
        fd.allocate_request(r, 8)  # 2 KV + 4 state each: 18 used
        r.num_computed_tokens = 8
    assert [len(r.block_tables) for r in running] == [2, 2, 2]
    new = request("new")  # wants 12 tokens: 3 KV + 4 state = 7 > 6 free
    preempted, scheduled = [], []
    assert fd.trigger_preempt(running, new, 3, preempted, scheduled, preempt_task=lambda r: ("preempt", r.request_id))
    assert [r.request_id for r in preempted] == [2] and scheduled == [("preempt", 2)]
    assert preempted[0].block_tables == [] and preempted[0].num_computed_tokens == 0
    fd.allocate_request(new, 12)
    assert len(new.block_tables) == 3 and fd.available_block_num() == 24 - 12 - 7
    # the requester itself is the newest: it goes, and the answer is False
    big = request("big")
    running.append(big)
    fd.allocate_request(big, 0)
    assert not fd.trigger_preempt(running, big, 4, preempted, scheduled)
    assert preempted[-1] is big
    for r in [*running, new]:
        fd.free_request(r)
    assert fd.available_block_num() == 24 and not m.requests
    m.check_integrity()


# ---- ForwardMeta ------------------------------------------------------------------------------------
def test_attach_keeps_attention_cache_shapes_and_state_tables_address_the_same_tensors():
    model = preset("minimax-m1", tp_size=8)
    layout = plan(model, 600 * 327_680, block_size=64)  # 600 blocks of MiniMax-M1 TP8 shapes
    m = HybridBlockManager(layout)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=512))
    s.add_request("a", 100, 4)
    s.add_request("b", 70, 4)
    s.update(StepOutputs(_sample_all(s.step())))  # both prefilled
    step = s.step()
    md = build_step_metadata(m, step, batch_size=4)
    slots = torch_slots(layout)
    fm = attach(FakeForwardMeta(ids_remove_padding=None), md, slots)

    # attention: FastDeploy's [k0, v0, k1, v1, ...] by model layer id, shapes of get_kv_cache_shape
    assert len(fm.caches) == 2 * 80
    for layer_id in range(80):
        k, v = fm.caches[2 * layer_id], fm.caches[2 * layer_id + 1]
        if layer_id % 8 == 7:
            assert k.shape == v.shape == (layout.num_blocks, 1, 64, 128) and k.dtype == torch.bfloat16
        else:
            assert k is None and v is None
    assert fm.block_tables.dtype == torch.int32 and fm.block_tables.shape == (4, 2)
    assert fm.state_block_tables.shape == (7, 4, 16) and fm.has_initial_state.tolist() == [True, True, False, False]

    # state: layer 0 (group 0, slot 0) lives in the tensor attention layer 7 reads through caches[14]
    st = fm.state_layer_slots[0]
    assert (st.group, st.slot) == (0, 0) and st.pool.data_ptr() == fm.caches[14].data_ptr()
    last = fm.state_layer_slots[78]  # the 70th lightning layer: group 6, slot 9
    assert (last.group, last.slot) == (6, 9) and last.pool is slots[9]

    # write KV of every new token through caches and each request's layer-0 state through its state
    # table; neither write disturbs the other
    seg = layout.segment_bytes
    k_cache = fm.caches[14]
    slot_ids = torch.from_numpy(md.slot_mapping)
    k_cache.view(-1, 128)[slot_ids] = torch.arange(1, slot_ids.numel() + 1, dtype=torch.bfloat16)[:, None]
    state_bytes = model.layers[0].state_bytes  # 512 KiB = 16 blocks of 32 KiB
    for row in range(2):
        blocks = fm.state_block_tables[0, row]
        flat = torch.full((state_bytes,), 10 + row, dtype=torch.uint8)
        for j, b in enumerate(blocks.tolist()):  # block j holds bytes [j*block_bytes, (j+1)*block_bytes)
            chunk = flat[j * layout.block_bytes : (j + 1) * layout.block_bytes].view(2, seg)
            st.pool[:, b] = chunk
    assert torch.equal(
        k_cache.view(-1, 128)[slot_ids][:, 0], torch.arange(1, slot_ids.numel() + 1, dtype=torch.bfloat16)
    )
    for row in range(2):
        blocks = fm.state_block_tables[0, row].long()
        assert bool((st.pool[:, blocks] == 10 + row).all())
    kv_blocks = set(md.block_tables[md.block_tables > 0].tolist())
    assert kv_blocks.isdisjoint(md.state_tables.ravel().tolist())


def _sample_all(step):
    return {r.request_id: [7] for r in step.scheduled if r.samples}


def test_attach_sets_sequence_lengths_on_request():
    m = tiny_manager(32)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", 5, 2)
    md = build_step_metadata(m, s.step(), batch_size=2)
    fm = attach(FakeForwardMeta(None), md, torch_slots(m.layout), set_seq_lens=True)
    assert fm.seq_lens_this_time.tolist() == [5, 0] and fm.cu_seqlens_q.tolist() == [0, 5, 5]
    assert fm.batch_id_per_token.tolist() == [0] * 5 and fm.hybridkv_metadata is md
    assert len(fm.caches) == 6 and fm.caches[0].shape == (32, 1, 4, 8)


def test_attach_with_paddle_tensors():
    paddle = pytest.importorskip("paddle")
    m = tiny_manager(32)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", 5, 2)
    md = build_step_metadata(m, s.step())
    slots = [paddle.zeros([2, 32, 64], dtype="uint8") for _ in range(m.layout.num_layer_slots)]
    fm = attach(FakeForwardMeta(None), md, slots)
    assert list(fm.caches[0].shape) == [32, 1, 4, 8] and fm.caches[0].dtype == paddle.bfloat16
    assert fm.caches[0].data_ptr() == slots[0].data_ptr()
    assert isinstance(fm.block_tables, paddle.Tensor) and fm.block_tables.dtype == paddle.int32
    np.testing.assert_array_equal(fm.state_block_tables.numpy(), md.state_tables)


def test_attach_accepts_ops_block_pools():
    pools_mod = pytest.importorskip("hybridkv.ops.pools")
    m = tiny_manager(32)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", 5, 2)
    md = build_step_metadata(m, s.step())
    pools = pools_mod.allocate_pools(m.layout, device="cpu")
    fm = attach(FakeForwardMeta(None), md, pools)
    views = pools_mod.kv_cache_views(pools)
    assert fm.caches[0].data_ptr() == views[0].data_ptr() and fm.caches[1].data_ptr() == views[1].data_ptr()
    assert fm.caches[0].shape == views[0].shape


def test_attach_slots_follows_fastdeploy_batch_slots():
    m = tiny_manager(32)
    fd = FastDeployBlockManager(m)
    fd.allocate_gpu_blocks(1, "x")
    fd.allocate_gpu_blocks(2, "y")
    fm = FakeForwardMeta(None, seq_lens_decoder=torch.tensor([[0], [6], [0]], dtype=torch.int32))
    fd.attach_slots(fm, torch_slots(m.layout), ["x", None, "y"])
    np.testing.assert_array_equal(fm.state_block_tables[:, 0].numpy(), m.state_table(["x"])[:, 0])
    np.testing.assert_array_equal(fm.state_block_tables[:, 2].numpy(), m.state_table(["y"])[:, 0])
    assert not fm.state_block_tables[:, 1].any() and fm.has_initial_state.tolist() == [False, True, False]
    assert fm.caches[0].shape == (32, 1, 4, 8) and set(fm.state_layer_slots) == {1, 2}

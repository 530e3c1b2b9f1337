"""FastDeploy ``caches``: index, shape, dtype, and one allocation per tensor; state in the same memory.

Facts checked against FastDeploy's ``gpu_model_runner.initialize_kv_cache`` / the v1
``CacheController.initialize_kv_cache``: ``caches`` is ``[key_cache_layer0, value_cache_layer0, ...]``,
K/V ``[num_blocks, kv_heads, block_size, head_dim]`` in the model dtype or uint8 for a quantized
cache, and with ``block_wise_fp8`` each layer adds K and V scales ``[num_blocks, kv_heads, block_size]``
(``caches[4*l .. 4*l+3]``).
"""

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy.state import read_state_bytes, write_state_bytes
from hybridkv.integrations.fastdeploy.worker import (
    allocate_caches,
    allocation_start,
    is_own_allocation,
    state_layer_slots,
)
from hybridkv.models.presets import preset
from hybridkv.models.spec import with_kv_dtype
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig, StepOutputs, attach, build_step_metadata

FRAMEWORKS = [f for f in ("torch", "paddle") if importlib.util.find_spec(f) is not None]
FW = FRAMEWORKS[0]  # torch in the torch lane, Paddle in the no-torch lane


def minimax_layout(kv_dtype: str = "bfloat16", num_blocks: int = 24):
    model = with_kv_dtype(preset("minimax-m1", tp_size=8), kv_dtype)
    probe = plan(model, 2**30, block_size=64)
    layout = plan(model, num_blocks * probe.bytes_per_block, block_size=64)
    assert layout.num_blocks == num_blocks
    return layout


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.").removeprefix("paddle.")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_minimax_m1_tp8_caches_are_fastdeploys_list_one_allocation_each(framework):
    layout = minimax_layout()
    c = allocate_caches(layout, framework=framework)
    assert len(c.caches) == 2 * 80 and c.stride == 2
    starts = set()
    for layer_id in range(80):
        k, v = c.caches[2 * layer_id], c.caches[2 * layer_id + 1]
        if layer_id % 8 != 7:  # lightning layers hold no KV
            assert k is None and v is None
            continue
        for t in (k, v):
            assert tuple(t.shape) == (24, 1, 64, 128) and _dtype_name(t) == "bfloat16"
            assert is_own_allocation(t) and t.data_ptr() == allocation_start(t)
            starts.add(t.data_ptr())
    assert len(starts) == 20  # 10 attention layers x (K, V), no two share memory
    names = c.names(rank=3, device_id=3)
    assert names[14] == "key_caches_7_rank3.device3" and names[15] == "value_caches_7_rank3.device3"
    assert names[0] is None


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_block_wise_fp8_caches_interleave_scales(framework):
    layout = minimax_layout("block_wise_fp8")
    assert layout.scale_segment_bytes == 64 * 4  # 64 tokens x 1 head x float32, for K (and for V)
    c = allocate_caches(layout, framework=framework)
    assert len(c.caches) == 4 * 80 and c.stride == 4
    for layer_id in range(7, 80, 8):
        k, v, ks, vs = c.caches[4 * layer_id : 4 * layer_id + 4]
        assert tuple(k.shape) == tuple(v.shape) == (24, 1, 64, 128) and _dtype_name(k) == "uint8"
        assert tuple(ks.shape) == tuple(vs.shape) == (24, 1, 64) and _dtype_name(ks) == "float32"
        assert all(is_own_allocation(t) for t in (k, v, ks, vs))
    assert c.caches[0] is None and c.caches[3] is None
    assert c.names()[4 * 7 + 2] == "key_cache_scales_7_rank0.device0"


def test_int8_kv_is_uint8_storage_without_scales():
    layout = minimax_layout("int8")
    assert layout.segment_bytes == 64 * 128 and layout.scale_segment_bytes == 0
    c = allocate_caches(layout, framework=FW)
    assert len(c.caches) == 160 and _dtype_name(c.caches[14]) == "uint8"
    assert tuple(c.caches[14].shape) == (24, 1, 64, 128)
    bf16 = minimax_layout("bfloat16")
    assert layout.block_bytes * 2 == bf16.block_bytes  # half the bytes per block: state sets span twice the blocks
    assert layout.blocks_per_state[0] == 2 * bf16.blocks_per_state[0]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_state_lives_in_the_same_allocations_addressed_per_segment(framework):
    layout = minimax_layout(num_blocks=130)
    m = HybridBlockManager(layout)
    m.allocate("a", 100)  # 2 KV blocks + 7 state sets of 8 blocks (56; bf16 lightning state)
    c = allocate_caches(layout, framework=framework)
    slots = state_layer_slots(c)
    st = slots[0]  # lightning layer 0: state group 0, slot 0: the allocations caches[14], caches[15] show as K, V
    assert (st.group, st.slot) == (0, 0) and st.segments[0].data_ptr() == c.caches[14].data_ptr()
    assert st.segments[1].data_ptr() == c.caches[15].data_ptr()
    kv_blocks = m.requests["a"].kv_blocks.tolist()
    for t in (c.caches[14], c.caches[15]):  # write K/V of the request's tokens
        for b in kv_blocks:
            t[b] = 7
    state_bytes = layout.model.layers[0].state_bytes
    data = np.random.default_rng(0).integers(0, 256, state_bytes, dtype=np.uint8)
    blocks = m.state_table(["a"])[0, 0].tolist()
    write_state_bytes(st, layout, blocks, data)
    np.testing.assert_array_equal(read_state_bytes(st, layout, blocks, state_bytes), data)
    for t in (c.caches[14], c.caches[15]):
        for b in kv_blocks:
            assert bool((t[b] == 7).all())  # the state write touched no KV block
    assert not set(kv_blocks) & set(blocks)


@dataclass
class FakeForwardMeta:
    caches: Any = None
    block_tables: Any = None
    seq_lens_encoder: Any = None
    seq_lens_decoder: Any = None
    seq_lens_this_time: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    batch_id_per_token: Any = None

    def __getattr__(self, name):  # FastDeploy's ForwardMeta: undeclared attributes read as None
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def test_attach_for_hybridkv_scheduler_uses_the_same_caches():
    layout = minimax_layout(num_blocks=600)
    m = HybridBlockManager(layout)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=512))
    s.add_request("a", 100, 4)
    s.add_request("b", 70, 4)
    s.update(StepOutputs({r.request_id: [7] for r in s.step().scheduled if r.samples}))
    md = build_step_metadata(m, s.step(), batch_size=4)
    c = allocate_caches(layout, framework=FW)
    fm = attach(FakeForwardMeta(), md, c, set_seq_lens=True)
    assert fm.caches is c.caches and _dtype_name(fm.block_tables) == "int32" and tuple(fm.block_tables.shape) == (4, 2)
    # 7 state groups x 4 rows x 8 blocks: a TP8 bf16 lightning state (8 x 128 x 128 x 2 B = 256 KiB) over
    # 32 KiB blocks (64 tokens x 1 KV head x 128 x K and V x 2 B)
    assert tuple(fm.state_block_tables.shape) == (7, 4, 8)
    assert fm.has_initial_state.tolist() == [True, True, False, False]
    assert fm.state_layer_slots[78].slot == 9 and fm.state_layer_slots[78].group == 6
    with pytest.raises(ValueError, match="different layout"):
        attach(FakeForwardMeta(), md, allocate_caches(minimax_layout(), framework=FW))


def test_plan_kv_dtype_cli(capsys):
    import json

    from hybridkv.cli import main

    sizes = {}
    for kv in ("bfloat16", "int8", "block_wise_fp8"):
        args = ["plan", "--model", "minimax-m1", "--tp", "8", "--gpu-memory", "10GiB", "--layout", "paged"]
        assert main([*args, "--context", "32k", "--kv-dtype", kv, "--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        sizes[kv] = out["layouts"]["paged"]["kv_bytes_per_request"]
    # 32k tokens x 10 layers x 2 (K, V) x 128: 2 bytes, 1 byte, 1 byte + 4-byte scale per 128
    assert sizes == {
        "bfloat16": 32768 * 10 * 2 * 256,
        "int8": 32768 * 10 * 2 * 128,
        "block_wise_fp8": 32768 * 10 * 2 * 132,
    }
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["plan", "--model", "minimax-m1", "--kv-dtype", "int4"])


def test_ops_pools_hold_block_wise_fp8_scales_and_uint8_kv_views():
    from hybridkv.ops.pools import allocate_pools, kv_cache_views

    layout = minimax_layout("block_wise_fp8")
    pools = allocate_pools(layout, device="cpu", framework=FW)
    assert tuple(pools.scales.shape) == (10, 2, 24, 64 * 4) and _dtype_name(pools.scales) == "uint8"
    views = kv_cache_views(pools)
    assert len(views) == 20 and _dtype_name(views[0]) == "uint8" and tuple(views[0].shape) == (24, 1, 64, 128)
    assert allocate_pools(minimax_layout(), device="cpu", framework=FW).scales is None


def _mla_layout(num_blocks=12, hybrid=False):
    """A Kimi-like model (tests/test_ops_pools.py's, without its torch import): MLA attention keeping K
    12 wide and V 4 wide (segments of 4: K takes 3, V 1) beside a recurrent layer; ``hybrid``: every
    decoder layer keeps both (Falcon-H1-like)."""
    from hybridkv.models.spec import AttentionLayerSpec, HybridLayerSpec, ModelSpec, RecurrentLayerSpec, StateComponent

    attn = AttentionLayerSpec(2, 12, "bfloat16", 4, v_head_dim=4)
    rec = RecurrentLayerSpec("kda", (StateComponent("ssm", (2, 8, 8), "float32"),))
    model = ModelSpec("mla-mini", (HybridLayerSpec(attn, rec),) * 3 if hybrid else (rec, attn, rec, rec, attn))
    probe = plan(model, 1 << 30, block_size=4)
    return plan(model, num_blocks * probe.bytes_per_block, block_size=4)


def _bf16(like: Any, values: np.ndarray) -> Any:
    """``values`` as a bfloat16 tensor of ``like``'s framework."""
    if type(like).__module__.startswith("paddle"):
        import paddle

        return paddle.to_tensor(np.asarray(values, np.float32)).astype("bfloat16")
    import torch

    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.bfloat16)


def _bf16_bytes(values: Any) -> np.ndarray:
    """The bytes of small integers stored as bfloat16 (the upper half of their float32)."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def _host_bytes(t: Any) -> np.ndarray:
    """A tensor's elements in logical order as numpy (bfloat16 as its uint16 bits), on the host."""
    if type(t).__module__.startswith("paddle"):
        return np.ascontiguousarray(t.numpy())
    import torch

    return np.ascontiguousarray((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())


def _value(t: Any) -> float:
    return float(t.astype("float32").item()) if type(t).__module__.startswith("paddle") else float(t.float().item())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_k_and_v_of_different_widths_are_one_allocation_each_in_fastdeploys_list(framework):
    """Kimi-like MLA (K 12 wide, V 4: segments of 4, K takes 3): caches[2l] is K [num_blocks, kv_heads,
    block_size, 3, 4] over one allocation of its 3 segments, caches[2l+1] V over the 4th; the state
    addressing still sees one tensor per segment of that memory. Torch and Paddle (no torch needed)."""
    layout = _mla_layout()
    c = allocate_caches(layout, framework=framework)
    assert len(c.caches) == 2 * 5 and [i for i, t in enumerate(c.caches) if t is not None] == [2, 3, 8, 9]
    k, v = c.caches[2], c.caches[3]
    assert tuple(k.shape) == (12, 2, 4, 3, 4) and tuple(v.shape) == (12, 2, 4, 4)
    for t in (k, v):
        assert is_own_allocation(t) and t.data_ptr() == allocation_start(t) and _dtype_name(t) == "bfloat16"
    slot = layout.kv_group.layer_ids.index(1)
    segs = c.segments[slot]
    seg_nbytes = layout.num_blocks * layout.segment_bytes
    assert [s.data_ptr() for s in segs[:3]] == [k.data_ptr() + j * seg_nbytes for j in range(3)]
    assert segs[3].data_ptr() == v.data_ptr() and all(tuple(s.shape) == (12, layout.segment_bytes) for s in segs)
    # block 5, head 1, token 2: the K head's 12 columns in segments 0..2, V's 4 in segment 3
    k[5, 1, 2] = _bf16(k, np.arange(12).reshape(3, 4))
    v[5, 1, 2] = _bf16(v, np.arange(100, 104))
    offset = (1 * 4 + 2) * 4 * 2  # (head 1, token 2) x width 4 x 2 bytes
    raw = [_host_bytes(s) for s in segs]
    for j in range(3):
        np.testing.assert_array_equal(raw[j][5, offset : offset + 8], _bf16_bytes(np.arange(4 * j, 4 * j + 4)))
    np.testing.assert_array_equal(raw[3][5, offset : offset + 8], _bf16_bytes(np.arange(100, 104)))
    assert sum(int(np.count_nonzero(r)) for r in raw) == int(np.count_nonzero(_bf16_bytes(np.arange(12)))) + 8
    # the recurrent layer sharing the slot: its state bytes, written per segment, are K's and V's memory
    st = next(s for s in state_layer_slots(c).values() if s.slot == slot)
    assert [t.data_ptr() for t in st.segments] == [t.data_ptr() for t in segs]
    nbytes = layout.model.layers[st.layer_id].state_bytes
    blocks = list(range(1, 1 + layout.blocks_per_state[st.group]))
    data = np.random.default_rng(0).integers(1, 256, nbytes, dtype=np.uint8)
    write_state_bytes(st, layout, blocks, data)
    np.testing.assert_array_equal(read_state_bytes(st, layout, blocks, nbytes), data)
    k_mem = _host_bytes(k).transpose(3, 0, 1, 2, 4).copy().view(np.uint8).reshape(3, 12, -1)  # memory order
    v_mem = _host_bytes(v).view(np.uint8).reshape(12, -1)
    seg = layout.segment_bytes
    state_set = np.concatenate([np.concatenate([*k_mem[:, b], v_mem[b]]) for b in blocks])  # block by block
    np.testing.assert_array_equal(state_set[:nbytes], data)
    assert layout.block_bytes == 4 * seg and nbytes > seg  # the state spans K's segments and V's


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_hybrid_models_caches_are_indexed_by_decoder_layer(framework):
    """Falcon-H1-like: every decoder layer keeps K/V and a state (two cache layers each); FastDeploy's
    caches[2l] / [2l+1] are decoder layer l's K and V (layout.decoder_layer_id). Torch and Paddle."""
    layout = _mla_layout(hybrid=True)
    c = allocate_caches(layout, framework=framework)
    assert c.num_layers == 3 and len(c.caches) == 6 and all(t is not None for t in c.caches)
    for slot, cache_id in enumerate(layout.kv_group.layer_ids):
        if cache_id is not None:
            k, v = c.caches[2 * layout.decoder_layer_id(cache_id)], c.caches[2 * layout.decoder_layer_id(cache_id) + 1]
            assert k.data_ptr() == c.segments[slot][0].data_ptr() and v.data_ptr() == c.segments[slot][3].data_ptr()
            assert all(is_own_allocation(t) for t in (k, v)) and tuple(k.shape) == (12, 2, 4, 3, 4)
    with pytest.raises(ValueError, match="below the model's 3 layers"):
        allocate_caches(layout, num_layers=2, framework=framework)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_k_and_v_of_different_widths_move_with_their_blocks(framework):
    """MLA caches: copy_blocks and the host tier's offload / onload move every byte of a block's K (in
    its 3 segments of one allocation) and V through the segment views, in Paddle as in torch."""
    from hybridkv.integrations.fastdeploy.host_tier import allocate_host_caches, run_tier_copies
    from hybridkv.integrations.fastdeploy.worker import copy_blocks

    layout = _mla_layout()
    c = allocate_caches(layout, framework=framework)
    k, v = c.caches[2], c.caches[3]
    k[4] = _bf16(k, np.arange(2 * 4 * 12).reshape(2, 4, 3, 4) + 1)
    v[4] = _bf16(v, np.arange(2 * 4 * 4).reshape(2, 4, 4) + 500)
    want_k, want_v = _host_bytes(k)[4], _host_bytes(v)[4]
    copy_blocks(c, [[4], [7]])
    np.testing.assert_array_equal(_host_bytes(k)[7], want_k)
    np.testing.assert_array_equal(_host_bytes(v)[7], want_v)
    host = allocate_host_caches(c, 3, pin_memory=False)
    run_tier_copies(c, host, {"offload": [[7], [2]], "onload": [[], []]})
    run_tier_copies(c, host, {"offload": [[], []], "onload": [[9], [2]]})  # [[device], [host]]
    np.testing.assert_array_equal(_host_bytes(k)[9], want_k)
    np.testing.assert_array_equal(_host_bytes(v)[9], want_v)
    assert not _host_bytes(k)[[1, 2, 3, 5, 6, 8, 10, 11]].any() and not _host_bytes(v)[[1, 2, 3, 5, 6, 8, 10, 11]].any()


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("mla", [False, True])
def test_every_kv_view_of_a_pool_reads_its_own_segment(framework, mla):
    """ops.pools.kv_cache_views: each K / V view (every slot, K and V, MLA runs too) reads the bytes of
    its own segments, in Paddle as in torch (Paddle 3.3 reads a typed view of an offset slice from
    the wrong bytes)."""
    from hybridkv.ops.pools import allocate_pools, kv_cache_views

    layout = _mla_layout() if mla else minimax_layout(num_blocks=6)
    pools = allocate_pools(layout, device="cpu", framework=framework)
    views = kv_cache_views(pools)
    slots = [s for s, i in enumerate(layout.kv_group.layer_ids) if i is not None]
    assert len(views) == 2 * len(slots)
    cuts = [(0, layout.key_segments), (layout.key_segments, layout.key_segments + layout.value_segments)]
    for n, view in enumerate(views):
        slot, (first, stop) = slots[n // 2], cuts[n % 2]
        for seg in range(first, stop):  # bf16 (n + 1) * 2**(seg - first) in the first element of block 3
            value = (n + 1) * 2.0 ** (seg - first)
            pools.data[slot, seg, 3, :2] = _host_like(pools.data, _bf16_bytes([value]))
            at = (3, 0, 0, seg - first, 0) if stop - first > 1 else (3, 0, 0, 0)
            assert _value(view[at]) == value, (n, slot, seg)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_keys_only_pools_v_view_is_empty_of_the_attention_dtype(framework):
    """MLA without a rotary part keeps keys only (tests/test_ops_pools.py's torch case): the V view is
    empty, of the attention dtype; Paddle pools build both views without torch."""
    from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, StateComponent
    from hybridkv.ops.pools import allocate_pools, kv_cache_views

    attn = AttentionLayerSpec(1, 16, "bfloat16", 4, v_head_dim=0)
    model = ModelSpec("keys-only", (RecurrentLayerSpec("kda", (StateComponent("ssm", (2, 8, 8), "float32"),)), attn))
    layout = plan(model, 8 * plan(model, 1 << 30, block_size=4).bytes_per_block, block_size=4)
    assert (layout.key_segments, layout.value_segments) == (1, 0)
    k, v = kv_cache_views(allocate_pools(layout, "cpu", framework=framework))
    assert tuple(k.shape) == (layout.num_blocks, 1, 4, 16) and tuple(v.shape) == (layout.num_blocks, 1, 4, 0)
    assert _dtype_name(k) == _dtype_name(v) == "bfloat16"


@pytest.mark.skipif("paddle" not in FRAMEWORKS, reason="Paddle's view rule")
def test_a_paddle_segment_run_at_an_offset_is_refused():
    """Paddle 3.3 reads a typed view of a slice at a byte offset from the wrong bytes: segment_kv_view
    refuses a Paddle run that does not start its allocation instead of showing those bytes."""
    import paddle

    from hybridkv.ops.pools import segment_kv_view

    layout = _mla_layout()
    spec = layout.model.layers[layout.kv_group.layer_ids[0]]
    run = paddle.zeros([4, layout.num_blocks, layout.segment_bytes], dtype="uint8")
    assert tuple(segment_kv_view(run[:3], spec, layout.block_size).shape) == (12, 2, 4, 3, 4)
    with pytest.raises(ValueError, match="offset 0"):
        segment_kv_view(run[1:4], spec, layout.block_size)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_ops_read_state_gives_every_components_bytes(framework):
    """ops.pools.read_state of a GDN state (ssm float32, then the conv window bf16 at byte 120): each
    component holds its own bytes of the state set, in Paddle as in torch (Paddle 3.3 read the conv
    window through a typed view of an offset slice, from the wrong bytes)."""
    from hybridkv.models.presets import gdn_layer, layers_from_pattern
    from hybridkv.models.spec import AttentionLayerSpec, ModelSpec
    from hybridkv.ops.pools import allocate_pools, read_state

    rec = gdn_layer(1, 2, 3, 5, 4, "float32", "bfloat16")
    model = ModelSpec("mini-qwen3-next", layers_from_pattern("RA", AttentionLayerSpec(1, 8, "bfloat16"), rec))
    layout = plan(model, 40 * plan(model, 1 << 20, block_size=4).bytes_per_block, block_size=4)
    pools = allocate_pools(layout, device="cpu", framework=framework)
    noise = np.random.default_rng(0).integers(0, 256, tuple(int(d) for d in pools.data.shape), dtype=np.uint8)
    noise[:, :, 0] = 0
    pools.data[:] = _host_like(pools.data, noise)
    slot = next(s for s in range(layout.group_size) if layout.state_layer(0, s) is not None)
    spec = layout.state_layer(0, slot)[1]
    blocks = list(range(3, 3 + layout.blocks_per_state[0]))
    state = np.concatenate([noise[slot, :, b].reshape(-1) for b in blocks])[: spec.state_bytes]
    got = read_state(pools, 0, slot, blocks)
    offsets = spec.component_offsets()
    assert offsets["conv"] > 0 and set(got) == {"ssm", "conv"}
    for c in spec.components:
        assert tuple(got[c.name].shape) == c.shape and _dtype_name(got[c.name]) == c.dtype.value
        raw = _host_bytes(got[c.name]).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(raw, state[offsets[c.name] : offsets[c.name] + c.nbytes], err_msg=c.name)


def _host_like(like: Any, arr: np.ndarray) -> Any:
    if type(like).__module__.startswith("paddle"):
        import paddle

        return paddle.to_tensor(arr)
    import torch

    return torch.from_numpy(arr)

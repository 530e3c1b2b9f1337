"""Pools, typed views and state buffers: shapes, shared memory, the null block, fills."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridkv.ops import (
    allocate_host_pools,
    allocate_pools,
    allocate_state_buffers,
    kv_cache_views,
    read_state,
)
from hybridkv.ops._framework import widest_word
from hybridkv.ops.addressing import state_runs
from hybridkv.ops.testing import expected_state_bytes, fill_random_, random_state_table, small_layout
from hybridkv.planner.layout import NULL_BLOCK


def test_one_backing_tensor_with_slot_views():
    layout = small_layout()
    pools = allocate_pools(layout, "cpu")
    assert pools.data.shape == (layout.group_size, 2, layout.num_blocks, layout.segment_bytes)
    assert pools.data.dtype == torch.uint8 and pools.num_blocks == layout.num_blocks == 24
    slot = pools.slot(1)
    assert slot.shape == (2, 24, layout.segment_bytes)
    slot[1, 3, 5] = 9
    assert pools.data[1, 1, 3, 5] == 9
    assert len(pools.slots()) == layout.group_size


def test_nan_fill_keeps_the_null_block_zero():
    layout = small_layout()
    pools = allocate_pools(layout, "cpu", fill="nan")
    assert not pools.data[:, :, NULL_BLOCK].any()
    assert (pools.data[:, :, 1:] == 0xFF).all()
    assert torch.isnan(kv_cache_views(pools)[0][1]).all()
    assert (allocate_pools(layout, "cpu", fill=0x5A).data[:, :, 2] == 0x5A).all()
    with pytest.raises(ValueError, match="fill"):
        allocate_pools(layout, "cpu", fill=300)


def test_kv_cache_views_are_fastdeploy_caches_over_the_pool():
    layout = small_layout(pattern="RARRARR", kv_heads=2, head_dim=8, block_size=4)
    pools = allocate_pools(layout, "cpu")
    caches = kv_cache_views(pools)
    assert len(caches) == 4  # [k0, v0, k1, v1]
    for t in caches:
        assert t.shape == (24, 2, 4, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    caches[3][5, 1, 2, 3] = 1.5  # V of attention layer 1 (slot 1), block 5, head 1, token 2, dim 3
    offset = ((1 * 4 + 2) * 8 + 3) * 2
    raw = pools.data[1, 1, 5, offset : offset + 2].view(torch.bfloat16)
    assert raw.item() == 1.5
    assert kv_cache_views(allocate_pools(small_layout(pattern="RR", state_block_bytes=64), "cpu")) == []


def test_host_pools_have_their_own_block_count():
    layout = small_layout()
    host = allocate_host_pools(layout, 7)
    assert host.data.shape == (7, layout.group_size, 2, layout.segment_bytes)  # block-major
    assert host.num_blocks == 7 and host.block_major
    host.slot(1)[0, 3, 5] = 4
    assert host.data[3, 1, 0, 5] == 4
    assert host.device.type == "cpu"
    assert host.data.is_pinned() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="num_host_blocks"):
        allocate_host_pools(layout, 0)


def test_state_buffers_hold_contiguous_component_views_of_one_buffer():
    layout = small_layout(pattern="RARRARR")
    bufs = allocate_state_buffers(layout, 5, device="cpu")
    assert bufs.groups == (0, 1, 2)
    assert len(bufs.regions) == 2 * 5  # 5 recurrent layers x (ssm, conv)
    for r in bufs.regions:
        assert r.buffer_offset % 256 == 0
        t = bufs.layer(r.group, r.slot)[r.name]
        assert t.is_contiguous() and t.shape[0] == 5
        assert t.untyped_storage().data_ptr() == bufs.torch_data.untyped_storage().data_ptr()
    assert bufs.layer(0, 0)["ssm"].shape == (5, 3, 5, 7)
    assert set(bufs.by_layer_id()) == {0, 2, 3, 5, 6}
    one = allocate_state_buffers(layout, 2, group=2, device="cpu")
    assert one.groups == (2,) and {r.group for r in one.regions} == {2}
    with pytest.raises(ValueError, match="does not exist"):
        allocate_state_buffers(layout, 2, group=3, device="cpu")


def test_read_state_follows_the_table_order():
    layout = small_layout()
    pools = fill_random_(allocate_pools(layout, "cpu"), seed=4)
    table = random_state_table(layout, 1, seed=4)
    blocks = table[1, 0].tolist()
    state = read_state(pools, 1, 0, blocks)
    want = expected_state_bytes(pools, 1, 0, blocks)
    assert torch.equal(state["ssm"].reshape(-1).view(torch.uint8), want[:420])
    assert torch.equal(state["conv"].reshape(-1).view(torch.uint8), want[420:])
    assert not read_state(pools, 1, 0, [NULL_BLOCK] * 2)["ssm"].any()
    with pytest.raises(ValueError, match="no layer in slot"):
        read_state(allocate_pools(small_layout(pattern="ARRRAR-R"), "cpu"), 2, 1, [1])
    with pytest.raises(ValueError, match="2 block ids"):
        read_state(pools, 1, 0, [3])


def test_runs_stay_inside_segments_and_cover_each_component_once():
    layout = small_layout(components=(("kv", (2, 4, 4), "float32"), ("scale", (2,), "float32")), pattern="ARRRAR-R",
                          kv_heads=1, head_dim=4, kv_dtype="float32", block_size=2)  # fmt: skip
    bufs = allocate_state_buffers(layout, 2, device="cpu")
    regions = list(bufs.regions)
    runs = state_runs(layout, 24, regions, {g: g for g in range(layout.num_state_groups)}, word=4, tile_bytes=16)
    seg_words = layout.segment_bytes // 4
    offset_in_segment = runs[:, 0] % seg_words
    assert (offset_in_segment + runs[:, 3] <= seg_words).all()
    assert (runs[:, 3] <= 4).all()
    assert runs[:, 3].sum() * 4 == sum(r.nbytes for r in regions)


def test_widest_word():
    assert widest_word(256, 48, 144) == 8
    assert widest_word(256, 48, 420, 36) == 4
    assert widest_word(256, 9) == 1
    assert widest_word(256, 10, 6) == 2


def test_ops_import_without_triton_or_paddle():
    code = "import sys, hybridkv.ops; assert 'triton' not in sys.modules and 'paddle' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tables_may_come_from_numpy_torch_or_lists():
    layout = small_layout()
    pools = fill_random_(allocate_pools(layout, "cpu"), seed=2)
    table = random_state_table(layout, 1, seed=2)
    a = read_state(pools, 0, 1, table[0, 0])
    b = read_state(pools, 0, 1, torch.from_numpy(np.array(table[0, 0])))
    assert torch.equal(a["ssm"].view(torch.int32), b["ssm"].view(torch.int32))


# ---- K and V of different widths (MLA, Kimi Linear) and hybrid layers ----------------------------------
def _mla_layout(num_blocks=12, hybrid=False):
    """A Kimi-like model: MLA attention keeping K 12 wide and V 4 wide (segments of their common width 4:
    K takes 3, V 1) beside a recurrent layer; ``hybrid``: every decoder layer keeps both (Falcon-H1-like)."""
    from hybridkv.models.spec import (
        AttentionLayerSpec,
        HybridLayerSpec,
        ModelSpec,
        RecurrentLayerSpec,
        StateComponent,
    )
    from hybridkv.planner.layout import plan

    attn = AttentionLayerSpec(2, 12, "bfloat16", 4, v_head_dim=4)
    rec = RecurrentLayerSpec("kda", (StateComponent("ssm", (2, 8, 8), "float32"),))
    layers = (HybridLayerSpec(attn, rec),) * 3 if hybrid else (rec, attn, rec, rec, attn)
    model = ModelSpec("mla-mini", layers)
    probe = plan(model, 1 << 30, block_size=4)
    return plan(model, num_blocks * probe.bytes_per_block, block_size=4)


def test_k_and_v_of_different_widths_are_views_over_their_segments():
    from hybridkv.ops.pools import kv_view_shape

    layout = _mla_layout()
    assert (layout.key_segments, layout.value_segments, layout.num_segments) == (3, 1, 4)
    pools = allocate_pools(layout, "cpu")
    caches = kv_cache_views(pools)
    assert len(caches) == 4  # [k0, v0, k1, v1]
    spec = layout.model.layers[layout.kv_group.layer_ids[0]]
    k, v = caches[0], caches[1]
    assert k.shape == kv_view_shape(layout, spec, value=False) == (12, 2, 4, 3, 4)  # head_dim 12 = 3 x 4
    assert v.shape == kv_view_shape(layout, spec, value=True) == (12, 2, 4, 4) and v.is_contiguous()
    assert k.dtype == v.dtype == torch.bfloat16
    # block 5, head 1, token 2: the K head's 12 columns in segments 0..2, V's 4 in segment 3
    k[5, 1, 2] = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    v[5, 1, 2] = torch.arange(100, 104, dtype=torch.bfloat16)
    offset = (1 * 4 + 2) * 4 * 2  # (head 1, token 2) x width 4 x 2 bytes
    for seg in range(3):
        raw = pools.data[0, seg, 5, offset : offset + 8].view(torch.bfloat16)
        assert raw.tolist() == [4.0 * seg + i for i in range(4)]
    assert pools.data[0, 3, 5, offset : offset + 8].view(torch.bfloat16).tolist() == [100, 101, 102, 103]
    assert k.reshape(12, 2, 4, 12)[5, 1, 2].tolist() == list(range(12))  # the plain shape, copied
    assert int(pools.data.view(-1).view(torch.bfloat16).count_nonzero()) == 11 + 4  # nothing else written


def test_a_hybrid_layers_kv_and_state_are_two_cache_layers_mapped_to_their_decoder_layer():
    layout = _mla_layout(hybrid=True)
    assert len(layout.model.layers) == 6 and layout.num_decoder_layers == 3
    assert layout.model.decoder_layer_ids == (0, 0, 1, 1, 2, 2)
    assert [layout.decoder_layer_id(i) for i in layout.kv_group.layer_ids if i is not None] == [0, 1, 2]
    assert len(kv_cache_views(allocate_pools(layout, "cpu"))) == 6


def test_keys_only_attention_gives_an_empty_value_view():
    """MLA with no rotary part (GLM-5 Next's indexed layers) keeps keys only: the V view is empty, of
    the attention dtype, and K still sees its own segments."""
    from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, StateComponent
    from hybridkv.ops.pools import kv_view_shape
    from hybridkv.planner.layout import plan

    attn = AttentionLayerSpec(1, 16, "bfloat16", 4, v_head_dim=0)
    rec = RecurrentLayerSpec("kda", (StateComponent("ssm", (2, 8, 8), "float32"),))
    model = ModelSpec("keys-only", (rec, attn))
    probe = plan(model, 1 << 30, block_size=4)
    layout = plan(model, 8 * probe.bytes_per_block, block_size=4)
    assert layout.value_segments == 0
    k, v = kv_cache_views(allocate_pools(layout, "cpu"))
    assert k.shape == kv_view_shape(layout, attn, value=False) == (layout.num_blocks, 1, 4, 16)
    assert v.shape == kv_view_shape(layout, attn, value=True) == (layout.num_blocks, 1, 4, 0)
    assert v.dtype == k.dtype == torch.bfloat16 and v.numel() == 0

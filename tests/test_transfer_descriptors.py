"""Descriptors: a request's KV blocks and state sets between two pools, checked byte for byte with the
in-process reference copy (no network), against a reader that follows the layout's rule."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.presets import preset
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.transfer import (
    PoolRegions,
    TransferError,
    check_compatible,
    layout_signature,
    pair_descriptors,
    request_descriptors,
)
from hybridkv.transfer.loopback import copy_pairs, covered_mask, regions_of_array, sha256
from hybridkv.transfer.testing import (
    mini_layout,
    mini_mamba2,
    mini_minimax,
    reference_bytes,
    seeded_pool,
    state_bytes,
)


def blocks_of(layout, ids, num_tokens):
    ids, sets, pos = np.asarray(ids, dtype=np.int32), [], 0
    for n in layout.blocks_per_state:
        sets.append(ids[pos : pos + n])
        pos += n
    return RequestBlocks(num_tokens, ids[pos:], tuple(sets))


def scattered_source(layout, num_tokens, seed=0):
    """A manager whose request "r" holds state sets in place and KV blocks scattered among others'."""
    m = HybridBlockManager(layout)
    m.allocate("r", 1)
    m.allocate("other", 1)
    for i in range(layout.num_kv_blocks(num_tokens) - 1):  # every block appended between others' blocks
        m.append("r", layout.block_size)
        m.append("other", layout.block_size if i % 2 else 0)
    m.append("r", num_tokens - m.requests["r"].num_tokens)
    return m


def transfer(src_layout, dst_layout, num_tokens, src_pool=None, dst_seed=2):
    """Export from a scattered source, import into a destination that holds something else first."""
    src_m = scattered_source(src_layout, num_tokens)
    dst_m = HybridBlockManager(dst_layout)
    dst_m.allocate("resident", 3 * dst_layout.block_size)
    export, imp = src_m.export_request("r"), dst_m.import_request("r", num_tokens)
    src = seeded_pool(src_layout, 1) if src_pool is None else src_pool
    dst = seeded_pool(dst_layout, dst_seed)
    before = dst.copy()
    src_regions, dst_regions = regions_of_array(src_layout, src), regions_of_array(dst_layout, dst)
    pairs = pair_descriptors(src_regions, export.blocks, dst_regions, imp.blocks)
    copy_pairs([src.reshape(-1)], [dst.reshape(-1)], pairs)
    return src_m, dst_m, export, imp, src, dst, before, pairs, dst_regions


@pytest.mark.parametrize("model", [mini_minimax, mini_mamba2])
@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_loopback_moves_exactly_the_request(model, kind):
    layout = mini_layout(model(), 200, kind)
    num_tokens = 7 * layout.block_size + 3  # a partly filled last KV block
    src_m, dst_m, export, imp, src, dst, before, pairs, dst_regions = transfer(layout, layout, num_tokens)
    assert export.blocks.ids().tolist() != imp.blocks.ids().tolist()  # other ids on each side
    assert reference_bytes(dst, layout, imp.blocks) == reference_bytes(src, layout, export.blocks)
    assert sha256([src.reshape(-1)], pairs.src) == sha256([dst.reshape(-1)], pairs.dst)
    assert (pairs.src.length == pairs.dst.length).all()
    untouched = ~covered_mask(dst_regions, pairs.dst)[0]
    assert np.array_equal(dst.reshape(-1)[untouched], before.reshape(-1)[untouched])
    fp = layout.footprint(num_tokens)
    useful = fp.num_kv_blocks * layout.block_bytes * len([i for i in layout.kv_group.layer_ids if i is not None])
    assert pairs.num_bytes == useful + fp.state_bytes  # whole KV blocks, states cut to their real bytes
    imp.commit()
    export.commit()
    src_m.check_integrity()
    dst_m.check_integrity()
    assert "r" not in src_m.requests and dst_m.block_table(["r"]).shape == (1, fp.num_kv_blocks)


def test_state_tails_are_cut_to_the_real_state_bytes():
    """Mamba2 state 160 B in blocks of 2 x 64 B: block 0 holds 128 B, block 1 only 32 B in segment 0."""
    layout = mini_layout(mini_mamba2(), 64)
    blocks = blocks_of(layout, [1, 2, 10, 11], 0)  # two state sets, no KV
    descs = request_descriptors(regions_of_array(layout, seeded_pool(layout, 0)), blocks)
    seg, n = layout.segment_bytes, layout.num_blocks
    plane = n * seg
    # slot 0 / 1 (one Mamba2 layer each per group), segment 0: blocks 1-2 (64 + 32 B) and 10-11 (64 + 32 B)
    expected = [
        (0 * plane + 1 * seg, 96),
        (0 * plane + 10 * seg, 96),
        (1 * plane + 1 * seg, 64),  # segment 1: only block 1 and block 10 are used
        (1 * plane + 10 * seg, 64),
        (2 * plane + 1 * seg, 96),
        (2 * plane + 10 * seg, 96),
        (3 * plane + 1 * seg, 64),
        (3 * plane + 10 * seg, 64),
    ]
    assert list(zip(descs.offset.tolist(), descs.length.tolist(), strict=True)) == expected


def test_one_run_on_both_sides_is_one_descriptor_per_plane():
    layout = mini_layout(mini_minimax(), 200)
    n = layout.footprint(40).num_blocks
    src, dst = blocks_of(layout, range(1, n + 1), 40), blocks_of(layout, range(50, 50 + n), 40)
    regions = PoolRegions.contiguous(layout, 4096)
    pairs = pair_descriptors(regions, src, regions, dst)
    assert len(pairs) == layout.group_size * layout.num_segments
    # the destination scattered: one descriptor per block and plane
    scattered = blocks_of(layout, range(1, 2 * n + 1, 2), 40)
    assert len(pair_descriptors(regions, src, regions, scattered)) == n * layout.group_size * layout.num_segments


def test_per_slot_and_per_plane_regions_move_the_same_bytes():
    layout = mini_layout(mini_mamba2(), 80)
    src_m, dst_m, export, imp, src, dst, _, pairs, _ = transfer(layout, layout, 13)
    # the same destination as one tensor per plane (engines with separate K and V caches per layer)
    planes = [[np.ascontiguousarray(dst[s, g]) for g in range(layout.num_segments)] for s in range(layout.group_size)]
    per_plane = PoolRegions.per_plane(layout, [[p.ctypes.data for p in row] for row in planes])
    flat = [p.reshape(-1) for row in planes for p in row]
    for p in flat:
        p[:] = 0
    src_regions = PoolRegions.per_slot(layout, [src[s].ctypes.data for s in range(layout.group_size)])
    pairs2 = pair_descriptors(src_regions, export.blocks, per_plane, imp.blocks)
    copy_pairs([src[s].reshape(-1) for s in range(layout.group_size)], flat, pairs2)
    rebuilt = np.stack([np.stack(row) for row in planes])
    assert reference_bytes(rebuilt, layout, imp.blocks) == reference_bytes(dst, layout, imp.blocks)
    assert pairs2.num_bytes == pairs.num_bytes


def test_mismatches_are_refused_with_the_fix():
    layout = mini_layout(mini_minimax(), 200)
    other = mini_layout(mini_minimax(), 200, block_size=8)
    n = layout.footprint(10).num_blocks
    src = blocks_of(layout, range(1, n + 1), 10)
    with pytest.raises(TransferError, match="block_size"):
        pair_descriptors(PoolRegions.contiguous(layout, 0), src, PoolRegions.contiguous(other, 0), src)
    regions = PoolRegions.contiguous(layout, 0)
    with pytest.raises(TransferError, match="token count"):
        longer = blocks_of(layout, range(1, n + 2), 14)
        pair_descriptors(regions, src, regions, longer)
    with pytest.raises(TransferError, match="KV blocks for"):
        pair_descriptors(regions, src._replace(num_tokens=30), regions, src._replace(num_tokens=30))
    with pytest.raises(TransferError, match="block ids"):
        pair_descriptors(regions, src, PoolRegions.contiguous(layout, 0, num_blocks=20), src)
    # wire round trip keeps the peer's addresses and refuses another layout
    wire = PoolRegions.contiguous(layout, 1 << 33, num_blocks=77).to_wire()
    assert PoolRegions.from_wire(layout, wire).num_blocks == 77
    with pytest.raises(TransferError, match="only the number of blocks may differ"):
        PoolRegions.from_wire(other, wire)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_ops_pools_regions_match_the_numpy_rule(framework):
    torch = pytest.importorskip("torch")
    if framework == "paddle":
        pytest.importorskip("paddle")
    from hybridkv.ops.pools import allocate_pools, read_state
    from hybridkv.transfer.loopback import regions_of_pools

    layout = mini_layout(mini_mamba2(), 80)
    src_m = scattered_source(layout, 13)
    export = src_m.export_request("r")
    pools = allocate_pools(layout, device="cpu", framework=framework)
    assert regions_of_pools(pools).regions[0].address == pools.data.data_ptr()  # the paddle tensor itself too
    pools.torch_data.copy_(torch.from_numpy(seeded_pool(layout, 5)))
    dst = seeded_pool(layout, 6)
    ids = np.arange(40, 40 + export.blocks.num_blocks)
    dst_blocks = blocks_of(layout, ids, 13)
    pairs = pair_descriptors(regions_of_pools(pools), export.blocks, regions_of_array(layout, dst), dst_blocks)
    copy_pairs([pools.torch_data.numpy().reshape(-1)], [dst.reshape(-1)], pairs)
    dst_pools = allocate_pools(layout, device="cpu")
    dst_pools.torch_data.copy_(torch.from_numpy(dst))
    for g, group in enumerate(layout.state_groups):
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is None:
                continue
            a = read_state(pools, g, slot, export.blocks.state_blocks[g])
            b = read_state(dst_pools, g, slot, dst_blocks.state_blocks[g])
            assert a.keys() == b.keys() == {"ssm", "conv"}
            assert all(np.array_equal(_state_bytes(a[k]), _state_bytes(b[k])) for k in a)


def _state_bytes(t) -> np.ndarray:
    """The bytes of a state tensor read from torch or Paddle pools (read_state answers in the pool's framework)."""
    import torch

    if isinstance(t, torch.Tensor):
        return t.contiguous().view(torch.uint8).numpy()
    import paddle

    return t.contiguous().view(paddle.uint8).numpy()


def test_minimax_m1_tp8_32k_counts():
    """The figures docs/transfer.md quotes: 195 MiB per request either way; descriptors by fragmentation
    (lightning state in float32, as the page says: the figures do not follow the preset's default)."""
    counts = {}
    for kind in ("paged", "padded"):
        layout = plan(preset("minimax-m1", state_dtype="float32", tp_size=8), 8 << 30, layout=kind)
        n = layout.footprint(32768).num_blocks
        regions = PoolRegions.contiguous(layout, 1 << 40)
        run = blocks_of(layout, range(1, n + 1), 32768)
        scattered = blocks_of(layout, range(1, 2 * n + 1, 2), 32768)
        runs = pair_descriptors(regions, run, regions, run)
        worst = pair_descriptors(regions, run, regions, scattered)
        counts[kind] = (n, len(runs), len(worst), runs.num_bytes)
    assert counts == {"paged": (624, 20, 12480, 204472320), "padded": (39, 20, 780, 204472320)}


def quantized_states(pool: np.ndarray, layout, blocks) -> list[tuple[np.ndarray, np.ndarray]]:
    """(value bytes, float32 scales) of every int8 / fp8 state component of the request, each read on
    its own by the layout's rule (byte ``o`` of a state in block ``set[o // block_bytes]``, segment
    ``o % block_bytes // segment_bytes``), in layer-slot order; empty for a model without them."""
    out = []
    for g, group in enumerate(layout.state_groups):
        ids = blocks.state_blocks[g]
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is None:
                continue
            spec = layout.model.layers[layer_id]
            for c in spec.components:
                if not c.dtype.quantized:
                    continue
                raw = state_bytes(pool, layout, ids, slot, spec.component_offsets()[c.name] + np.arange(c.nbytes))
                out.append((raw[: c.value_bytes].copy(), raw[c.value_bytes :].copy().view(np.float32)))
    return out


def _same_states(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(va, vb) and np.array_equal(sa.view(np.uint32), sb.view(np.uint32))
        for (va, sa), (vb, sb) in zip(a, b, strict=True)
    )


STATE_DTYPES = ["bfloat16", "int8", "float8_e4m3fn"]


@settings(
    max_examples=int(os.environ.get("HYBRIDKV_HYPOTHESIS_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.integers(0, 60),
    st.permutations(list(range(1, 60))),
    st.sampled_from(["paged", "padded"]),
    st.sampled_from(STATE_DTYPES),
)
def test_any_ids_move_byte_exact(num_tokens, perm, kind, state_dtype):
    """Any source and destination ids, any state dtype: an int8 / fp8 state arrives with its values
    and its float32 scales byte for byte (they are bytes of the state set like any other)."""
    from hybridkv.models.spec import with_state_dtype

    layout = mini_layout(with_state_dtype(mini_mamba2(), state_dtype), 60, kind)
    n = layout.footprint(num_tokens).num_blocks
    src_ids, dst_ids = np.arange(1, n + 1), np.asarray(perm[:n])
    src, dst = seeded_pool(layout, 1), seeded_pool(layout, 2)
    before = dst.copy()
    sb, db = blocks_of(layout, src_ids, num_tokens), blocks_of(layout, dst_ids, num_tokens)
    dst_regions = regions_of_array(layout, dst)
    pairs = pair_descriptors(regions_of_array(layout, src), sb, dst_regions, db)
    copy_pairs([src.reshape(-1)], [dst.reshape(-1)], pairs)
    assert reference_bytes(dst, layout, db) == reference_bytes(src, layout, sb)
    states = quantized_states(src, layout, sb)
    assert len(states) == (4 if state_dtype != "bfloat16" else 0) * (n > 0)
    assert _same_states(quantized_states(dst, layout, db), states)
    untouched = ~covered_mask(dst_regions, pairs.dst)[0]
    assert np.array_equal(dst.reshape(-1)[untouched], before.reshape(-1)[untouched])


@pytest.mark.parametrize("state_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_a_transfer_that_drops_the_scales_bytes_fails_the_check(state_dtype, kind):
    """The same copy with the destination's scale bytes left as they were (a mover that sized the
    state by its values): the values still match, the scales do not, and both checks say so."""
    from hybridkv.models.spec import with_state_dtype

    layout = mini_layout(with_state_dtype(mini_mamba2(), state_dtype), 60, kind)
    src_m, dst_m, export, imp, src, dst, before, pairs, _ = transfer(layout, layout, 13)
    good = quantized_states(dst, layout, imp.blocks)
    assert _same_states(good, quantized_states(src, layout, export.blocks)) and len(good) == 4
    for g, group in enumerate(layout.state_groups):  # put the destination's old scale bytes back
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is None:
                continue
            spec = layout.model.layers[layer_id]
            c = spec.component("ssm")
            o = spec.component_offsets()["ssm"] + np.arange(c.value_bytes, c.nbytes)
            within = o % layout.block_bytes
            at = (within // layout.segment_bytes, imp.blocks.state_blocks[g][o // layout.block_bytes])
            dst[slot][(*at, within % layout.segment_bytes)] = before[slot][(*at, within % layout.segment_bytes)]
    dropped = quantized_states(dst, layout, imp.blocks)
    assert all(np.array_equal(v, gv) for (v, _), (gv, _) in zip(dropped, good, strict=True))
    assert not _same_states(dropped, good)
    assert reference_bytes(dst, layout, imp.blocks) != reference_bytes(src, layout, export.blocks)


def test_docs_transfer_python_snippet_runs_as_written(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "transfer.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "descriptors," in proc.stdout


def _model(kv_dtype="bfloat16", ssm_dtype="bfloat16", name="mini-mamba2"):
    from hybridkv.blockmgr.presets import layers_from_pattern, mamba2_layer
    from hybridkv.blockmgr.spec import AttentionLayerSpec, ModelSpec, with_kv_dtype

    m2 = mamba2_layer(num_heads=2, head_dim=4, d_state=4, n_groups=1, conv_kernel=4, ssm_dtype=ssm_dtype)
    model = ModelSpec(name, layers_from_pattern("MMAMMA", AttentionLayerSpec(1, 8), m2))
    return with_kv_dtype(model, kv_dtype)


@pytest.mark.parametrize(
    ("here", "peer", "expect"),
    [
        (dict(kv_dtype="bfloat16"), dict(kv_dtype="float16"), r"dtype: here 'bfloat16', peer 'float16'"),
        (dict(kv_dtype="int8"), dict(kv_dtype="fp8"), r"dtype: here 'int8', peer 'float8_e4m3fn'"),
        (
            dict(ssm_dtype="bfloat16"),
            dict(ssm_dtype="float16"),
            r"components\[0\]\.dtype: here 'bfloat16', peer 'float16'",
        ),
        (dict(kv_dtype="fp8"), dict(kv_dtype="block_wise_fp8"), r"kv_scale_dtype: here None, peer 'float32'"),
        (dict(ssm_dtype="int8"), dict(ssm_dtype="fp8"), r"components\[0\]\.dtype: here 'int8', peer 'float8_e4m3fn'"),
    ],
    ids=["kv-bf16-vs-fp16", "kv-int8-vs-fp8", "state-bf16-vs-fp16", "kv-scales", "state-int8-vs-fp8"],
)
def test_layout_signature_covers_every_kv_and_state_dtype(here, peer, expect):
    """Same model name, same byte sizes, another element type: every path that meets a peer's layout
    refuses it and names the difference (the peer would read every byte as the wrong type)."""
    a = mini_layout(_model(**here), 60)
    b = mini_layout(_model(**peer), 60)
    assert layout_signature(a) != layout_signature(b)
    with pytest.raises(TransferError, match=expect):
        check_compatible(a, layout_signature(b))
    with pytest.raises(TransferError, match=expect):
        PoolRegions.from_wire(a, PoolRegions.contiguous(b, 1 << 32).to_wire())
    n = a.footprint(10).num_blocks
    blocks = blocks_of(a, range(1, n + 1), 10)
    with pytest.raises(TransferError, match="dtype"):
        pair_descriptors(PoolRegions.contiguous(a, 0), blocks, PoolRegions.contiguous(b, 0), blocks)
    check_compatible(a, layout_signature(mini_layout(_model(**here), 90)))  # only the block count differs: fine


def test_layout_signature_names_the_layout_kind_and_survives_the_wire():
    import json

    paged, padded = mini_layout(mini_mamba2(), 60), mini_layout(mini_mamba2(), 60, "padded")
    with pytest.raises(TransferError, match="layout_kind: here 'paged', peer 'padded'"):
        check_compatible(paged, layout_signature(padded))
    check_compatible(paged, json.loads(json.dumps(layout_signature(paged))))  # JSON round trip compares equal
    with pytest.raises(TransferError, match="not a mapping"):
        check_compatible(paged, ["not", "a", "signature"])


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("plane_region", [[0, 3], [0, 0]], "plane_region names regions"),
        ("plane_offset", [[0, 0], [0, 1 << 40]], "does not fit in its region"),
        ("plane_region", [[0, 0]], "shape"),
        ("num_blocks", 10**6, "does not fit in its region"),
        ("num_blocks", "7", "must be an integer"),
        ("regions", [[0, 10, 0, "HBM"]], "unknown memory kind"),
        ("regions", [[0, 10]], "region 0 must be"),
    ],
)
def test_a_malformed_pool_message_is_refused(field, value, expect):
    layout = mini_layout(mini_mamba2(), 60)
    wire = PoolRegions.contiguous(layout, 1 << 32).to_wire()
    wire[field] = value
    with pytest.raises(TransferError, match=expect):
        PoolRegions.from_wire(layout, wire)

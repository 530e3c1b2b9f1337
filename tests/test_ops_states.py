"""gather_states / scatter_states: the reference reads the layout's rule, the Triton kernel matches it bit for bit.

Triton tests run in Triton's interpreter: ``TRITON_INTERPRET=1 python -m pytest``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, scatter_states
from hybridkv.ops.testing import (
    expected_state_bytes,
    fill_random_,
    interpreter_enabled,
    random_state_table,
    small_layout,
)
from hybridkv.planner.layout import NULL_BLOCK

needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="Triton kernels run on CPU only in Triton's interpreter: set TRITON_INTERPRET=1"
)

# name -> small_layout kwargs; comments give the shape facts each case covers
CASES = {
    # two segments (K, V); fp32 ssm + bf16 conv; 456-byte state over 2 blocks of 256 B: partial last block
    "hybrid_ssm_conv": dict(),
    # no attention: one segment; fp16 144-byte state over 3 blocks of 48 B (3 = not a power of two); int64 words
    "recurrent_fp16_3_blocks": dict(components=(("kv", (2, 6, 6), "float16"),), pattern="RRRRR", state_block_bytes=48),
    # odd 9-byte blocks: byte words; bf16 + fp32 components, 26-byte state over 3 blocks
    "recurrent_odd_bytes": dict(
        components=(("shift", (3,), "bfloat16"), ("wkv", (5,), "float32")), pattern="RR-R", state_block_bytes=9
    ),
    # fp32 attention, 2-token blocks; a padding slot in the last state group; 136-byte state over 3 blocks
    "hybrid_fp32_padding_slot": dict(
        components=(("kv", (2, 4, 4), "float32"), ("scale", (2,), "float32")),
        pattern="ARRRAR-R",
        kv_heads=1,
        head_dim=4,
        kv_dtype="float32",
        block_size=2,
        num_blocks=40,
    ),
}


def _setup(case: str, batch_size: int = 3, seed: int = 0, null_rows=(1,)):
    layout = small_layout(**CASES[case])
    pools = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed)
    table = random_state_table(layout, batch_size, seed, null_rows=null_rows, extra_columns=1)
    return layout, pools, table


@pytest.mark.parametrize("case", CASES)
def test_reference_gather_reads_blocks_in_table_order(case):
    layout, pools, table = _setup(case)
    out = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    gather_states(pools, table, None, out, backend="naive")
    for r in out.regions:
        got = out.region_bytes(r)
        for b in range(3):
            want = expected_state_bytes(pools, r.group, r.slot, table[r.group, b].tolist())
            assert torch.equal(got[b], want[r.state_offset : r.state_offset + r.nbytes])
    row = out.regions[0]
    assert not out.region_bytes(row)[1].any(), "a null row reads zeros"


BACKENDS = ["naive", pytest.param("triton", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_gather_of_a_null_row_writes_zeros_not_block_0(case, backend):
    layout, pools, table = _setup(case)
    pools.torch_data[:, :, NULL_BLOCK] = 7  # a corrupted null block must not leak into padding rows
    out = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    gather_states(pools, table, None, out, backend=backend)
    assert all(not out.region_bytes(r)[1].any() for r in out.regions)


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [None, 0, -1])
def test_triton_gather_matches_reference_bit_for_bit(case, group):
    layout, pools, table = _setup(case)
    group = None if group is None else group % layout.num_state_groups
    want = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    got = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    gather_states(pools, table, group, want, backend="naive")
    gather_states(pools, table, group, got, backend="triton")
    assert torch.equal(got.torch_data, want.torch_data)
    if group is not None:
        other = [r for r in got.regions if r.group != group]
        assert all((got.region_bytes(r) == 0xFF).all() for r in other), "other groups stay untouched"


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_triton_scatter_matches_reference_and_touches_only_state_bytes(case):
    layout, pools, table = _setup(case)
    src = fill_random_state_buffers(layout, 3, seed=5)
    want = allocate_pools(layout, "cpu")
    want.torch_data.copy_(pools.torch_data)
    before = pools.torch_data.clone()
    scatter_states(want, table, None, src, backend="naive")
    scatter_states(pools, table, None, src, backend="triton")
    assert torch.equal(pools.torch_data, want.torch_data)
    _assert_only_state_bytes_changed(layout, before, pools.torch_data, table)


def test_reference_scatter_touches_only_state_bytes():
    layout, pools, table = _setup("hybrid_ssm_conv")
    before = pools.torch_data.clone()
    scatter_states(pools, table, None, fill_random_state_buffers(layout, 3, seed=1), backend="naive")
    _assert_only_state_bytes_changed(layout, before, pools.torch_data, table)


def fill_random_state_buffers(layout, batch_size, seed, group=None):
    bufs = allocate_state_buffers(layout, batch_size, group=group, device="cpu")
    rng = np.random.default_rng(seed)
    bufs.torch_data.copy_(torch.from_numpy(rng.integers(0, 256, size=bufs.torch_data.numel(), dtype=np.uint8)))
    return bufs


def _assert_only_state_bytes_changed(layout, before, after, table):
    """Every byte outside the written state sets is as before; so is each last block's unused tail."""
    may_change = torch.zeros_like(before, dtype=torch.bool)
    for g, bps in enumerate(layout.blocks_per_state):
        for slot in range(layout.group_size):
            entry = layout.state_layer(g, slot)
            if entry is None:
                continue
            state_bytes = entry[1].state_bytes
            for row in table[g]:
                for j, block in enumerate(row[:bps].tolist()):
                    if block == NULL_BLOCK:
                        continue
                    n = min(layout.block_bytes, state_bytes - j * layout.block_bytes)
                    for seg in range(layout.num_segments):  # block bytes = segments back to back
                        k = min(max(n - seg * layout.segment_bytes, 0), layout.segment_bytes)
                        may_change[slot, seg, block, :k] = True
    assert torch.equal(after[~may_change], before[~may_change])
    assert not after[:, :, NULL_BLOCK].any()


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_scatter_then_gather_roundtrips(case):
    layout, pools, table = _setup(case, null_rows=(0,))
    src = fill_random_state_buffers(layout, 3, seed=3)
    out = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    scatter_states(pools, table, None, src, backend="triton")
    gather_states(pools, table, None, out, backend="triton")
    for r in src.regions:
        assert torch.equal(out.region_bytes(r)[1:], src.region_bytes(r)[1:])
        assert not out.region_bytes(r)[0].any()


@needs_interpreter
def test_one_group_with_a_2d_table_and_group_buffers():
    layout, pools, table = _setup("hybrid_fp32_padding_slot")
    g = layout.num_state_groups - 1
    got = allocate_state_buffers(layout, 3, group=g, device="cpu", fill="nan")
    want = allocate_state_buffers(layout, 3, group=g, device="cpu", fill="nan")
    gather_states(pools, torch.from_numpy(table[g]), g, got, backend="triton")
    gather_states(pools, table, g, want, backend="naive")
    assert torch.equal(got.torch_data, want.torch_data)
    assert set(got.tensors) == {(g, s) for s, lid in enumerate(layout.state_groups[g].layer_ids) if lid is not None}


@needs_interpreter
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    dtypes=st.lists(st.sampled_from(["float32", "bfloat16", "float16"]), min_size=1, max_size=3),
    block_bytes=st.integers(12, 80),
    with_attention=st.booleans(),
    batch_size=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_on_random_shapes(shape, dtypes, block_bytes, with_attention, batch_size, seed):
    components = tuple((f"c{i}", tuple(shape[i:] or shape), d) for i, d in enumerate(dtypes))
    if with_attention:
        kwargs = dict(pattern="RAR", block_size=1 + block_bytes % 4, head_dim=2 + 2 * (block_bytes % 3), kv_heads=1)
    else:
        kwargs = dict(pattern="RR", state_block_bytes=block_bytes)
    probe = small_layout(components, num_blocks=2, **kwargs)
    layout = small_layout(components, num_blocks=sum(probe.blocks_per_state) * batch_size + 1, **kwargs)
    pools = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed)
    null_rows = (seed % batch_size,) if seed % 3 == 0 else ()
    table = random_state_table(layout, batch_size, seed, null_rows=null_rows)
    want = allocate_state_buffers(layout, batch_size, device="cpu", fill="nan")
    got = allocate_state_buffers(layout, batch_size, device="cpu", fill="nan")
    gather_states(pools, table, None, want, backend="naive")
    gather_states(pools, table, None, got, backend="triton")
    assert torch.equal(got.torch_data, want.torch_data)
    src = fill_random_state_buffers(layout, batch_size, seed + 1)
    ref = allocate_pools(layout, "cpu")
    ref.torch_data.copy_(pools.torch_data)
    scatter_states(ref, table, None, src, backend="naive")
    scatter_states(pools, table, None, src, backend="triton")
    assert torch.equal(pools.torch_data, ref.torch_data)


def test_component_tensors_are_typed_contiguous_views():
    layout, pools, table = _setup("hybrid_ssm_conv")
    out = gather_states(pools, table, None, allocate_state_buffers(layout, 3, device="cpu"), backend="naive")
    ssm, conv = out.layer(0, 0)["ssm"], out.layer(0, 0)["conv"]
    assert ssm.shape == (3, 3, 5, 7) and ssm.dtype == torch.float32 and ssm.is_contiguous()
    assert conv.shape == (3, 6, 3) and conv.dtype == torch.bfloat16 and conv.is_contiguous()
    want = expected_state_bytes(pools, 0, 0, table[0, 0].tolist())
    assert torch.equal(ssm[0].reshape(-1).view(torch.uint8), want[: 3 * 5 * 7 * 4])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.__setitem__((0, 0, 0), 10_000), "outside the pool"),
        (lambda t: t.__setitem__((0, 0, 0), -1), "outside the pool"),
        (lambda t: t.__setitem__((1, 0, 0), t[0, 0, 0]), "twice"),
    ],
)
def test_scatter_rejects_bad_block_ids(mutate, message):
    layout, pools, table = _setup("hybrid_ssm_conv")
    mutate(table)
    with pytest.raises(ValueError, match=message):
        scatter_states(pools, table, None, allocate_state_buffers(layout, 3, device="cpu"), backend="naive")


def test_gather_allows_shared_blocks_but_checks_shapes_and_groups():
    layout, pools, table = _setup("hybrid_ssm_conv")
    table[1, 0] = table[0, 0]  # reading one block twice is fine
    out = allocate_state_buffers(layout, 3, device="cpu")
    gather_states(pools, table, None, out, backend="naive")
    with pytest.raises(ValueError, match="batch of at most 2"):
        gather_states(pools, table, None, allocate_state_buffers(layout, 2, device="cpu"), backend="naive")
    with pytest.raises(ValueError, match="at least 2 block ids"):
        gather_states(pools, table[:, :, :1], None, out, backend="naive")
    with pytest.raises(ValueError, match="does not exist"):
        gather_states(pools, table, 9, out, backend="naive")
    with pytest.raises(ValueError, match="not \\[0, 2\\]"):
        gather_states(pools, table, None, allocate_state_buffers(layout, 3, group=1, device="cpu"), backend="naive")
    with pytest.raises(ValueError, match="with an int group"):
        gather_states(pools, table[0], None, out, backend="naive")
    with pytest.raises(ValueError, match="3 state groups"):
        gather_states(pools, table[:2], None, out, backend="naive")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_smaller_table_fills_the_first_rows_of_larger_buffers(backend):
    """One set of buffers for every step: rows past the table's batch are neither read nor written."""
    layout, pools, table = _setup("hybrid_ssm_conv", batch_size=2, null_rows=())
    want = allocate_state_buffers(layout, 2, device="cpu", fill="nan")
    got = allocate_state_buffers(layout, 5, device="cpu", fill="nan")
    gather_states(pools, table, None, want, backend="naive")
    gather_states(pools, table, None, got, backend=backend)
    for r_want, r_got in zip(want.regions, got.regions, strict=True):
        assert torch.equal(got.region_bytes(r_got)[:2], want.region_bytes(r_want))
        assert (got.region_bytes(r_got)[2:] == 0xFF).all()
    ref = allocate_pools(layout, "cpu")
    ref.torch_data.copy_(pools.torch_data)
    scatter_states(ref, table, None, want, backend="naive")
    scatter_states(pools, table, None, got, backend=backend)  # the NaN rows 2..4 must not be written
    assert torch.equal(pools.torch_data, ref.torch_data)


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch):
    layout, pools, table = _setup("hybrid_ssm_conv")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gather_states(pools, table, None, allocate_state_buffers(layout, 3, device="cpu"), backend="triton")

"""Lightning decode / prefill in place over a quantized state (int8 / fp8 values then float32 scales in
the set): the reference writes the bytes of gather (dequantize) -> float32 recurrence -> scatter
(quantize) with the same seeds, the Triton kernels (``TRITON_INTERPRET=1``) the reference's bytes
(decode) or within one quantization step (prefill: its block sums run in another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.models.spec import with_state_scales
from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, scatter_states
from hybridkv.ops.addressing import state_byte_addresses
from hybridkv.ops.lightning import (
    lightning_decode,
    lightning_decode_naive,
    lightning_layer,
    lightning_prefill,
    lightning_prefill_varlen_naive,
    lightning_slopes,
    read_layer_states,
    write_layer_states,
)
from hybridkv.ops.states import quant
from hybridkv.ops.testing import fill_random_, interpreter_enabled, random_state_table, small_layout
from hybridkv.planner.layout import NULL_BLOCK, plan

needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="set TRITON_INTERPRET=1")
BACKENDS = ["naive", pytest.param("triton", marks=needs_interpreter)]

# name -> (small_layout kwargs, scale granularity)
CASES = {
    # two segments per block (attention K/V), an int8 [3, 4, 8] state and a bf16 conv after it
    "int8_row": (dict(components=(("ssm", (3, 4, 8), "int8"), ("conv", (6, 3), "bfloat16"))), "row"),
    # 40-byte blocks: rows and heads cross block boundaries, scales in the last block
    "fp8_row": (dict(components=(("ssm", (2, 4, 8), "fp8"),), pattern="RRR", state_block_bytes=40), "row"),
    "int8_head": (dict(components=(("ssm", (2, 4, 8), "int8"),), pattern="RRR", state_block_bytes=40), "head"),
    "fp8_head_odd": (dict(components=(("ssm", (2, 3, 12), "fp8"),), pattern="RRR", state_block_bytes=40), "head"),
}
SEEDS = quant.rounding_seeds([5, 6, 7, 8], [100, 101, 102, 103])


def _setup(case: str, batch: int = 4, null_rows=(1,)):
    kwargs, scales = CASES[case]
    layout = small_layout(**kwargs)
    if scales != "row":
        model = with_state_scales(layout.model, scales)
        layout = plan(model, layout.budget_bytes, layout.block_size, state_block_bytes=kwargs.get("state_block_bytes"))
    pools = fill_random_(allocate_pools(layout, "cpu"), 0)
    table = torch.from_numpy(random_state_table(layout, batch, 1, null_rows=null_rows, extra_columns=1))
    g, s = next(
        (g, s) for g in range(layout.num_state_groups) for s in range(layout.group_size) if layout.state_layer(g, s)
    )
    layer = lightning_layer(pools, g, s)
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(batch, layer.num_heads, layer.dk, layer.dv, generator=gen) * torch.logspace(-2, 1, layer.dv)
    write_layer_states(pools, layer, table[g], states)
    return layout, pools, table, layer


def _qkv(t: int, layer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, layer.num_heads, d, generator=gen) for d in (layer.dk, layer.dk, layer.dv)]


def _component_mask(pools, layer, rows) -> torch.Tensor:
    """bool over the layer slot's bytes: the component's values and scales in the (non-null) sets of ``rows``."""
    address, null = state_byte_addresses(pools.layout, pools.num_blocks, rows.to(torch.int64), layer.state_bytes)
    cut = slice(layer.component_offset, layer.component_offset + layer.stored_bytes)
    mask = torch.zeros(pools.torch_data[layer.slot].numel(), dtype=torch.bool)
    mask[address[:, cut][~null[:, cut]]] = True
    return mask.view(pools.torch_data[layer.slot].shape)


def _stored(pools, layer, rows) -> torch.Tensor:
    """uint8 ``[B, component bytes]``: the component's stored values and scales of the sets ``rows``, in order."""
    address, _ = state_byte_addresses(pools.layout, pools.num_blocks, rows.to(torch.int64), layer.state_bytes)
    cut = slice(layer.component_offset, layer.component_offset + layer.stored_bytes)
    return pools.torch_data[layer.slot].reshape(-1)[address[:, cut]]


def _composed_decode(pools, table, layer, q, k, v, slopes, seeds):
    """gather_states (dequantize into float32) -> the float32 decode -> scatter_states (quantize) of the group."""
    buf = allocate_state_buffers(pools.layout, table.shape[1], device="cpu", compute_dtype="float32")
    gather_states(pools, table, None, buf, backend="naive")
    state = buf.layer(layer.group, layer.slot)["ssm"]
    o = lightning_decode_naive(q, k, v, state, slopes)
    scatter_states(pools, table, None, buf, backend="naive", seeds=seeds)
    return o


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_decode_writes_the_bytes_of_gather_recurrence_scatter(case, stochastic):
    layout, pools, table, layer = _setup(case, null_rows=())
    seeds = SEEDS if stochastic else None
    q, k, v = _qkv(4, layer, 3)
    slopes = lightning_slopes(layer.num_heads, 1, 3)
    pools_c = allocate_pools(layout, "cpu")
    pools_c.torch_data.copy_(pools.torch_data)
    o_c = _composed_decode(pools_c, table, layer, q, k, v, slopes, seeds)
    o = lightning_decode(pools, table, layer.group, layer.slot, q, k, v, slopes, backend="naive", seeds=seeds)
    mask = _component_mask(pools, layer, table[layer.group])
    assert torch.equal(pools.torch_data[layer.slot][mask], pools_c.torch_data[layer.slot][mask])
    assert torch.allclose(o, o_c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_decode_rewrites_every_scale_and_stays_within_half_a_step(case):
    """Nearest rounding: every value of the new state within half its group's new step, so a stale or
    per-tensor scale fails (the state grows past the old scales: v is large)."""
    layout, pools, table, layer = _setup(case)
    q, k, v = _qkv(4, layer, 4)
    v = v * 50.0
    slopes = lightning_slopes(layer.num_heads, 0, 3)
    want = read_layer_states(pools, layer, table[layer.group])
    lightning_decode_naive(q, k, v, want, slopes)
    lightning_decode(pools, table, layer.group, layer.slot, q, k, v, slopes, backend="naive")
    got = read_layer_states(pools, layer, table[layer.group])
    for b in (0, 2, 3):
        groups = want[b].reshape(-1, layer.scale_group)
        step = groups.abs().amax(1, keepdim=True) / layer.stored.quant_max
        if layer.stored.value == "int8":
            bound = step / 2 * 1.0001 + 1e-7
        else:
            bound = torch.maximum(groups.abs() / 16, step * 448 * 2.0**-10) * 1.0001
        assert ((got[b].reshape(-1, layer.scale_group) - groups).abs() <= bound).all()


@needs_interpreter
@pytest.mark.parametrize("tile", [None, 8])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_triton_decode_writes_the_reference_bytes(case, stochastic, tile, monkeypatch):
    """``tile`` 8: one state row per step of the program's loop (several steps; head scales: two passes)."""
    if tile is not None:
        from hybridkv.ops.lightning import kernel_quant

        monkeypatch.setattr(kernel_quant, "MAX_DECODE_TILE", tile)
    seeds = SEEDS if stochastic else None
    _, pools, table, layer = _setup(case)
    _, pools_r, _, _ = _setup(case)
    before = pools.torch_data.clone()
    init = torch.tensor([True, True, False, True])
    q, k, v = _qkv(4, layer, 5)
    slopes = lightning_slopes(layer.num_heads, 2, 3)
    args = (table, layer.group, layer.slot, q, k, v, slopes)
    o = lightning_decode(pools, *args, has_initial_state=init, backend="triton", seeds=seeds)
    o_r = lightning_decode(pools_r, *args, has_initial_state=init, backend="naive", seeds=seeds)
    assert torch.equal(pools.torch_data, pools_r.torch_data)
    assert torch.allclose(o, o_r, rtol=1e-5, atol=1e-5) and (o[1] == 0).all()
    changed = pools.torch_data != before
    live = table.clone()
    live[:, 1] = NULL_BLOCK
    assert not (changed[layer.slot] & ~_component_mask(pools, layer, live[layer.group])).any()
    assert not changed[: layer.slot].any() and not changed[layer.slot + 1 :].any()


def _prefill_inputs(layer):
    lengths = [5, 0, 37, 3]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    q, k, v = _qkv(int(cu[-1]), layer, 6)
    return cu, q, k * 0.3, v, torch.tensor([True, True, False, True])


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_prefill_writes_the_bytes_of_gather_recurrence_scatter(case, stochastic):
    layout, pools, table, layer = _setup(case, null_rows=(3,))
    seeds = SEEDS if stochastic else None
    cu, q, k, v, init = _prefill_inputs(layer)
    slopes = lightning_slopes(layer.num_heads, 0, 3)
    pools_c = allocate_pools(layout, "cpu")
    pools_c.torch_data.copy_(pools.torch_data)
    buf = allocate_state_buffers(layout, 4, device="cpu", compute_dtype="float32")
    gather_states(pools_c, table, None, buf, backend="naive")
    state = buf.layer(layer.group, layer.slot)["ssm"]
    o_c = lightning_prefill_varlen_naive(q, k, v, cu, state, init, slopes, block_size=16)
    live = table.clone()
    live[:, [1, 3]] = NULL_BLOCK  # no tokens / a null row: nothing written
    scatter_states(pools_c, live, None, buf, backend="naive", seeds=seeds)
    slot = layer.slot
    o = lightning_prefill(pools, table, layer.group, slot, q, k, v, cu, init, slopes, 16, backend="naive", seeds=seeds)
    mask = _component_mask(pools, layer, live[layer.group])
    assert torch.equal(pools.torch_data[slot][mask], pools_c.torch_data[slot][mask])
    assert torch.allclose(o[: int(cu[3])], o_c[: int(cu[3])], rtol=1e-6, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_triton_prefill_is_within_one_step_of_the_reference(case, stochastic):
    seeds = SEEDS if stochastic else None
    _, pools, table, layer = _setup(case, null_rows=(3,))
    _, pools_r, _, _ = _setup(case, null_rows=(3,))
    before = pools.torch_data.clone()
    cu, q, k, v, init = _prefill_inputs(layer)
    slopes = lightning_slopes(layer.num_heads, 1, 3)
    args = (table, layer.group, layer.slot, q, k, v, cu, init, slopes, 16)
    o = lightning_prefill(pools, *args, backend="triton", seeds=seeds)
    o_r = lightning_prefill(pools_r, *args, backend="naive", seeds=seeds)
    assert torch.allclose(o, o_r, rtol=1e-4, atol=1e-4) and (o[int(cu[3]) :] == 0).all()
    got = read_layer_states(pools, layer, table[layer.group])
    want = read_layer_states(pools_r, layer, table[layer.group])
    for b in (0, 2):
        groups = want[b].reshape(-1, layer.scale_group)
        step = groups.abs().amax(1, keepdim=True) / layer.stored.quant_max
        bound = step * 1.001 if layer.stored.value == "int8" else torch.maximum(groups.abs() / 7, step * 0.01)
        assert ((got[b].reshape(-1, layer.scale_group) - groups).abs() <= bound).all()
    live = table.clone()
    live[:, [1, 3]] = NULL_BLOCK
    changed = pools.torch_data != before
    assert not (changed[layer.slot] & ~_component_mask(pools, layer, live[layer.group])).any()
    assert not changed[: layer.slot].any() and not changed[layer.slot + 1 :].any()


def test_tensor_scales_and_a_state_dtype_are_refused():
    layout = small_layout(components=(("ssm", (2, 4, 8), "int8"),), pattern="RRR", state_block_bytes=40)
    tensor = plan(
        with_state_scales(layout.model, "tensor"), layout.budget_bytes, layout.block_size, state_block_bytes=40
    )
    with pytest.raises(ValueError, match="row or head"):
        lightning_layer(allocate_pools(tensor, "cpu"), 0, 0)
    with pytest.raises(ValueError, match="row or head"):
        lightning_layer(allocate_pools(layout, "cpu"), 0, 0, state_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["int8_row", "fp8_head_odd"])
def test_prefill_exports_copy_the_stored_values_and_scales(backend, case):
    """An export of a quantized state is the live set's stored bytes after the piece, values and scales
    as they are: byte-equal to prefilling the row's first tokens on its own (same seeds), and the
    live state after the row equals the same two pieces run one after the other."""
    layout, pools, table, layer = _setup(case, batch=6, null_rows=())
    _, pools_2, _, _ = _setup(case, batch=6, null_rows=())
    live, spare = table[:, :3], table[:, 3:]
    g, slot = layer.group, layer.slot
    cu = torch.tensor([0, 9, 12, 26])
    init = torch.tensor([True, False, True])
    q, k, v = _qkv(26, layer, 7)
    slopes = lightning_slopes(layer.num_heads, 0, 3)
    seeds = SEEDS[:3]
    lightning_prefill(pools, live, g, slot, q, k, v * 3, cu, init, slopes, 4, backend=backend, seeds=seeds,
                      exports=[(2, 5, spare[:, 2])])  # fmt: skip
    # the same row 2 in two calls: its first 5 tokens, then the rest
    first = torch.cat([torch.arange(0, 9), torch.arange(9, 12), torch.arange(12, 17)])
    lightning_prefill(pools_2, live, g, slot, q[first], k[first], v[first] * 3, torch.tensor([0, 9, 12, 17]), init,
                      slopes, 4, backend=backend, seeds=seeds)  # fmt: skip
    assert torch.equal(_stored(pools, layer, spare[g][2:3]), _stored(pools_2, layer, live[g][2:3]))
    rest = torch.arange(17, 26)
    none = torch.tensor([0, 0, 0, 9])
    lightning_prefill(pools_2, live, g, slot, q[rest], k[rest], v[rest] * 3, none, torch.ones(3, dtype=torch.bool),
                      slopes, 4, backend=backend, seeds=seeds)  # fmt: skip
    assert torch.equal(_stored(pools, layer, live[g]), _stored(pools_2, layer, live[g]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_into_other_sets_reads_the_live_ones_and_writes_only_its_outputs(backend):
    """The speculative shape over an fp8 state: rows read their live sets and write other sets (a
    null output set writes nothing); the written sets hold the bytes an in-place decode writes."""
    _, pools, table, layer = _setup("fp8_row", batch=6, null_rows=())
    _, pools_2, _, _ = _setup("fp8_row", batch=6, null_rows=())
    live, out = table[:, :3], table[:, 3:].clone()
    out[:, 1] = NULL_BLOCK
    before = pools.torch_data.clone()
    q, k, v = _qkv(3, layer, 8)
    slopes = lightning_slopes(layer.num_heads, 1, 3)
    g, slot = layer.group, layer.slot
    o = lightning_decode(pools, live, g, slot, q, k, v, slopes, out_table=out, backend=backend, seeds=SEEDS[:3])
    o_2 = lightning_decode(pools_2, live, g, slot, q, k, v, slopes, backend=backend, seeds=SEEDS[:3])
    assert (o[1] == 0).all() and torch.allclose(o[[0, 2]], o_2[[0, 2]], rtol=1e-6, atol=1e-6)
    assert torch.equal(_stored(pools, layer, out[g][[0, 2]]), _stored(pools_2, layer, live[g][[0, 2]]))
    changed = pools.torch_data != before
    assert not (changed[slot] & ~_component_mask(pools, layer, out[g])).any()

"""Quantized state at the gather / scatter boundary: scatter quantizes a compute-dtype buffer into
int8 / fp8 values and float32 scales inside the state set (or rounds float32 to float16), gather
dequantizes; the reference and the Triton kernel write and read the same bytes, stochastic rounding
included (``TRITON_INTERPRET=1`` for the Triton cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.models.spec import with_state_scales
from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, scatter_states
from hybridkv.ops.states import quant
from hybridkv.ops.testing import fill_random_, interpreter_enabled, random_state_table, small_layout
from hybridkv.planner.layout import NULL_BLOCK, plan

needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="set TRITON_INTERPRET=1")
BACKENDS = ["naive", pytest.param("triton", marks=needs_interpreter)]

# name -> (small_layout kwargs, scale granularity); states straddle blocks and segments
CASES = {
    # K/V segments of 64 B, blocks of 128 B: int8 ssm [3, 4, 8] (96 B + 12 row scales) + bf16 conv
    "int8_row": (dict(components=(("ssm", (3, 4, 8), "int8"), ("conv", (6, 3), "bfloat16"))), "row"),
    "fp8_row": (dict(components=(("ssm", (3, 4, 8), "fp8"), ("conv", (6, 3), "bfloat16"))), "row"),
    # no attention, 40-byte blocks: one head's 32 values cross a block boundary
    "fp8_head": (dict(components=(("ssm", (2, 4, 8), "fp8"),), pattern="RRR", state_block_bytes=40), "head"),
    "int8_tensor": (dict(components=(("ssm", (2, 4, 8), "int8"),), pattern="RRR", state_block_bytes=40), "tensor"),
    # float16 state, stochastic rounding from float32, no scales
    "float16": (dict(components=(("ssm", (3, 4, 8), "float16"), ("conv", (6, 3), "bfloat16"))), None),
}


def _setup(case: str, batch: int = 3, null_rows=(1,)):
    kwargs, scales = CASES[case]
    layout = small_layout(**kwargs)
    if scales not in (None, "row"):
        model = with_state_scales(layout.model, scales)
        layout = plan(model, layout.budget_bytes, layout.block_size, state_block_bytes=kwargs.get("state_block_bytes"))
    pools = fill_random_(allocate_pools(layout, "cpu"), 0)
    table = random_state_table(layout, batch, 0, null_rows=null_rows, extra_columns=1)
    return layout, pools, table


def _fill(buffers, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    for (_, _), comps in buffers.tensors.items():
        for t in comps.values():
            if t.dtype.is_floating_point:
                rows = torch.randn(t.shape, generator=gen) * torch.logspace(-3, 1, t.shape[-1])
                t.copy_(rows.to(t.dtype))
    return {k: {n: t.clone() for n, t in v.items()} for k, v in buffers.tensors.items()}


def _pool_after_scatter(case: str, backend: str, seeds=None):
    layout, pools, table = _setup(case)
    src = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32")
    _fill(src)
    scatter_states(pools, table, None, src, backend=backend, seeds=seeds)
    return pools, table, src


@pytest.mark.parametrize("case", CASES)
def test_scatter_then_gather_is_within_half_a_step_and_the_null_row_writes_nothing(case):
    layout, pools, table = _setup(case)
    before_null = pools.torch_data[:, :, NULL_BLOCK].clone()
    src = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32")
    want = _fill(src)
    scatter_states(pools, table, None, src, backend="naive")
    assert torch.equal(pools.torch_data[:, :, NULL_BLOCK], before_null)
    out = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32", fill="nan")
    gather_states(pools, table, None, out, backend="naive")
    for key, comps in out.tensors.items():
        spec = layout.state_layer(*key)[1]
        for name, got in comps.items():
            c, x = spec.component(name), want[key][name]
            assert not got[1].any(), "the null row reads zeros"
            for b in (0, 2):
                if c.dtype.quantized:
                    groups = x[b].reshape(-1, c.scale_group)
                    step = groups.abs().amax(1, keepdim=True) / c.dtype.quant_max
                    if c.dtype.value == "int8":
                        bound = step / 2 + 1e-6
                    else:  # e4m3: half a spacing at 3 mantissa bits, relative to the value, or subnormal steps
                        bound = torch.maximum(groups.abs() / 16, step * 448 * 2.0**-10) * 1.0001
                    assert ((got[b].reshape(-1, c.scale_group) - groups).abs() <= bound).all(), name
                elif c.dtype.value == "float16":
                    assert torch.equal(got[b], x[b].to(torch.float16).to(torch.float32)) or torch.allclose(
                        got[b], x[b], rtol=2**-11, atol=2**-24
                    )
                else:
                    assert torch.equal(got[b], x[b]), name


@pytest.mark.parametrize("case", CASES)
def test_stored_bytes_hold_values_then_scales(case):
    """A buffer without compute_dtype sees the stored bytes; decoding them gives what gather gives."""
    layout, _, _ = _setup(case)
    pools, table, _ = _pool_after_scatter(case, "naive")
    raw = allocate_state_buffers(layout, 3, device="cpu")
    gather_states(pools, table, None, raw, backend="naive")
    out = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32")
    gather_states(pools, table, None, out, backend="naive")
    for key, comps in raw.tensors.items():
        spec = layout.state_layer(*key)[1]
        for name, t in comps.items():
            c = spec.component(name)
            if c.dtype.quantized:
                assert t.shape == (3, c.nbytes) and t.dtype == torch.uint8
                decoded = quant.decode(t, c.dtype, c.numel, c.scale_group).view(3, *c.shape)
                assert torch.equal(decoded, out.tensors[key][name])
                scales = t[:, c.value_bytes :].contiguous().view(torch.float32)
                assert scales.shape == (3, c.scale_count) and (scales[0] > 0).all()


@needs_interpreter
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_triton_writes_and_reads_the_reference_bytes(case, stochastic):
    seeds = quant.rounding_seeds([11, 12, 13], [64, 64, 200]) if stochastic else None
    ref, table, _ = _pool_after_scatter(case, "naive", seeds)
    tri, _, _ = _pool_after_scatter(case, "triton", seeds)
    assert torch.equal(ref.torch_data, tri.torch_data)
    layout = ref.layout
    outs = []
    for backend, pools in (("naive", ref), ("triton", tri)):
        # float32: Triton's interpreter casts to bfloat16 by truncation, the GPU and torch round to nearest
        out = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32", fill="nan")
        gather_states(pools, table, None, out, backend=backend)
        outs.append(out.torch_data)
    assert torch.equal(outs[0], outs[1])  # nan fill bytes compare as bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_reproduces_from_request_and_position(backend):
    seeds = quant.rounding_seeds([5, 6, 7], [128, 128, 128])
    a, _, _ = _pool_after_scatter("int8_row", backend, seeds)
    b, _, _ = _pool_after_scatter("int8_row", backend, seeds)
    c, _, _ = _pool_after_scatter("int8_row", backend, quant.rounding_seeds([5, 6, 7], [129, 129, 129]))
    d, _, _ = _pool_after_scatter("int8_row", backend, None)
    assert torch.equal(a.torch_data, b.torch_data)
    assert not torch.equal(a.torch_data, c.torch_data)
    assert not torch.equal(a.torch_data, d.torch_data)


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1, 4096), 0.3)
    x[0, 0] = 1.0  # the group's largest magnitude: scale 1/127, 0.3 lies between 38 and 39 steps
    for dtype, group in ((quant.DType.INT8, 4096), (quant.DType.FLOAT8_E4M3, 4096), (quant.DType.FLOAT16, 4096)):
        u = quant.uniforms(torch.tensor([3]), 17, 4096)
        got = quant.decode(quant.encode(x, dtype, group, u), dtype, 4096, group)[0, 1:]
        nearest = quant.decode(quant.encode(x, dtype, group, 0.5), dtype, 4096, group)[0, 1:]
        assert abs(got.mean().item() - 0.3) < abs(nearest.mean().item() - 0.3) / 4 or dtype is quant.DType.FLOAT16
        assert abs(got.double().mean().item() - 0.3) < 1e-4 * (1 if dtype is quant.DType.FLOAT16 else 100)


def test_rounding_seeds_depend_on_request_and_position():
    s = quant.rounding_seeds([1, 1, 2], [10, 11, 10])
    assert len(set(s.tolist())) == 3 and (s >= 0).all() and (s < 2**32).all()
    assert np.array_equal(s, quant.rounding_seeds([1, 1, 2], [10, 11, 10]))


@pytest.mark.parametrize("case", ["int8_row", "fp8_head"])
def test_values_and_scales_survive_a_checkpoint_copy_and_a_swap_out_and_in(case):
    """A quantized state set is plain blocks: copy_blocks (a checkpoint) and swap_blocks (the host
    tier) move its values and scales unchanged, so the state gathered from the copy equals the original."""
    from hybridkv.ops import allocate_host_pools, copy_blocks, swap_blocks

    layout, pools, _ = _setup(case)
    rng = np.random.default_rng(3)
    bps = layout.blocks_per_state
    ids = rng.permutation(np.arange(1, layout.num_blocks))[: 3 * sum(bps)].reshape(3, -1)  # live, copy, swapped-in
    tables = []
    for part in ids:
        t = np.zeros((len(bps), 1, max(bps)), dtype=np.int32)
        pos = 0
        for g, n in enumerate(bps):
            t[g, 0, :n] = part[pos : pos + n]
            pos += n
        tables.append(t)
    src = allocate_state_buffers(layout, 1, device="cpu", compute_dtype="float32")
    _fill(src)
    scatter_states(pools, tables[0], None, src, backend="naive", seeds=quant.rounding_seeds([9], [32]))

    def gathered(table):
        out = allocate_state_buffers(layout, 1, device="cpu", compute_dtype="float32", fill="nan")
        gather_states(pools, table, None, out, backend="naive")
        raw = allocate_state_buffers(layout, 1, device="cpu")
        gather_states(pools, table, None, raw, backend="naive")
        return out.torch_data.clone(), raw.torch_data.clone()

    want, want_raw = gathered(tables[0])
    copy_blocks(pools, ids[0], ids[1], backend="naive")  # a checkpoint of the live set
    assert all(torch.equal(a, b) for a, b in zip(gathered(tables[1]), (want, want_raw), strict=True))
    host = allocate_host_pools(layout, len(ids[0]) + 1)
    swap_blocks(pools, host, ids[1], np.arange(1, len(ids[0]) + 1), "out", backend="naive")
    pools.torch_data[:, :, torch.from_numpy(ids[1].astype(np.int64))] = 0  # the device blocks are reused
    swap_blocks(pools, host, ids[2], np.arange(1, len(ids[0]) + 1), "in", backend="naive")
    got, got_raw = gathered(tables[2])
    assert torch.equal(got, want) and torch.equal(got_raw, want_raw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paddle_pools_store_the_same_bytes_as_torch_pools(backend):
    """Paddle pools: the computed components go through the same reference / kernel (on DLPack views),
    the byte components through the Paddle path; the pool bytes equal the torch pools'."""
    paddle = pytest.importorskip("paddle")
    seeds = quant.rounding_seeds([1, 2, 3], [7, 7, 7])
    ref, table, src = _pool_after_scatter("int8_row", "naive", seeds)
    layout = ref.layout
    pools = allocate_pools(layout, "cpu", framework="paddle")
    pools.data[:] = paddle.to_tensor(fill_random_(allocate_pools(layout, "cpu"), 0).torch_data.numpy())
    bufs = allocate_state_buffers(layout, 3, device="cpu", framework="paddle", compute_dtype="float32")
    bufs.data[:] = paddle.to_tensor(src.torch_data.numpy())  # the same regions: the same values
    scatter_states(pools, table, None, bufs, backend=backend, seeds=seeds)
    assert np.array_equal(pools.data.numpy(), ref.torch_data.numpy())
    out = allocate_state_buffers(layout, 3, device="cpu", framework="paddle", compute_dtype="float32", fill="nan")
    gather_states(pools, table, None, out, backend=backend)
    want = allocate_state_buffers(layout, 3, device="cpu", compute_dtype="float32", fill="nan")
    gather_states(ref, table, None, want, backend="naive")
    assert np.array_equal(out.data.numpy(), want.torch_data.numpy())


def test_paddle_state_buffer_views_read_their_own_region():
    """Each component tensor of Paddle buffers is a view of its region of the backing buffer (Paddle's
    view(dtype) of a slice at a byte offset reads elsewhere; the pools view the whole buffer instead)."""
    paddle = pytest.importorskip("paddle")
    layout = small_layout()
    bufs = allocate_state_buffers(layout, 2, device="cpu", framework="paddle")
    want = (np.arange(bufs.data.shape[0]) % 251).astype(np.uint8)
    bufs.data[:] = paddle.to_tensor(want)
    for r in bufs.regions:
        got = bufs.layer(r.group, r.slot)[r.name].numpy().view(np.uint8).ravel()
        assert np.array_equal(got, want[r.buffer_offset : r.buffer_offset + 2 * r.nbytes]), r


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float16"])
def test_the_numpy_stored_form_is_the_torch_one_bit_for_bit(dtype, stochastic):
    """quant_np (the torch-free paths: FastDeploy's layer reference and GDN staging) writes and reads
    exactly the bytes of quant, over magnitudes from 1e-6 to 1e3, zero groups and every granularity."""
    from hybridkv.models.dtypes import DType
    from hybridkv.ops.states import quant_np

    dt = DType(dtype)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 96)) * np.logspace(-6, 3, 96)).astype(np.float32)
    x[1, :32] = 0
    seeds = quant.rounding_seeds(rng.integers(0, 1 << 40, 5), rng.integers(0, 1 << 20, 5))
    for group in (8, 32, 96):
        u_t = quant.uniforms(torch.from_numpy(seeds), 1234, 96) if stochastic else 0.5
        u_n = quant_np.uniforms(seeds, 1234, 96) if stochastic else 0.5
        raw = quant.encode(torch.from_numpy(x), dt, group, u_t).numpy()
        assert np.array_equal(quant_np.encode(x, dt, group, u_n), raw)
        back = quant.decode(torch.from_numpy(raw), dt, 96, group).numpy()
        assert np.array_equal(quant_np.decode(raw, dt, 96, group).view(np.uint32), back.view(np.uint32))

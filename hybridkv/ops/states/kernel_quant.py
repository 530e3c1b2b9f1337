"""Triton kernels of gather_states / scatter_states for computed regions: int8 / fp8 / float16 state
components in the pool, float32 / bfloat16 / float16 values in the buffers (the arithmetic of
:mod:`hybridkv.ops.states.quant`, bit for bit).

One launch per component region; program ``(i_group, i_b)`` handles one scale group (float16: one
last-axis row) of batch row ``i_b``, in tiles of ``TILE`` values. Every element's pool address
follows the layout's rule (:mod:`hybridkv.ops.addressing`) from its own byte offset, so a group may
straddle blocks and segments. Null-block entries read zeros and are never written. Scatter reads its
group twice (the largest magnitude, then the rounding), so a scale is known before any value is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from hybridkv.ops import _framework

if TYPE_CHECKING:
    import torch

# value kinds (constexpr KIND)
KIND_INT8, KIND_E4M3, KIND_F16 = 0, 1, 2


@triton.jit
def _address(o, t_row, block_bytes, segment_bytes, segment_stride, slot_base):
    """Pool byte address of state byte offsets ``o`` (int64) of one row whose table row starts at
    ``t_row``, and whether their block is a real one (not the null block)."""
    column = o // block_bytes
    within = o - column * block_bytes
    seg = within // segment_bytes
    off = within - seg * segment_bytes
    blk = tl.load(t_row + column).to(tl.int64)
    return slot_base + seg * segment_stride + blk * segment_bytes + off, blk != 0


@triton.jit
def _hash(x):
    """lowbias32 on int64 holding 32-bit values (as :func:`hybridkv.ops.states.quant._hash`)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(a):
    return ((a.to(tl.int32, bitcast=True).to(tl.int64) >> 23) & 0xFF) - 127


@triton.jit
def _round_float(v, u, MANT: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr):
    a = tl.abs(v)
    k = tl.maximum(_exponent(a), EMIN) - MANT
    q = tl.minimum(tl.floor(a * _pow2(-k) + u) * _pow2(k), MAXV)
    return tl.where((v.to(tl.int32, bitcast=True) >> 31) != 0, -q, q)


@triton.jit
def _e4m3_bits(q):
    a = tl.abs(q)
    bits_q = q.to(tl.int32, bitcast=True).to(tl.int64)
    sign = (bits_q >> 31) & 1
    mant = (a.to(tl.int32, bitcast=True).to(tl.int64) >> 20) & 7
    bits = tl.where(a >= 0.015625, ((_exponent(a) + 7) << 3) | mant, (a * 512.0).to(tl.int64))
    return ((sign << 7) | bits).to(tl.uint8)


@triton.jit
def _e4m3_values(bits):
    b = bits.to(tl.int64)
    e = (b >> 3) & 0xF
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * _pow2(e - 10))
    return tl.where((b >> 7) == 1, -mag, mag)


@triton.jit
def _quant_kernel(
    pool_ptr, buf_ptr, table_ptr, seeds_ptr,
    stride_table_b, t_group_base, block_bytes, segment_bytes, segment_stride, slot_base,
    state_offset, value_bytes, numel, group, salt, row_start,
    KIND: tl.constexpr, QMAX: tl.constexpr, HAS_SCALE: tl.constexpr, SCATTER: tl.constexpr,
    STOCHASTIC: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    i_g = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64) + row_start
    t_row = table_ptr + t_group_base + i_b * stride_table_b
    o_t = tl.arange(0, TILE).to(tl.int64)
    first = i_g * group  # element index of the group's first value
    buf_row = buf_ptr + i_b * numel + first
    pool_f32 = pool_ptr.to(tl.pointer_type(tl.float32))
    pool_f16 = pool_ptr.to(tl.pointer_type(tl.float16))
    o_scale = state_offset + value_bytes + i_g * 4
    if SCATTER:
        scale = 1.0
        if HAS_SCALE:
            amax = tl.zeros([TILE], dtype=tl.float32)
            for start in range(0, group, TILE):
                m = start + o_t < group
                x = tl.load(buf_row + start + o_t, mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.max(amax, axis=0) / QMAX
            a_s, live_s = _address(o_scale, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
            tl.store(pool_f32 + a_s // 4, scale, mask=live_s)
        safe = tl.where(scale > 0, scale, 1.0)
        seed = tl.load(seeds_ptr + i_b).to(tl.int64) & 0xFFFFFFFF if STOCHASTIC else 0
        for start in range(0, group, TILE):
            m = start + o_t < group
            e = first + start + o_t
            x = tl.load(buf_row + start + o_t, mask=m, other=0.0).to(tl.float32)
            if HAS_SCALE:
                v = tl.where(scale > 0, x / safe, 0.0)
            else:
                v = x
            if STOCHASTIC:
                u = (_hash(_hash(e ^ salt) ^ seed) >> 8).to(tl.float32) * 5.9604644775390625e-08
            else:
                u = tl.full([TILE], 0.5, tl.float32)
            if KIND == 0:
                q = tl.minimum(tl.maximum(tl.floor(v + u), -127.0), 127.0)
                a_v, live = _address(state_offset + e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
                tl.store(pool_ptr + a_v, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=m & live)
            elif KIND == 1:
                q = _round_float(v, u, 3, -6, 448.0)
                a_v, live = _address(state_offset + e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
                tl.store(pool_ptr + a_v, _e4m3_bits(q), mask=m & live)
            else:
                q = _round_float(v, u, 10, -14, 65504.0)
                a_v, live = _address(state_offset + 2 * e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
                tl.store(pool_f16 + a_v // 2, q.to(tl.float16), mask=m & live)
    else:
        scale = 1.0
        if HAS_SCALE:
            a_s, live_s = _address(o_scale, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
            scale = tl.load(pool_f32 + a_s // 4, mask=live_s, other=0.0)
        for start in range(0, group, TILE):
            m = start + o_t < group
            e = first + start + o_t
            if KIND == 2:
                a_v, live = _address(state_offset + 2 * e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
                x = tl.load(pool_f16 + a_v // 2, mask=m & live, other=0.0).to(tl.float32)
            else:
                a_v, live = _address(state_offset + e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
                bits = tl.load(pool_ptr + a_v, mask=m & live, other=0)
                if KIND == 0:
                    q = bits.to(tl.int8, bitcast=True).to(tl.float32)
                else:
                    q = _e4m3_values(bits)
                x = q * scale
            tl.store(buf_row + start + o_t, x.to(buf_ptr.dtype.element_ty), mask=m)


def launch(
    scatter: bool,
    pool_bytes: torch.Tensor,
    buf: torch.Tensor,
    table: torch.Tensor,
    seeds: torch.Tensor | None,
    *,
    kind: int,
    qmax: float,
    table_group: int,
    block_bytes: int,
    segment_bytes: int,
    segment_stride: int,
    slot_base: int,
    state_offset: int,
    value_bytes: int,
    numel: int,
    group: int,
    salt: int,
) -> None:
    """One launch over the ``numel / group`` groups x the rows of ``table`` (int32 ``[G, B, W]``
    contiguous) for one region: ``pool_bytes`` the 1-D uint8 pool, ``buf`` the region's
    ``[batch, *shape]`` compute tensor, ``seeds`` int64 ``[>= B]`` (None: round to nearest)."""
    num_rows = table.shape[1]
    if num_rows == 0:
        return
    stride_b = int(table.shape[2])
    tile = min(1024, triton.next_power_of_2(group))
    limit = _framework.MAX_GRID_YZ
    dummy = seeds if seeds is not None else table
    for row_start in range(0, num_rows, limit):
        grid = (numel // group, min(limit, num_rows - row_start))
        _quant_kernel[grid](
            pool_bytes, buf, table, dummy, stride_b, table_group * num_rows * stride_b, block_bytes,
            segment_bytes, segment_stride, slot_base, state_offset, value_bytes, numel, group, salt, row_start,
            KIND=kind, QMAX=qmax, HAS_SCALE=kind != KIND_F16, SCATTER=scatter, STOCHASTIC=seeds is not None,
            TILE=tile, num_warps=4,
        )  # fmt: skip

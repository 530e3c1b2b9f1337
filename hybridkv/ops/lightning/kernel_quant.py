"""Triton lightning kernels over a quantized state component, in place: int8 / float8_e4m3fn values
then float32 scales inside the state set (the layout of :mod:`hybridkv.ops.states.quant`).

Program ``(b, h)`` owns the whole ``[d_k, d_v]`` state of head ``h`` of row ``b`` (a row scale covers
all ``d_v`` values of a row, a head scale the whole head, so one program sees every value of the
scales it rewrites): the decode runs it a few whole rows at a time (head scales: a first pass finds
the head's largest new magnitude), the prefill holds it whole across its token blocks. It reads the
values and their scales, dequantizes (``q * scale``, float32), runs the recurrence in float32 exactly
as :mod:`.kernel` does, then quantizes the new state: per scale
group ``scale = max|S| / quant_max``, ``S / scale`` rounded to nearest or stochastically with the
row's seed (the arithmetic of :mod:`hybridkv.ops.states.quant`, bit for bit, same hash and salt), and
writes values and scales back. Byte addresses follow the layout's rule
(:func:`hybridkv.ops.states.kernel_quant._address`), so a head may straddle blocks and segments.
Rows whose output set starts with the null block read and write nothing (output zero); a row
without an initial state reads zeros. Per-tensor scales are not taken (every head of a row would
have to be finished before any is written): :func:`hybridkv.ops.lightning.lightning_layer` refuses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from hybridkv.ops.states.kernel_quant import _address, _e4m3_bits, _e4m3_values, _hash, _round_float

if TYPE_CHECKING:
    import torch

KIND_INT8, KIND_E4M3 = 0, 1
NUM_WARPS = 4
MAX_DECODE_TILE = 1024  # state elements a decode step holds: no spills on sm_90 at d 128 (2048: 0.3 KB)


def decode_rows(dk: int, dv: int) -> int:
    """State rows a decode program runs at a time: whole rows (a row scale covers all of ``d_v``)."""
    return max(1, min(triton.next_power_of_2(dk), MAX_DECODE_TILE // triton.next_power_of_2(dv)))


@triton.jit
def _scale_index(i_h, o_k, DK: tl.constexpr, ROW: tl.constexpr):
    """Scale index ``[BK]`` of the state rows of head ``i_h`` (row scales: one per row; head: one)."""
    if ROW:
        return i_h * DK + o_k
    return i_h + o_k * 0


@triton.jit
def _load(
    pool_ptr, t_row, e, g, read, m_k, state_offset, value_bytes, block_bytes, segment_bytes, segment_stride,
    slot_base, KIND: tl.constexpr,
):  # fmt: skip
    """float32 values ``[BK, BV]`` of component elements ``e`` (their scale indices ``g`` ``[BK]``), zero
    where ``read`` is False or the block is the null block."""
    a_v, blk = _address(state_offset + e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
    o_s = state_offset + value_bytes + 4 * g
    a_s, blk_s = _address(o_s, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
    m_s = m_k & blk_s & tl.max(read.to(tl.int32), axis=1).to(tl.int1)
    scale = tl.load(pool_ptr.to(tl.pointer_type(tl.float32)) + a_s // 4, mask=m_s, other=0.0)
    bits = tl.load(pool_ptr + a_v, mask=read & blk, other=0)
    if KIND == 0:
        q = bits.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        q = _e4m3_values(bits)
    return tl.where(read & blk & m_s[:, None], q * scale[:, None], 0.0)


@triton.jit
def _scales(s, m_kv, QMAX: tl.constexpr, ROW: tl.constexpr):
    """New scales ``[BK]`` of float32 ``s`` ``[BK, BV]`` (padding lanes ignored): each row's largest
    magnitude over ``QMAX``, or (head scales) the tile's, on every lane."""
    a = tl.abs(tl.where(m_kv, s, 0.0))
    if ROW:
        return tl.max(a, axis=1) / QMAX
    return tl.max(tl.max(a, axis=1), axis=0) / QMAX + tl.zeros([s.shape[0]], dtype=tl.float32)


@triton.jit
def _store_values(
    pool_ptr, t_row, e, s, scale, m_kv, write, seed, salt, state_offset, block_bytes, segment_bytes,
    segment_stride, slot_base, KIND: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Quantize float32 ``s`` ``[BK, BV]`` with ``scale`` ``[BK]`` and write the values where ``write``
    (``[1, BV]``) and the block is real."""
    safe = tl.where(scale > 0, scale, 1.0)
    v = tl.where(scale[:, None] > 0, tl.where(m_kv, s, 0.0) / safe[:, None], 0.0)
    if STOCHASTIC:
        u = (_hash(_hash(e ^ salt) ^ seed) >> 8).to(tl.float32) * 5.9604644775390625e-08
    else:
        u = tl.full(s.shape, 0.5, tl.float32)
    if KIND == 0:
        bits = tl.minimum(tl.maximum(tl.floor(v + u), -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        bits = _e4m3_bits(_round_float(v, u, 3, -6, 448.0))
    a_v, blk = _address(state_offset + e, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
    tl.store(pool_ptr + a_v, bits, mask=m_kv & blk & write)


@triton.jit
def _store_scales(
    pool_ptr, t_row, g, scale, m, write, state_offset, value_bytes, block_bytes, segment_bytes, segment_stride,
    slot_base,
):  # fmt: skip
    """Write ``scale`` ``[BK]`` at scale indices ``g`` where ``m`` and the row writes (``write`` ``[1, BV]``)."""
    o_s = state_offset + value_bytes + 4 * g
    a_s, blk_s = _address(o_s, t_row, block_bytes, segment_bytes, segment_stride, slot_base)
    w_k = tl.max(write.to(tl.int32), axis=1).to(tl.int1)  # [1] -> the row's flag for every lane
    tl.store(pool_ptr.to(tl.pointer_type(tl.float32)) + a_s // 4, scale, mask=m & blk_s & w_k)


@triton.jit
def _new_rows(
    pool_ptr, p_in, k_row, b_v, b_decay, i_h, r0, live, init, state_offset, value_bytes, block_bytes,
    segment_bytes, segment_stride, slot_base,
    DK: tl.constexpr, DV: tl.constexpr, BKR: tl.constexpr, BV: tl.constexpr, KIND: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """Rows ``r0 ..`` of head ``i_h``'s new state (``decay S + k^T v``, float32 ``[BKR, BV]``), with their
    element and scale indices, row offsets and masks."""
    o_k = r0 + tl.arange(0, BKR).to(tl.int64)
    o_v = tl.arange(0, BV).to(tl.int64)
    m_k = o_k < DK
    m_kv = m_k[:, None] & (o_v < DV)[None, :]
    # padding lanes address element 0 / scale 0 (masked): no table entry past the state is read
    e = tl.where(m_kv, i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :], 0)
    g = tl.where(m_k, _scale_index(i_h, o_k, DK, ROW), 0)
    old = _load(
        pool_ptr, p_in, e, g, m_kv & live & init, m_k, state_offset, value_bytes, block_bytes, segment_bytes,
        segment_stride, slot_base, KIND,
    )  # fmt: skip
    b_k = tl.load(k_row + o_k, mask=m_k, other=0).to(tl.float32)
    return b_decay * old + b_k[:, None] * b_v[None, :], e, g, o_k, m_k, m_kv


@triton.jit
def _decode_quant_kernel(
    pool_ptr, in_table_ptr, out_table_ptr, init_ptr, seeds_ptr, q_ptr, k_ptr, v_ptr, o_ptr, decay_ptr,
    stride_in_b, stride_out_b, stride_q_b, stride_q_h, stride_v_b, stride_v_h, stride_o_b, stride_o_h,
    block_bytes, segment_bytes, segment_stride, slot_base, state_offset, value_bytes, salt,
    DK: tl.constexpr, DV: tl.constexpr, BKR: tl.constexpr, BV: tl.constexpr, KIND: tl.constexpr,
    QMAX: tl.constexpr, ROW: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Program ``(b, h)`` runs head ``h``'s state ``BKR`` rows at a time (a row scale covers one row);
    head scales take a first pass for the head's largest new magnitude, the old scale is read before
    the new one is written."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_v = tl.arange(0, BV).to(tl.int64)
    m_v = o_v < DV
    p_in = in_table_ptr + i_b * stride_in_b
    p_out = out_table_ptr + i_b * stride_out_b
    live = (tl.load(p_out + o_v * 0) != 0)[None, :]
    init = (tl.load(init_ptr + i_b + o_v * 0) != 0)[None, :]
    q_row = q_ptr + i_b * stride_q_b + i_h * stride_q_h
    k_row = k_ptr + i_b * stride_q_b + i_h * stride_q_h
    b_v = tl.load(v_ptr + i_b * stride_v_b + i_h * stride_v_h + o_v, mask=m_v, other=0).to(tl.float32)
    b_decay = tl.load(decay_ptr + i_h).to(tl.float32)
    seed = tl.load(seeds_ptr + i_b).to(tl.int64) & 0xFFFFFFFF if STOCHASTIC else 0
    geo = (state_offset, value_bytes, block_bytes, segment_bytes, segment_stride, slot_base)
    amax = tl.zeros([BKR], dtype=tl.float32)
    if not ROW:  # the head's largest new magnitude first
        for r0 in range(0, DK, BKR):
            s, e, g, o_k, m_k, m_kv = _new_rows(
                pool_ptr, p_in, k_row, b_v, b_decay, i_h, r0, live, init, *geo, DK, DV, BKR, BV, KIND, ROW
            )
            amax = tl.maximum(amax, _scales(s, m_kv, 1.0, ROW))
    b_o = tl.zeros([BV], dtype=tl.float32)
    for r0 in range(0, DK, BKR):
        s, e, g, o_k, m_k, m_kv = _new_rows(
            pool_ptr, p_in, k_row, b_v, b_decay, i_h, r0, live, init, *geo, DK, DV, BKR, BV, KIND, ROW
        )
        b_q = tl.load(q_row + o_k, mask=m_k, other=0).to(tl.float32)
        b_o += tl.sum(tl.where(live, b_q[:, None] * s, 0.0), axis=0)
        if ROW:
            scale = _scales(s, m_kv, QMAX, ROW)
        else:
            scale = amax / QMAX
        _store_values(
            pool_ptr, p_out, e, s, scale, m_kv, live, seed, salt, state_offset, block_bytes, segment_bytes,
            segment_stride, slot_base, KIND, STOCHASTIC,
        )  # fmt: skip
        if ROW:
            _store_scales(pool_ptr, p_out, g, scale, m_k, live, *geo)
    if not ROW:  # after every row was read with the old scale
        o_k = tl.arange(0, BKR).to(tl.int64)
        _store_scales(pool_ptr, p_out, i_h + o_k * 0, amax / QMAX, o_k == 0, live, *geo)
    tl.store(o_ptr + i_b * stride_o_b + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _prefill_quant_kernel(
    pool_ptr, table_ptr, init_ptr, seeds_ptr, cu_ptr, q_ptr, k_ptr, v_ptr, o_ptr, log_decay_ptr,
    stride_table_b, stride_q_t, stride_q_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    block_bytes, segment_bytes, segment_stride, slot_base, state_offset, value_bytes, salt,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    KIND: tl.constexpr, QMAX: tl.constexpr, ROW: tl.constexpr, STOCHASTIC: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK).to(tl.int64)
    o_v = tl.arange(0, BV).to(tl.int64)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < DK, o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    start = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1) - tl.load(cu_ptr + i_b)
    q_row = q_ptr + start * stride_q_t + i_h * stride_q_h
    k_row = k_ptr + start * stride_q_t + i_h * stride_q_h
    v_row = v_ptr + start * stride_v_t + i_h * stride_v_h
    o_row = o_ptr + start * stride_o_t + i_h * stride_o_h
    p_row = table_ptr + i_b * stride_table_b
    n_v = tl.load(cu_ptr + i_b + 1 + o_v * 0) - tl.load(cu_ptr + i_b + o_v * 0)
    live = ((tl.load(p_row + o_v * 0) != 0) & (n_v > 0))[None, :]
    init = (tl.load(init_ptr + i_b + o_v * 0) != 0)[None, :]
    # padding lanes address element 0 / scale 0 (masked): no table entry past the state is read
    e = tl.where(m_kv, i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :], 0)
    g = tl.where(m_k, _scale_index(i_h, o_k, DK, ROW), 0)
    b_s = _load(
        pool_ptr, p_row, e, g, m_kv & live & init, m_k, state_offset, value_bytes, block_bytes, segment_bytes,
        segment_stride, slot_base, KIND,
    )  # fmt: skip
    log_lam = tl.load(log_decay_ptr + i_h).to(tl.float32)
    f_t = o_t.to(tl.float32)
    diff = f_t[:, None] - f_t[None, :]
    m_causal = diff >= 0
    decay_mask = tl.where(m_causal, tl.exp(log_lam * tl.where(m_causal, diff, 0.0)), 0.0)
    q_decay = tl.exp(log_lam * (f_t + 1.0))
    for c in range(0, n, BT):
        t = c + o_t
        m_t = t < n
        p_q = t[:, None] * stride_q_t + o_k[None, :]
        b_q = tl.load(q_row + p_q, mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_k = tl.load(k_row + p_q, mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_v = tl.load(v_row + t[:, None] * stride_v_t + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        b_v = b_v.to(tl.float32)
        b_len = tl.minimum(n - c, BT).to(tl.float32)
        scores = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay_mask
        b_o = tl.dot(scores, b_v, input_precision=PRECISION)
        b_o += tl.dot(b_q * q_decay[:, None], b_s, input_precision=PRECISION)
        b_o = tl.where(live, b_o, 0.0)
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(o_row + t[:, None] * stride_o_t + o_v[None, :], b_o.to(o_ptr.dtype.element_ty), mask=m_tv)
        k_decay = tl.where(m_t, tl.exp(log_lam * tl.where(m_t, b_len - 1.0 - f_t, 0.0)), 0.0)
        b_s = tl.exp(log_lam * b_len) * b_s + tl.dot(tl.trans(b_k * k_decay[:, None]), b_v, input_precision=PRECISION)
    seed = tl.load(seeds_ptr + i_b).to(tl.int64) & 0xFFFFFFFF if STOCHASTIC else 0
    scale = _scales(b_s, m_kv, QMAX, ROW)
    _store_values(
        pool_ptr, p_row, e, b_s, scale, m_kv, live, seed, salt, state_offset, block_bytes, segment_bytes,
        segment_stride, slot_base, KIND, STOCHASTIC,
    )  # fmt: skip
    _store_scales(  # head scales: every lane writes the same scale to the same address
        pool_ptr, p_row, g, scale, m_k, live, state_offset, value_bytes, block_bytes, segment_bytes, segment_stride,
        slot_base,
    )  # fmt: skip


def _common(pool: Any, geometry: dict[str, Any], seeds: Any, table: Any) -> tuple[tuple, dict]:
    """Positional pool geometry and the constexpr keywords shared by both launches."""
    args = (
        geometry["block_bytes"], geometry["segment_bytes"], geometry["segment_stride"], geometry["slot_base"],
        geometry["state_offset"], geometry["value_bytes"], geometry["salt"],
    )  # fmt: skip
    kind = KIND_INT8 if geometry["kind"] == "int8" else KIND_E4M3
    consts = dict(KIND=kind, QMAX=geometry["qmax"], ROW=geometry["row"], STOCHASTIC=seeds is not None)
    return args, consts


def launch_decode(
    pool: torch.Tensor, in_table: torch.Tensor, out_table: torch.Tensor, has_initial_state: torch.Tensor,
    seeds: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    decay: torch.Tensor, geometry: dict[str, Any],
) -> None:  # fmt: skip
    """One launch over ``B x H`` programs. ``pool``: the whole pool as flat uint8; tables int32
    ``[B, >= blocks_per_state]``; ``has_initial_state`` int8 ``[B]``; ``seeds`` int64 ``[B]`` or None
    (round to nearest); ``q``, ``k`` ``[B, H, d_k]``, ``v``, ``o`` ``[B, H, d_v]``; ``decay`` float32 ``[H]``.
    ``geometry``: :func:`hybridkv.ops.lightning.quantized.geometry` (byte offsets, kind, scales, salt)."""
    b, h, dk = q.shape
    dv = v.shape[2]
    if b == 0:
        return
    args, consts = _common(pool, geometry, seeds, in_table)
    _decode_quant_kernel[(b, h)](
        pool, in_table, out_table, has_initial_state, seeds if seeds is not None else in_table, q, k, v, o, decay,
        in_table.stride(0), out_table.stride(0), q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), *args,
        DK=dk, DV=dv, BKR=decode_rows(dk, dv), BV=triton.next_power_of_2(dv), num_warps=NUM_WARPS, **consts,
    )  # fmt: skip


def launch_prefill(
    pool: torch.Tensor, table: torch.Tensor, has_initial_state: torch.Tensor, seeds: torch.Tensor | None,
    cu_seqlens: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    log_decay: torch.Tensor, geometry: dict[str, Any], block_tokens: int = 16,
) -> None:  # fmt: skip
    """One launch over ``B x H`` programs, each running its row's tokens on its head's whole state.
    ``cu_seqlens`` int32 ``[B + 1]``; ``q``, ``k`` ``[T, H, d_k]``, ``v``, ``o`` ``[T, H, d_v]``;
    ``log_decay`` float32 ``[H]`` = ``-slopes``; the rest as :func:`launch_decode`."""
    from hybridkv.ops.lightning.kernel import FP32_DOT, PREFILL_WARPS

    b = table.shape[0]
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    if b == 0 or q.shape[0] == 0:
        return
    args, consts = _common(pool, geometry, seeds, table)
    _prefill_quant_kernel[(b, h)](
        pool, table, has_initial_state, seeds if seeds is not None else table, cu_seqlens, q, k, v, o, log_decay,
        table.stride(0), q.stride(0), q.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), *args,
        DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=max(16, triton.next_power_of_2(dv)),
        BT=max(16, triton.next_power_of_2(block_tokens)), PRECISION=FP32_DOT, num_warps=PREFILL_WARPS, **consts,
    )  # fmt: skip

"""Triton decode kernel of lightning attention, in place in the paged pool, one launch per layer.

Program ``(b, h, iv)`` owns the ``[d_k, BV]`` piece of head ``h``'s state of batch row ``b`` (value
columns ``iv * BV ...``). Each state element is found with the layout's addressing rule
(``hybridkv.ops.addressing``: state byte ``o`` lives in block ``table[o // block_bytes]``, segment
``(o % block_bytes) // segment_bytes``, at ``slot * slot_bytes + seg * num_blocks * segment_bytes +
block * segment_bytes + off``), evaluated here in elements of the state dtype, so a head's tile may
span several blocks or share one with other heads, in any block order. The program reads the
input set (``in_table``), applies ``S <- lambda_h S + k^T v`` and ``o = q S``, and writes ``S`` to the
output set (``out_table``; the same table for an in-place decode). A row whose output set starts
with the null block is padding: nothing is read or written, its output is zero. A row without an
initial state reads zeros. Element indices inside a state are int32, pool addresses int64; the
recurrence runs in fp32 (fp64 for fp64 states).

The prefill kernel keeps the same addressing: program ``(b, h, iv)`` loads its state piece once,
runs the row's tokens in blocks of ``BT`` (Lightning Attention-2: intra-block ``[(Q K^T) * M] V``,
inter-block ``(Lambda Q) S``, then ``S <- lambda^b S + (lambda^b Lambda^-1 K)^T V``, a short last
block with its own ``b``), and writes the state back in place: no gather, no scatter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch


@triton.jit
def _state_offsets(e, slot_base, block_elems, segment_elems, segment_stride):
    """The addressing rule without the block term: (table column, pool offset of block 0) of state
    elements ``e`` (int32, any shape); the element lives at ``offset + table[column] * segment_elems``."""
    column = e // block_elems
    within = e - column * block_elems
    seg = within // segment_elems
    off = within - seg * segment_elems
    return column, slot_base + seg.to(tl.int64) * segment_stride + off


@triton.jit
def _lightning_decode_kernel(
    pool_ptr,
    in_table_ptr,
    out_table_ptr,
    init_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    decay_ptr,
    stride_in_b,
    stride_out_b,
    stride_q_b,
    stride_q_h,
    stride_v_b,
    stride_v_h,
    stride_o_b,
    stride_o_h,
    slot_base,
    component_base,
    block_elems,
    segment_elems,
    segment_stride,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    F64: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    cdt = tl.float64 if F64 else tl.float32
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]

    p_in = in_table_ptr + i_b * stride_in_b
    p_out = out_table_ptr + i_b * stride_out_b
    # row flags as [BV] vectors (one cached address each): a padding row's output set is the null block
    live = (tl.load(p_out + o_v * 0) != 0)[None, :]
    init = (tl.load(init_ptr + i_b + o_v * 0) != 0)[None, :]

    # [BK, BV] state elements of head i_h (int32: a component's index fits), their column and offset;
    # input and output sets differ only in the block ids the table gives
    e = component_base + i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    column, base = _state_offsets(e, slot_base, block_elems, segment_elems, segment_stride)
    blk_in = tl.load(p_in + column).to(tl.int64)
    blk_out = tl.load(p_out + column).to(tl.int64)
    a_in = base + blk_in * segment_elems
    a_out = base + blk_out * segment_elems
    m_read = m_kv & (blk_in != 0) & live & init
    b_s = tl.load(pool_ptr + a_in, mask=m_read, other=0).to(cdt)

    b_q = tl.load(q_ptr + i_b * stride_q_b + i_h * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
    b_k = tl.load(k_ptr + i_b * stride_q_b + i_h * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
    b_v = tl.load(v_ptr + i_b * stride_v_b + i_h * stride_v_h + o_v, mask=m_v, other=0).to(cdt)
    b_decay = tl.load(decay_ptr + i_h).to(cdt)

    b_s = b_decay * b_s + b_k[:, None] * b_v[None, :]
    b_o = tl.sum(tl.where(live, b_q[:, None] * b_s, 0.0), axis=0)
    tl.store(pool_ptr + a_out, b_s.to(pool_ptr.dtype.element_ty), mask=m_kv & (blk_out != 0) & live)
    tl.store(o_ptr + i_b * stride_o_b + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)


MAX_TILE_ELEMENTS = 2048  # state elements per program: 16 per thread at 4 warps (no spills on sm_90 at d_k 128)
NUM_WARPS = 4


def tile_sizes(dk: int, dv: int) -> tuple[int, int]:
    """(BK, BV): all of ``d_k`` (padded to a power of two) by as many value columns as the tile allows."""
    bk = triton.next_power_of_2(dk)
    return bk, min(triton.next_power_of_2(dv), max(1, MAX_TILE_ELEMENTS // bk))


def launch_decode(
    pool: torch.Tensor,
    in_table: torch.Tensor,
    out_table: torch.Tensor,
    has_initial_state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    decay: torch.Tensor,
    slot_base: int,
    component_base: int,
    block_elems: int,
    segment_elems: int,
    num_blocks: int,
) -> None:
    """One launch over ``B x H x ceil(d_v / BV)`` programs.

    ``pool``: the whole pool as a flat tensor of the state dtype; ``in_table`` / ``out_table``: int32
    ``[B, >= blocks_per_state]`` (unit stride along the row); ``has_initial_state``: int8 ``[B]``;
    ``q``, ``k`` ``[B, H, d_k]`` and ``v``, ``o`` ``[B, H, d_v]`` with unit last stride (``k`` strides as
    ``q``); ``decay``: ``[H]`` fp32/fp64. Sizes in elements of the state dtype.
    """
    b, h, dk = q.shape
    dv = v.shape[2]
    if b == 0:
        return
    bk, bv = tile_sizes(dk, dv)
    grid = (b, h, triton.cdiv(dv, bv))
    _lightning_decode_kernel[grid](
        pool, in_table, out_table, has_initial_state, q, k, v, o, decay,
        in_table.stride(0), out_table.stride(0), q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), slot_base, component_base, block_elems, segment_elems, num_blocks * segment_elems,
        DK=dk, DV=dv, BK=bk, BV=bv, F64=_is_f64(pool), num_warps=NUM_WARPS,
    )  # fmt: skip


@triton.jit
def _lightning_prefill_kernel(
    pool_ptr,
    table_ptr,
    init_ptr,
    cu_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    log_decay_ptr,
    stride_table_b,
    stride_q_t,
    stride_q_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    slot_base,
    component_base,
    block_elems,
    segment_elems,
    segment_stride,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    F64: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    cdt = tl.float64 if F64 else tl.float32
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < DK, o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    start = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1) - tl.load(cu_ptr + i_b)
    # the row's first token, head i_h: tiles below use int32 offsets from these
    q_row = q_ptr + start * stride_q_t + i_h * stride_q_h
    k_row = k_ptr + start * stride_q_t + i_h * stride_q_h
    v_row = v_ptr + start * stride_v_t + i_h * stride_v_h
    o_row = o_ptr + start * stride_o_t + i_h * stride_o_h
    p_row = table_ptr + i_b * stride_table_b
    # a null row or no tokens: nothing moves ([BV] vectors: see the decode kernel)
    n_v = tl.load(cu_ptr + i_b + 1 + o_v * 0) - tl.load(cu_ptr + i_b + o_v * 0)
    live = ((tl.load(p_row + o_v * 0) != 0) & (n_v > 0))[None, :]
    init = (tl.load(init_ptr + i_b + o_v * 0) != 0)[None, :]
    e = component_base + i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    column, base = _state_offsets(e, slot_base, block_elems, segment_elems, segment_stride)
    blk = tl.load(p_row + column).to(tl.int64)
    b_s = tl.load(pool_ptr + base + blk * segment_elems, mask=m_kv & (blk != 0) & live & init, other=0).to(cdt)

    log_lam = tl.load(log_decay_ptr + i_h).to(cdt)  # -s_h
    f_t = o_t.to(cdt)
    diff = f_t[:, None] - f_t[None, :]
    m_causal = diff >= 0
    decay_mask = tl.where(m_causal, tl.exp(log_lam * tl.where(m_causal, diff, 0.0)), 0.0)  # lambda^(i-j)
    q_decay = tl.exp(log_lam * (f_t + 1.0))  # Lambda = diag(lambda^1 .. lambda^BT)
    for c in range(0, n, BT):
        t = c + o_t
        m_t = t < n
        p_q = t[:, None] * stride_q_t + o_k[None, :]
        b_q = tl.load(q_row + p_q, mask=m_t[:, None] & m_k[None, :], other=0).to(cdt)
        b_k = tl.load(k_row + p_q, mask=m_t[:, None] & m_k[None, :], other=0).to(cdt)
        b_v = tl.load(v_row + t[:, None] * stride_v_t + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        b_v = b_v.to(cdt)
        b_len = tl.minimum(n - c, BT).to(cdt)  # a short last block uses its own length
        scores = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay_mask
        b_o = tl.dot(scores, b_v, input_precision=PRECISION)
        b_o += tl.dot(b_q * q_decay[:, None], b_s, input_precision=PRECISION)
        b_o = tl.where(live, b_o, 0.0)
        p_o = t[:, None] * stride_o_t + o_v[None, :]
        tl.store(o_row + p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        k_decay = tl.where(m_t, tl.exp(log_lam * tl.where(m_t, b_len - 1.0 - f_t, 0.0)), 0.0)  # lambda^(b-1-j)
        b_s = tl.exp(log_lam * b_len) * b_s + tl.dot(tl.trans(b_k * k_decay[:, None]), b_v, input_precision=PRECISION)
    # the addresses again (not kept in registers across the token loop)
    column, base = _state_offsets(e, slot_base, block_elems, segment_elems, segment_stride)
    blk = tl.load(p_row + column).to(tl.int64)
    tl.store(pool_ptr + base + blk * segment_elems, b_s.to(pool_ptr.dtype.element_ty), mask=m_kv & (blk != 0) & live)


FP32_DOT = "tf32x3"  # fp32 products on tensor cores, three tf32 passes: ~fp32 accuracy without FMA-dot spills
PREFILL_BLOCK = 16  # tokens per block of the prefill kernel (the least tl.dot takes)
MAX_PREFILL_TILE = 4096  # state elements per prefill program
PREFILL_WARPS = 8  # sm_90, d_k 128: 80 B (fp32) / 168 B (fp64) of spills at 8 warps, 4x that at 4


def prefill_tile_sizes(dk: int, dv: int) -> tuple[int, int]:
    """(BK, BV) of the prefill kernel: ``tl.dot`` needs every dimension >= 16."""
    bk = max(16, triton.next_power_of_2(dk))
    return bk, max(16, min(triton.next_power_of_2(dv), MAX_PREFILL_TILE // bk))


def launch_prefill(
    pool: torch.Tensor,
    table: torch.Tensor,
    has_initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    log_decay: torch.Tensor,
    slot_base: int,
    component_base: int,
    block_elems: int,
    segment_elems: int,
    num_blocks: int,
    block_tokens: int = PREFILL_BLOCK,
) -> None:
    """One launch over ``B x H x ceil(d_v / BV)`` programs, each running its row's tokens in place.

    ``table``: int32 ``[B, >= blocks_per_state]``; ``has_initial_state`` int8 ``[B]``; ``cu_seqlens``
    int32 ``[B + 1]``; ``q``, ``k`` ``[T, H, d_k]`` and ``v``, ``o`` ``[T, H, d_v]`` (unit last stride,
    ``k`` strides as ``q``); ``log_decay`` ``[H]`` = ``-slopes`` (fp32/fp64).
    """
    b = table.shape[0]
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    if b == 0 or q.shape[0] == 0:
        return
    bk, bv = prefill_tile_sizes(dk, dv)
    bt = max(16, triton.next_power_of_2(block_tokens))
    grid = (b, h, triton.cdiv(dv, bv))
    _lightning_prefill_kernel[grid](
        pool, table, has_initial_state, cu_seqlens, q, k, v, o, log_decay,
        table.stride(0), q.stride(0), q.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        slot_base, component_base, block_elems, segment_elems, num_blocks * segment_elems,
        DK=dk, DV=dv, BK=bk, BV=bv, BT=bt, F64=_is_f64(pool),
        PRECISION="ieee" if _is_f64(pool) else FP32_DOT, num_warps=PREFILL_WARPS,
    )  # fmt: skip


def _is_f64(t: Any) -> bool:
    """``t`` holds float64 (torch or Paddle dtype)."""
    return str(t.dtype).rpartition(".")[2] == "float64"

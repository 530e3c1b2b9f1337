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
initial state reads zeros. Addresses are int64; the recurrence runs in fp32 (fp64 for fp64 states).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
        DK=dk, DV=dv, BK=bk, BV=bv, F64=pool.dtype == torch.float64, num_warps=NUM_WARPS,
    )  # fmt: skip

"""Triton kernels of the layer API (:mod:`.layers`), in place over FastDeploy's per-segment allocations.

FastDeploy shares every ``caches`` entry by the CUDA IPC handle of its allocation, so the segments of a
layer slot are separate allocations (:class:`~hybridkv.integrations.fastdeploy.worker.StateLayerSlot`).
A kernel gets their base addresses as one int64 device row ``ptrs`` (built once per set of
allocations, :func:`hybridkv.ops.segments.pointer_row`) and finds state element ``e`` of a component
at byte offset ``component_offset`` of the state by the layout's rule, in elements of the state dtype:
``x = component_base + e``, table column ``x // block_elems``, segment ``(x % block_elems) //
segment_elems``, address ``ptrs[segment] + table[row, column] * segment_elems + x % segment_elems``.

Every kernel is one launch per layer per step over all ``max_num_seqs`` batch slots: slot ``i`` runs
tokens ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1]`` (read on the device), from its stored state when
``seq_lens_decoder[i] > 0`` and from zero otherwise, and writes the new state in place. A slot without
tokens, or whose state set starts with padding (-1) or the null block, reads and writes nothing and its
outputs stay zero. There is no per-request Python loop and no host sync. The recurrences run in fp32
(fp64 for fp64 states) token by token, except the lightning kernel's prefill rows, which run in chunks
(:func:`lightning_kernel`); the references are :mod:`.layers`' numpy paths (float64).
Variables follow the ops kernels: ``i_`` program ids, ``o_`` offsets, ``m_`` masks, ``p_`` pointers,
``b_`` register tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _state_pointers(ptrs, p_row, e, m, component_base, block_elems, segment_elems, DT: tl.constexpr):
    """Pointers (``DT``) to state elements ``e`` (int32 tile) of the set whose table row is ``p_row``,
    and the mask of those whose block is real (> 0: not padding, not the null block)."""
    x = component_base + e
    column = x // block_elems
    within = x - column * block_elems
    seg = within // segment_elems
    off = within - seg * segment_elems
    blk = tl.load(p_row + column, mask=m, other=0).to(tl.int64)
    base = tl.load(ptrs + seg, mask=m, other=0).to(tl.pointer_type(DT))
    return base + blk * segment_elems + off, m & (blk > 0)


@triton.jit
def _row_span(cu_ptr, dec_ptr, p_row, i_b):
    """(first token, number of tokens, tokens before this step) of batch slot ``i_b``, int64 scalars;
    a slot whose state set starts with padding or the null block runs no tokens. Scalars enter masks
    broadcast to a tile (``zero + n``): Triton's interpreter refuses scalar masks."""
    first = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1).to(tl.int64) - first
    n = tl.where(tl.load(p_row).to(tl.int64) > 0, n, 0)
    return first, n, tl.load(dec_ptr + i_b).to(tl.int64)


@triton.jit
def _powers(b_log, x):
    """``decay ** x`` for ``x >= 0`` from ``b_log = log(decay)``, with ``decay ** 0 = 1`` even for a zero
    decay (whose log is -inf)."""
    return tl.where(x == 0, 1.0, tl.exp(x * b_log))


@triton.jit
def lightning_kernel(
    ptrs, table_ptr, cu_ptr, dec_ptr, q_ptr, k_ptr, v_ptr, o_ptr, decay_ptr,
    stride_table, stride_q_t, stride_q_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    component_base, block_elems, segment_elems,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr,
    F64: tl.constexpr,
):  # fmt: skip
    """Program ``(i_b, i_h, i_v)``: value columns ``i_v * BV ..`` of head ``i_h``'s state ``[d_k, d_v]``
    of slot ``i_b``. Per token ``S <- decay_h S + k^T v``, ``o = q S``. ``k`` strides as ``q``.

    A row of one token (decode) steps once. A longer row (prefill) runs in chunks of ``BT`` tokens:
    with ``S0`` the state before a chunk of ``c`` tokens and ``d = decay_h``, token ``t`` of the chunk
    gets ``o_t = d^(t+1) q_t S0 + sum_{s <= t} d^(t-s) (q_t . k_s) v_s`` (intra-chunk attention) and
    the chunk leaves ``S = d^c S0 + sum_s d^(c-1-s) k_s^T v_s`` (inter-chunk state): the token
    recurrence unrolled, four ``tl.dot`` per chunk. ``BK``, ``BV``, ``BT`` at least 16 on a GPU."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    cdt = tl.float64 if F64 else tl.float32
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    p_row = table_ptr + i_b * stride_table
    first, n, init = _row_span(cu_ptr, dec_ptr, p_row, i_b)
    e = i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    p_s, m_s = _state_pointers(ptrs, p_row, e, m_k[:, None] & m_v[None, :], component_base, block_elems,
                               segment_elems, DT)  # fmt: skip
    z = e * 0
    m_s = m_s & (z + n > 0)
    b_s = tl.load(p_s, mask=m_s & (z + init > 0), other=0).to(cdt)
    b_decay = tl.load(decay_ptr + i_h).to(cdt)
    if n > 1:  # prefill: chunk by chunk
        b_log = tl.log(b_decay)
        o_t = tl.arange(0, BT)
        f_t = o_t.to(cdt)
        b_gap = f_t[:, None] - f_t[None, :]  # t - s
        b_intra = tl.where(b_gap >= 0, _powers(b_log, tl.maximum(b_gap, 0.0)), 0.0)  # causal, decayed
        b_qdecay = _powers(b_log, f_t + 1)
        for c in range(0, n, BT):
            m_t = (c + o_t) < n
            tok = first + c + o_t
            m_qk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            p_qk = tok[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :]
            b_q = tl.load(q_ptr + p_qk, mask=m_qk, other=0).to(cdt)
            b_k = tl.load(k_ptr + p_qk, mask=m_qk, other=0).to(cdt)
            b_v = tl.load(v_ptr + tok[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :], mask=m_tv,
                          other=0).to(cdt)  # fmt: skip
            b_a = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_intra
            b_o = tl.dot(b_a, b_v, input_precision="ieee")
            b_o += tl.dot(b_q, b_s, input_precision="ieee") * b_qdecay[:, None]
            tl.store(o_ptr + tok[:, None] * stride_o_t + i_h * stride_o_h + o_v[None, :],
                     b_o.to(o_ptr.dtype.element_ty), mask=m_tv)  # fmt: skip
            f_c = tl.minimum(n - c, BT).to(cdt)  # tokens in this chunk (the last may be short)
            b_w = tl.where(m_t, _powers(b_log, tl.maximum(f_c - 1 - f_t, 0.0)), 0.0)
            b_s = _powers(b_log, f_c) * b_s + tl.dot(tl.trans(b_k * b_w[:, None]), b_v, input_precision="ieee")
    else:  # decode: one token
        for t in range(0, n):
            tok = first + t
            b_q = tl.load(q_ptr + tok * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
            b_k = tl.load(k_ptr + tok * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
            b_v = tl.load(v_ptr + tok * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0).to(cdt)
            b_s = b_decay * b_s + b_k[:, None] * b_v[None, :]
            b_o = tl.sum(b_q[:, None] * b_s, axis=0)
            tl.store(o_ptr + tok * stride_o_t + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s.to(DT), mask=m_s)


@triton.jit
def gated_delta_kernel(
    ptrs, table_ptr, cu_ptr, dec_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    stride_table, stride_q_t, stride_q_h, stride_v_t, stride_v_h, stride_g_t, stride_o_t, stride_o_h,
    scale, component_base, block_elems, segment_elems,
    REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, F64: tl.constexpr,
):  # fmt: skip
    """Program ``(i_b, i_h, i_v)``: value columns ``i_v * BV ..`` of value head ``i_h``'s state
    ``[d_k, d_v]`` (q / k head ``i_h // REP``). Per token, with L2-normalised ``q``, ``k``:
    ``S <- exp(g) S``; ``S <- S + k (beta (v - k^T S))``; ``o = scale q^T S``. ``k`` strides as ``q``,
    ``beta`` as ``g``."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    cdt = tl.float64 if F64 else tl.float32
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    p_row = table_ptr + i_b * stride_table
    first, n, init = _row_span(cu_ptr, dec_ptr, p_row, i_b)
    e = i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    p_s, m_s = _state_pointers(ptrs, p_row, e, m_k[:, None] & m_v[None, :], component_base, block_elems,
                               segment_elems, DT)  # fmt: skip
    z = e * 0
    m_s = m_s & (z + n > 0)
    b_s = tl.load(p_s, mask=m_s & (z + init > 0), other=0).to(cdt)
    i_hk = i_h // REP
    for t in range(0, n):
        tok = first + t
        b_q = tl.load(q_ptr + tok * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
        b_k = tl.load(k_ptr + tok * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k, other=0).to(cdt)
        b_q = b_q / tl.maximum(tl.sqrt(tl.sum(b_q * b_q, axis=0)), 1e-6) * scale
        b_k = b_k / tl.maximum(tl.sqrt(tl.sum(b_k * b_k, axis=0)), 1e-6)
        b_v = tl.load(v_ptr + tok * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0).to(cdt)
        b_g = tl.load(g_ptr + tok * stride_g_t + i_h).to(cdt)
        b_beta = tl.load(beta_ptr + tok * stride_g_t + i_h).to(cdt)
        b_s = b_s * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_k[:, None] * b_s, axis=0)) * b_beta
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        tl.store(o_ptr + tok * stride_o_t + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s.to(DT), mask=m_s)


@triton.jit
def conv_kernel(
    ptrs, table_ptr, cu_ptr, dec_ptr, x_ptr, w_ptr, o_ptr,
    stride_table, stride_x_t, stride_o_t, component_base, block_elems, segment_elems,
    DIM: tl.constexpr, TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr,
    F64: tl.constexpr,
):  # fmt: skip
    """Program ``(i_b, i_c)``: channels ``i_c * BC ..`` of slot ``i_b``'s causal depthwise conv.
    The window ``conv [DIM, TAPS]`` (oldest first) is the ``TAPS`` inputs before the row's first
    token; ``w`` is ``[DIM, TAPS + 1]`` contiguous, column ``TAPS`` multiplying the current token.
    The row's last ``TAPS`` inputs (window and tokens together) become its window."""
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    cdt = tl.float64 if F64 else tl.float32
    o_c = i_c * BC + tl.arange(0, BC)
    o_j = tl.arange(0, BT)
    m_c, m_j = o_c < DIM, o_j < TAPS
    p_row = table_ptr + i_b * stride_table
    first, n, init = _row_span(cu_ptr, dec_ptr, p_row, i_b)
    e = o_c[:, None] * TAPS + o_j[None, :]
    p_w, m_w = _state_pointers(ptrs, p_row, e, m_c[:, None] & m_j[None, :], component_base, block_elems,
                               segment_elems, DT)  # fmt: skip
    z = e * 0
    m_w = m_w & (z + n > 0)
    b_win = tl.load(p_w, mask=m_w & (z + init > 0), other=0).to(cdt)  # [BC, BT]: column j = input j of the window
    for t in range(0, n):
        b_o = tl.zeros([BC], dtype=cdt)
        for j in tl.static_range(TAPS + 1):
            at = t + j  # position in (window ++ tokens)
            b_old = tl.sum(tl.where(o_j[None, :] == at, b_win, 0.0), axis=1)
            tok = first + tl.where(at >= TAPS, at - TAPS, 0)
            m_x = (o_c * 0 + at) >= TAPS
            b_x = tl.load(x_ptr + tok * stride_x_t + o_c, mask=m_c & m_x, other=0).to(cdt)
            b_w = tl.load(w_ptr + o_c * (TAPS + 1) + j, mask=m_c, other=0).to(cdt)
            b_o += tl.where(m_x, b_x, b_old) * b_w
        tl.store(o_ptr + (first + t) * stride_o_t + o_c, b_o.to(o_ptr.dtype.element_ty), mask=m_c)
    # new window column j = position n + j: an old window column while n + j < TAPS, else a token
    b_new = tl.zeros([BC, BT], dtype=cdt)
    for j in tl.static_range(TAPS):
        b_col = tl.sum(tl.where(o_j[None, :] == j, b_win, 0.0), axis=1)
        b_new += tl.where(o_j[None, :] == j - n, b_col[:, None], 0.0)
    at = n + o_j
    tok = first + tl.where(at >= TAPS, at - TAPS, 0)
    m_x = m_c[:, None] & (m_j & (at >= TAPS))[None, :]
    b_x = tl.load(x_ptr + tok[None, :] * stride_x_t + o_c[:, None], mask=m_x, other=0).to(cdt)
    b_new = tl.where((at >= TAPS)[None, :], b_x, b_new)
    tl.store(p_w, b_new.to(DT), mask=m_w)

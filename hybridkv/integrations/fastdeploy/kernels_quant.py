"""Triton kernels of the layer API over an int8 / fp8 state, in place in FastDeploy's per-segment allocations.

The state component is ``numel`` one-byte values then float32 scales (row or head scales), the
stored form of :mod:`hybridkv.ops.states.quant`. Every byte is found by the layout's rule over the
pointer row (:mod:`.kernels`), a scale as its four bytes (so no alignment is assumed, and a scale may
cross a segment or block edge). Program ``(i_b, i_h)`` owns the whole ``[d_k, d_v]`` state of head
``i_h`` of batch slot ``i_b``: it dequantizes it, runs the slot's tokens in fp32 exactly as
:mod:`.kernels` does, then writes it back quantized per scale group, rounded stochastically with the
seed of (request, position after the step) (:func:`~hybridkv.ops.states.quant.rounding_seeds`, the
request key ``keys[i_b]``; -1: to nearest) and the salt of (layer, component offset), the hash of
:mod:`hybridkv.ops.states.kernel_quant`. Slots without tokens or without a state set read and write
nothing. The reference is :mod:`.layers`' numpy path (float64, quantized from float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl

from hybridkv.integrations.fastdeploy import launch
from hybridkv.integrations.fastdeploy.kernels import _row_span
from hybridkv.integrations.fastdeploy.worker import StateLayerSlot
from hybridkv.models.spec import RecurrentLayerSpec
from hybridkv.ops.states import quant_np
from hybridkv.ops.states.kernel_quant import _e4m3_bits, _e4m3_values, _hash, _round_float
from hybridkv.planner.layout import Layout


@triton.jit
def _byte_pointers(ptrs, p_row, o, m, block_bytes, segment_bytes):
    """uint8 pointers to state bytes ``o`` (int64) of the set at ``p_row``, and where the block is real."""
    column = o // block_bytes
    within = o - column * block_bytes
    seg = within // segment_bytes
    off = within - seg * segment_bytes
    blk = tl.load(p_row + column, mask=m, other=0).to(tl.int64)
    base = tl.load(ptrs + seg, mask=m, other=0).to(tl.pointer_type(tl.uint8))
    return base + blk * segment_bytes + off, m & (blk > 0)


@triton.jit
def _geometry(i_h, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROW: tl.constexpr):
    """Element indices ``e`` ``[BK, BV]`` of head ``i_h``, scale indices ``g`` ``[BK]`` and the masks
    (padding lanes point at element / scale 0, masked)."""
    o_k = tl.arange(0, BK).to(tl.int64)
    o_v = tl.arange(0, BV).to(tl.int64)
    m_k = o_k < DK
    m_kv = m_k[:, None] & (o_v < DV)[None, :]
    e = tl.where(m_kv, i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :], 0)
    if ROW:
        g = tl.where(m_k, i_h * DK + o_k, 0)
    else:
        g = i_h + o_k * 0
    return e, g, m_k, m_kv


@triton.jit
def _q_read(
    ptrs, p_row, i_h, n, init, component_base, value_bytes, block_bytes, segment_bytes,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KIND: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """float32 ``[BK, BV]``: head ``i_h``'s state dequantized (zeros for a fresh row or padding)."""
    e, g, m_k, m_kv = _geometry(i_h, DK, DV, BK, BV, ROW)
    z = e * 0
    p_v, m_v = _byte_pointers(ptrs, p_row, component_base + e, m_kv, block_bytes, segment_bytes)
    read = m_v & (z + n > 0) & (z + init > 0)
    bits = tl.load(p_v, mask=read, other=0)
    if KIND == 0:
        q = bits.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        q = _e4m3_values(bits)
    word = (g * 0).to(tl.int32)
    ok = m_k
    o_s = component_base + value_bytes + 4 * g
    for j in tl.static_range(4):  # a scale's four bytes, little-endian, each by the layout's rule
        p_j, ok_j = _byte_pointers(ptrs, p_row, o_s + j, m_k, block_bytes, segment_bytes)
        word = word | (tl.load(p_j, mask=ok_j, other=0).to(tl.int32) << (8 * j))
        ok = ok & ok_j
    scale = tl.where(ok, word.to(tl.float32, bitcast=True), 0.0)
    return tl.where(read & ok[:, None], q * scale[:, None], 0.0)


@triton.jit
def _q_write(
    ptrs, p_row, i_h, b_s, n, key, pos, salt, component_base, value_bytes, block_bytes, segment_bytes,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KIND: tl.constexpr,
    QMAX: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """Quantize ``b_s`` per scale group and write values and scales (nothing for a row without tokens)."""
    e, g, m_k, m_kv = _geometry(i_h, DK, DV, BK, BV, ROW)
    s = tl.where(m_kv, b_s, 0.0)
    if ROW:
        scale = tl.max(tl.abs(s), axis=1) / QMAX
    else:
        scale = tl.max(tl.max(tl.abs(s), axis=1), axis=0) / QMAX + (g * 0).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)
    v = tl.where(scale[:, None] > 0, s / safe[:, None], 0.0)
    seed = ((key & 0xFFFFFFFF) * 0x9E3779B1 + (pos & 0xFFFFFFFF) * 0x7FEB352D + 1) & 0xFFFFFFFF
    u = (_hash(_hash(e ^ salt) ^ seed) >> 8).to(tl.float32) * 5.9604644775390625e-08
    u = tl.where((e * 0 + key) >= 0, u, 0.5)
    if KIND == 0:
        bits = tl.minimum(tl.maximum(tl.floor(v + u), -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        bits = _e4m3_bits(_round_float(v, u, 3, -6, 448.0))
    z = e * 0
    p_v, m_v = _byte_pointers(ptrs, p_row, component_base + e, m_kv, block_bytes, segment_bytes)
    tl.store(p_v, bits, mask=m_v & (z + n > 0))
    word = scale.to(tl.int32, bitcast=True)
    o_s = component_base + value_bytes + 4 * g
    for j in tl.static_range(4):
        p_j, ok_j = _byte_pointers(ptrs, p_row, o_s + j, m_k, block_bytes, segment_bytes)
        tl.store(p_j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=ok_j & (g * 0 + n > 0))


@triton.jit
def lightning_quant_kernel(
    ptrs, table_ptr, cu_ptr, dec_ptr, keys_ptr, q_ptr, k_ptr, v_ptr, o_ptr, decay_ptr,
    stride_table, stride_q_t, stride_q_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    component_base, value_bytes, block_bytes, segment_bytes, salt,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KIND: tl.constexpr,
    QMAX: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """Program ``(i_b, i_h)``: head ``i_h`` of slot ``i_b``; per token ``S <- decay_h S + k^T v``, ``o = q S``."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    p_row = table_ptr + i_b * stride_table
    first, n, init = _row_span(cu_ptr, dec_ptr, p_row, i_b)
    geo = (component_base, value_bytes, block_bytes, segment_bytes)
    b_s = _q_read(ptrs, p_row, i_h, n, init, *geo, DK, DV, BK, BV, KIND, ROW)
    b_decay = tl.load(decay_ptr + i_h).to(tl.float32)
    for t in range(0, n):
        tok = first + t
        b_q = tl.load(q_ptr + tok * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k_ptr + tok * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v_ptr + tok * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0).to(tl.float32)
        b_s = b_decay * b_s + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        tl.store(o_ptr + tok * stride_o_t + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    key = tl.load(keys_ptr + i_b).to(tl.int64)
    _q_write(ptrs, p_row, i_h, b_s, n, key, init + n, salt, *geo, DK, DV, BK, BV, KIND, QMAX, ROW)


@triton.jit
def gated_delta_quant_kernel(
    ptrs, table_ptr, cu_ptr, dec_ptr, keys_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    stride_table, stride_q_t, stride_q_h, stride_v_t, stride_v_h, stride_g_t, stride_o_t, stride_o_h,
    scale, component_base, value_bytes, block_bytes, segment_bytes, salt,
    REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    KIND: tl.constexpr, QMAX: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """Program ``(i_b, i_h)``: value head ``i_h`` of slot ``i_b``, the delta rule of :mod:`.kernels`."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    p_row = table_ptr + i_b * stride_table
    first, n, init = _row_span(cu_ptr, dec_ptr, p_row, i_b)
    geo = (component_base, value_bytes, block_bytes, segment_bytes)
    b_s = _q_read(ptrs, p_row, i_h, n, init, *geo, DK, DV, BK, BV, KIND, ROW)
    i_hk = i_h // REP
    for t in range(0, n):
        tok = first + t
        b_q = tl.load(q_ptr + tok * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k_ptr + tok * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k, other=0).to(tl.float32)
        b_q = b_q / tl.maximum(tl.sqrt(tl.sum(b_q * b_q, axis=0)), 1e-6) * scale
        b_k = b_k / tl.maximum(tl.sqrt(tl.sum(b_k * b_k, axis=0)), 1e-6)
        b_v = tl.load(v_ptr + tok * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0).to(tl.float32)
        b_g = tl.load(g_ptr + tok * stride_g_t + i_h).to(tl.float32)
        b_beta = tl.load(beta_ptr + tok * stride_g_t + i_h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_k[:, None] * b_s, axis=0)) * b_beta
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        tl.store(o_ptr + tok * stride_o_t + i_h * stride_o_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    key = tl.load(keys_ptr + i_b).to(tl.int64)
    _q_write(ptrs, p_row, i_h, b_s, n, key, init + n, salt, *geo, DK, DV, BK, BV, KIND, QMAX, ROW)


def request_keys(forward_meta: Any, like: Any) -> Any:
    """int64 ``[max_num_seqs]`` on ``like``'s device: each slot's request key
    (:func:`~hybridkv.ops.states.quant_np.request_key`), -1 for a slot without a request id (rounds
    to nearest), all -1 without ``forward_meta.state_request_ids``."""
    ids = getattr(forward_meta, "state_request_ids", None)
    slots = int(launch._field(forward_meta.seq_lens_decoder, like, "seq_lens_decoder").shape[0])
    keys = np.full(slots, -1, dtype=np.int64)
    for i, r in enumerate(list(ids or [])[:slots]):
        if r is not None:
            keys[i] = quant_np.request_key(r) & 0xFFFFFFFF
    return launch.tensors_.to_like(keys, like)


def _args(forward_meta: Any, slot: StateLayerSlot, layout: Layout, spec: RecurrentLayerSpec, name: str, layer_id: int):
    """(tensors, geometry scalars, constexprs) shared by both launches, for component ``name``."""
    from hybridkv.ops.segments import pointer_row
    from hybridkv.ops.states.quant import region_salt

    first = slot.segments[0]
    comp = spec.component(name)
    if comp.scales not in ("row", "head"):
        raise ValueError(f"the layer kernels take row or head scales, component {name!r} has {comp.scales!r}")
    tables = forward_meta.state_block_tables
    table = launch._field(tables[slot.group] if tables is not None else None, first, "state_block_tables")
    cu = launch._field(forward_meta.cu_seqlens_q, first, "cu_seqlens_q")
    dec = launch._field(forward_meta.seq_lens_decoder, first, "seq_lens_decoder")
    if int(cu.shape[0]) != int(dec.shape[0]) + 1 or int(table.shape[0]) < int(dec.shape[0]):
        raise ValueError("cu_seqlens_q needs one entry per batch slot plus one and the state tables a row per slot")
    base = spec.component_offsets()[name]
    tensors = [pointer_row(slot.segments), table, cu, dec, request_keys(forward_meta, first)]
    geometry = [base, comp.value_bytes, layout.block_bytes, layout.segment_bytes, region_salt(layer_id, base)]
    h, dk, dv = comp.shape
    consts = dict(
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
        KIND=0 if comp.dtype.value == "int8" else 1, QMAX=comp.dtype.quant_max, ROW=comp.scales == "row",
    )  # fmt: skip
    return tensors, launch._strides(table)[0], geometry, consts, h, int(dec.shape[0])


def lightning(q: Any, k: Any, v: Any, slopes: Any, forward_meta: Any, slot: StateLayerSlot, layout: Layout,
              spec: RecurrentLayerSpec, layer_id: int) -> Any:  # fmt: skip
    """:func:`.layers.lightning_attention` over an int8 / fp8 state: one launch, ``[num_tokens, H, d_v]`` out."""
    tensors, stride_table, geometry, consts, heads, slots = _args(
        forward_meta, slot, layout, spec, spec.components[0].name, layer_id
    )
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = launch.output_like(v, tuple(int(d) for d in v.shape))
    sq, sv = launch._strides(q), launch._strides(v)
    decay = launch.decay_row(slopes, tensors[0])
    launch.launch(lightning_quant_kernel, (slots, heads), [*tensors, q, k, v, out, decay],
                  [stride_table, sq[0], sq[1], sv[0], sv[1], sv[0], sv[1], *geometry], **consts)  # fmt: skip
    return out


def gated_delta(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, forward_meta: Any, slot: StateLayerSlot,
                layout: Layout, spec: RecurrentLayerSpec, layer_id: int) -> Any:  # fmt: skip
    """:func:`.layers.gated_delta_rule` over an int8 / fp8 ``ssm``: one launch, ``[num_tokens, Hv, d_v]`` out."""
    tensors, stride_table, geometry, consts, hv, slots = _args(forward_meta, slot, layout, spec, "ssm", layer_id)
    q, k, v, g, beta = (a.contiguous() for a in (q, k, v, g, beta))
    out = launch.output_like(v, tuple(int(d) for d in v.shape))
    sq, sv = launch._strides(q), launch._strides(v)
    launch.launch(gated_delta_quant_kernel, (slots, hv), [*tensors, q, k, v, g, beta, out],
                  [stride_table, sq[0], sq[1], sv[0], sv[1], hv, sv[0], sv[1], float(scale), *geometry],
                  REP=hv // int(q.shape[1]), **consts)  # fmt: skip
    return out

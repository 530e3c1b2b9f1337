"""What a FastDeploy model layer calls: a linear-attention layer's recurrence over the paged state.

A MiniMax-M1 lightning layer in FastDeploy today keeps ``_kv_history`` as a layer attribute. With
hybridkv it passes its projections and ``forward_meta`` instead and gets its output back; the state
of every row lives in the row's state set (``forward_meta.state_block_tables`` /
``state_layer_slots``, patch W2 / W3) and is updated in place::

    o = lightning_attention(q, k, v, self.slopes, forward_meta, self.layer_id)   # replaces _kv_history

and a Gated DeltaNet layer (Qwen3-Next, Qwen3.5) its conv window and delta rule::

    x = F.silu(gdn_conv(mixed_qkv, conv_weight, forward_meta, layer_id))           # window in place
    o = gated_delta_rule(q, k, v, g, beta, forward_meta, layer_id)                 # state in place

FastDeploy's batch is flat: the tokens of all rows back to back, ``[num_tokens, heads, dim]``; batch
slot ``i`` holds tokens ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1]`` (``get_padding_offset`` builds
``cu_seqlens_q`` over all ``max_num_seqs`` slots, an empty slot adding 0). ``seq_lens_decoder[i]`` is
the number of tokens slot ``i`` computed before this step: 0 is a fresh prompt, whose state starts
from zero; otherwise the row continues from its stored state (a later prefill chunk, or a decode
token). Each row runs its own recurrence over its own tokens; rows never see one another's state.

Two paths, chosen by ``backend`` (``"auto"``: the kernel on CUDA, the reference elsewhere):

- the Triton kernels (:mod:`.kernels`): one launch per layer per step over every batch slot, each
  reading its row's span and state set on the device through the per-segment base pointer row, and
  writing the state in place; no per-request loop, no host sync. A slot with tokens but no state set
  (-1 row) is skipped there (its outputs are zero): the kernel cannot raise;
- the reference: the rows' states read and written through the per-segment byte helpers
  (:mod:`.state`), the recurrence in numpy (float64); it reads the step's fields on the host and
  raises ``ValueError`` for a slot with tokens but no state set, before anything is written.

Neither imports torch for Paddle tensors. An int8 / fp8 state (values then float32 scales) is
dequantized, run and written back quantized, rounded by (request, position) from
``forward_meta.state_request_ids`` (:mod:`.kernels_quant`; the reference through
:mod:`hybridkv.ops.states.quant_np`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridkv.integrations.fastdeploy import launch
from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.state import gather_state_bytes, scatter_state_bytes
from hybridkv.integrations.fastdeploy.worker import PAD_BLOCK, StateLayerSlot
from hybridkv.models.spec import RecurrentLayerSpec, StateComponent
from hybridkv.ops.states import quant_np
from hybridkv.ops.states.quant import region_salt
from hybridkv.planner.layout import Layout

_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


def _from_store(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Flat state bytes ``[B, nbytes]`` (uint8) as float64 values of ``dtype`` (bfloat16 included)."""
    with np.errstate(invalid="ignore"):  # a fresh row's stored bytes may be anything; it is not read
        if dtype == "bfloat16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return raw.view(_NUMPY[dtype]).astype(np.float64)


def _to_store(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values as the bytes of ``dtype`` (bfloat16: round to nearest even), uint8 ``[B, nbytes]``."""
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8).reshape(len(values), -1)
    return values.astype(_NUMPY[dtype]).view(np.uint8).reshape(len(values), -1)


def _decode(raw: np.ndarray, comp: StateComponent) -> np.ndarray:
    """A component's stored bytes ``[B, nbytes]`` as float64 ``[B, numel]``: an int8 / fp8 one
    dequantized (values times their float32 scales, :mod:`hybridkv.ops.states.quant_np`)."""
    if comp.dtype.quantized:
        with np.errstate(over="ignore", invalid="ignore"):  # a fresh row's stored bytes may be anything
            return quant_np.decode(raw, comp.dtype, comp.numel, comp.scale_group).astype(np.float64)
    return _from_store(raw, comp.dtype.value)


def _encode(values: np.ndarray, comp: StateComponent, seeds: np.ndarray | None, salt: int) -> np.ndarray:
    """float64 ``[B, numel]`` as the component's stored bytes; an int8 / fp8 one quantized from float32
    per scale group, rounded stochastically with ``seeds`` ``[B]`` (None: to nearest)."""
    if not comp.dtype.quantized:
        return _to_store(values, comp.dtype.value)
    u: np.ndarray | float = 0.5
    if seeds is not None:  # a row without a request (seed -1) rounds to nearest
        u = np.where((seeds < 0)[:, None], np.float32(0.5), quant_np.uniforms(seeds, salt, comp.numel))
    return quant_np.encode(values.reshape(len(values), -1).astype(np.float32), comp.dtype, comp.scale_group, u)


def row_seeds(forward_meta: Any, spans: Sequence[tuple[int, int, int, int]]) -> np.ndarray | None:
    """Stochastic-rounding seeds ``[len(spans)]`` of the rows' new states, from (request, position
    after this step) (:func:`~hybridkv.ops.states.quant.rounding_seeds`); -1 (round to nearest) for a
    slot without a request id, None without ``forward_meta.state_request_ids`` (set by ``attach_worker``)."""
    ids = getattr(forward_meta, "state_request_ids", None)
    if ids is None:
        return None
    keys = [quant_np.request_key(ids[slot]) if ids[slot] is not None else 0 for slot, *_ in spans]
    seeds = quant_np.rounding_seeds(keys, [start + n for _, _, n, start in spans])
    return np.where([ids[slot] is None for slot, *_ in spans], -1, seeds).astype(np.int64)


def _host(x: Any, what: str) -> np.ndarray:
    if x is None:
        raise ValueError(f"lightning_attention: forward_meta.{what} is not set (patches W2 / W3 set it)")
    return tensors_.to_numpy(x)


def row_spans(forward_meta: Any) -> list[tuple[int, int, int, int]]:
    """``(slot, first_token, num_tokens, start_position)`` of every batch slot with tokens this step,
    from ``cu_seqlens_q`` ``[max_num_seqs + 1]`` and ``seq_lens_decoder`` ``[max_num_seqs]``."""
    cu = _host(forward_meta.cu_seqlens_q, "cu_seqlens_q").reshape(-1).astype(np.int64)
    dec = _host(forward_meta.seq_lens_decoder, "seq_lens_decoder").reshape(-1).astype(np.int64)
    if cu.size != dec.size + 1 or (np.diff(cu) < 0).any() or cu[0] != 0:
        raise ValueError(
            f"lightning_attention: cu_seqlens_q must rise from 0 with one entry per batch slot plus one, got "
            f"{cu.size} entries for {dec.size} slots"
        )
    return [(i, int(cu[i]), int(cu[i + 1] - cu[i]), int(dec[i])) for i in range(dec.size) if cu[i + 1] > cu[i]]


def _layer(
    forward_meta: Any, layer_id: int, components: tuple[str, ...] | None = None, what: str = "lightning_attention"
) -> tuple[StateLayerSlot, Layout, RecurrentLayerSpec]:
    slots = forward_meta.state_layer_slots
    if slots is None or layer_id not in slots:
        raise ValueError(f"{what}: layer {layer_id} has no state slot in forward_meta.state_layer_slots")
    slot = slots[layer_id]
    layout = forward_meta.hybridkv_layout
    spec = layout.model.layers[layer_id]
    names = tuple(c.name for c in getattr(spec, "components", ()))
    if not isinstance(spec, RecurrentLayerSpec) or (len(names) != 1 if components is None else names != components):
        want = "a one-component recurrent layer" if components is None else f"a layer with states {components}"
        raise ValueError(f"{what}: layer {layer_id} is not {want}")
    return slot, layout, spec


def lightning_attention(
    q: Any, k: Any, v: Any, slopes: Sequence[float], forward_meta: Any, layer_id: int, backend: str = "auto"
) -> Any:
    """One lightning-attention layer over the flat batch, its states read and written in place.

    ``q``, ``k``: ``[num_tokens, H, d_k]``; ``v``: ``[num_tokens, H, d_v]`` (Paddle or torch, the
    layer's own tensors); ``slopes``: the layer's ``[H]`` decay slopes (``hybridkv.ops.lightning``'s
    ``lightning_slopes``). Per head ``S <- exp(-s_h) S + k^T v`` then ``o = q S``, token by token
    within a row. Returns ``o`` ``[num_tokens, H, d_v]`` in ``v``'s framework, dtype and device (a new
    tensor). ``forward_meta`` carries ``state_block_tables`` / ``state_layer_slots`` (W3),
    ``hybridkv_layout`` (the layout, set once with them), ``cu_seqlens_q`` and ``seq_lens_decoder``.
    Rows without tokens are not touched. Raises ``ValueError`` for a slot with tokens but no state
    set (-1 row; the reference path only, see the module), shapes that disagree, or missing fields,
    before any state is written. ``backend``: ``"auto"``, ``"triton"`` or ``"naive"`` (the module)."""
    slot, layout, spec = _layer(forward_meta, layer_id)
    comp = spec.components[0]
    heads, dk, dv = comp.shape
    qs, ks, vs = (tuple(int(d) for d in x.shape) for x in (q, k, v))
    if qs[1:] != (heads, dk) or ks != qs or vs[1:] != (heads, dv) or vs[0] != qs[0]:
        raise ValueError(
            f"lightning_attention: q, k [T, {heads}, {dk}] and v [T, {heads}, {dv}] expected, got "
            f"{list(qs)}, {list(ks)}, {list(vs)}"
        )
    if launch.use_kernel(slot, backend):
        if comp.dtype.quantized:
            from hybridkv.integrations.fastdeploy import kernels_quant

            return kernels_quant.lightning(q, k, v, slopes, forward_meta, slot, layout, spec, layer_id)
        return launch.lightning(q, k, v, slopes, forward_meta, slot, layout, spec)
    qn, kn, vn = (tensors_.to_numpy(x).astype(np.float64) for x in (q, k, v))
    spans = row_spans(forward_meta)
    if spans and spans[-1][1] + spans[-1][2] != len(qn):
        covered = spans[-1][1] + spans[-1][2]
        raise ValueError(f"lightning_attention: cu_seqlens_q covers {covered} tokens, q has {len(qn)}")
    tables = _host(forward_meta.state_block_tables, "state_block_tables")[slot.group]
    width = layout.blocks_per_state[slot.group]
    live = [i for i, *_ in spans]
    rows = tables[live, :width] if live else np.zeros((0, width), dtype=np.int64)
    if (rows == PAD_BLOCK).any():
        raise ValueError("lightning_attention: a batch slot with tokens has no state set (apply the step's tasks)")
    decay = np.exp(-np.asarray(slopes, dtype=np.float64)).reshape(heads, 1, 1)
    out = np.zeros(vn.shape, dtype=np.float64)
    if not live:
        return _as_output(out, v)
    offset, nbytes = spec.component_offsets()[comp.name], comp.nbytes
    old = tensors_.to_numpy(gather_state_bytes(slot, layout, rows, offset + nbytes))
    states = _decode(np.ascontiguousarray(old[:, offset:]), comp).reshape(len(live), heads, dk, dv)
    for r, (_, first, n, start) in enumerate(spans):
        s = states[r] if start > 0 else np.zeros((heads, dk, dv))  # a fresh prompt starts from zero
        for t in range(first, first + n):
            s = decay * s + kn[t][:, :, None] * vn[t][:, None, :]
            out[t] = np.einsum("hk,hkv->hv", qn[t], s)
        states[r] = s
    new = _encode(states.reshape(len(live), -1), comp, row_seeds(forward_meta, spans), region_salt(layer_id, offset))
    data = np.concatenate([old[:, :offset], new], axis=1)
    scatter_state_bytes(slot, layout, rows, data)
    return _as_output(out, v)


def _as_output(out: np.ndarray, v: Any) -> Any:
    """``out`` (float64 numpy) as a new tensor of ``v``'s framework, device and dtype."""
    name = str(v.dtype).rpartition(".")[2]
    t = tensors_.to_like(out.astype(np.float32 if name not in ("float64",) else np.float64), v)
    if name in ("float32", "float64"):
        return t
    return t.astype(name) if tensors_.is_paddle(t) else t.to(v.dtype)


# ---- Gated DeltaNet (Qwen3-Next, Qwen3.5): the conv window and the delta rule ------------------------
def _gdn_rows(forward_meta: Any, layer_id: int, num_tokens: int, what: str):
    """(slot, layout, spec, spans, rows, old state bytes [B, state_bytes]) of a GDN layer's live rows."""
    slot, layout, spec = _layer(forward_meta, layer_id, ("ssm", "conv"), what)
    spans = row_spans(forward_meta)
    covered = spans[-1][1] + spans[-1][2] if spans else 0
    if covered != num_tokens:
        raise ValueError(f"{what}: cu_seqlens_q covers {covered} tokens, the input has {num_tokens}")
    tables = _host(forward_meta.state_block_tables, "state_block_tables")[slot.group]
    width = layout.blocks_per_state[slot.group]
    rows = tables[[i for i, *_ in spans], :width] if spans else np.zeros((0, width), dtype=np.int64)
    if (rows == PAD_BLOCK).any():
        raise ValueError(f"{what}: a batch slot with tokens has no state set (apply the step's tasks)")
    old = tensors_.to_numpy(gather_state_bytes(slot, layout, rows, spec.state_bytes)) if spans else None
    return slot, layout, spec, spans, rows, old


def _component(spec: RecurrentLayerSpec, old: np.ndarray, name: str) -> np.ndarray:
    comp = spec.component(name)
    at = spec.component_offsets()[name]
    values = _decode(np.ascontiguousarray(old[:, at : at + comp.nbytes]), comp)
    return values.reshape(len(old), *comp.shape)


def _store(slot, layout, spec, rows, old: np.ndarray, name: str, values: np.ndarray, seeds=None, layer_id=0) -> None:
    comp = spec.component(name)
    at = spec.component_offsets()[name]
    new = old.copy()
    new[:, at : at + comp.nbytes] = _encode(values.reshape(len(old), -1), comp, seeds, region_salt(layer_id, at))
    scatter_state_bytes(slot, layout, rows, new)


def gdn_conv(x: Any, weight: Any, forward_meta: Any, layer_id: int, backend: str = "auto") -> Any:
    """The causal depthwise conv of a GDN layer over FastDeploy's flat batch, its window in place.

    ``x``: ``[num_tokens, conv_dim]`` (the projected q, k, v before the conv); ``weight``: ``[conv_dim,
    kernel]`` (``conv1d.weight`` squeezed; column ``kernel - 1`` multiplies the current token). Row
    ``i``'s output at a token reads the ``kernel - 1`` inputs before it: from this step, or from the
    stored window (``conv [conv_dim, kernel - 1]``, oldest first) when the row continues
    (``seq_lens_decoder[i] > 0``), zeros for a fresh prompt. The row's last ``kernel - 1`` inputs
    become its window. Returns ``[num_tokens, conv_dim]`` in ``x``'s framework and dtype, before the
    activation (the layer applies its own). ``backend``: as :func:`lightning_attention`'s."""
    slot, layout, spec = _layer(forward_meta, layer_id, ("ssm", "conv"), "gdn_conv")
    dim, taps = spec.component("conv").shape
    xs, ws = tuple(int(d) for d in x.shape), tuple(int(d) for d in weight.shape)
    if len(xs) != 2 or xs[1] != dim or ws != (dim, taps + 1):
        raise ValueError(f"gdn_conv: x [T, {dim}] and weight [{dim}, {taps + 1}] expected, got {xs}, {ws}")
    if launch.use_kernel(slot, backend):
        return launch.conv(x, weight, forward_meta, slot, layout, spec)
    xn, w = tensors_.to_numpy(x).astype(np.float64), tensors_.to_numpy(weight).astype(np.float64)
    slot, layout, spec, spans, rows, old = _gdn_rows(forward_meta, layer_id, len(xn), "gdn_conv")
    out = np.zeros(xn.shape)
    if not spans:
        return _as_output(out, x)
    windows = _component(spec, old, "conv")  # [B, conv_dim, kernel - 1]
    for r, (_, first, n, start) in enumerate(spans):
        past = windows[r].T if start > 0 else np.zeros((taps, dim))  # a fresh prompt starts from zeros
        seq = np.concatenate([past, xn[first : first + n]])  # [kernel - 1 + n, conv_dim]
        for t in range(n):
            out[first + t] = (seq[t : t + taps + 1] * w.T).sum(0)
        windows[r] = seq[-taps:].T
    _store(slot, layout, spec, rows, old, "conv", windows)
    return _as_output(out, x)


def gated_delta_rule(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    forward_meta: Any,
    layer_id: int,
    scale: float | None = None,
    backend: str = "auto",
) -> Any:
    """The gated delta rule of a GDN layer over FastDeploy's flat batch, the state in place.

    ``q``, ``k``: ``[num_tokens, Hk, d_k]`` (after the conv and activation; L2-normalised here, as the
    Qwen3-Next kernels do with ``use_qk_l2norm_in_kernel``); ``v``: ``[num_tokens, Hv, d_v]``; ``g``
    (log decay) and ``beta``: ``[num_tokens, Hv]``; ``Hv`` a multiple of ``Hk`` (each q / k head serves
    ``Hv / Hk`` value heads). Per token: ``S <- exp(g) S``; ``S <- S + k (beta (v - k^T S))``;
    ``o = (scale q)^T S``, with ``S`` = ``ssm [Hv, d_k, d_v]`` of the row, from zero for a fresh prompt.
    Returns ``o`` ``[num_tokens, Hv, d_v]`` in ``v``'s framework and dtype. ``backend``: as
    :func:`lightning_attention`'s."""
    slot, layout, spec = _layer(forward_meta, layer_id, ("ssm", "conv"), "gated_delta_rule")
    hv, dk, dv = spec.component("ssm").shape
    qs, ks, vs, gs, bs = (tuple(int(d) for d in a.shape) for a in (q, k, v, g, beta))
    if len(qs) != 3 or qs[2:] != (dk,) or ks != qs or vs[1:] != (hv, dv) or hv % qs[1] or qs[0] != vs[0]:
        raise ValueError(f"gated_delta_rule: q, k [T, Hk, {dk}] and v [T, {hv}, {dv}] expected")
    if gs != (vs[0], hv) or bs != gs:
        raise ValueError(f"gated_delta_rule: g and beta [T, {hv}] expected, got {list(gs)}, {list(bs)}")
    if launch.use_kernel(slot, backend) and spec.component("ssm").dtype.quantized:
        from hybridkv.integrations.fastdeploy import kernels_quant

        return kernels_quant.gated_delta(q, k, v, g, beta, dk**-0.5 if scale is None else scale, forward_meta, slot,
                                         layout, spec, layer_id)  # fmt: skip
    if launch.use_kernel(slot, backend):
        return launch.gated_delta(q, k, v, g, beta, dk**-0.5 if scale is None else scale, forward_meta, slot,
                                  layout, spec)  # fmt: skip
    qn, kn, vn, gn, bn = (tensors_.to_numpy(a).astype(np.float64) for a in (q, k, v, g, beta))
    slot, layout, spec, spans, rows, old = _gdn_rows(forward_meta, layer_id, len(vn), "gated_delta_rule")
    rep = hv // qn.shape[1]
    qn = np.repeat(qn / np.linalg.norm(qn, axis=-1, keepdims=True).clip(1e-6), rep, axis=1)
    kn = np.repeat(kn / np.linalg.norm(kn, axis=-1, keepdims=True).clip(1e-6), rep, axis=1)
    qn = qn * (dk**-0.5 if scale is None else scale)
    out = np.zeros(vn.shape)
    if not spans:
        return _as_output(out, v)
    states = _component(spec, old, "ssm")  # [B, Hv, d_k, d_v]
    for r, (_, first, n, start) in enumerate(spans):
        s = states[r] if start > 0 else np.zeros((hv, dk, dv))
        for t in range(first, first + n):
            s = s * np.exp(gn[t])[:, None, None]
            delta = (vn[t] - np.einsum("hk,hkv->hv", kn[t], s)) * bn[t][:, None]
            s = s + kn[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hk,hkv->hv", qn[t], s)
        states[r] = s
    _store(slot, layout, spec, rows, old, "ssm", states, row_seeds(forward_meta, spans), layer_id)
    return _as_output(out, v)

"""MiniMax's lightning layers on hybridkv's paged in-place kernels, inside the unmodified HF model.

:func:`use_paged_lightning` makes an :class:`~.engine.HFEngine` serving a MiniMax model run each
``MiniMaxLightningAttention`` layer through :func:`hybridkv.ops.lightning.lightning_decode` (one
token per row, in place through the state table: reads the row's source set, writes its destination
set, so the verify step of speculative decoding writes speculative sets) and
:func:`~hybridkv.ops.lightning.lightning_prefill` (chunks, ``has_initial_state``), instead of
gathering the states into ``MiniMaxCache``. The layer's own weights are used (its fused ``qkv_proj``
with the activation, ``norm``, sigmoid ``output_gate``, ``out_proj``) and its own decay slopes
(``slope_rate``); only the recurrence runs in hybridkv. ``backend``: ``"naive"`` (torch reference)
or ``"triton"`` (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import torch

from hybridkv.integrations.transformers.families import UnsupportedModelError
from hybridkv.ops.lightning import lightning_decode, lightning_prefill


class PagedLightning:
    """The engine's mixer hook: swaps the lightning layers' ``forward`` for the paged one during a forward."""

    def __init__(self, engine, backend: str = "naive") -> None:
        if engine.family.model_type != "minimax":
            raise UnsupportedModelError(
                f"paged lightning kernels serve MiniMax only, not model_type {engine.family.model_type!r}"
            )
        if backend not in ("naive", "triton"):
            raise ValueError(f"backend must be 'naive' or 'triton', got {backend!r}")
        self.engine, self.backend = engine, backend
        self.where = {lid: (sl.group, sl.slot) for lid, sl in engine.cache.states.items()}
        layers = engine.model.model.layers
        self.modules = {lid: layers[lid].self_attn for lid in self.where}
        self._call: tuple | None = None

    @contextlib.contextmanager
    def __call__(self, engine, group, meta, past, src, dst, init):
        self._call = (src, dst, init)
        saved = {lid: m.forward for lid, m in self.modules.items()}
        for lid, m in self.modules.items():
            m.forward = types.MethodType(_paged_forward(self, lid), m)
        try:
            yield
        finally:
            for lid, m in self.modules.items():
                m.forward = saved[lid]
            self._call = None


def _paged_forward(hook: PagedLightning, lid: int):
    group, slot = hook.where[lid]
    pools = hook.engine.pools

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        src, dst, init = hook._call
        b, t, _ = hidden_states.shape
        h, d = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(b, t, h, 3 * d)
        q, k, v = torch.split(qkv, d, dim=3)  # [B, T, H, D] each
        slopes = self.slope_rate.reshape(-1)
        dst_t = torch.from_numpy(np.ascontiguousarray(dst))
        if t == 1 and init:
            src_t = torch.from_numpy(np.ascontiguousarray(src))
            o = lightning_decode(
                pools, src_t, group, slot, q[:, 0], k[:, 0], v[:, 0], slopes, out_table=dst_t, backend=hook.backend
            )[:, None]
        else:
            cu = torch.arange(0, b * t + 1, t, dtype=torch.int64)
            has_init = torch.full((b,), bool(init))
            o = lightning_prefill(
                pools,
                dst_t,
                group,
                slot,
                q.reshape(b * t, h, d),
                k.reshape(b * t, h, d),
                v.reshape(b * t, h, d),
                cu,
                has_init,
                slopes,
                block_size=self.block_size,
                backend=hook.backend,
            ).reshape(b, t, h, d)
        o = self.norm(o.reshape(b, t, h * d).to(hidden_states.dtype))
        o = torch.sigmoid(self.output_gate(hidden_states)) * o
        return self.out_proj(o), None

    return forward


def use_paged_lightning(engine, backend: str = "naive") -> PagedLightning:
    """Route ``engine``'s MiniMax lightning layers to hybridkv's paged kernels (see the module docstring).
    The engine stops gathering / scattering those layers' states: the kernels read and write the pool."""
    hook = PagedLightning(engine, backend)
    engine.cache.states = {}  # MiniMax's only states are the lightning layers', now handled in place
    engine.mixer_hook = hook
    return hook

"""FLOPs of a prefill, from the model spec: what a prefix hit saves and what a recompute costs.

Per token on one tensor-parallel rank: ``2 * params_active / tp_size`` for the weights; causal
attention over the context for each attention layer (``QK^T`` and ``PV``: ``4 * t * q_heads *
head_dim`` at position ``t``, summed to ``2 * (end^2 - start^2) * q_heads * head_dim``); and
``4 * state elements`` per token for each recurrent layer (decay and ``k^T v`` into the state,
``q S`` out of it). Estimates for choosing between options, not step-time predictions.
"""

from __future__ import annotations

import math

from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec


def flop_coefficients(model: ModelSpec) -> tuple[float, float]:
    """``(linear, quadratic)`` such that computing tokens ``[start, end)`` costs
    ``linear * (end - start) + quadratic * (end**2 - start**2)`` FLOPs. A spec without
    ``params_active`` counts only attention and recurrent FLOPs."""
    linear = 2.0 * (model.params_active or 0.0) / model.tp_size
    quadratic = 0.0
    for layer in model.layers:
        if isinstance(layer, AttentionLayerSpec):
            quadratic += 2.0 * (layer.num_q_heads or layer.num_kv_heads) * layer.head_dim
        elif isinstance(layer, RecurrentLayerSpec):
            linear += 4.0 * sum(math.prod(c.shape) for c in layer.components)
    return linear, quadratic


def prefill_flops(model: ModelSpec | tuple[float, float], end: int, start: int = 0) -> float:
    """FLOPs to compute tokens ``[start, end)`` of one sequence, with ``start`` tokens already cached.

    ``model`` may be a spec or its :func:`flop_coefficients` (faster in loops).
    """
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    linear, quadratic = model if isinstance(model, tuple) else flop_coefficients(model)
    return linear * (end - start) + quadratic * (float(end) ** 2 - float(start) ** 2)

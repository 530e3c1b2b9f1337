"""FLOPs of a prefill, from the model spec: what a prefix hit saves and what a recompute costs.

Per token on one tensor-parallel rank: ``2 * params_active / tp_size`` for the weights; causal
attention over the context for each attention layer (``QK^T`` and ``PV``: ``4 * t * q_heads *
head_dim`` at position ``t``, summed to ``2 * (end^2 - start^2) * q_heads * head_dim``); and
``4 * state elements`` per token for each recurrent layer (decay and ``k^T v`` into the state,
``q S`` out of it). Estimates for choosing between options, not step-time predictions.
"""

from __future__ import annotations

import math

from hybridkv.blockmgr.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec


def prefill_flops(model: ModelSpec, end: int, start: int = 0) -> float:
    """FLOPs to compute tokens ``[start, end)`` of one sequence, with ``start`` tokens already cached.

    A spec without ``params_active`` counts only attention and recurrent FLOPs.
    """
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    n = float(end - start)
    flops = 2.0 * (model.params_active or 0.0) / model.tp_size * n
    quad = float(end) ** 2 - float(start) ** 2
    for layer in model.layers:
        if isinstance(layer, AttentionLayerSpec):
            q_heads = layer.num_q_heads or layer.num_kv_heads
            flops += 2.0 * quad * q_heads * layer.head_dim
        elif isinstance(layer, RecurrentLayerSpec):
            flops += 4.0 * n * sum(math.prod(c.shape) for c in layer.components)
    return flops

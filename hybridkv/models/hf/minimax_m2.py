"""MiniMax-M2 (``model_type`` ``minimax_m2``): softmax attention in every layer (no lightning
layers, unlike MiniMax-M1): a KV-only model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("minimax_m2",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """Every layer an attention layer."""
    return (_hf_attention(cfg, where, dt),) * _num_layers(cfg, where)

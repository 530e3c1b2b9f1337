"""Jamba (``model_type`` ``jamba``): Mamba-1 layers with attention at ``attn_layer_offset`` of
every ``attn_layer_period`` layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import _hf_attention, _num_layers
from hybridkv.models.spec import AttentionLayerSpec, DType, RecurrentLayerSpec


def read(cfg: Mapping[str, Any], where: str, dt: DType | None) -> tuple[str, AttentionLayerSpec, RecurrentLayerSpec]:
    """(layer pattern, attention layer, Mamba-1 layer) of a Jamba config."""
    n = _num_layers(cfg, where)
    period = _field(cfg, "attn_layer_period", where, default=8)
    offset = _field(cfg, "attn_layer_offset", where, default=4, minimum=0)
    if offset >= period:
        raise SpecError(f"{where}: attn_layer_offset {offset} must be below attn_layer_period {period}")
    pattern = "".join("A" if i % period == offset else "R" for i in range(n))
    attn = _hf_attention(cfg, where)
    d_inner = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
    rec = P.mamba1_layer(
        d_inner,
        _field(cfg, "mamba_d_state", where, default=16),
        _field(cfg, "mamba_d_conv", where, default=4, minimum=2),
        dt or DType.BFLOAT16,
    )
    return pattern, attn, rec

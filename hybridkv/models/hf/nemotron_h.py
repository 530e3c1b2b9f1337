"""Nemotron-H (``model_type`` ``nemotron_h``): Mamba2 and attention layers in the order of
``hybrid_override_pattern`` (M: Mamba2, *: attention, -: MLP)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _text
from hybridkv.models.hf.common import _hf_attention
from hybridkv.models.spec import AttentionLayerSpec, DType, RecurrentLayerSpec


def read(cfg: Mapping[str, Any], where: str, dt: DType | None) -> tuple[str, AttentionLayerSpec, RecurrentLayerSpec]:
    """(layer pattern, attention layer, Mamba2 layer) of a Nemotron-H config."""
    pattern = _text(cfg.get("hybrid_override_pattern"), f"{where}: hybrid_override_pattern")
    attn = _hf_attention(cfg, where)
    rec = P.mamba2_layer(
        _field(cfg, "mamba_num_heads", where),
        _field(cfg, "mamba_head_dim", where),
        _field(cfg, "ssm_state_size", where),
        _field(cfg, "n_groups", where),
        _field(cfg, "conv_kernel", where, minimum=2),
        dt or DType.BFLOAT16,
    )
    return pattern, attn, rec

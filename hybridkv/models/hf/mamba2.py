"""Mamba2 (``model_type`` ``mamba2``): every layer a Mamba2 mixer, no attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import _num_layers
from hybridkv.models.spec import DType, RecurrentLayerSpec


def read(cfg: Mapping[str, Any], where: str, dt: DType | None) -> tuple[str, None, RecurrentLayerSpec]:
    """(layer pattern, no attention layer, Mamba2 layer) of a Mamba2 config."""
    pattern = "R" * _num_layers(cfg, where)
    rec = P.mamba2_layer(
        _field(cfg, "num_heads", where),
        _field(cfg, "head_dim", where),
        _field(cfg, "state_size", where),
        _field(cfg, "n_groups", where, default=1),
        _field(cfg, "conv_kernel", where, default=4, minimum=2),
        dt or DType.BFLOAT16,
    )
    return pattern, None, rec

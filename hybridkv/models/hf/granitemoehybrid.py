"""Granite 4.0 H (``model_type`` ``granitemoehybrid``): Mamba2 and attention layers in the order of
``layer_types`` / ``layers_block_type`` (``mamba`` / ``attention``, or transformers 5's
``linear_attention`` / ``full_attention``); ``d_inner = mamba_expand * hidden_size``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.bamba import MAMBA_KEYS
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, pattern_from
from hybridkv.models.hf.mamba2 import mamba2_mixer
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("granitemoehybrid",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Granite 4.0 H config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types", "layers_block_type"), "AR", n)
    if pattern is None:
        raise SpecError(f"{where}: needs 'layer_types' (which layers are mamba, which attention)")
    attn = _hf_attention(cfg, where, dt, head_dim_keys=())  # granite: hidden_size / num_attention_heads
    d_inner = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
    return P.layers_from_pattern(pattern, attn, mamba2_mixer(cfg, where, dt, MAMBA_KEYS, d_inner))

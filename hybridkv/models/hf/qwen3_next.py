"""Qwen3-Next (``model_type`` ``qwen3_next``): Gated DeltaNet layers with full attention every
``full_attention_interval`` layers (``layer_types`` when the config gives it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import _hf_attention, _hf_types, _num_layers
from hybridkv.models.spec import AttentionLayerSpec, DType, RecurrentLayerSpec


def read(cfg: Mapping[str, Any], where: str, dt: DType | None) -> tuple[str, AttentionLayerSpec, RecurrentLayerSpec]:
    """(layer pattern, attention layer, GDN layer) of a Qwen3-Next config."""
    n = _num_layers(cfg, where)
    if "layer_types" in cfg:
        types = _hf_types(cfg, "layer_types", n, where)
        allowed = ("full_attention", "linear_attention")
        if any(t not in allowed for t in types):
            raise SpecError(f"{where}: layer_types entries must be one of {list(allowed)}")
        pattern = "".join("A" if t == "full_attention" else "R" for t in types)
    else:
        k = _field(cfg, "full_attention_interval", where, default=4)
        pattern = "".join("A" if (i + 1) % k == 0 else "R" for i in range(n))
    attn = _hf_attention(cfg, where)
    rec = P.gdn_layer(
        _field(cfg, "linear_num_key_heads", where),
        _field(cfg, "linear_num_value_heads", where),
        _field(cfg, "linear_key_head_dim", where),
        _field(cfg, "linear_value_head_dim", where),
        _field(cfg, "linear_conv_kernel_dim", where, minimum=2),
        dt or DType.BFLOAT16,
    )
    return pattern, attn, rec

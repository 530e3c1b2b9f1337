"""MiniMax-M1 / MiniMax-Text-01 (``model_type`` ``minimax*``): lightning attention layers with a
softmax attention layer every 8th (``attn_type_list`` when the config gives it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.hf.common import _hf_attention, _hf_types, _num_layers
from hybridkv.models.spec import AttentionLayerSpec, DType, RecurrentLayerSpec


def read(cfg: Mapping[str, Any], where: str, dt: DType | None) -> tuple[str, AttentionLayerSpec, RecurrentLayerSpec]:
    """(layer pattern, attention layer, lightning layer) of a MiniMax config."""
    n = _num_layers(cfg, where)
    if "attn_type_list" in cfg:
        types = _hf_types(cfg, "attn_type_list", n, where)
        if any(t not in (0, 1) or isinstance(t, bool) for t in types):
            raise SpecError(f"{where}: attn_type_list entries must be 0 (lightning) or 1 (softmax)")
    else:
        types = [1 if i % 8 == 7 else 0 for i in range(n)]
    pattern = "".join("A" if t == 1 else "R" for t in types)
    attn = _hf_attention(cfg, where)
    return pattern, attn, P.lightning_layer(attn.num_q_heads or attn.num_kv_heads, attn.head_dim, dt or DType.FLOAT32)

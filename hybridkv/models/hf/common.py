"""Shared readers of HuggingFace ``config.json`` fields: attention, layer counts, per-layer types."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import MAX_LAYERS, _field, _list, _whole
from hybridkv.models.spec import AttentionLayerSpec, DType


def _hf_attention(cfg: Mapping[str, Any], where: str) -> AttentionLayerSpec:
    heads = _field(cfg, "num_attention_heads", where)
    hd = cfg.get("head_dim") or cfg.get("attention_head_dim")
    if hd is None:
        hidden = _field(cfg, "hidden_size", where)
        if hidden % heads:
            raise SpecError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        hd = hidden // heads
    kv = _field(cfg, "num_key_value_heads", where, default=heads)
    return AttentionLayerSpec(kv, _whole(hd, where, "head_dim"), DType.BFLOAT16, heads)


def _num_layers(cfg: Mapping[str, Any], where: str) -> int:
    n = _field(cfg, "num_hidden_layers", where)
    if n > MAX_LAYERS:
        raise SpecError(f"{where}: num_hidden_layers {n:,} is above {MAX_LAYERS:,}: not a model this planner expands")
    return n


def _hf_types(cfg: Mapping[str, Any], key: str, n: int, where: str) -> list[Any]:
    types = _list(cfg[key], f"{where}: {key}")
    if len(types) != n:
        raise SpecError(f"{where}: {key} has {len(types)} entries, num_hidden_layers is {n}")
    return types

"""Zamba2 (``model_type`` ``zamba2``): Mamba2 layers, and hybrid layers that run the shared
transformer block before their own Mamba2 mixer (``layers_block_type``: ``mamba`` / transformers 5's
``linear_attention``, and ``hybrid``). The shared block's weights are shared, its K/V are not: each
hybrid layer keeps K/V of its own (``num_key_value_heads x attention_head_dim``, ``attention_head_dim
= 2 * hidden_size / num_attention_heads``: the block reads the hidden state concatenated with the
embeddings) and its own Mamba2 state. Mamba-only layers keep only the state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, pattern_from
from hybridkv.models.hf.mamba2 import mamba2_mixer
from hybridkv.models.spec import AttentionLayerSpec, HybridLayerSpec, LayerSpec

MODEL_TYPES = ("zamba2",)
MAMBA_KEYS = ("n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state", "mamba_d_conv")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Zamba2 config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layers_block_type", "layer_types"), "RH", n)
    if pattern is None:
        raise SpecError(f"{where}: needs 'layers_block_type' (which layers are mamba, which hybrid)")
    hidden, heads = _field(cfg, "hidden_size", where), _field(cfg, "num_attention_heads", where)
    head_dim = cfg.get("attention_head_dim") or 2 * hidden // heads
    attn = _hf_attention({**cfg, "attention_head_dim": head_dim}, where, dt, head_dim_keys=("attention_head_dim",))
    d_inner = _field(cfg, "mamba_expand", where, default=2) * hidden
    rec = mamba2_mixer(cfg, where, dt, MAMBA_KEYS, d_inner)
    hybrid = HybridLayerSpec(AttentionLayerSpec(attn.num_kv_heads, attn.head_dim, attn.dtype, attn.num_q_heads), rec)
    return tuple(hybrid if c == "H" else rec for c in pattern)

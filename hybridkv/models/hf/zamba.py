"""Zamba (v1, ``model_type`` ``zamba``): Mamba layers, and hybrid layers that run the shared
transformer block before their own Mamba mixer (``layers_block_type``: ``mamba`` / transformers 5's
``linear_attention``, and ``hybrid``). Zamba's Mamba is Mamba-1 split into ``n_mamba_heads``
independent heads: transformers keeps ``ssm [n_mamba_heads, d_inner / n_mamba_heads, d_state]``
(float32) and ``conv [d_inner, d_conv]`` (model dtype), ``d_inner = mamba_expand * hidden_size``. The
shared block's weights are shared, its K/V are not: each hybrid layer keeps its own
(``num_key_value_heads x attention_head_dim``, ``attention_head_dim = 2 * hidden_size /
num_attention_heads`` by default: the block reads the hidden state concatenated with the embeddings).

Without a layer list, transformers' config derives one from ``attn_layer_period`` /
``attn_layer_offset`` (layers 0, 1 mamba, 2 hybrid, then hybrid where ``(i - 3) % period == offset``);
hybridkv does the same only when the config names both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, mamba1_of, pattern_from
from hybridkv.models.spec import AttentionLayerSpec, HybridLayerSpec, LayerSpec

MODEL_TYPES = ("zamba",)


def _pattern(cfg: Mapping[str, Any], where: str, n: int) -> str:
    pattern = pattern_from(cfg, where, ("layers_block_type", "layer_types"), "RH", n)
    if pattern is not None:
        return pattern
    if cfg.get("attn_layer_period") is None or cfg.get("attn_layer_offset") is None or n < 3:
        raise SpecError(
            f"{where}: needs 'layers_block_type' (which layers are mamba, which hybrid) or "
            "attn_layer_period and attn_layer_offset"
        )
    period = _field(cfg, "attn_layer_period", where)
    offset = _field(cfg, "attn_layer_offset", where, minimum=0)
    return "RRH" + "".join("H" if i % period == offset else "R" for i in range(n - 3))


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Zamba (v1) config."""
    n = _num_layers(cfg, where)
    pattern = _pattern(cfg, where, n)
    hidden, heads = _field(cfg, "hidden_size", where), _field(cfg, "num_attention_heads", where)
    head_dim = cfg.get("attention_head_dim") or 2 * hidden // heads
    attn = _hf_attention({**cfg, "attention_head_dim": head_dim}, where, dt, head_dim_keys=("attention_head_dim",))
    d_inner = _field(cfg, "mamba_expand", where, default=2) * hidden
    rec = mamba1_of(cfg, where, dt, d_inner, num_heads=_field(cfg, "n_mamba_heads", where, default=2))
    hybrid = HybridLayerSpec(AttentionLayerSpec(attn.num_kv_heads, attn.head_dim, attn.dtype, attn.num_q_heads), rec)
    return tuple(hybrid if c == "H" else rec for c in pattern)

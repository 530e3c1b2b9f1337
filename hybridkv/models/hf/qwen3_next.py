"""Gated DeltaNet hybrids: Qwen3-Next (``qwen3_next``), Qwen3.5 dense and MoE (``qwen3_5_text``,
``qwen3_5_moe_text``; the multimodal ``qwen3_5`` / ``qwen3_5_moe`` through their ``text_config``)
OLMo Hybrid (``olmo_hybrid``) and LaraMini (``lara_mini``: GDN, full and sliding-window attention,
Qwen3.5's GDN). GDN layers and attention in the order of ``layer_types``, else full attention every
``full_attention_interval`` layers. A ``sliding_attention`` layer keeps the K/V of its last
``sliding_window - 1`` tokens, a fixed-size state (:func:`~hybridkv.models.hf.common.window_layer`).
State per GDN layer: ``ssm [value_heads, key_dim, value_dim]`` (float32 in transformers) + one conv
window over q, k, v."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, expand, pattern_from, window_layer, window_of
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a GDN hybrid config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "ARW", n)
    if pattern is None:
        k = _field(cfg, "full_attention_interval", where, default=4)
        pattern = "".join("A" if (i + 1) % k == 0 else "R" for i in range(n))
    attn = _hf_attention(cfg, where, dt)
    rec = P.gdn_layer(
        _field(cfg, "linear_num_key_heads", where),
        _field(cfg, "linear_num_value_heads", where),
        _field(cfg, "linear_key_head_dim", where),
        _field(cfg, "linear_value_head_dim", where),
        _field(cfg, "linear_conv_kernel_dim", where, minimum=2),
        dt.ssm("gdn"),
        dt.conv("gdn"),
    )
    specs = {"A": attn, "R": rec}
    if "W" in pattern:
        specs["W"] = window_layer(attn, window_of(cfg, where, dt), where)
    return expand(pattern, specs, where)

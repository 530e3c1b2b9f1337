"""Bailing hybrid (``model_type`` ``bailing_hybrid``, inclusionAI Ling / Ring 2.5): Kimi Delta
Attention layers and multi-head latent attention (MLA) layers in the order of ``layer_types``
(transformers' config derives it from ``layer_group_size``: every ``layer_group_size``-th layer
MLA). As in Kimi Linear, MLA is cached as its compressed latent: one "head" with K =
``kv_lora_rank`` and V = ``qk_rope_head_dim`` wide; KDA keeps ``ssm [H, d, d]`` (float32 in
transformers) and one conv window over q, k, v ``[3 H d, K]`` (model dtype), ``H = linear_num_heads``
(the config class sets it to ``num_attention_heads``), ``d = linear_head_dim`` (the hub config's
``head_dim``: transformers' config moves it to ``linear_head_dim`` and writes ``head_dim =
qk_rope_head_dim``). The multi-token-prediction layers (``num_nextn_predict_layers``) are not run by
transformers' decoder and keep no cache there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _whole
from hybridkv.models.hf.common import Dtypes, _num_layers, pattern_from
from hybridkv.models.spec import AttentionLayerSpec, LayerSpec

MODEL_TYPES = ("bailing_hybrid",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Bailing hybrid config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "AR", n)
    if pattern is None:
        if cfg.get("layer_group_size") is None:
            raise SpecError(f"{where}: needs 'layer_types' or 'layer_group_size' (which layers are MLA)")
        group = _field(cfg, "layer_group_size", where)
        pattern = "".join("A" if (i + 1) % group == 0 else "R" for i in range(n))
    heads = _field(cfg, "num_attention_heads", where)
    attn = AttentionLayerSpec(
        1, _field(cfg, "kv_lora_rank", where), dt.kv(), heads, v_head_dim=_field(cfg, "qk_rope_head_dim", where)
    )
    lin_heads = _field(cfg, "linear_num_heads", where, default=heads)
    lin_dim = _field(cfg, "linear_head_dim", where) if "linear_head_dim" in cfg else _field(cfg, "head_dim", where)
    conv = cfg.get("linear_conv_kernel_dim") or cfg.get("short_conv_kernel_size") or 4
    rec = P.kda_layer(
        lin_heads, lin_dim, _whole(conv, where, "linear_conv_kernel_dim", 2), dt.ssm("kda"), dt.conv("kda")
    )
    return P.layers_from_pattern(pattern, attn, rec)

"""Kimi Linear (``model_type`` ``kimi_linear``): Kimi Delta Attention layers and multi-head latent
attention (MLA) layers, in the order of ``layer_types`` or the hub's 1-based
``linear_attn_config.full_attn_layers`` / ``kda_layers``. MLA is cached, by transformers and vLLM, as
its compressed latent: one "head" with K = ``kv_lora_rank`` (512) and V = ``qk_rope_head_dim`` (64)
wide, replicated on every tensor-parallel rank. KDA keeps ``ssm [heads, head_dim, head_dim]``
(float32 in transformers) and one conv window over q, k, v."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _list, _table, _whole
from hybridkv.models.hf.common import Dtypes, _num_layers, pattern_from
from hybridkv.models.spec import AttentionLayerSpec, LayerSpec

MODEL_TYPES = ("kimi_linear",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Kimi Linear config."""
    n = _num_layers(cfg, where)
    lac = _table(cfg.get("linear_attn_config") or {}, f"{where}: linear_attn_config")
    pattern = pattern_from(cfg, where, ("layer_types",), "AR", n)
    if pattern is None:
        if lac.get("full_attn_layers") is None:
            raise SpecError(f"{where}: needs 'layer_types' or linear_attn_config.full_attn_layers")
        full = {_whole(i, where, "full_attn_layers[]") - 1 for i in _list(lac["full_attn_layers"], where)}
        if any(i >= n for i in full):
            raise SpecError(f"{where}: full_attn_layers (1-based) name layers beyond num_hidden_layers {n}")
        pattern = "".join("A" if i in full else "R" for i in range(n))
    heads = _field(cfg, "num_attention_heads", where)
    attn = AttentionLayerSpec(
        1, _field(cfg, "kv_lora_rank", where), dt.kv(), heads, v_head_dim=_field(cfg, "qk_rope_head_dim", where)
    )
    kda_heads = _field(lac, "num_heads", f"{where}: linear_attn_config") if "num_heads" in lac else None
    kda_heads = kda_heads or _field(cfg, "linear_num_heads", where)
    kda_dim = _field(lac, "head_dim", f"{where}: linear_attn_config") if "head_dim" in lac else None
    kda_dim = kda_dim or _field(cfg, "linear_head_dim", where)
    conv = lac.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))
    rec = P.kda_layer(
        kda_heads, kda_dim, _whole(conv, where, "short_conv_kernel_size", 2), dt.ssm("kda"), dt.conv("kda")
    )
    return P.layers_from_pattern(pattern, attn, rec)

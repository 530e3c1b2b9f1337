"""MiniMax-M1 / MiniMax-Text-01 (``model_type`` ``minimax``, hub ``minimax_m1`` / ``minimax_text_01``):
lightning attention layers and softmax attention layers in the order of ``layer_types``
(transformers 5: ``full_attention`` / ``linear_attention``) or the hub's ``attn_type_list``
(1 softmax, 0 lightning). The lightning state ``kv [heads, head_dim, head_dim]`` is kept in the
activation dtype, as transformers (and FastDeploy's port) keep it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.hf.common import Dtypes, _hf_attention, _hf_types, _num_layers, pattern_from
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("minimax", "minimax_m1", "minimax_text_01")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a MiniMax config, one per decoder layer."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "AR", n)
    if pattern is None and cfg.get("attn_type_list") is not None:
        types = _hf_types(cfg, "attn_type_list", n, where)
        if any(t not in (0, 1) or isinstance(t, bool) for t in types):
            raise SpecError(f"{where}: attn_type_list entries must be 0 (lightning) or 1 (softmax)")
        pattern = "".join("A" if t == 1 else "R" for t in types)
    if pattern is None:
        raise SpecError(f"{where}: needs 'layer_types' or 'attn_type_list' (which layers are softmax attention)")
    attn = _hf_attention(cfg, where, dt)
    rec = P.lightning_layer(attn.num_q_heads or attn.num_kv_heads, attn.head_dim, dt.activation("lightning", "kv"))
    return P.layers_from_pattern(pattern, attn, rec)

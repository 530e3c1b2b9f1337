"""Nemotron-H (``model_type`` ``nemotron_h``): Mamba2, attention, MLP and MoE layers in the order of
``layers_block_type`` (what transformers 5 writes: ``linear_attention`` / ``full_attention`` /
``mlp`` / ``moe``; the hub's ``mamba`` / ``attention``) or the older ``hybrid_override_pattern``
(M: Mamba2, *: attention, -: MLP, E: MoE). ``mamba_ssm_cache_dtype`` (float32 by default in
``NemotronHConfig``) sets the SSM state's dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _text
from hybridkv.models.hf.common import Dtypes, _hf_attention, pattern_from
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("nemotron_h",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Nemotron-H config."""
    pattern = pattern_from(cfg, where, ("layers_block_type", "layer_types"), "AR-")
    if pattern is None:
        if cfg.get("hybrid_override_pattern") is None:
            raise SpecError(f"{where}: needs 'layers_block_type' (a list) or 'hybrid_override_pattern'")
        pattern = _text(cfg.get("hybrid_override_pattern"), f"{where}: hybrid_override_pattern")
    attn = _hf_attention(cfg, where, dt)
    rec = P.mamba2_layer(
        _field(cfg, "mamba_num_heads", where),
        _field(cfg, "mamba_head_dim", where),
        _field(cfg, "ssm_state_size", where),
        _field(cfg, "n_groups", where, default=cfg.get("mamba_n_groups", 8)),
        _field(cfg, "conv_kernel", where, default=4, minimum=2),
        dt.ssm("mamba2"),
        dt.conv("mamba2"),
    )
    return P.layers_from_pattern(pattern, attn, rec)

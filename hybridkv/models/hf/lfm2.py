"""LFM2, LFM2-MoE and LFM3 (``model_type`` ``lfm2``, ``lfm2_moe``, ``lfm3``; ``lfm3_vl`` through its
``text_config``): gated short-convolution layers, whose only state is the conv window
``conv [hidden_size, conv_L_cache - 1]`` (transformers keeps ``conv_L_cache`` columns), and attention
layers, in the order of ``layer_types`` (``conv`` / ``full_attention`` / LFM3's
``sliding_attention``, whose K/V window of ``sliding_window - 1`` tokens is a fixed-size state) or
``full_attn_idxs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _list, _whole
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, expand, pattern_from, window_layer, window_of
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("lfm2", "lfm2_moe", "lfm3")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of an LFM2 config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "ARW", n)
    if pattern is None:
        if cfg.get("full_attn_idxs") is None:
            raise SpecError(f"{where}: needs 'layer_types' or 'full_attn_idxs'")
        ids = {_whole(i, where, "full_attn_idxs[]", 0) for i in _list(cfg["full_attn_idxs"], where)}
        pattern = "".join("A" if i in ids else "R" for i in range(n))
    rec = P.short_conv_layer(
        _field(cfg, "hidden_size", where),
        _field(cfg, "conv_L_cache", where, default=3, minimum=2),
        dt.conv("short_conv"),
    )
    attn = _hf_attention(cfg, where, dt)
    specs = {"A": attn, "R": rec}
    if "W" in pattern:
        specs["W"] = window_layer(attn, window_of(cfg, where, dt), where)
    return expand(pattern, specs, where)

"""Jamba (``model_type`` ``jamba``): Mamba-1 layers with attention at ``attn_layer_offset`` of
every ``attn_layer_period`` layers (or in the order of ``layer_types`` when the config lists it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, mamba1_of, pattern_from
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("jamba",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Jamba config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layers_block_type",), "AR", n)
    if pattern is None:
        period = _field(cfg, "attn_layer_period", where, default=8)
        offset = _field(cfg, "attn_layer_offset", where, default=4, minimum=0)
        if offset >= period:
            raise SpecError(f"{where}: attn_layer_offset {offset} must be below attn_layer_period {period}")
        pattern = "".join("A" if i % period == offset else "R" for i in range(n))
    attn = _hf_attention(cfg, where, dt)
    d_inner = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
    rec = mamba1_of(cfg, where, dt, d_inner)
    return P.layers_from_pattern(pattern, attn, rec)

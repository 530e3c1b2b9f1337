"""RWKV-4 (transformers ``model_type`` ``rwkv``): every layer keeps five vectors of ``hidden_size``:
the channel-mix and time-mix token shifts (model dtype) and the WKV numerator, denominator and
running maximum (float32), as transformers' ``RwkvModel`` allocates them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _num_layers
from hybridkv.models.spec import DType, LayerSpec

MODEL_TYPES = ("rwkv",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of an RWKV-4 config."""
    hidden = _field(cfg, "hidden_size", where)
    shift = dt.conv_override or dt.model
    dt.fixed("rwkv4", "shift_ffn", shift, "--conv-dtype" if dt.conv_override else dt.model_source)
    dt.fixed("rwkv4", "shift_attn", shift, "--conv-dtype" if dt.conv_override else dt.model_source)
    for c in ("num", "den", "max"):
        dt.fixed("rwkv4", c, DType.FLOAT32, "transformers keeps the WKV sums in float32")
    return (P.rwkv4_layer(hidden, hidden, shift),) * _num_layers(cfg, where)

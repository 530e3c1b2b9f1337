"""Falcon-H1 (``model_type`` ``falcon_h1``): every layer runs attention and a Mamba2 mixer side by
side, so every layer keeps K/V **and** a Mamba2 state (a :class:`HybridLayerSpec`);
``d_inner = mamba_d_ssm`` (else ``mamba_expand * hidden_size``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.fields import _field
from hybridkv.models.hf.bamba import MAMBA_KEYS
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, positive
from hybridkv.models.hf.mamba2 import mamba2_mixer
from hybridkv.models.spec import HybridLayerSpec, LayerSpec

MODEL_TYPES = ("falcon_h1",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Falcon-H1 config: one hybrid layer per decoder layer."""
    expand = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
    d_inner = positive(cfg, "mamba_d_ssm", where, expand)
    layer = HybridLayerSpec(_hf_attention(cfg, where, dt), mamba2_mixer(cfg, where, dt, MAMBA_KEYS, d_inner))
    return (layer,) * _num_layers(cfg, where)

"""Mamba-1 (``model_type`` ``mamba``) and Falcon-Mamba (``falcon_mamba``): every layer a Mamba
mixer, ``ssm [d_inner, state_size]`` + ``conv [d_inner, conv_kernel-1]`` with ``d_inner = expand *
hidden_size``; tensor parallelism splits the ``d_inner`` channels (vLLM's MambaMixer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _num_layers, positive
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("mamba", "falcon_mamba")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Mamba-1 config."""
    d_inner = positive(
        cfg, "intermediate_size", where, _field(cfg, "expand", where, default=2) * _field(cfg, "hidden_size", where)
    )
    rec = P.mamba1_layer(
        d_inner,
        _field(cfg, "state_size", where, default=16),
        _field(cfg, "conv_kernel", where, default=4, minimum=2),
        dt.ssm("mamba"),
        dt.conv("mamba"),
    )
    return (rec,) * _num_layers(cfg, where)

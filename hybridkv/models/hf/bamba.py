"""Bamba (``model_type`` ``bamba``): Mamba2 layers with attention at ``attn_layer_indices`` (or in
the order of ``layers_block_type``); ``d_inner = mamba_expand * hidden_size``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _list, _whole
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, pattern_from
from hybridkv.models.hf.mamba2 import mamba2_mixer
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("bamba",)
MAMBA_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Bamba config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layers_block_type", "layer_types"), "AR", n)
    if pattern is None:
        ids = {_whole(i, where, "attn_layer_indices[]", 0) for i in _list(cfg.get("attn_layer_indices") or [], where)}
        if any(i >= n for i in ids):
            raise SpecError(f"{where}: attn_layer_indices {sorted(ids)} name layers beyond num_hidden_layers {n}")
        pattern = "".join("A" if i in ids else "R" for i in range(n))
    d_inner = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
    return P.layers_from_pattern(
        pattern, _hf_attention(cfg, where, dt), mamba2_mixer(cfg, where, dt, MAMBA_KEYS, d_inner)
    )

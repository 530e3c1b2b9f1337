"""Mamba2 (``model_type`` ``mamba2``): every layer a Mamba2 mixer, no attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models import presets as P
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _num_layers, positive
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("mamba2",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Mamba2 config (``d_inner = expand * hidden_size`` when the config gives both)."""
    heads, head_dim = _field(cfg, "num_heads", where), _field(cfg, "head_dim", where)
    d_inner = None
    if cfg.get("expand") is not None and cfg.get("hidden_size") is not None:
        d_inner = int(_field(cfg, "expand", where) * _field(cfg, "hidden_size", where))
    rec = P.mamba2_layer(
        heads,
        head_dim,
        _field(cfg, "state_size", where),
        _field(cfg, "n_groups", where, default=1),
        _field(cfg, "conv_kernel", where, default=4, minimum=2),
        dt.ssm("mamba2"),
        dt.conv("mamba2"),
        d_inner,
    )
    return (rec,) * _num_layers(cfg, where)


def mamba2_mixer(
    cfg: Mapping[str, Any], where: str, dt: Dtypes, keys: tuple[str, str, str, str, str], d_inner: int
) -> Any:
    """A Mamba2 layer from the ``(heads, head_dim, groups, d_state, d_conv)`` keys of a hybrid's config
    (Bamba, Granite 4.0 H, Falcon-H1, Zamba2); ``head_dim`` absent or ``"auto"``: ``d_inner / heads``."""
    heads_key, head_dim_key, groups_key, state_key, conv_key = keys
    heads = _field(cfg, heads_key, where)
    head_dim = positive(cfg, head_dim_key, where, d_inner // heads)
    return P.mamba2_layer(
        heads,
        head_dim,
        _field(cfg, state_key, where),
        _field(cfg, groups_key, where, default=1),
        _field(cfg, conv_key, where, default=4, minimum=2),
        dt.ssm("mamba2"),
        dt.conv("mamba2"),
        d_inner,
    )

"""xLSTM (``model_type`` ``xlstm``, NX-AI xLSTM-7b): every block an mLSTM layer whose per-request
state is a matrix memory ``c [num_heads, qk_head_dim, v_head_dim]``, a normalizer ``n [num_heads,
qk_head_dim]`` and a stabilizer ``m [num_heads, 1]``, as transformers' ``xLSTMCache`` allocates them:
``qk_dim = hidden_size * qk_dim_factor`` and ``v_dim = hidden_size * v_dim_factor``, each rounded up
to a multiple of 64, divided by ``num_heads``. No attention, no conv window.

Dtype: ``xLSTMCache`` keeps the three in the activation (model) dtype; the step kernel computes in
the config's ``inference_state_dtype`` (float32) and the cache keeps its result cast back. A config
whose rounded dims differ from the layer's own ``int(hidden_size * factor)`` is refused: transformers'
cache and mLSTM layer disagree on its shapes (its forward with a cache fails)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import MAX_LAYERS, _field
from hybridkv.models.hf.common import Dtypes
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("xlstm",)


def _factor(cfg: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = cfg.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise SpecError(f"{where}: {key} must be a positive number, got {value!r}")
    return value


def _dim(hidden: int, factor: float, key: str, where: str) -> int:
    layer = int(hidden * factor)  # the mLSTM layer's projection width
    cache = int(((hidden * factor + 63) // 64) * 64)  # xLSTMCache's width: rounded up to a multiple of 64
    if cache != layer:
        raise SpecError(
            f"{where}: hidden_size {hidden} x {key} {factor} = {hidden * factor:g} is not a multiple of 64: "
            f"transformers' xLSTMCache keeps {cache} wide states, its mLSTM layer computes {layer}"
        )
    return cache


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of an xLSTM config (``hidden_size`` or ``embedding_dim``, ``num_hidden_layers`` or
    ``num_blocks``)."""
    hidden = _field(cfg, "hidden_size" if cfg.get("hidden_size") is not None else "embedding_dim", where)
    n = _field(cfg, "num_hidden_layers" if cfg.get("num_hidden_layers") is not None else "num_blocks", where)
    if n > MAX_LAYERS:
        raise SpecError(f"{where}: {n:,} blocks is above {MAX_LAYERS:,}: not a model this planner expands")
    heads = _field(cfg, "num_heads", where)
    qk = _dim(hidden, _factor(cfg, "qk_dim_factor", 0.5, where), "qk_dim_factor", where)
    v = _dim(hidden, _factor(cfg, "v_dim_factor", 1.0, where), "v_dim_factor", where)
    if qk % heads or v % heads:
        raise SpecError(f"{where}: qk_dim {qk} and v_dim {v} must be multiples of num_heads {heads}")
    if dt.state_override is not None:
        dtype, why = dt.state_override, "--state-dtype"
    else:
        kernel = cfg.get("inference_state_dtype") or "float32"
        dtype = dt.model
        why = (
            f"{dt.model_source}: transformers' xLSTMCache keeps the mLSTM state in it (the step kernel "
            f"computes in inference_state_dtype {kernel} and the cache keeps the result cast back)"
        )
    for c in ("c", "n", "m"):
        dt.fixed("mlstm", c, dtype, why)
    return (P.mlstm_layer(heads, qk // heads, v // heads, dtype),) * n

"""Dory (``model_type`` ``dory``): a looped transformer of full and sliding-window attention layers,
``layer_types`` (``full_attention`` / ``sliding_attention``; the written config.json lists each layer
as an attention block and an ``mlp`` block, with every layer count doubled, which transformers halves
on load, as this reader does).

The ``n_recurrent_layers`` layers after the first ``n_input_layers`` run ``n_recurrent_loops`` times.
With ``recurrent_kv_cache_mode = "per_loop"`` (the default) every loop after the first writes K/V of
its own: transformers appends ``n_recurrent_loops - 1`` copies of those layers' caches after the
model's layers, and so does this reader (the copies' ``decoder_layer_ids`` name the layer they
re-run). ``"last_loop"``: one cache per layer, written by the last loop. A sliding layer keeps the
K/V of its last ``sliding_window - 1`` tokens, a fixed-size state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field, _list
from hybridkv.models.hf.common import Dtypes, ReadOut, _hf_attention, expand, layer_codes, window_layer, window_of
from hybridkv.models.spec import LayerSpec

MODEL_TYPES = ("dory",)
_MODES = ("per_loop", "last_loop")


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...] | ReadOut:
    """The cache layers of a Dory config: its decoder layers, then the per-loop copies."""
    if cfg.get("layer_types") is None:
        raise SpecError(f"{where}: needs 'layer_types' (which layers are sliding-window attention)")
    types = _list(cfg["layer_types"], f"{where}: layer_types")
    halve = "mlp" in types  # attention and mlp listed as separate blocks, counts doubled
    if halve:
        types = types[::2]

    def count(key: str, default: Any = None) -> int:
        value = _field(cfg, key, where, default=default, minimum=0)
        if halve and value % 2:
            raise SpecError(f"{where}: {key} {value} is odd, but layer_types lists attention and mlp blocks")
        return value // 2 if halve else value

    n = count("num_hidden_layers")
    if len(types) != n:
        raise SpecError(f"{where}: layer_types names {len(types)} attention layers, num_hidden_layers is {n}")
    pattern = layer_codes(types, "layer_types", where, "AW")
    first, last = count("n_input_layers", 16 if halve else 8), count("n_output_layers", 16 if halve else 8)
    loop = n - first - last if cfg.get("n_recurrent_layers") is None else count("n_recurrent_layers")
    if loop < 0 or first + loop + last != n:
        raise SpecError(f"{where}: n_input_layers + n_recurrent_layers + n_output_layers must equal {n}")
    loops = _field(cfg, "n_recurrent_loops", where, default=2)
    mode = cfg.get("recurrent_kv_cache_mode") or "per_loop"
    if mode not in _MODES:
        raise SpecError(f"{where}: recurrent_kv_cache_mode must be one of {list(_MODES)}, got {mode!r}")
    attn = _hf_attention(cfg, where, dt)
    specs: dict[str, LayerSpec] = {"A": attn}
    if "W" in pattern:
        specs["W"] = window_layer(attn, window_of(cfg, where, dt), where)
    layers = expand(pattern, specs, where)
    if mode == "last_loop" or loops == 1 or loop == 0:
        return layers
    copies = list(range(first, first + loop)) * (loops - 1)
    return ReadOut((*layers, *(layers[i] for i in copies)), (*range(n), *copies))

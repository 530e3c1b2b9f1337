"""RecurrentGemma / Griffin (``model_type`` ``recurrent_gemma``): recurrent blocks and local
(sliding-window) attention blocks, ``block_types`` (``recurrent`` / ``attention``) repeated over
``num_hidden_layers``.

A recurrent block keeps its state on the module, not in the cache object: the RG-LRU state
``lru [lru_width]`` in float32 ("always computed in full precision") and the temporal conv window
``conv [lru_width, conv1d_width - 1]`` in the model dtype (transformers keeps ``conv1d_width - 1``
columns, as hybridkv does). An attention block keeps the K/V of its last ``attention_window_size - 1``
tokens (``DynamicSlidingWindowLayer``), described as a fixed-size state; ``head_dim = hidden_size /
num_attention_heads``, ``num_key_value_heads`` defaulting to ``num_attention_heads``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field, _list
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, expand, positive, window_layer, window_of
from hybridkv.models.spec import LayerSpec, RecurrentLayerSpec, StateComponent

MODEL_TYPES = ("recurrent_gemma",)
_CODES = {"recurrent": "R", "attention": "W"}


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a RecurrentGemma config."""
    n = _num_layers(cfg, where)
    kinds = _list(cfg.get("block_types", ["recurrent", "recurrent", "attention"]), f"{where}: block_types")
    if not kinds or any(k not in _CODES for k in kinds):
        raise SpecError(f"{where}: block_types entries must be 'recurrent' or 'attention', got {kinds}")
    pattern = "".join(_CODES[kinds[i % len(kinds)]] for i in range(n))
    lru = positive(cfg, "lru_width", where, _field(cfg, "hidden_size", where))
    width = _field(cfg, "conv1d_width", where, default=4, minimum=2)
    rec = RecurrentLayerSpec(
        "rglru",
        (
            StateComponent("lru", (lru,), dt.ssm("rglru", "lru")),
            StateComponent("conv", (lru, width - 1), dt.conv("rglru")),
        ),
    )
    attn = _hf_attention({**cfg, "head_dim": None}, where, dt)
    window = window_layer(attn, window_of(cfg, where, dt, "attention_window_size"), where)
    return expand(pattern, {"R": rec, "W": window}, where)

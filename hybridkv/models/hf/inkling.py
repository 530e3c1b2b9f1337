"""Inkling 1 and 2 (``model_type`` ``inkling_text``, ``inkling2_text``, ``inkling2_loop_text``; the
multimodal ``inkling_mm_model``, ``inkling2``, ``inkling2_loop`` through their ``text_config``): every
layer is ``hybrid`` (full attention) or ``hybrid_sliding`` (sliding-window attention with its own head
shape, ``swa_num_key_value_heads x swa_head_dim``), in the order of ``layer_types`` (else
``local_layer_ids``, else every layer but each sixth sliding).

Besides K/V every layer keeps four short-convolution windows, which transformers computes and keeps
in float32 whatever the model dtype: ``conv_k`` and ``conv_v`` over the layer's K and V channels
(``kv_heads x head_dim``), ``conv_attn`` and ``conv_mlp`` over ``hidden_size``, each ``conv_kernel_size
- 1`` columns (transformers keeps ``conv_kernel_size``). A ``hybrid`` layer keeps all of K/V
(:class:`HybridLayerSpec`); a ``hybrid_sliding`` layer the K/V of its last ``sliding_window_size - 1``
tokens, so its whole cache is a fixed-size state. (Inkling 2's full layers compute ``conv_k`` / ``conv_v``
with per-token taps; the window they keep is the same.) The checkpoints' MTP layers are not built by
transformers (their weights are ignored on load) and keep nothing.

Inkling 2 Loop re-runs layers ``loop_layer_index_start`` to ``loop_layer_index_end - 1``
``loop_num_passes`` times (the hub's ``loop_config`` ``core_start`` / ``core_end`` / ``num_passes``); every
pass after the first keeps caches of its own, which transformers appends after the model's layers, as
this reader does (their ``decoder_layer_ids`` name the layer they re-run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field, _list, _whole
from hybridkv.models.hf.common import (
    Dtypes,
    ReadOut,
    _hf_attention,
    _num_layers,
    expand,
    layer_codes,
    pattern_from,
    window_of,
    with_window,
)
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    HybridLayerSpec,
    LayerSpec,
    RecurrentLayerSpec,
    StateComponent,
)

MODEL_TYPES = ("inkling_text", "inkling2_text", "inkling2_loop_text")
_WHY = "transformers computes Inkling's short convolutions in float32 and keeps their windows so"


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...] | ReadOut:
    """The cache layers of an Inkling text config (with a loop's per-pass copies after them)."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "HS", n)
    if pattern is None:
        local = cfg.get("local_layer_ids")
        ids = {_whole(i, where, "local_layer_ids[]", 0) for i in _list(local, where)} if local is not None else None
        types = ["hybrid_sliding" if (i in ids if ids is not None else (i + 1) % 6) else "hybrid" for i in range(n)]
        pattern = layer_codes(types, "layer_types", where, "HS")
    hidden = _field(cfg, "hidden_size", where)
    kernel = _field(cfg, "conv_kernel_size", where, default=cfg.get("sconv_kernel_size") or 4, minimum=2)
    conv = dt.conv_override or DType.FLOAT32
    why = "--conv-dtype" if dt.conv_override else _WHY
    for name in ("conv_k", "conv_v", "conv_attn", "conv_mlp"):
        dt.fixed("sconv", name, conv, why)

    def sconv(kv_channels: int) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(
            "sconv",
            tuple(
                StateComponent(name, (width, kernel - 1), conv)
                for name, width in (
                    ("conv_k", kv_channels),
                    ("conv_v", kv_channels),
                    ("conv_attn", hidden),
                    ("conv_mlp", hidden),
                )
            ),
        )

    full = _hf_attention(cfg, where, dt)
    specs: dict[str, LayerSpec] = {"H": HybridLayerSpec(full, sconv(full.num_kv_heads * full.head_dim))}
    if "S" in pattern:
        kv = _field(cfg, "swa_num_key_value_heads", where, default=full.num_kv_heads)
        hd = _field(cfg, "swa_head_dim", where, default=full.head_dim)
        swa = AttentionLayerSpec(kv, hd, full.dtype)
        key = "sliding_window_size" if cfg.get("sliding_window_size") is not None else "sliding_window"
        specs["S"] = with_window(sconv(kv * hd), swa, window_of(cfg, where, dt, key), where)
    layers = expand(pattern, specs, where)
    loop = cfg.get("loop_config") if isinstance(cfg.get("loop_config"), Mapping) else {}
    passes = cfg.get("loop_num_passes", loop.get("num_passes"))
    if passes is None:
        return layers
    start = _whole(cfg.get("loop_layer_index_start", loop.get("core_start")), where, "loop_layer_index_start", 1)
    end = _whole(cfg.get("loop_layer_index_end", loop.get("core_end")), where, "loop_layer_index_end", start)
    passes = _whole(passes, where, "loop_num_passes")
    if end > n:
        raise SpecError(f"{where}: loop_layer_index_end {end} is past num_hidden_layers {n}")
    copies = list(range(start, end)) * (passes - 1)
    return ReadOut((*layers, *(layers[i] for i in copies)), (*range(n), *copies)) if copies else layers

"""Qwen4-exp (``qwen4_exp_text``; ``qwen4_exp`` through its ``text_config``): Gated DeltaNet layers
(``linear_attention``) and QSA-indexed attention layers (``indexed_attention``; ``full_attention``
is read as it, as transformers does), in the order of ``layer_types``, else every
``full_attention_interval``-th (4) layer indexed.

What transformers 5.24 keeps (``LinearAttentionLayer`` / ``DynamicIndexedLayer``):

- GDN, as Qwen3.5: conv ``[2 Hk dk + Hv dv, K]`` in the model dtype, recurrent ``[Hv, dk, dv]``
  float32; a GDN layer named in ``ple_layer_ids`` (one-based) also keeps its per-layer-embedding
  state: ``ple_window [hc_count x hidden, (ple_conv_kernel_size - 1) x ngram_size]`` in the model
  dtype (the dilated convolution's inputs: exactly the columns a step reads, so not widened by
  :func:`~hybridkv.models.spec.with_conv_columns`) and ``ngram_ids [ngram_size - 1]`` int64 (the
  last token ids the n-gram hash reads);
- indexed attention: K/V ``[num_key_value_heads, head_dim]`` per token, and per token the QSA
  indexer key ``[indexer_head_dim]`` (one head, activation dtype; side tensor ``indexer_keys``); the
  first indexed layer also keeps every token's 3-D rotary positions ``[3]`` int64 (side tensor
  ``positions``: transformers stores the positions all indexers share there).

Tensor parallelism: GDN heads split; K/V by KV heads; the indexer keys and positions (one head) and
the PLE state (transformers' TP plan gathers the PLE outputs) are replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _list, _whole
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, pattern_from
from hybridkv.models.spec import DType, LayerSpec, RecurrentLayerSpec, SideTensor, StateComponent

MODEL_TYPES = ("qwen4_exp_text",)


def _ple_layer(gdn: RecurrentLayerSpec, cfg: Mapping[str, Any], where: str, dt: Dtypes) -> RecurrentLayerSpec:
    hidden = _field(cfg, "hidden_size", where)
    streams = _field(cfg, "hc_count", where, default=4, minimum=2)
    kernel = _field(cfg, "ple_conv_kernel_size", where, default=4, minimum=2)
    ngram = _field(cfg, "ngram_size", where, default=3, minimum=2)
    ids = dt.fixed("ple", "ngram_ids", DType.INT64, "token ids, int64 as transformers keeps them")
    return RecurrentLayerSpec(
        "gdn+ple",
        (
            *gdn.components,
            StateComponent("ple_window", (streams * hidden, (kernel - 1) * ngram), dt.conv("ple"), None),
            StateComponent("ngram_ids", (ngram - 1,), ids, None),
        ),
    )


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a Qwen4-exp text config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "ARI", n)
    if pattern is None:
        k = _field(cfg, "full_attention_interval", where, default=4)
        pattern = "".join("I" if (i + 1) % k == 0 else "R" for i in range(n))
    pattern = pattern.replace("A", "I")  # transformers reads full_attention as indexed_attention
    gdn = P.gdn_layer(
        _field(cfg, "linear_num_key_heads", where, default=16),
        _field(cfg, "linear_num_value_heads", where, default=32),
        _field(cfg, "linear_key_head_dim", where, default=128),
        _field(cfg, "linear_value_head_dim", where, default=128),
        _field(cfg, "linear_conv_kernel_dim", where, default=4, minimum=2),
        dt.ssm("gdn"),
        dt.conv("gdn"),
    )
    raw = cfg.get("ple_layer_ids") or []
    ple = {_whole(i, where, "ple_layer_ids[]") - 1 for i in _list(raw, f"{where}: ple_layer_ids")}
    if any(not 0 <= i < n or pattern[i] != "R" for i in ple):
        raise SpecError(f"{where}: ple_layer_ids (one-based) must name linear_attention layers of the {n}")
    with_ple = _ple_layer(gdn, cfg, where, dt) if ple else gdn
    layers: list[LayerSpec] = [with_ple if i in ple else gdn for i in range(n)]
    if "I" in pattern:
        if cfg.get("indexer_head_dim") is None:
            raise SpecError(
                f"{where}: needs 'indexer_head_dim' (transformers builds a QSA indexer on each indexed layer)"
            )
        if _field(cfg, "indexer_kv_heads", where, default=1) != 1:
            raise SpecError(f"{where}: indexer_kv_heads must be 1 (transformers' Qwen4-exp QSA keeps one key head)")
        attn = _hf_attention(cfg, where, dt)
        dt.fixed("indexer", "indexer_keys", dt.model, f"{dt.model_source}; the activation dtype (transformers)")
        dt.fixed("indexer", "positions", DType.INT64, "rotary positions, int64 as transformers keeps them")
        keys = SideTensor("indexer_keys", _field(cfg, "indexer_head_dim", where), dt.model)
        first = pattern.index("I")
        for i, c in enumerate(pattern):
            if c == "I":
                side = (keys, SideTensor("positions", 3, DType.INT64)) if i == first else (keys,)
                layers[i] = replace(attn, side=side)
    return tuple(layers)

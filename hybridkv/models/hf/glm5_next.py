"""GLM-5 Next (``glm5_next_text``; ``glm5_next`` through its ``text_config``, or flat: transformers
reads a ``glm5_next`` config without ``text_config`` as its text config): Kimi Delta
Attention layers (``linear_attention``) and DeepSeek-sparse MLA layers (``indexed_attention``;
``full_attention`` is read as it, as transformers does), in the order of ``layer_types``, else
every 4th layer from layer 3 indexed.

What transformers 5.24 keeps (``DynamicIndexedLayer`` / ``LinearAttentionLayer``):

- KDA: conv ``[3 H d, K]`` in the model dtype and recurrent ``[H, d, d]`` float32 (``H`` =
  ``linear_num_heads``, ``d`` = ``linear_head_dim``, ``K`` = ``linear_conv_kernel_dim``);
- MLA: per token the latent, "keys" ``[1, kv_lora_rank]``, and "values" ``[1, qk_rope_head_dim]``,
  which is 0 wide (the config refuses rotary dims: NoPE), so V is empty;
- the DSA indexer of a ``full`` layer (``indexer_types``; ``shared`` layers reuse the previous full
  layer's selection and keep nothing more): per token one packed vector ``[2 index_head_dim + 1]``
  (indexer key, pool gate scores, a valid flag) in the activation dtype: a
  :class:`~hybridkv.models.spec.SideTensor` ``indexer`` of the layer.

Tensor parallelism: MLA's latent and the indexer are one head, replicated on every rank (vLLM's MLA
and DSA indexer caches); KDA heads split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _field, _list, _table
from hybridkv.models.hf.common import Dtypes, _hf_types, _num_layers, pattern_from
from hybridkv.models.spec import AttentionLayerSpec, LayerSpec, SideTensor

MODEL_TYPES = ("glm5_next_text",)


def _indexer_types(cfg: Mapping[str, Any], n: int, where: str) -> list[str]:
    """``full`` / ``shared`` per layer: ``indexer_types``, else the hub's ``index_topk_pattern``
    (``F`` / ``S``), else ``index_topk_freq`` / ``index_skip_topk_offset`` (transformers' rule)."""
    if cfg.get("indexer_types") is not None:
        types = [str(t) for t in _hf_types(cfg, "indexer_types", n, where)]
    elif cfg.get("index_topk_pattern") is not None:
        raw = cfg["index_topk_pattern"]
        chars = list(raw) if isinstance(raw, str) else _list(raw, f"{where}: index_topk_pattern")
        codes = {"F": "full", "S": "shared", "full": "full", "shared": "shared"}
        if any(c not in codes for c in chars) or len(chars) != n:
            raise SpecError(f"{where}: index_topk_pattern must give F or S for each of the {n} layers")
        types = [codes[c] for c in chars]
    else:
        freq = max(_field(cfg, "index_topk_freq", where, default=1), 1)
        offset = cfg.get("index_skip_topk_offset", 2)
        offset = offset if isinstance(offset, int) and not isinstance(offset, bool) else 2
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    bad = sorted({t for t in types if t not in ("full", "shared")})
    if bad:
        raise SpecError(f"{where}: indexer_types names {bad}: transformers knows 'full' and 'shared'")
    return types


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a GLM-5 Next text config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "ARI", n)
    if pattern is None:
        pattern = "".join("R" if i % 4 != 3 else "I" for i in range(n))
    pattern = pattern.replace("A", "I")  # transformers reads full_attention as indexed_attention
    rope = _field(cfg, "qk_rope_head_dim", where, default=0, minimum=0)
    if rope:
        raise SpecError(f"{where}: qk_rope_head_dim is {rope}; GLM-5 Next's DSA layers are NoPE (transformers: 0)")
    heads = _field(cfg, "num_attention_heads", where, default=64)  # transformers' class defaults when absent
    mla = AttentionLayerSpec(1, _field(cfg, "kv_lora_rank", where, default=512), dt.kv(), heads, v_head_dim=0)
    dt.fixed("indexer", "indexer", dt.model, f"{dt.model_source}; the activation dtype, as transformers keeps it")
    packed = SideTensor("indexer", 2 * _field(cfg, "index_head_dim", where, default=128) + 1, dt.model)
    full = AttentionLayerSpec(1, mla.head_dim, mla.dtype, heads, v_head_dim=0, side=(packed,))
    # the hub's linear_attn_config names the KDA fields as Kimi Linear's does; transformers copies them
    lac = _table(cfg.get("linear_attn_config") or {}, f"{where}: linear_attn_config")

    def kda_field(hub: str, key: str, default: int, minimum: int = 1) -> int:
        if lac.get(hub) is not None:
            return _field(lac, hub, f"{where}: linear_attn_config", minimum=minimum)
        return _field(cfg, key, where, default=default, minimum=minimum)

    kda = P.kda_layer(
        kda_field("num_heads", "linear_num_heads", 64),
        kda_field("head_dim", "linear_head_dim", 128),
        kda_field("short_conv_kernel_size", "linear_conv_kernel_dim", 4, 2),
        dt.ssm("kda"),
        dt.conv("kda"),
    )
    indexers = _indexer_types(cfg, n, where)
    first = pattern.find("I")
    if first >= 0 and indexers[first] != "full":
        raise SpecError(f"{where}: indexer_types[{first}] is 'shared' but no earlier indexed layer runs the indexer")
    return tuple(kda if c == "R" else full if indexers[i] == "full" else mla for i, c in enumerate(pattern))

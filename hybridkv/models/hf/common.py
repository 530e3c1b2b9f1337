"""Shared readers of HuggingFace ``config.json`` fields: dtypes and where they came from, attention,
layer counts, per-layer types in every vocabulary transformers and the hub use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import MAX_LAYERS, _dtype, _field, _list, _whole
from hybridkv.models.spec import AttentionLayerSpec, DType, LayerSpec, RecurrentLayerSpec, StateComponent

HF_SSM = "transformers keeps SSM / delta-net states in float32 whatever the model dtype"


class Dtypes:
    """The dtype of each cache component of one config, and a line saying where each came from.

    ``model``: the config's ``dtype`` / ``torch_dtype`` (bfloat16, said so, when it gives none).
    ``state`` / ``conv``: the caller's overrides (``--state-dtype``, ``--conv-dtype``).
    """

    def __init__(self, cfg: Mapping[str, Any], where: str, state: DType | None = None, conv: DType | None = None):
        key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
        raw = cfg.get(key)
        if raw is None:
            self.model, self.model_source = DType.BFLOAT16, "bfloat16 assumed (the config names no dtype)"
        else:
            self.model = _dtype(raw, f"{where}: {key}")
            self.model_source = f"the model dtype (config {key} {self.model.value})"
        self.cfg, self.where, self.state_override, self.conv_override = cfg, where, state, conv
        self.sources: dict[str, str] = {}

    def _note(self, key: str, dtype: DType, why: str) -> DType:
        self.sources.setdefault(key, f"{dtype.value}: {why}")
        return dtype

    def kv(self) -> DType:
        return self._note("kv", self.model, self.model_source)

    def conv(self, mixer: str) -> DType:
        if self.conv_override is not None:
            return self._note(f"{mixer}.conv", self.conv_override, "--conv-dtype")
        return self._note(f"{mixer}.conv", self.model, self.model_source)

    def ssm(self, mixer: str, component: str = "ssm") -> DType:
        """SSM / delta-net state: the override, else the config's cache dtype key, else float32 (HF)."""
        if self.state_override is not None:
            return self._note(f"{mixer}.{component}", self.state_override, "--state-dtype")
        for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
            if self.cfg.get(key) not in (None, "auto"):
                return self._note(
                    f"{mixer}.{component}", _dtype(self.cfg[key], f"{self.where}: {key}"), f"config {key}"
                )
        return self._note(f"{mixer}.{component}", DType.FLOAT32, HF_SSM)

    def activation(self, mixer: str, component: str) -> DType:
        """A state transformers keeps in the activation dtype (MiniMax's lightning ``kv``)."""
        if self.state_override is not None:
            return self._note(f"{mixer}.{component}", self.state_override, "--state-dtype")
        return self._note(f"{mixer}.{component}", self.model, "the activation dtype, as transformers keeps it")

    def fixed(self, mixer: str, component: str, dtype: DType, why: str) -> DType:
        return self._note(f"{mixer}.{component}", dtype, why)


def _hf_attention(
    cfg: Mapping[str, Any], where: str, dt: Dtypes, head_dim_keys: tuple[str, ...] = ("head_dim", "attention_head_dim")
) -> AttentionLayerSpec:
    heads = _field(cfg, "num_attention_heads", where)
    hd = next((cfg[k] for k in head_dim_keys if cfg.get(k) is not None), None)
    if hd is None:
        hidden = _field(cfg, "hidden_size", where)
        if hidden % heads:
            raise SpecError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        hd = hidden // heads
    kv = _field(cfg, "num_key_value_heads", where, default=heads)
    return AttentionLayerSpec(kv, _whole(hd, where, "head_dim"), dt.kv(), heads)


def _num_layers(cfg: Mapping[str, Any], where: str) -> int:
    n = _field(cfg, "num_hidden_layers", where)
    if n > MAX_LAYERS:
        raise SpecError(f"{where}: num_hidden_layers {n:,} is above {MAX_LAYERS:,}: not a model this planner expands")
    return n


def _hf_types(cfg: Mapping[str, Any], key: str, n: int | None, where: str) -> list[Any]:
    types = _list(cfg[key], f"{where}: {key}")
    if n is not None and len(types) != n:
        raise SpecError(f"{where}: {key} has {len(types)} entries, num_hidden_layers is {n}")
    if len(types) > MAX_LAYERS:
        raise SpecError(f"{where}: {key} has {len(types):,} entries: not a model this planner expands")
    return types


class ReadOut(NamedTuple):
    """What a reader returns when its cache layers are not one per decoder layer: the cache layers and
    the decoder layer each comes from (:attr:`~hybridkv.models.spec.ModelSpec.decoder_layer_ids`)."""

    layers: tuple[LayerSpec, ...]
    decoder_layer_ids: tuple[int, ...]


WINDOW = "sliding_window"
"""The mixer name of a sliding-window attention layer's K/V window (a fixed-size per-request state)."""


def window_components(attn: AttentionLayerSpec, window: int, where: str) -> tuple[StateComponent, ...]:
    """The K/V window a sliding-window layer of ``attn``'s shape keeps: ``k_window [kv_heads,
    window - 1, head_dim]`` and ``v_window [kv_heads, window - 1, v_head_dim]``, in the KV dtype.

    transformers' ``DynamicSlidingWindowLayer`` (the default cache) keeps the last ``window - 1``
    tokens between steps: a step's query reads those and itself, ``window`` in all. (Its
    ``StaticSlidingWindowLayer`` keeps ``window``: one more, overwritten every step.) Split by KV
    heads, replicated when fewer KV heads than ranks (as vLLM does for attention).
    """
    if window < 2:
        raise SpecError(f"{where}: sliding_window {window} keeps no token between steps; it must be at least 2")
    tokens = window - 1
    return (
        StateComponent("k_window", (attn.num_kv_heads, tokens, attn.head_dim), attn.dtype, 0, tp_replicate=True),
        StateComponent("v_window", (attn.num_kv_heads, tokens, attn.value_head_dim), attn.dtype, 0, tp_replicate=True),
    )


def window_layer(attn: AttentionLayerSpec, window: int, where: str) -> RecurrentLayerSpec:
    """A sliding-window attention layer as the fixed-size state its K/V window is (see
    :func:`window_components`)."""
    return RecurrentLayerSpec(WINDOW, window_components(attn, window, where))


def with_window(rec: RecurrentLayerSpec, attn: AttentionLayerSpec, window: int, where: str) -> RecurrentLayerSpec:
    """One layer keeping ``rec``'s state and a sliding-window K/V window (a ``hybrid_sliding`` layer):
    ``rec``'s components, then the window's."""
    return RecurrentLayerSpec(f"{rec.mixer}+{WINDOW}", (*rec.components, *window_components(attn, window, where)))


def window_of(cfg: Mapping[str, Any], where: str, dt: Dtypes, key: str = "sliding_window") -> int:
    """The sliding window (tokens a query sees, itself included) a config names for its window layers;
    records the window's dtype source (the KV dtype, as transformers keeps K/V)."""
    if cfg.get(key) is None:
        raise SpecError(f"{where}: its layer types name sliding-window layers, so it needs {key!r}")
    dt.fixed(WINDOW, "k_window", dt.model, f"{dt.model_source}; the last {key} - 1 tokens' K/V (transformers)")
    return _whole(cfg[key], where, key, 2)


def expand(pattern: str, specs: Mapping[str, LayerSpec], where: str) -> tuple[LayerSpec, ...]:
    """One layer spec per character of ``pattern`` (codes of :data:`LAYER_TYPE_CODES`)."""
    missing = sorted(set(pattern) - set(specs))
    if missing:
        raise SpecError(f"{where}: layer kinds {missing} have no layer spec in this family")
    return tuple(specs[c] for c in pattern)


# Per-layer type names seen in transformers 5 configs and on the hub, -> A (attention), R (recurrent),
# H (attention and state in one layer), W (sliding-window attention: a K/V window kept as a state),
# S (a state and a K/V window in one layer), I (attention with per-token indexer keys), - (no cache)
LAYER_TYPE_CODES = {
    "full_attention": "A",
    "attention": "A",
    "linear_attention": "R",
    "mamba": "R",
    "mamba2": "R",
    "conv": "R",
    "hybrid": "H",
    "sliding_attention": "W",
    "hybrid_sliding": "S",
    "indexed_attention": "I",
    "mlp": "-",
    "moe": "-",
}
NOT_DESCRIBED = {
    "chunked_attention": "chunked attention keeps a bounded window of K/V, which hybridkv does not describe",
    "indexed_attention": "indexed (DeepSeek sparse) attention keeps indexer keys beside K/V, which only the "
    "glm5_next and qwen4_exp readers describe",
}


def layer_codes(types: list[Any], key: str, where: str, allowed: str = "ARH-") -> str:
    """``types`` (strings) as a pattern of A/R/H/-; a type hybridkv does not describe is one clear error."""
    out = []
    for i, t in enumerate(types):
        if isinstance(t, str) and t in NOT_DESCRIBED and LAYER_TYPE_CODES.get(t) not in allowed:
            raise SpecError(f"{where}: {key}[{i}] is {t!r}: {NOT_DESCRIBED[t]}")
        code = LAYER_TYPE_CODES.get(t) if isinstance(t, str) else None
        if code is None or code not in allowed:
            names = sorted(k for k, v in LAYER_TYPE_CODES.items() if v in allowed)
            raise SpecError(f"{where}: {key}[{i}] is {t!r}: this family's layer types are {names}")
        out.append(code)
    return "".join(out)


def pattern_from(
    cfg: Mapping[str, Any], where: str, keys: tuple[str, ...], allowed: str = "ARH-", n: int | None = None
) -> str | None:
    """The layer pattern from the first of ``keys`` the config has (a list of type names), or None."""
    for key in keys:
        if cfg.get(key) is not None:
            return layer_codes(_hf_types(cfg, key, n, where), key, where, allowed)
    return None


def positive(cfg: Mapping[str, Any], key: str, where: str, default: Any = None, minimum: int = 1) -> int:
    """An integer field, ``default`` when absent or null (``"auto"`` also means the default)."""
    value = cfg.get(key)
    if value is None or value == "auto":
        if default is None:
            raise SpecError(f"{where}: needs {key!r}")
        return default
    return _whole(value, where, key, minimum)


def mamba1_of(cfg: Mapping[str, Any], where: str, dt: Any, d_inner: int, **kwargs: Any) -> Any:
    """The Mamba-1 layer of a hybrid config that names its mixer's fields ``mamba_d_state`` and
    ``mamba_d_conv`` (Jamba, Zamba): ``d_inner`` channels, the state and conv dtypes of ``dt``
    (a :class:`Dtypes`); ``kwargs`` go to :func:`~hybridkv.models.presets.mamba1_layer`."""
    return P.mamba1_layer(
        d_inner,
        _field(cfg, "mamba_d_state", where, default=16),
        _field(cfg, "mamba_d_conv", where, default=4, minimum=2),
        dt.ssm("mamba"),
        dt.conv("mamba"),
        **kwargs,
    )

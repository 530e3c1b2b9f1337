"""Frozen specs of hybrid models: which layers hold KV, which hold recurrent state, of what shape.

A :class:`ModelSpec` is the ordered list of a model's layers. Each layer is one of

- :class:`AttentionLayerSpec`: softmax attention with a paged KV cache (K and V per token);
- :class:`RecurrentLayerSpec`: a fixed-size per-request state made of named
  :class:`StateComponent` tensors (lightning ``kv``, Mamba2 ``ssm`` + ``conv``, RWKV ``wkv`` +
  token shifts, ...);
- :class:`HybridLayerSpec`: one decoder layer that keeps both (Falcon-H1: every layer has attention
  and a Mamba2 mixer side by side; Zamba2's hybrid layers: the shared transformer block's K/V, kept
  per layer that calls it, plus the layer's own Mamba2 state);
- :class:`NoCacheLayerSpec`: a layer that holds nothing per request (an MLP layer of Nemotron-H).

Shapes are per request and per layer at tensor-parallel size 1; :meth:`ModelSpec.shard` divides
heads and channels by ``tp_size`` (the rules vLLM applies, named in the sharded spec's ``notes``)
and raises :class:`TensorParallelError` when they do not divide.

Conv windows: a component whose name starts with ``conv`` is a causal-conv window
``[channels, columns]``. hybridkv keeps ``kernel_size - 1`` columns: the next step's convolution
reads those plus the new token, so that is all a decode needs (a transformers forward fed
``kernel_size - 1`` columns gives the same logits). transformers keeps ``kernel_size`` columns (one
more, overwritten every step); :func:`with_conv_columns` gives a spec with the width an engine
keeps, so that transfers to and from such an engine can be described byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridkv.errors import SpecError, TensorParallelError
from hybridkv.models.components import (  # noqa: F401  (re-exported: their import path stays hybridkv.models.spec)
    SideTensor,
    StateComponent,
    _check_positive,
    _divide,
    groups_per_rank,
)
from hybridkv.models.dtypes import STATE_SCALES, DType  # noqa: F401  (re-exported)


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """Softmax attention with a paged KV cache: K of ``num_kv_heads x head_dim`` and V of
    ``num_kv_heads x v_head_dim`` per token (``v_head_dim`` None: as K). Multi-head latent attention
    (Kimi Linear, DeepSeek) as transformers and vLLM cache it: one "head" whose K is the compressed
    latent (``kv_lora_rank``, e.g. 512) and whose V is the rotary key (``qk_rope_head_dim``, 64),
    replicated on every tensor-parallel rank.

    ``v_head_dim`` 0: the layer keeps no V (GLM-5 Next's MLA has no rotary part, ``qk_rope_head_dim``
    0: transformers caches a 0-wide "value"), K only.

    ``kv_scale_dtype``: with a quantized ``dtype``, the dtype of a per-token, per-head scale kept
    for K and for V beside the cache (FastDeploy's ``block_wise_fp8``: float32 tensors
    ``[num_blocks, kv_heads, block_size]``); None when scales are per layer (``cache_int8``,
    ``cache_fp8``) or the cache is not quantized.

    ``side``: per-token tensors kept beside K and V (:class:`SideTensor`: DeepSeek-sparse indexer
    keys), counted in :attr:`kv_bytes_per_token` and paged with the layer's K/V.
    """

    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    num_q_heads: int | None = None
    kv_scale_dtype: DType | None = None
    v_head_dim: int | None = None
    side: tuple[SideTensor, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype, quantized=True))
        if self.dtype is DType.INT64:
            raise SpecError("attention K/V cannot be int64 (an integer dtype is for cached ids and positions)")
        _check_positive("attention num_kv_heads/head_dim", (self.num_kv_heads, self.head_dim))
        object.__setattr__(self, "side", tuple(self.side))
        if not all(isinstance(t, SideTensor) for t in self.side):
            raise SpecError("attention side tensors must be SideTensor entries")
        names = [t.name for t in self.side]
        if len(set(names)) != len(names):
            raise SpecError(f"attention side tensors have duplicate names {names}")
        if self.v_head_dim is not None:
            if not isinstance(self.v_head_dim, int) or isinstance(self.v_head_dim, bool) or self.v_head_dim < 0:
                raise SpecError(f"attention v_head_dim must be a non-negative integer, got {self.v_head_dim!r}")
            if self.v_head_dim == self.head_dim:
                object.__setattr__(self, "v_head_dim", None)  # one spelling for equal widths
        if self.num_q_heads is not None:
            _check_positive("attention num_q_heads", (self.num_q_heads,))
        if self.kv_scale_dtype is not None:
            object.__setattr__(self, "kv_scale_dtype", DType.parse(self.kv_scale_dtype))
            if self.dtype.itemsize != 1:
                raise SpecError(f"KV scales go with a quantized (1-byte) KV dtype, not {self.dtype.value}")

    kind = "attention"

    @property
    def value_head_dim(self) -> int:
        """Width of one V head (``head_dim`` unless the layer says otherwise)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K plus V bytes of one token in this layer (their scales and the side tensors included)."""
        widths = self.head_dim + self.value_head_dim
        return self.num_kv_heads * widths * self.dtype.itemsize + self.scale_bytes_per_token + self.side_bytes_per_token

    @property
    def side_bytes_per_token(self) -> int:
        """Bytes of the side tensors of one token (0 without side tensors)."""
        return sum(t.bytes_per_token for t in self.side)

    @property
    def scale_bytes_per_token(self) -> int:
        """K plus V scale bytes of one token (0 without per-token scales)."""
        return 2 * self.num_kv_heads * self.kv_scale_dtype.itemsize if self.kv_scale_dtype is not None else 0

    def shard(self, tp_size: int, layer: str) -> AttentionLayerSpec:
        if tp_size == 1:
            return self
        q_heads = self.num_q_heads
        if q_heads is not None:
            q_heads = _divide(f"{layer} attention query heads", q_heads, tp_size)
        if self.num_kv_heads >= tp_size:
            kv_heads = _divide(f"{layer} attention kv heads", self.num_kv_heads, tp_size)
        elif tp_size % self.num_kv_heads == 0:
            kv_heads = 1  # fewer KV heads than ranks: each rank keeps one replicated head
        else:
            raise TensorParallelError(
                f"tp_size={tp_size} and {layer} kv heads={self.num_kv_heads}: one must divide the "
                f"other (KV heads are split or replicated across ranks)"
            )
        return replace(self, num_kv_heads=kv_heads, num_q_heads=q_heads)


@dataclass(frozen=True, slots=True)
class RecurrentLayerSpec:
    """A layer whose per-request cache is a fixed-size state, overwritten every step.

    ``mixer`` names the recurrence (``lightning``, ``mamba``, ``mamba2``, ``gdn``, ``rwkv``,
    ``gla``, ``retention``); ``components`` are laid out one after another in the state's flat bytes,
    in this order (see :meth:`component_offsets`).
    """

    mixer: str
    components: tuple[StateComponent, ...]

    kind = "recurrent"

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", tuple(self.components))
        if not self.components:
            raise SpecError(f"recurrent layer {self.mixer!r} needs at least one state component")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise SpecError(f"recurrent layer {self.mixer!r} has duplicate component names {names}")

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in this layer (components back to back, no padding)."""
        return sum(c.nbytes for c in self.components)

    def component_offsets(self) -> dict[str, int]:
        """Byte offset of each component inside the layer's flat state bytes."""
        offsets, pos = {}, 0
        for c in self.components:
            offsets[c.name] = pos
            pos += c.nbytes
        return offsets

    def component(self, name: str) -> StateComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise SpecError(f"recurrent layer {self.mixer!r} has no component {name!r}")

    def shard(self, tp_size: int, layer: str) -> RecurrentLayerSpec:
        if tp_size == 1:
            return self
        return replace(self, components=tuple(c.shard(tp_size, layer) for c in self.components))


@dataclass(frozen=True, slots=True)
class HybridLayerSpec:
    """One decoder layer that keeps attention K/V **and** a recurrent state (Falcon-H1's parallel
    attention + Mamba2 layers, Zamba2's hybrid layers). The planner lays it out as two cache layers:
    its attention joins the KV group, its state a state group (:meth:`ModelSpec.cache_view`)."""

    attention: AttentionLayerSpec
    recurrent: RecurrentLayerSpec

    kind = "hybrid"

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionLayerSpec) or not isinstance(self.recurrent, RecurrentLayerSpec):
            raise SpecError("a hybrid layer needs an attention layer spec and a recurrent layer spec")

    @property
    def mixer(self) -> str:
        return self.recurrent.mixer

    @property
    def components(self) -> tuple[StateComponent, ...]:
        return self.recurrent.components

    @property
    def kv_bytes_per_token(self) -> int:
        return self.attention.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        return self.recurrent.state_bytes

    def shard(self, tp_size: int, layer: str) -> HybridLayerSpec:
        if tp_size == 1:
            return self
        return HybridLayerSpec(self.attention.shard(tp_size, layer), self.recurrent.shard(tp_size, layer))


@dataclass(frozen=True, slots=True)
class NoCacheLayerSpec:
    """A layer that keeps nothing per request (MLP, MoE); kept so layer ids stay faithful."""

    kind = "none"

    def shard(self, tp_size: int, layer: str) -> NoCacheLayerSpec:
        return self


LayerSpec = AttentionLayerSpec | RecurrentLayerSpec | HybridLayerSpec | NoCacheLayerSpec
_LAYER_TYPES = (AttentionLayerSpec, RecurrentLayerSpec, HybridLayerSpec, NoCacheLayerSpec)


def _attention_of(layer: LayerSpec) -> AttentionLayerSpec | None:
    if isinstance(layer, HybridLayerSpec):
        return layer.attention
    return layer if isinstance(layer, AttentionLayerSpec) else None


def _recurrent_of(layer: LayerSpec) -> RecurrentLayerSpec | None:
    if isinstance(layer, HybridLayerSpec):
        return layer.recurrent
    return layer if isinstance(layer, RecurrentLayerSpec) else None


MAX_CACHE_BYTES = 2**60
"""Largest state per request or KV per token a spec may describe (1 EiB): beyond it a config's
dimension is out of range, refused before any planning."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as the ordered list of its layers, at one tensor-parallel size.

    ``tp_size`` records how the shapes were divided (1 = as published). ``vocab_*`` and FLOP
    fields are optional facts the cost model uses; the memory planner ignores them.

    ``dtype_sources``: ``(key, where the dtype came from)`` pairs, ``key`` ``"kv"`` or
    ``"<mixer>.<component>"`` (e.g. ``("gdn.ssm", "float32: transformers keeps ...")``).
    ``conv_columns``: ``"kernel-1"`` (hybridkv's conv windows) or ``"kernel"`` (as transformers keeps
    them, see :func:`with_conv_columns`). ``decoder_layer_ids``: the decoder layer each entry of
    ``layers`` comes from (None: entry ``i`` is decoder layer ``i``), for a :meth:`cache_view` or a
    model whose decoder layers keep more than one cache (Dory's looped layers: one K/V per loop).
    """

    name: str
    layers: tuple[LayerSpec, ...]
    tp_size: int = 1
    hidden_size: int | None = None
    params_active: float | None = None
    notes: tuple[str, ...] = field(default=())
    dtype_sources: tuple[tuple[str, str], ...] = field(default=())
    conv_columns: str = "kernel-1"
    decoder_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "dtype_sources", tuple(tuple(p) for p in self.dtype_sources))
        if not self.layers:
            raise SpecError(f"model {self.name!r} has no layers")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, _LAYER_TYPES):
                raise SpecError(f"model {self.name!r} layer {i} is not a layer spec: {layer!r}")
        if not self.attention_layer_ids and not self.recurrent_layer_ids:
            raise SpecError(f"model {self.name!r} has no layer that holds a cache")
        if self.conv_columns not in CONV_COLUMNS:
            raise SpecError(f"conv_columns must be one of {CONV_COLUMNS}, got {self.conv_columns!r}")
        if self.decoder_layer_ids is not None:
            object.__setattr__(self, "decoder_layer_ids", tuple(self.decoder_layer_ids))
            if len(self.decoder_layer_ids) != len(self.layers):
                raise SpecError(f"model {self.name!r}: decoder_layer_ids must name one decoder layer per entry")
        for what, size in (("state per request", self.state_bytes), ("KV per token", self.kv_bytes_per_token)):
            if size > MAX_CACHE_BYTES:
                raise SpecError(
                    f"model {self.name!r}: {what} is above 2**60 bytes (1 EiB): not a model this planner "
                    "sizes (a dimension is out of range)"
                )

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers that keep K/V (hybrid layers included)."""
        return tuple(i for i, l in enumerate(self.layers) if _attention_of(l) is not None)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Layers that keep a recurrent state (hybrid layers included)."""
        return tuple(i for i, l in enumerate(self.layers) if _recurrent_of(l) is not None)

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if isinstance(l, HybridLayerSpec))

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one token summed over all attention layers."""
        return sum(a.kv_bytes_per_token for a in map(_attention_of, self.layers) if a is not None)

    @property
    def state_bytes(self) -> int:
        """Recurrent state bytes of one request summed over all recurrent layers."""
        return sum(r.state_bytes for r in map(_recurrent_of, self.layers) if r is not None)

    def attention_layers(self) -> tuple[tuple[int, AttentionLayerSpec], ...]:
        """``(layer id, attention spec)`` of every layer keeping K/V (a hybrid layer's attention part)."""
        return tuple((i, a) for i, a in enumerate(map(_attention_of, self.layers)) if a is not None)

    def recurrent_layers(self) -> tuple[tuple[int, RecurrentLayerSpec], ...]:
        """``(layer id, recurrent spec)`` of every layer keeping a state (a hybrid layer's state part)."""
        return tuple((i, r) for i, r in enumerate(map(_recurrent_of, self.layers)) if r is not None)

    def dtype_source(self, key: str) -> str | None:
        """Where the dtype of ``key`` (``"kv"`` or ``"<mixer>.<component>"``) came from, if recorded."""
        return dict(self.dtype_sources).get(key)

    def cache_view(self) -> ModelSpec:
        """This model with each hybrid layer split into two cache layers, its attention then its
        recurrent part, so that every entry of ``layers`` is one kind; ``decoder_layer_ids`` maps each
        entry back to its decoder layer. A model without hybrid layers is returned as it is."""
        if not self.hybrid_layer_ids:
            return self
        layers: list[LayerSpec] = []
        source: list[int] = []
        ids = self.decoder_layer_ids or range(len(self.layers))
        for i, layer in zip(ids, self.layers, strict=True):
            parts = (layer.attention, layer.recurrent) if isinstance(layer, HybridLayerSpec) else (layer,)
            layers.extend(parts)
            source.extend([i] * len(parts))
        note = (
            f"hybrid layers {list(self.hybrid_layer_ids)} keep K/V and a state: each is two cache layers "
            "(attention, then state); decoder_layer_ids maps cache layers to decoder layers"
        )
        return replace(self, layers=tuple(layers), decoder_layer_ids=tuple(source), notes=(*self.notes, note))

    def shard(self, tp_size: int) -> ModelSpec:
        """This model as one rank of ``tp_size``-way tensor parallelism sees it.

        Raises :class:`TensorParallelError` if ``tp_size`` does not divide a head or channel axis.
        """
        if not isinstance(tp_size, int) or tp_size <= 0:
            raise TensorParallelError(f"tp_size must be a positive integer, got {tp_size!r}")
        if self.tp_size != 1:
            raise TensorParallelError(
                f"model {self.name!r} is already sharded (tp_size={self.tp_size}); shard the TP 1 spec"
            )
        if tp_size == 1:
            return self
        layers = tuple(l.shard(tp_size, f"layer {i}") for i, l in enumerate(self.layers))
        return replace(self, layers=layers, tp_size=tp_size, notes=(*self.notes, *self._tp_notes(tp_size)))

    def _tp_notes(self, tp_size: int) -> list[str]:
        """The tensor-parallel rules applied at ``tp_size``, one line each (vLLM's rules)."""
        notes: list[str] = []
        attn = next((a for _, a in self.attention_layers()), None)
        if attn is not None:
            if attn.num_kv_heads < tp_size:
                notes.append(
                    f"TP{tp_size}: {attn.num_kv_heads} KV head(s) < {tp_size} ranks: each rank keeps one "
                    "replicated KV head (vLLM)"
                )
            else:
                notes.append(f"TP{tp_size}: KV heads split across ranks")
        seen: set[str] = set()
        for _, r in self.recurrent_layers():
            if r.mixer in seen:
                continue
            seen.add(r.mixer)
            grouped = next((c for c in r.components if c.tp_groups is not None), None)
            if grouped is not None and grouped.tp_groups is not None:
                heads, groups, _ = grouped.tp_groups
                per = groups_per_rank(heads, groups, tp_size) if heads % tp_size == 0 else "?"
                rule = (
                    f"groups split ({groups} / {tp_size})"
                    if groups % tp_size == 0
                    else f"n_groups {groups} % tp {tp_size} != 0: each rank keeps the {per} group(s) its heads use "
                    "whole (B and C replicated, vLLM extra_groups_for_head_shards)"
                )
                notes.append(f"TP{tp_size}: {r.mixer} heads split; conv B/C {rule}")
            elif r.mixer == "mamba":
                notes.append(f"TP{tp_size}: mamba (v1) channels d_inner split across ranks (vLLM MambaMixer)")
            elif any(c.tp_replicate for c in r.components):
                notes.append(
                    f"TP{tp_size}: {r.mixer} K/V window split by KV heads (one replicated head per rank when "
                    "fewer KV heads than ranks, vLLM)"
                )
            elif r.mixer.split("+")[0] in ("gdn", "kda"):
                notes.append(f"TP{tp_size}: {r.mixer} key and value heads split (conv over q, k, v split by heads)")
            else:
                notes.append(f"TP{tp_size}: {r.mixer} heads / channels split across ranks")
            whole = [c.name for c in r.components if c.tp_axis is None]
            if whole:
                notes.append(f"TP{tp_size}: {r.mixer} {', '.join(whole)} kept whole on every rank")
        sides = sorted({t.name for _, a in self.attention_layers() for t in a.side})
        if sides:
            notes.append(
                f"TP{tp_size}: attention side tensors ({', '.join(sides)}, one head) replicated on every rank "
                "(vLLM's DSA indexer cache)"
            )
        return notes


KV_CACHE_DTYPES: dict[str, tuple[DType, DType | None]] = {
    "bfloat16": (DType.BFLOAT16, None),
    "float16": (DType.FLOAT16, None),
    "float32": (DType.FLOAT32, None),
    "int8": (DType.INT8, None),  # FastDeploy cache_int8: uint8 storage, per-layer scales
    "fp8": (DType.FLOAT8_E4M3, None),  # FastDeploy cache_fp8: uint8 storage, per-layer scales
    "block_wise_fp8": (DType.FLOAT8_E4M3, DType.FLOAT32),  # per-token, per-head float32 scales
}
"""KV cache dtypes FastDeploy serves with: name -> (element dtype, per-token scale dtype)."""


def with_kv_dtype(model: ModelSpec, kv_dtype: str) -> ModelSpec:
    """``model`` with every attention layer's KV cache in ``kv_dtype`` (a :data:`KV_CACHE_DTYPES` name,
    or ``bf16`` / ``fp16`` / ``fp32`` / ``cache_int8`` / ``cache_fp8``); recurrent states keep their dtype."""
    key = str(kv_dtype).strip().lower().removeprefix("cache_")
    key = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(key, key)
    if key not in KV_CACHE_DTYPES:
        raise SpecError(f"unknown KV cache dtype {kv_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    dtype, scale = KV_CACHE_DTYPES[key]

    def convert(l: LayerSpec) -> LayerSpec:
        if isinstance(l, AttentionLayerSpec):
            return replace(l, dtype=dtype, kv_scale_dtype=scale)
        if isinstance(l, HybridLayerSpec):
            return HybridLayerSpec(replace(l.attention, dtype=dtype, kv_scale_dtype=scale), l.recurrent)
        return l

    sources = tuple((k, v) for k, v in model.dtype_sources if k != "kv") + (("kv", f"{key}: --kv-dtype"),)
    return replace(model, layers=tuple(map(convert, model.layers)), dtype_sources=sources)


CONV_COLUMNS = ("kernel-1", "kernel")
"""Conv window widths: ``kernel-1`` columns (hybridkv, vLLM, FastDeploy: all a decode reads) or
``kernel`` (transformers keeps the whole kernel window)."""


def with_conv_columns(model: ModelSpec, columns: str) -> ModelSpec:
    """``model`` with every conv window (components named ``conv*``, last axis = columns) keeping
    ``columns`` = ``"kernel-1"`` or ``"kernel"`` columns; other components are unchanged."""
    if columns not in CONV_COLUMNS:
        raise SpecError(f"conv columns must be one of {', '.join(CONV_COLUMNS)}, got {columns!r}")
    delta = CONV_COLUMNS.index(columns) - CONV_COLUMNS.index(model.conv_columns)
    if delta == 0:
        return model

    def widen(r: RecurrentLayerSpec) -> RecurrentLayerSpec:
        comps = tuple(
            replace(c, shape=(*c.shape[:-1], c.shape[-1] + delta)) if c.name.startswith("conv") else c
            for c in r.components
        )
        return replace(r, components=comps)

    def convert(l: LayerSpec) -> LayerSpec:
        if isinstance(l, RecurrentLayerSpec):
            return widen(l)
        if isinstance(l, HybridLayerSpec):
            return HybridLayerSpec(l.attention, widen(l.recurrent))
        return l

    return replace(model, layers=tuple(map(convert, model.layers)), conv_columns=columns)


def with_state_scales(model: ModelSpec, scales: str) -> ModelSpec:
    """``model`` with every quantized state component's scales at granularity ``scales`` (one of
    :data:`STATE_SCALES`); unquantized components are unchanged."""

    def scaled(r: RecurrentLayerSpec) -> RecurrentLayerSpec:
        comps = tuple(replace(c, scales=scales) if c.dtype.quantized else c for c in r.components)
        return replace(r, components=comps)

    def convert(l: LayerSpec) -> LayerSpec:
        if isinstance(l, RecurrentLayerSpec):
            return scaled(l)
        if isinstance(l, HybridLayerSpec):
            return HybridLayerSpec(l.attention, scaled(l.recurrent))
        return l

    return replace(model, layers=tuple(map(convert, model.layers)))


def state_scale_bytes(model: ModelSpec) -> int:
    """Bytes of one request's state that are quantization scales (0 without a quantized state)."""
    return sum(c.scale_bytes for _, r in model.recurrent_layers() for c in r.components)


def with_state_dtype(model: ModelSpec, dtype: DType | str, scales: str | None = None) -> ModelSpec:
    """``model`` with every recurrent state component that is not a conv window or a token shift
    (names ``conv*`` / ``shift*``) stored in ``dtype``: float32, bfloat16, float16, or int8 / fp8 with
    float32 scales at ``scales`` (default ``row``). What an engine computes with is its own affair: only
    what the pool keeps changes. Components of integer dtypes (cached ids) are left as they are."""
    target = DType.parse(dtype, quantized=True)

    def stored(r: RecurrentLayerSpec) -> RecurrentLayerSpec:
        comps = tuple(
            c
            if c.name.startswith(("conv", "shift")) or c.dtype is DType.INT64
            else replace(c, dtype=target, scales=scales if target.quantized else None)
            for c in r.components
        )
        return replace(r, components=comps)

    def convert(l: LayerSpec) -> LayerSpec:
        if isinstance(l, RecurrentLayerSpec):
            return stored(l)
        if isinstance(l, HybridLayerSpec):
            return HybridLayerSpec(l.attention, stored(l.recurrent))
        return l

    return replace(model, layers=tuple(map(convert, model.layers)))

"""Frozen specs of hybrid models: which layers hold KV, which hold recurrent state, of what shape.

A :class:`ModelSpec` is the ordered list of a model's layers. Each layer is one of

- :class:`AttentionLayerSpec`: softmax attention with a paged KV cache (K and V per token);
- :class:`RecurrentLayerSpec`: a fixed-size per-request state made of named
  :class:`StateComponent` tensors (lightning ``kv``, Mamba2 ``ssm`` + ``conv``, RWKV ``wkv`` +
  token shifts, ...);
- :class:`NoCacheLayerSpec`: a layer that holds nothing per request (an MLP layer of Nemotron-H).

Shapes are per request and per layer at tensor-parallel size 1; :meth:`ModelSpec.shard` divides
heads and channels by ``tp_size`` and raises :class:`TensorParallelError` when they do not divide.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from hybridkv.errors import SpecError, TensorParallelError


class DType(enum.Enum):
    """Element types a cache can hold; the value is the canonical name."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"  # quantized KV (FastDeploy cache_int8; stored as uint8)
    FLOAT8_E4M3 = "float8_e4m3fn"  # quantized KV (cache_fp8, block_wise_fp8; stored as uint8)

    @property
    def itemsize(self) -> int:
        return {DType.FLOAT32: 4, DType.INT8: 1, DType.FLOAT8_E4M3: 1}.get(self, 2)

    @classmethod
    def parse(cls, value: DType | str, quantized: bool = False) -> DType:
        """Accept a :class:`DType` or a name (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``;
        with ``quantized``, the KV cache names ``int8`` and ``fp8``/``float8_e4m3fn`` too)."""
        if isinstance(value, DType):
            return value
        key = str(value).strip().lower().removeprefix("torch.").removeprefix("paddle.")
        aliases = {
            "float32": cls.FLOAT32,
            "fp32": cls.FLOAT32,
            "float": cls.FLOAT32,
            "bfloat16": cls.BFLOAT16,
            "bf16": cls.BFLOAT16,
            "float16": cls.FLOAT16,
            "fp16": cls.FLOAT16,
            "half": cls.FLOAT16,
        }
        if quantized:
            aliases |= {"int8": cls.INT8, "float8_e4m3fn": cls.FLOAT8_E4M3, "fp8": cls.FLOAT8_E4M3}
        if key not in aliases:
            more = ", int8 or fp8" if quantized else " or float16 (int8 / fp8: KV caches only, see --kv-dtype)"
            raise SpecError(f"unknown dtype {value!r}: use float32, bfloat16{', float16' if quantized else ''}{more}")
        return aliases[key]


def _check_positive(name: str, values: Iterable[int]) -> None:
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise SpecError(f"{name} must be positive integers, got {v!r}")


def _divide(what: str, value: int, tp_size: int) -> int:
    if value % tp_size:
        raise TensorParallelError(
            f"tp_size={tp_size} does not divide {what}={value}: "
            f"use a tp_size that divides {value} (e.g. {_divisors_hint(value)})"
        )
    return value // tp_size


def _divisors_hint(value: int) -> str:
    divisors = [d for d in (1, 2, 4, 8, 16, 32, 64) if value % d == 0]
    return ", ".join(str(d) for d in divisors)


@dataclass(frozen=True, slots=True)
class StateComponent:
    """One named tensor of a recurrent layer's per-request state.

    ``shape`` is per request at TP 1; ``tp_axis`` is the axis tensor parallelism divides
    (heads or channels), ``None`` for a tensor every rank holds whole.
    """

    name: str
    shape: tuple[int, ...]
    dtype: DType
    tp_axis: int | None = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("a state component needs a name")
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not self.shape:
            raise SpecError(f"state component {self.name!r} needs a non-empty shape")
        _check_positive(f"shape of state component {self.name!r}", self.shape)
        if self.tp_axis is not None and not 0 <= self.tp_axis < len(self.shape):
            raise SpecError(f"state component {self.name!r}: tp_axis={self.tp_axis} is outside shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def shard(self, tp_size: int, layer: str) -> StateComponent:
        if tp_size == 1 or self.tp_axis is None:
            return self
        shape = list(self.shape)
        shape[self.tp_axis] = _divide(f"{layer} state '{self.name}' axis {self.tp_axis}", shape[self.tp_axis], tp_size)
        return replace(self, shape=tuple(shape))


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """Softmax attention with a paged KV cache: K and V of ``num_kv_heads x head_dim`` per token.

    ``kv_scale_dtype``: with a quantized ``dtype``, the dtype of a per-token, per-head scale kept
    for K and for V beside the cache (FastDeploy's ``block_wise_fp8``: float32 tensors
    ``[num_blocks, kv_heads, block_size]``); None when scales are per layer (``cache_int8``,
    ``cache_fp8``) or the cache is not quantized.
    """

    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    num_q_heads: int | None = None
    kv_scale_dtype: DType | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype, quantized=True))
        _check_positive("attention num_kv_heads/head_dim", (self.num_kv_heads, self.head_dim))
        if self.num_q_heads is not None:
            _check_positive("attention num_q_heads", (self.num_q_heads,))
        if self.kv_scale_dtype is not None:
            object.__setattr__(self, "kv_scale_dtype", DType.parse(self.kv_scale_dtype))
            if self.dtype.itemsize != 1:
                raise SpecError(f"KV scales go with a quantized (1-byte) KV dtype, not {self.dtype.value}")

    kind = "attention"

    @property
    def kv_bytes_per_token(self) -> int:
        """K plus V bytes of one token in this layer (their scales included)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize + self.scale_bytes_per_token

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
class NoCacheLayerSpec:
    """A layer that keeps nothing per request (MLP, MoE); kept so layer ids stay faithful."""

    kind = "none"

    def shard(self, tp_size: int, layer: str) -> NoCacheLayerSpec:
        return self


LayerSpec = AttentionLayerSpec | RecurrentLayerSpec | NoCacheLayerSpec


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as the ordered list of its layers, at one tensor-parallel size.

    ``tp_size`` records how the shapes were divided (1 = as published). ``vocab_*`` and FLOP
    fields are optional facts the cost model uses; the memory planner ignores them.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    tp_size: int = 1
    hidden_size: int | None = None
    params_active: float | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise SpecError(f"model {self.name!r} has no layers")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, AttentionLayerSpec | RecurrentLayerSpec | NoCacheLayerSpec):
                raise SpecError(f"model {self.name!r} layer {i} is not a layer spec: {layer!r}")
        if not self.attention_layer_ids and not self.recurrent_layer_ids:
            raise SpecError(f"model {self.name!r} has no layer that holds a cache")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if isinstance(l, AttentionLayerSpec))

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if isinstance(l, RecurrentLayerSpec))

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one token summed over all attention layers."""
        return sum(l.kv_bytes_per_token for l in self.layers if isinstance(l, AttentionLayerSpec))

    @property
    def state_bytes(self) -> int:
        """Recurrent state bytes of one request summed over all recurrent layers."""
        return sum(l.state_bytes for l in self.layers if isinstance(l, RecurrentLayerSpec))

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
        return replace(self, layers=layers, tp_size=tp_size)


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
    layers = tuple(
        replace(l, dtype=dtype, kv_scale_dtype=scale) if isinstance(l, AttentionLayerSpec) else l for l in model.layers
    )
    return replace(model, layers=layers)

"""State components and side tensors: the per-request tensors a layer keeps besides K and V, and the
tensor-parallel arithmetic they share with :mod:`hybridkv.models.spec` (which re-exports them).

A quantized component (``int8`` / ``float8_e4m3fn``, :mod:`hybridkv.models.dtypes`) keeps its values
then its float32 scales in its own bytes: ``nbytes = numel + 4 * scale_count``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from hybridkv.errors import SpecError, TensorParallelError
from hybridkv.models.dtypes import SCALE_DTYPE, DType, parse_state_scales


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

    ``tp_groups = (num_heads, n_groups, group_channels)``: the last ``n_groups * group_channels``
    entries of ``tp_axis`` belong to head groups (Mamba2's B and C: ``2 * d_state`` channels per
    group) that a rank needs whole for every head it holds. A rank keeps ``axis - n_groups *
    group_channels`` channels divided by ``tp_size``, plus ``group_channels`` for each group its heads
    use: with ``n_groups % tp_size != 0`` the groups are replicated (vLLM's
    ``extra_groups_for_head_shards``), so Mamba2-2.7B (1 group) at TP2 keeps 2,560 + 2 x 128 = 2,816
    conv channels per rank, not 5,376 / 2. ``tp_heads``: head counts tensor parallelism must divide
    for this tensor to split (GDN's conv spans key and value heads). ``tp_replicate``: ``tp_axis``
    counts KV heads, split when there are at least ``tp_size`` of them, else one replicated head per
    rank (as attention KV: a sliding-window layer's K/V window).

    ``scales``: with a quantized ``dtype`` (int8, float8_e4m3fn) the scale granularity (``row``,
    the default: one float32 scale per last-axis vector; ``head``: per index of axis 0; ``tensor``);
    the scales follow the values in the component's bytes (:attr:`value_bytes` onwards). None otherwise.
    """

    name: str
    shape: tuple[int, ...]
    dtype: DType
    tp_axis: int | None = 0
    tp_groups: tuple[int, int, int] | None = None
    tp_heads: tuple[int, ...] = ()
    tp_replicate: bool = False
    scales: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("a state component needs a name")
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", DType.parse(self.dtype, quantized=True))
        object.__setattr__(self, "scales", parse_state_scales(self.scales, self.dtype))
        if not self.shape:
            raise SpecError(f"state component {self.name!r} needs a non-empty shape")
        _check_positive(f"shape of state component {self.name!r}", self.shape)
        if self.tp_axis is not None and not 0 <= self.tp_axis < len(self.shape):
            raise SpecError(f"state component {self.name!r}: tp_axis={self.tp_axis} is outside shape {self.shape}")
        if self.tp_groups is not None:
            object.__setattr__(self, "tp_groups", tuple(self.tp_groups))
            _check_positive(f"tp_groups of state component {self.name!r}", self.tp_groups)
            heads, groups, width = self.tp_groups
            if self.tp_axis is None or heads % groups or groups * width > self.shape[self.tp_axis]:
                raise SpecError(
                    f"state component {self.name!r}: tp_groups {self.tp_groups} need a tp_axis holding "
                    f"n_groups x group_channels channels and heads divisible by groups"
                )
        object.__setattr__(self, "tp_heads", tuple(self.tp_heads))
        _check_positive(f"tp_heads of state component {self.name!r}", self.tp_heads)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def scale_count(self) -> int:
        """Scales of a quantized component (0 otherwise): each covers :attr:`scale_group` consecutive values."""
        if self.scales is None:
            return 0
        return {"row": self.numel // self.shape[-1], "head": self.shape[0], "tensor": 1}[self.scales]

    @property
    def scale_group(self) -> int:
        """Consecutive values (row-major) sharing one scale (0 without scales)."""
        return self.numel // self.scale_count if self.scales is not None else 0

    @property
    def value_bytes(self) -> int:
        """Bytes of the values alone (the scales, if any, start at this offset)."""
        return self.numel * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        return self.scale_count * SCALE_DTYPE.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of one request's component: values, then scales."""
        return self.value_bytes + self.scale_bytes

    def shard(self, tp_size: int, layer: str) -> StateComponent:
        if tp_size == 1 or self.tp_axis is None:
            return self
        what = f"{layer} state '{self.name}'"
        for heads in self.tp_heads:
            _divide(f"{what} heads", heads, tp_size)
        shape = list(self.shape)
        axis = shape[self.tp_axis]
        if self.tp_replicate and axis < tp_size:
            if tp_size % axis:
                raise TensorParallelError(
                    f"tp_size={tp_size} and {what} kv heads={axis}: one must divide the other "
                    "(KV heads are split or replicated across ranks)"
                )
            shape[self.tp_axis] = 1  # fewer KV heads than ranks: each rank keeps one replicated head
        elif self.tp_groups is None:
            shape[self.tp_axis] = _divide(f"{what} axis {self.tp_axis}", axis, tp_size)
        else:
            heads, groups, width = self.tp_groups
            split = _divide(f"{what} axis {self.tp_axis} (without its groups)", axis - groups * width, tp_size)
            shape[self.tp_axis] = split + width * groups_per_rank(heads, groups, tp_size, what)
        return replace(self, shape=tuple(shape), tp_groups=None, tp_heads=())


def groups_per_rank(num_heads: int, n_groups: int, tp_size: int, what: str = "layer") -> int:
    """Head groups one rank of ``tp_size`` needs whole when ``num_heads`` heads in ``n_groups`` groups
    are split by heads: ``n_groups / tp_size`` when that divides, else every group any of the rank's
    heads belongs to (the most over ranks; 1 when ``n_groups`` = 1: the group is replicated)."""
    per_rank = _divide(f"{what} heads", num_heads, tp_size)
    if n_groups % tp_size == 0:
        return n_groups // tp_size
    per_group = num_heads // n_groups
    return max(len({h // per_group for h in range(r * per_rank, (r + 1) * per_rank)}) for r in range(tp_size))


@dataclass(frozen=True, slots=True)
class SideTensor:
    """A per-token tensor an attention layer keeps beside K and V: ``width`` values of ``dtype`` per
    token, one head, replicated on every tensor-parallel rank (DeepSeek-sparse attention's indexer
    keys: vLLM keeps its DSA indexer cache whole on every rank). Paged with the layer's K/V: the
    planner gives it segments of the layer slot after V (``Layout.side_segments``).

    Examples: GLM-5 Next's packed indexer state ``[2 * index_head_dim + 1]`` (indexer key, pool gate
    scores, a valid flag) in the activation dtype; Qwen4-exp's indexer keys ``[indexer_head_dim]``
    and, on its first indexed layer, the 3-D rotary positions ``[3]`` int64.
    """

    name: str
    width: int
    dtype: DType

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("a side tensor needs a name")
        _check_positive(f"width of side tensor {self.name!r}", (self.width,))
        object.__setattr__(self, "dtype", DType.parse(self.dtype, integer=True))

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.itemsize

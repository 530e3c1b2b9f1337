"""Element types of caches and the quantized state formats (:class:`DType`, :data:`STATE_SCALES`).

A recurrent state component may be kept quantized: ``int8`` or ``float8_e4m3fn`` values with float32
scales stored inside the component's own bytes, after the values (see
:class:`~hybridkv.models.components.StateComponent`), so a state set stays plain bytes in ordinary
blocks. The value of element ``x`` is ``q * scale`` of its scale group; a scale is the group's
largest magnitude divided by :attr:`DType.quant_max` (127 for int8, 448 for e4m3). Granularities
(:data:`STATE_SCALES`): ``row`` (one scale per last-axis vector: per head and row of a
``[H, d_k, d_v]`` matrix state, the default, the lowest error measured in
``benchmarks/state_quant_error.py``), ``head`` (one per index of the first axis) and ``tensor``.
"""

from __future__ import annotations

import enum

from hybridkv.errors import SpecError


class DType(enum.Enum):
    """Element types a cache can hold; the value is the canonical name."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"  # quantized KV (FastDeploy cache_int8; stored as uint8) or state (with scales)
    FLOAT8_E4M3 = "float8_e4m3fn"  # quantized KV (cache_fp8, block_wise_fp8; stored as uint8) or state
    INT64 = "int64"  # token ids and positions some models cache (Qwen4-exp); never a KV or state override

    @property
    def itemsize(self) -> int:
        return {DType.FLOAT32: 4, DType.INT8: 1, DType.FLOAT8_E4M3: 1, DType.INT64: 8}.get(self, 2)

    @property
    def quantized(self) -> bool:
        """True for the 1-byte types that need scales (int8, float8_e4m3fn)."""
        return self in (DType.INT8, DType.FLOAT8_E4M3)

    @property
    def quant_max(self) -> float:
        """Largest magnitude a quantized value takes (int8 127, e4m3 448); a scale maps a group's
        largest magnitude onto it."""
        if not self.quantized:
            raise SpecError(f"{self.value} is not a quantized dtype")
        return 127.0 if self is DType.INT8 else 448.0

    @classmethod
    def parse(cls, value: DType | str, quantized: bool = False, integer: bool = False) -> DType:
        """Accept a :class:`DType` or a name (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``;
        with ``quantized``, ``int8`` and ``fp8``/``float8_e4m3``/``float8_e4m3fn`` too; with
        ``integer``, ``int64`` (cached token ids / positions, never a KV or state dtype choice))."""
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
            fp8 = cls.FLOAT8_E4M3
            aliases |= {"int8": cls.INT8, "float8_e4m3fn": fp8, "float8_e4m3": fp8, "fp8": fp8}
        if integer:
            aliases |= {"int64": cls.INT64}
        if key not in aliases:
            more = ", int8 or fp8" if quantized else " or float16 (int8 / fp8 where quantized values are allowed)"
            raise SpecError(f"unknown dtype {value!r}: use float32, bfloat16{', float16' if quantized else ''}{more}")
        return aliases[key]


STATE_SCALES = ("row", "head", "tensor")
"""Scale granularities of a quantized state component: one float32 scale per last-axis vector
(``row``), per index of the first axis (``head``) or per component (``tensor``)."""
SCALE_DTYPE = DType.FLOAT32
"""The dtype of a quantized state's scales (4 bytes each, after the component's values)."""


def parse_state_scales(value: str | None, dtype: DType) -> str | None:
    """The scale granularity of a state component of ``dtype``: None for an unquantized dtype, ``row``
    by default for a quantized one; :class:`SpecError` for a name not in :data:`STATE_SCALES` or
    scales on an unquantized dtype."""
    if not dtype.quantized:
        if value is not None:
            raise SpecError(f"scales ({value!r}) go with a quantized state dtype (int8, fp8), not {dtype.value}")
        return None
    value = "row" if value is None else str(value).strip().lower()
    if value not in STATE_SCALES:
        raise SpecError(f"unknown state scale granularity {value!r}: use one of {', '.join(STATE_SCALES)}")
    return value

"""Quantized state components at the gather / scatter boundary: the reference math, in torch.

A quantized component (``int8`` / ``float8_e4m3fn``, :mod:`hybridkv.models.dtypes`) is ``numel``
one-byte values then ``scale_count`` float32 scales, in its own bytes of the state set. Scatter
quantizes the compute-dtype buffer: per scale group of ``scale_group`` consecutive values,
``scale = max|x| / quant_max`` (0 for an all-zero group), ``v = x / scale``, then

- int8: ``q = clamp(floor(v + u), -127, 127)``;
- e4m3 (and ``float16`` components, without scales: ``v = x``): ``a = |v|``, ``spacing`` = the
  format's gap between neighbours at ``a`` (``2 ** (max(exponent(a), emin) - mantissa_bits)``),
  ``q = sign(v) * min(floor(a / spacing + u) * spacing, max)``,

with ``u = 0.5`` (round to nearest, ties away from zero) or, for stochastic rounding, ``u`` uniform
in [0, 1) from a hash of (the row's seed, the layer and component, the element's index): so a run
with the same seeds writes the same bytes, and :func:`rounding_seeds` derives a row's seed from its
(request, position). Gather dequantizes: ``x = q * scale`` in float32, cast to the buffer's dtype.

e4m3 bytes are encoded and decoded from their bits here (sign, 4 exponent bits with bias 7,
3 mantissa bits; 0x7f / 0xff NaN never written), so the Triton kernel (:mod:`.kernel_quant`) can
do the same arithmetic bit for bit without the GPU's fp8 conversions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybridkv.models.dtypes import DType

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
HASH_M1, HASH_M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 (Chris Wellons' integer hash) multipliers
SALT_MUL = 0x9E3779B1


class FloatFormat(NamedTuple):
    """A narrow float format as stochastic rounding sees it."""

    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal
    max_value: float


FORMATS = {DType.FLOAT8_E4M3: FloatFormat(3, -6, 448.0), DType.FLOAT16: FloatFormat(10, -14, 65504.0)}
COMPUTED_DTYPES = (DType.INT8, DType.FLOAT8_E4M3, DType.FLOAT16)
"""Component dtypes that buffers allocated with a ``compute_dtype`` hold dequantized (and that
scatter rounds: nearest, or stochastically with seeds)."""


def region_salt(layer_id: int, state_offset: int) -> int:
    """The 32-bit salt that makes one component's random stream differ from another's."""
    return (layer_id * SALT_MUL + state_offset) & MASK32


def rounding_seeds(request_ids: Any, positions: Any) -> np.ndarray:
    """int64 ``[B]`` seeds (each below 2**32) of batch rows from their request ids and positions
    (the token count the state covers): the same (request, position) always rounds the same way."""
    r = np.asarray(request_ids, dtype=np.uint64) & np.uint64(MASK32)
    p = np.asarray(positions, dtype=np.uint64) & np.uint64(MASK32)
    mixed = (r * np.uint64(SALT_MUL) + p * np.uint64(HASH_M1) + np.uint64(1)) & np.uint64(MASK32)
    return mixed.astype(np.int64)


def _hash(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * HASH_M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_M2) & MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, salt: int, numel: int) -> torch.Tensor:
    """float32 ``[B, numel]`` in [0, 1): element ``e`` of row ``b`` from ``seeds[b]``, ``salt`` and ``e``."""
    import torch

    e = torch.arange(numel, dtype=torch.int64, device=seeds.device)
    h = _hash(_hash(e ^ salt)[None, :] ^ (seeds.to(torch.int64)[:, None] & MASK32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _pow2(k: torch.Tensor) -> torch.Tensor:
    import torch

    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) of positive float32 ``a`` from its bits (a subnormal float32 reads -127: far below
    any format's minimum, where it is clamped)."""
    import torch

    return ((a.view(torch.int32).to(torch.int64) >> 23) & 0xFF) - 127


def round_float(v: torch.Tensor, fmt: FloatFormat, u: torch.Tensor | float) -> torch.Tensor:
    """float32 ``v`` rounded onto ``fmt``'s grid (``u`` 0.5: nearest; uniform: stochastic), clamped."""
    import torch

    a = v.abs()
    k = torch.clamp(_exponent(a), min=fmt.min_exponent) - fmt.mantissa_bits
    q = torch.floor(a * _pow2(-k) + u) * _pow2(k)
    return torch.copysign(torch.clamp(q, max=fmt.max_value), v)


def e4m3_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn encodings of float32 values already on the e4m3 grid (``|q| <= 448``)."""
    import torch

    a = q.abs()
    sign = (q.view(torch.int32).to(torch.int64) >> 31) & 1
    e = _exponent(a)
    normal = a >= 2.0**-6
    mant = (a.view(torch.int32).to(torch.int64) >> 20) & 7
    bits = torch.where(normal, ((e + 7) << 3) | mant, (a * 2.0**9).to(torch.int64))
    return ((sign << 7) | bits).to(torch.uint8)


def e4m3_values(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e4m3fn encodings."""
    import torch

    b = bits.to(torch.int64)
    e, m = (b >> 3) & 0xF, (b & 7).to(torch.float32)
    mag = torch.where(e == 0, m * 2.0**-9, (8.0 + m) * _pow2(e - 10))
    return torch.where((b >> 7) == 1, -mag, mag)


def encode(x: torch.Tensor, dtype: DType, group: int, u: torch.Tensor | float) -> torch.Tensor:
    """uint8 ``[B, nbytes]``: the stored form of float ``x`` ``[B, numel]`` (values, then float32 scales
    of each ``group`` consecutive values; float16 has no scales). ``u``: 0.5 or ``[B, numel]`` uniforms."""
    import torch

    x = x.to(torch.float32)
    if dtype is DType.FLOAT16:
        return round_float(x, FORMATS[dtype], u).to(torch.float16).view(torch.uint8)
    rows = x.shape[0]
    grouped = x.view(rows, -1, group)
    scale = grouped.abs().amax(dim=2) / dtype.quant_max  # [B, scale_count]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = torch.where(scale[..., None] > 0, grouped / safe[..., None], torch.zeros_like(grouped)).view(rows, -1)
    if dtype is DType.INT8:
        values = torch.clamp(torch.floor(v + u), -127, 127).to(torch.int8).view(torch.uint8)
    else:
        values = e4m3_bits(round_float(v, FORMATS[dtype], u))
    return torch.cat([values, scale.contiguous().view(torch.uint8)], dim=1)


def decode(raw: torch.Tensor, dtype: DType, numel: int, group: int) -> torch.Tensor:
    """float32 ``[B, numel]`` from the stored form ``raw`` uint8 ``[B, nbytes]`` (see :func:`encode`)."""
    import torch

    if dtype is DType.FLOAT16:
        return raw.contiguous().view(torch.float16).to(torch.float32)
    values, scales = raw[:, :numel], raw[:, numel:].contiguous().view(torch.float32)
    q = values.contiguous().view(torch.int8).to(torch.float32) if dtype is DType.INT8 else e4m3_values(values)
    return (q.view(raw.shape[0], -1, group) * scales[..., None]).view(raw.shape[0], numel)

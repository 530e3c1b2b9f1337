"""The stored form of a quantized state component in numpy, bit for bit :mod:`.quant`'s (no torch).

For the paths that never import torch: FastDeploy's layer API reference and its GDN staging over
Paddle caches (:mod:`hybridkv.integrations.fastdeploy.layers`, ``.gdn``). Same formats, same scale
groups, same hash, salt and seeds (:func:`~.quant.rounding_seeds`), so a state written here reads
back through :func:`hybridkv.ops.states.gather_states` and the other way round.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from hybridkv.models.dtypes import DType
from hybridkv.ops.states.quant import FORMATS, HASH_M1, HASH_M2, MASK32, FloatFormat, region_salt, rounding_seeds

__all__ = ["decode", "encode", "region_salt", "request_key", "rounding_seeds", "uniforms"]


def request_key(request_id: Any) -> int:
    """A request id as the integer :func:`~.quant.rounding_seeds` takes: an int as it is, anything else
    by the CRC-32 of its ``str`` (FastDeploy's ids are strings), the same in every process."""
    if isinstance(request_id, int | np.integer) and not isinstance(request_id, bool):
        return int(request_id)
    return zlib.crc32(str(request_id).encode())


def _hash(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint64 arrays holding 32-bit values (as :func:`.quant._hash`)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(HASH_M1)) & np.uint64(MASK32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(HASH_M2)) & np.uint64(MASK32)
    return x ^ (x >> np.uint64(16))


def uniforms(seeds: Any, salt: int, numel: int) -> np.ndarray:
    """float32 ``[B, numel]`` in [0, 1) from int ``seeds`` ``[B]`` (:func:`.quant.uniforms`'s values)."""
    e = np.arange(numel, dtype=np.uint64)
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64) & np.uint64(MASK32)
    h = _hash(_hash(e ^ np.uint64(salt & MASK32))[None, :] ^ s[:, None])
    return (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def _pow2(k: np.ndarray) -> np.ndarray:
    return ((k + 127) << 23).astype(np.int32).view(np.float32)


def _exponent(a: np.ndarray) -> np.ndarray:
    return ((a.view(np.int32).astype(np.int64) >> 23) & 0xFF) - 127


def _as_u(u: np.ndarray | float) -> np.ndarray:
    return np.asarray(u, dtype=np.float32)


def _round_float(v: np.ndarray, fmt: FloatFormat, u: np.ndarray | float) -> np.ndarray:
    a = np.abs(v)
    k = np.maximum(_exponent(a), fmt.min_exponent) - fmt.mantissa_bits
    q = np.floor(a * _pow2(-k) + _as_u(u)) * _pow2(k)
    return np.copysign(np.minimum(q, np.float32(fmt.max_value)), v).astype(np.float32)


def _e4m3_bits(q: np.ndarray) -> np.ndarray:
    a = np.abs(q)
    sign = (q.view(np.int32).astype(np.int64) >> 31) & 1
    mant = (a.view(np.int32).astype(np.int64) >> 20) & 7
    with np.errstate(invalid="ignore"):
        bits = np.where(a >= 2.0**-6, ((_exponent(a) + 7) << 3) | mant, (a * np.float32(2.0**9)).astype(np.int64))
    return ((sign << 7) | bits).astype(np.uint8)


def _e4m3_values(bits: np.ndarray) -> np.ndarray:
    b = bits.astype(np.int64)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float32)
    mag = np.where(e == 0, m * np.float32(2.0**-9), (np.float32(8.0) + m) * _pow2(e - 10))
    return np.where((b >> 7) == 1, -mag, mag).astype(np.float32)


def encode(x: np.ndarray, dtype: DType, group: int, u: np.ndarray | float = 0.5) -> np.ndarray:
    """uint8 ``[B, nbytes]``: values then float32 scales of float ``x`` ``[B, numel]`` (float16: no scales)
    rounded with ``u`` (0.5: nearest; ``[B, numel]`` uniforms: stochastic), as :func:`.quant.encode`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.shape[0]
    if dtype is DType.FLOAT16:
        return _round_float(x, FORMATS[dtype], u).astype(np.float16).view(np.uint8).reshape(rows, -1)
    grouped = x.reshape(rows, -1, group)
    scale = (np.abs(grouped).max(axis=2) / np.float32(dtype.quant_max)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    v = np.where(scale[..., None] > 0, grouped / safe[..., None], np.float32(0.0)).reshape(rows, -1)
    if dtype is DType.INT8:
        values = np.clip(np.floor(v + _as_u(u)), -127, 127).astype(np.int8)
        values = values.view(np.uint8)
    else:
        values = _e4m3_bits(_round_float(v, FORMATS[dtype], u))
    return np.concatenate([values, np.ascontiguousarray(scale).view(np.uint8)], axis=1)


def decode(raw: np.ndarray, dtype: DType, numel: int, group: int) -> np.ndarray:
    """float32 ``[B, numel]`` from the stored form uint8 ``[B, nbytes]`` (as :func:`.quant.decode`)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if dtype is DType.FLOAT16:
        return raw.view(np.float16).astype(np.float32).reshape(rows, numel)
    values, scales = raw[:, :numel], np.ascontiguousarray(raw[:, numel:]).view(np.float32)
    q = values.view(np.int8).astype(np.float32) if dtype is DType.INT8 else _e4m3_values(values)
    return (q.reshape(rows, -1, group) * scales[..., None]).reshape(rows, numel)

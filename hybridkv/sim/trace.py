"""Mooncake-style jsonl traces: arrivals, lengths and prefix sharing through hash ids.

Each line: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` with one
hash id per 512-token block of the input (equal ids = identical prefix block). Token ids are made
deterministically from the hash ids: id ``h`` becomes a fixed block of 512 tokens seeded by ``h``,
the last block cut to ``input_length``.

Every field is a JSON integer: bools and floats are refused, integral ones such as ``10.0`` too (as
hybridkv's counts refuse ``8.0``), so a length is never rounded or truncated on the way in. A trace,
or a window of one, that holds no request is an error: there is nothing to simulate.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hybridkv.units import as_count

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace line that is not a request (the message names the file and the line, 1-based), or a
    trace or window that holds no request (the message names the file and the window)."""


def _int_field(d: dict, key: str, where: str, minimum: int) -> int:
    """``d[key]`` if it is a JSON integer ``>= minimum`` (not a bool, not a float, even ``10.0``)."""
    v = d[key]
    if type(v) is not int:
        hint = " (JSON integers only: write it without the fraction)" if type(v) is float and v.is_integer() else ""
        raise TraceError(f"{where}: {key} must be an integer, got {json.dumps(v)}{hint}")
    if v < minimum:
        raise TraceError(f"{where}: {key} must be >= {minimum}, got {v}")
    return v


def _parse_line(line: str, where: str, index: int) -> TraceRequest:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected an object with timestamp, input_length, output_length, hash_ids")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in d]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    arrival = _int_field(d, "timestamp", where, 0)
    input_length = _int_field(d, "input_length", where, 1)
    output_length = _int_field(d, "output_length", where, 1)
    ids = d["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {json.dumps(ids)}")
    bad = next((h for h in ids if type(h) is not int or h < 0), None)
    if bad is not None:
        raise TraceError(f"{where}: hash_ids must be integers >= 0, got {json.dumps(bad)}")
    req = TraceRequest(index, arrival, input_length, output_length, tuple(ids))
    if len(req.hash_ids) != -(-req.input_length // MOONCAKE_BLOCK_TOKENS):
        raise TraceError(
            f"{where}: {len(req.hash_ids)} hash_ids for {req.input_length} input tokens "
            f"(expect one per {MOONCAKE_BLOCK_TOKENS}-token block)"
        )
    return req


def load_trace(
    path: str | Path = DEFAULT_TRACE,
    limit: int | None = None,
    start_ms: int = 0,
    end_ms: int | None = None,
    rate_scale: float = 1.0,
) -> list[TraceRequest]:
    """Read a Mooncake-style jsonl trace.

    ``start_ms`` / ``end_ms``: keep arrivals in ``[start_ms, end_ms)`` (trace time), shifted so the
    window starts at 0. ``rate_scale``: arrival rate multiplier (2.0 = timestamps halved).
    ``limit``: keep the first ``limit`` requests of the window. Blank lines are skipped.

    Raises, before reading: ``TypeError`` / ``ValueError`` for arguments that are not integers
    (``limit >= 1``, ``start_ms >= 0``, ``end_ms > start_ms``) or a ``rate_scale`` that is not a
    finite positive number; ``FileNotFoundError`` naming the path. While reading:
    :class:`TraceError` naming the first bad line, or the file or window if it holds no request.
    """
    limit = None if limit is None else as_count(limit, "limit", 1)
    start_ms = as_count(start_ms, "start_ms", 0)
    if end_ms is not None:
        end_ms = as_count(end_ms, "end_ms", 0)
        if end_ms <= start_ms:
            raise ValueError(f"the trace window [{start_ms}, {end_ms}) ms is empty: end_ms must be above start_ms")
    if isinstance(rate_scale, bool) or not isinstance(rate_scale, numbers.Real):
        raise TypeError(f"rate_scale must be a number, got {rate_scale!r}")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a finite positive number, got {rate_scale}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {p} not found: pass --trace PATH (Mooncake jsonl)")
    out: list[TraceRequest] = []
    num_lines = 0
    with p.open() as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            num_lines += 1
            req = _parse_line(line, f"{p}:{lineno}", len(out))
            if req.arrival_ms < start_ms or (end_ms is not None and req.arrival_ms >= end_ms):
                continue
            arrival = round((req.arrival_ms - start_ms) / rate_scale)
            out.append(req if arrival == req.arrival_ms else replace(req, arrival_ms=arrival))
    if not num_lines:
        raise TraceError(f"{p}: the trace holds no request (an empty file or only blank lines)")
    if not out:
        window = f"[{start_ms}, {'end' if end_ms is None else end_ms}) ms"
        raise TraceError(f"{p}: no request of the trace arrives in the window {window} (--trace-start / --trace-end)")
    return out


class TokenMaker:
    """Deterministic token ids for hash ids (cached per id)."""

    def __init__(self, vocab_size: int = 32000, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}
        self._arrays: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> list[int]:
        b = self._blocks.get(hash_id)
        if b is None:
            rng = np.random.default_rng(hash_id)
            b = rng.integers(0, self.vocab_size, self.block_tokens).tolist()
            self._blocks[hash_id] = b
        return b

    def tokens(self, req: TraceRequest) -> list[int]:
        out: list[int] = []
        for h in req.hash_ids:
            out.extend(self.block(h))
        return out[: req.input_length]

    def array(self, req: TraceRequest) -> np.ndarray:
        """:meth:`tokens` as an int64 array (the prefix cache hashes arrays without converting)."""
        arrays = self._arrays
        parts = []
        for h in req.hash_ids:
            a = arrays.get(h)
            if a is None:
                a = arrays[h] = np.array(self.block(h), dtype=np.int64)
            parts.append(a)
        out = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return out[: req.input_length]


def iter_tokens(trace: list[TraceRequest], maker: TokenMaker | None = None) -> Iterator[tuple[TraceRequest, list[int]]]:
    maker = maker or TokenMaker()
    for req in trace:
        yield req, maker.tokens(req)

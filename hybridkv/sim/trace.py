"""Mooncake-style jsonl traces: arrivals, lengths and prefix sharing through hash ids.

Each line: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` with one
hash id per 512-token block of the input (equal ids = identical prefix block). Token ids are made
deterministically from the hash ids: id ``h`` becomes a fixed block of 512 tokens seeded by ``h``,
the last block cut to ``input_length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-style jsonl trace; raises ``FileNotFoundError`` naming the path."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {p} not found: pass --trace PATH (Mooncake jsonl)")
    out: list[TraceRequest] = []
    with p.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            d = json.loads(line)
            out.append(
                TraceRequest(
                    i,
                    int(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            )
    return out


class TokenMaker:
    """Deterministic token ids for hash ids (cached per id)."""

    def __init__(self, vocab_size: int = 32000, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}

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


def iter_tokens(trace: list[TraceRequest], maker: TokenMaker | None = None) -> Iterator[tuple[TraceRequest, list[int]]]:
    maker = maker or TokenMaker()
    for req in trace:
        yield req, maker.tokens(req)

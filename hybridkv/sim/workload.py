"""Workloads for the simulator: a seeded synthetic generator and Mooncake-style traces.

Both describe a prompt the way the Mooncake trace does: ``hash_ids``, one id per 512-token block
(equal ids = identical content), cut to ``num_prompt_tokens``. Token ids are made from the ids only
when a request is submitted (:meth:`Workload.token_ids`), so a long trace costs no memory up front.
Token ids are drawn from a 256-id vocabulary: they only name content for the prefix cache's hash
chain (a 512-token block from 256 ids never collides by chance), and CPython keeps the ints 0-255 as
shared objects, so a queued 100k-token prompt costs 8 bytes per token.

Synthetic workload (:class:`SyntheticConfig`): Poisson or gamma arrivals, lognormal prompt and
output lengths, shared-prefix groups (a "system prompt" of whole blocks that a share of requests
starts with) and multi-turn sessions (a follow-up turn repeats the previous turn's blocks, the reply
included in its last block, then adds new ones; it arrives a think time after the previous turn
arrived, open loop).
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.sim.trace import MOONCAKE_BLOCK_TOKENS, load_trace
from hybridkv.units import as_count

SIM_VOCAB = 256


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload: arrives at ``arrival_s``; its prompt is ``hash_ids`` cut to
    ``num_prompt_tokens``; it generates ``max_new_tokens``."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_new_tokens: int
    hash_ids: tuple[int, ...]
    group: int = -1  # shared-prefix group, -1 = none
    session: int = -1  # multi-turn session, -1 = single turn
    turn: int = 0


@functools.lru_cache(maxsize=8192)
def _block_tokens(hash_id: int) -> tuple[int, ...]:
    rng = np.random.default_rng(hash_id)
    return tuple(rng.integers(0, SIM_VOCAB, MOONCAKE_BLOCK_TOKENS, dtype=np.int64).tolist())


class Workload:
    """Requests sorted by arrival, and where they came from (for the report)."""

    def __init__(self, requests: list[SimRequest], source: dict[str, Any]) -> None:
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.source = source

    def __len__(self) -> int:
        return len(self.requests)

    def check_runnable(self) -> None:
        """Raise ``ValueError`` if there is nothing to simulate (no request): a run of zero steps
        would write empty reports and exit as if it had worked."""
        if not self.requests:
            where = f" ({self.source['path']})" if self.source.get("path") else ""
            raise ValueError(f"the workload{where} holds no request: nothing to simulate")

    @staticmethod
    def token_ids(req: SimRequest) -> list[int]:
        """The prompt's token ids: each hash id's fixed 512-token block, cut to the prompt length."""
        out: list[int] = []
        for h in req.hash_ids:
            out.extend(_block_tokens(h))
        del out[req.num_prompt_tokens :]
        return out

    def summary(self) -> dict[str, Any]:
        n = len(self.requests)
        prompts = np.array([r.num_prompt_tokens for r in self.requests], dtype=np.float64)
        outputs = np.array([r.max_new_tokens for r in self.requests], dtype=np.float64)
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s if n else 0.0
        return {
            **self.source,
            "num_requests": n,
            "arrival_span_s": round(span, 3),
            "mean_prompt_tokens": round(float(prompts.mean()), 1) if n else 0.0,
            "mean_output_tokens": round(float(outputs.mean()), 1) if n else 0.0,
            "max_total_tokens": int((prompts + outputs).max()) if n else 0,
        }


class Arrivals(enum.Enum):
    POISSON = "poisson"
    GAMMA = "gamma"  # bursty: gaps ~ Gamma(shape, mean / shape); shape < 1 is burstier than Poisson


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Seeded synthetic workload; lengths are lognormal with the given median and sigma, clipped."""

    num_requests: int = 160
    rate: float = 4.0  # requests per second
    arrivals: Arrivals = Arrivals.GAMMA
    gamma_shape: float = 0.2  # bursty: bursts are what push a 14 GiB MiniMax-M1 cache into preemption
    prompt_median: int = 12000
    prompt_sigma: float = 0.8
    max_prompt_tokens: int = 65536
    output_median: int = 1024
    output_sigma: float = 0.6
    max_output_tokens: int = 4096
    num_prefix_groups: int = 6
    prefix_share: float = 0.5  # fraction of first turns that start with a group prefix
    prefix_blocks: int = 4  # 512-token blocks in a group prefix
    session_share: float = 0.25  # fraction of requests that are follow-up turns
    max_turns: int = 4
    think_time_s: float = 8.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrivals", Arrivals(self.arrivals))
        if self.num_requests < 1 or self.rate <= 0 or self.gamma_shape <= 0:
            raise ValueError("num_requests >= 1, rate > 0 and gamma_shape > 0 are required")
        if not (0 <= self.prefix_share <= 1 and 0 <= self.session_share < 1):
            raise ValueError("prefix_share must be in [0, 1] and session_share in [0, 1)")
        if min(self.prompt_median, self.output_median, self.max_prompt_tokens, self.max_output_tokens) < 1:
            raise ValueError("prompt and output lengths must be >= 1")


def synthetic(cfg: SyntheticConfig) -> Workload:
    """Generate ``cfg.num_requests`` requests (same config, same requests)."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    mean_gap = 1.0 / cfg.rate
    if cfg.arrivals is Arrivals.POISSON:
        gaps = rng.exponential(mean_gap, n)
    else:
        gaps = rng.gamma(cfg.gamma_shape, mean_gap / cfg.gamma_shape, n)
    starts = np.cumsum(gaps) - gaps[0]
    prompt = np.clip(rng.lognormal(np.log(cfg.prompt_median), cfg.prompt_sigma, n), 1, cfg.max_prompt_tokens)
    output = np.clip(rng.lognormal(np.log(cfg.output_median), cfg.output_sigma, n), 1, cfg.max_output_tokens)
    next_id = [1 << 40]  # hash ids of this generator; group prefixes get the first ones

    def fresh(k: int) -> tuple[int, ...]:
        ids = tuple(range(next_id[0], next_id[0] + k))
        next_id[0] += k
        return ids

    groups = [fresh(cfg.prefix_blocks) for _ in range(cfg.num_prefix_groups)]
    out: list[SimRequest] = []
    sessions: list[tuple[SimRequest, int]] = []  # (last turn, session id) of sessions that may continue
    i = 0
    while len(out) < n:
        p, o = int(prompt[i]), int(output[i])
        if sessions and rng.random() < cfg.session_share:
            k = int(rng.integers(len(sessions)))
            prev, sid = sessions[k]
            new_blocks = -(-p // MOONCAKE_BLOCK_TOKENS)
            ids = prev.hash_ids + fresh(new_blocks)
            total = min(len(prev.hash_ids) * MOONCAKE_BLOCK_TOKENS + p, cfg.max_prompt_tokens)
            ids = ids[: -(-total // MOONCAKE_BLOCK_TOKENS)]
            arrival = prev.arrival_s + float(rng.exponential(cfg.think_time_s))
            req = SimRequest(f"s{sid}t{prev.turn + 1}", arrival, total, o, ids, prev.group, sid, prev.turn + 1)
            if req.turn + 1 < cfg.max_turns and total < cfg.max_prompt_tokens:
                sessions[k] = (req, sid)
            else:
                sessions.pop(k)
        else:
            group = int(rng.integers(len(groups))) if groups and rng.random() < cfg.prefix_share else -1
            head = groups[group] if group >= 0 else ()
            p = max(p, len(head) * MOONCAKE_BLOCK_TOKENS + 1) if head else p
            p = min(p, cfg.max_prompt_tokens)
            ids = (head + fresh(-(-p // MOONCAKE_BLOCK_TOKENS)))[: -(-p // MOONCAKE_BLOCK_TOKENS)]
            sid = len(out)
            req = SimRequest(f"r{len(out)}", float(starts[i]), p, o, ids, group, sid, 0)
            sessions.append((req, sid))
        out.append(req)
        i += 1
    source = {"kind": "synthetic"} | {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(cfg).items()}
    return Workload(out, source)


def _seconds(value: object, what: str) -> float:
    """A finite number of seconds ``>= 0`` (``TypeError`` for bools and non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value}")
    return v


def from_trace(
    path: str | Path,
    limit: int | None = None,
    start_s: float = 0.0,
    end_s: float | None = None,
    rate_scale: float = 1.0,
    max_output_tokens: int | None = None,
) -> Workload:
    """A Mooncake-style jsonl trace (see :func:`~hybridkv.sim.trace.load_trace`): window
    ``[start_s, end_s)`` of trace time, arrival rate times ``rate_scale``, the first ``limit``
    requests, outputs truncated to ``max_output_tokens``.

    Raises before reading: ``TypeError`` / ``ValueError`` if ``start_s`` is not a finite number
    ``>= 0``, ``end_s`` not one above ``start_s``, or ``max_output_tokens`` not an integer ``>= 1``;
    then what :func:`~hybridkv.sim.trace.load_trace` raises (a trace or window without a request
    is a :class:`~hybridkv.sim.trace.TraceError`)."""
    start_s = _seconds(start_s, "start_s")
    if end_s is not None:
        end_s = _seconds(end_s, "end_s")
        if end_s <= start_s:
            raise ValueError(f"the trace window [{start_s}, {end_s}) s is empty: end_s must be above start_s")
    if max_output_tokens is not None:
        max_output_tokens = as_count(max_output_tokens, "max_output_tokens", 1)
    trace = load_trace(
        path,
        limit,
        start_ms=round(start_s * 1000),
        end_ms=None if end_s is None else round(end_s * 1000),
        rate_scale=rate_scale,
    )
    cap = max_output_tokens or 1 << 62
    reqs = [
        SimRequest(f"t{t.index}", t.arrival_ms / 1000.0, t.input_length, min(t.output_length, cap), t.hash_ids)
        for t in trace
    ]
    source = {
        "kind": "trace",
        "path": Path(path).name,
        "limit": limit,
        "start_s": start_s,
        "end_s": end_s,
        "rate_scale": rate_scale,
        "max_output_tokens": max_output_tokens,
    }
    return Workload(reqs, source)

"""Sampling and drafting for the transformers runner.

Sampling is a pure function of (logits, the request's seed, the position), so a request samples the
same tokens whatever it is batched with, preempted or forked next to: greedy (``temperature == 0``)
is argmax; otherwise argmax(logits / temperature + Gumbel noise seeded by (seed, position)), an exact
sample of softmax(logits / temperature). Draft verification keeps a draft while it equals the token
sampled at its position, so speculative decoding never changes what a request generates.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0: greedy. ``seed``: the noise stream of seeded sampling. ``n``: parallel samples:
    the request and ``n - 1`` children ``(request_id, i)`` (seeds :meth:`child`), each drawing its own
    first token from the prompt's last logits; the children are forked (:meth:`Scheduler.fork`) at
    that branch point (see :meth:`~.engine.HFEngine.add_request`)."""

    temperature: float = 0.0
    seed: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``TypeError`` / ``ValueError`` on a field the sampler cannot use (the engine checks
        again at ``add_request``, before it queues anything)."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
            raise TypeError(f"temperature must be a number, got {t!r}")
        if not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be finite and >= 0, got {t}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")

    def child(self, index: int) -> SamplingParams:
        """The parameters of parallel sample ``index`` (its own seed, ``n = 1``)."""
        return SamplingParams(self.temperature, zlib.crc32(f"{self.seed}/{index}".encode()), 1)


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token after ``position`` from its ``logits`` ``[vocab]``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    u = np.random.default_rng([params.seed & 0xFFFFFFFF, position]).random(logits.shape[-1])
    gumbel = -np.log(-np.log(np.clip(u, 1e-12, 1 - 1e-12)))
    return int(np.argmax(logits.double().cpu().numpy() / params.temperature + gumbel))


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``token_ids`` (the request's prompt and outputs so far)."""

    def propose(self, request_id: object, token_ids: list[int], k: int) -> list[int]: ...


@dataclass
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens (``n`` from
    ``max_n`` down to ``min_n``) and propose the tokens that followed it."""

    max_n: int = 3
    min_n: int = 1

    def propose(self, request_id: object, token_ids: list[int], k: int) -> list[int]:
        ids = list(token_ids)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    return ids[start + n : start + n + k]
        return []


class ModelDrafter:
    """A small causal LM as drafter: ``k`` greedy tokens, each from a whole forward of the sequence
    (no cache: drafter models are tiny, and the drafter never touches hybridkv's pools)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()

    @torch.no_grad()
    def propose(self, request_id: object, token_ids: list[int], k: int) -> list[int]:
        ids = list(token_ids)
        out = []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
        return out

"""A stand-in for a model forward: outputs for a :class:`StepPlan` without running anything.

Used by tests, benchmarks and the simulator to drive a :class:`Scheduler`. Sampled token ids are
``step * 1000 + row`` (deterministic, so tests can check where tokens went); accepted drafts are
drawn from ``accept_rate`` (one Bernoulli per draft, stopping at the first rejection).
"""

from __future__ import annotations

import random

from hybridkv.scheduler_adapter.requests import StepOutputs, StepPlan


class SyntheticEngine:
    def __init__(self, accept_rate: float = 0.7, seed: int = 0) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.accept_rate = accept_rate
        self.rng = random.Random(seed)

    def run(self, plan: StepPlan) -> StepOutputs:
        sampled: dict = {}
        accepted: dict = {}
        for row_index, row in enumerate(plan.scheduled):
            if not row.samples:
                continue
            a = 0
            while a < row.num_drafts and self.rng.random() < self.accept_rate:
                a += 1
            token = plan.step * 1000 + row_index
            sampled[row.request_id] = [token] * (a + 1)
            if row.num_drafts:
                accepted[row.request_id] = a
        return StepOutputs(sampled, frozenset(), accepted)

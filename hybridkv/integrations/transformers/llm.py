"""A five-line API over :class:`~.engine.HFEngine`::

from hybridkv.integrations.transformers import LLM
llm = LLM(model, num_blocks=128, num_host_blocks=64)       # any served transformers model
llm.add_request("a", [1, 2, 3], max_new_tokens=8)           # greedy; SamplingParams for more
outputs = llm.run()                                         # request id -> generated token ids
print(llm.events, llm.stats[-1])                            # what happened; per-step stats
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hybridkv.integrations.transformers.engine import EngineConfig, Events, HFEngine, StepStats
from hybridkv.integrations.transformers.sampling import Drafter, NgramDrafter, SamplingParams


class LLM:
    """Add requests, :meth:`run`, read the tokens. Keyword arguments are :class:`EngineConfig` fields;
    ``drafter`` defaults to n-gram lookup when ``num_speculative_tokens > 0``; ``lightning_backend``
    (MiniMax only: ``"naive"`` or ``"triton"``) runs its lightning layers on hybridkv's paged kernels."""

    def __init__(
        self,
        model: torch.nn.Module,
        drafter: Drafter | None = None,
        lightning_backend: str | None = None,
        **config: Any,
    ) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise TypeError(f"unknown LLM options {unknown}: the options are {sorted(fields)}")
        cfg = EngineConfig(**config)
        if cfg.num_speculative_tokens and drafter is None:
            drafter = NgramDrafter()
        self.engine = HFEngine(model, cfg, drafter)
        if lightning_backend is not None:
            from hybridkv.integrations.transformers.lightning import use_paged_lightning

            use_paged_lightning(self.engine, lightning_backend)

    def add_request(
        self,
        request_id: Any,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
    ) -> None:
        self.engine.add_request(request_id, prompt, max_new_tokens, params)

    def abort(self, request_id: Any) -> None:
        self.engine.abort(request_id)

    def step(self) -> StepStats:
        """One engine step; returns its stats."""
        self.engine.step()
        return self.engine.stats[-1]

    def run(self, progress=None) -> dict[Any, list[int]]:
        """Run until every request finished; returns request id -> generated tokens (the samples of a
        request with ``n > 1`` as ``(request_id, i)``). ``progress``: called with the requests
        finished in each step. An exception inside a step is raised once the step's requests are
        aborted (:attr:`failed`); ``run()`` again finishes the others."""
        self.engine.run(progress=progress)
        return {rid: toks for rid, toks in self.engine.outputs().items()}

    @property
    def failed(self) -> dict[Any, BaseException]:
        """Requests aborted because a step raised -> that exception (:meth:`HFEngine.step`)."""
        return self.engine.failed

    @property
    def events(self) -> Events:
        return self.engine.events

    @property
    def stats(self) -> list[StepStats]:
        return self.engine.stats

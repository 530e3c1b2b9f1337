"""Admission of waiting requests, the part of :class:`~hybridkv.scheduler_adapter.scheduler.Scheduler`
that turns the manager's one count and the :class:`AdmissionPolicy` into the requests a step admits
(step 3 of the scheduler's module docstring), and the builder a step fills.

:class:`AdmissionMixin` is a base of ``Scheduler`` and works on its queues, config and manager.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from hybridkv.blockmgr.records import BlockCopies, RequestId, SwapPlan
from hybridkv.scheduler_adapter.align import aligned_chunk, same_step_branch, state_cached_this_step
from hybridkv.scheduler_adapter.requests import (
    AdmissionPolicy,
    Preemption,
    RequestState,
    SchedRequest,
    ScheduledRequest,
    StateExport,
)
from hybridkv.scheduler_adapter.scheduler_config import request_key


class AdmissionMixin:
    """``Scheduler._admit_waiting`` and the admission policy's counts."""

    def _admit_waiting(self, s: _StepBuilder) -> None:
        k = self.config.num_speculative_tokens
        while self.waiting and s.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            total = req.num_tokens
            ids = req.token_ids() if req.prompt_token_ids is not None else None
            cached = self.manager.match_prefix(ids, total) if ids is not None else 0
            n = min(total - cached, s.budget)
            if ids is not None and not aligned_chunk(self.manager, self.config, req, cached, n):
                return  # vllm_align: no block-aligned first chunk fits this step's budget
            if self._in_place and ids is not None and state_cached_this_step(
                self.manager, self.requests, ids, cached, s.scheduled
            ):
                return  # vllm_align: its hit would be a state cached in this step (vLLM waits a step)
            if ids is not None and self.manager.plan_admission(cached + n, k, ids).num_cached_tokens != cached:
                # the manager would admit it as a miss (the hit pins more than it saves): do so
                # without token ids, so the first chunk is one allocation
                ids, cached, n = None, 0, min(total, s.budget)
            extra = {} if ids is None else {"token_ids": ids}
            if not self.manager.can_allocate(cached + n, k, **extra):  # the one count, for this chunk
                return
            # a re-admitted decode (preempted by recompute after it sampled, its hit all but the last
            # token) appends its drafts with that token: count them too
            decode = ids is not None and total - cached == 1 and bool(req.output_token_ids)
            drafts = self._drafts(req, s.budget) if decode else 0
            grow = self._kv_growth(cached + n, drafts) if drafts else 0
            if grow and (self.manager.blocks_to_admit(cached + n, k, ids) + grow + self.manager.watermark_blocks
                         > self.manager.num_available_blocks):
                return
            if not self.config.chunked_prefill and n < total - cached:
                return
            if self.config.admission is not AdmissionPolicy.FIRST_CHUNK and not self._whole_fits(req, ids, k, s):
                return
            self.waiting.pop(0)
            req.state = RequestState.RUNNING
            req.num_spec_sets = k
            bisect.insort(self.running, req, key=request_key)
            s.admitted.append(req.request_id)
            if ids is None:  # admit with the first chunk in one call
                self.manager.allocate(req.request_id, n, k)
                req.num_computed_tokens, req.num_allocated_tokens, req.num_cached_tokens = 0, n, 0
                self._row(req, n, 0, s)
                self._promise(req, s)
                continue
            # with token ids: take the hit, then grow chunk by chunk, ending chunks where the
            # prefix cache wants a checkpoint
            alloc = self.manager.allocate(req.request_id, cached, k, **extra)
            if alloc.num_cached_tokens != cached:
                raise AssertionError(f"prefix hit {alloc.num_cached_tokens} != match_prefix {cached}")
            if len(alloc.copies):
                s.copies = s.copies.concat(alloc.copies)
            req.num_computed_tokens = req.num_allocated_tokens = req.num_cached_tokens = cached
            req.token_ids_given = len(ids)
            if self._in_place:
                same_step_branch(self.manager, self.requests, req, ids, s.scheduled)
            n, drafts = self._demand(req, s.budget)
            self._run(req, n, drafts, s, self._export_positions(req, n))
            self._promise(req, s)

    def _export_positions(self, req: SchedRequest, n: int) -> tuple[int, ...]:
        """The positions whose states the prefill kernel exports from inside ``req``'s next ``n``
        tokens (their sets are reserved with the chunk), or none (``_exports``: the kernel can)."""
        if not self._exports or n < 2 or not req.token_ids_given:
            return ()
        start = req.num_computed_tokens
        return self.manager.export_positions(req.request_id, start, start + n)

    def _whole_fits(self, req: SchedRequest, ids: list[int] | None, k: int, s: _StepBuilder) -> bool:
        """The admission policy's test beyond the first chunk (see :class:`AdmissionPolicy`): the
        blocks of all of ``req``'s known tokens (prefix hit counted) fit in the available blocks;
        under ``RESERVED`` with its decode reserve too, next to what the running requests were
        promised."""
        tokens = req.num_tokens
        if self.config.admission is AdmissionPolicy.RESERVED:
            tokens += self._decode_reserve(req)
        need = self.manager.plan_admission(tokens, k, ids).num_blocks + self.manager.watermark_blocks
        cache = self.manager.prefix_cache
        # vLLM reserves the exported checkpoint's block; with nothing running it gives way (vLLM would
        # wait for ever: no block is freed while nothing runs, and the export is best effort)
        if self._exports and cache is not None and ids is not None and self.running:
            cached = self.manager.match_prefix(ids, req.num_tokens)
            if cache.exported_checkpoint(cached, req.num_tokens, len(ids)) is not None:
                need += self.manager.num_state_blocks
        if self.config.admission is AdmissionPolicy.RESERVED:
            if s.promised < 0:
                s.promised = sum(self._still_needs(r) for r in self.running)
            need += s.promised
        return need <= self.manager.num_available_blocks

    def _decode_reserve(self, req: SchedRequest) -> int:
        """Token slots of ``req``'s next ``decode_reserve_steps`` decode steps (all its remaining
        outputs when None), at most its remaining outputs."""
        steps = self.config.decode_reserve_steps
        remaining = req.num_remaining_tokens
        return remaining if steps is None else min(remaining, steps * (1 + self.config.num_speculative_tokens))

    def _still_needs(self, req: SchedRequest) -> int:
        """KV blocks a running request still takes for its known tokens and its decode reserve."""
        rest = req.num_tokens - req.num_allocated_tokens + self._decode_reserve(req)
        return self._kv_growth(req.num_allocated_tokens, rest)  # (a copy-on-write block is not counted)

    def _promise(self, req: SchedRequest, s: _StepBuilder) -> None:
        """An admitted request's prompt beyond its first chunk joins the promised blocks."""
        if s.promised >= 0:
            s.promised += self._still_needs(req)


@dataclass(slots=True)
class _StepBuilder:
    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    resumed: list[RequestId] = field(default_factory=list)
    admitted: list[RequestId] = field(default_factory=list)
    swap_out: list[SwapPlan] = field(default_factory=list)
    swap_in: list[SwapPlan] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies.empty)
    checkpoints: BlockCopies = field(default_factory=BlockCopies.empty)  # carried from the last update
    exports: list[StateExport] = field(default_factory=list)  # state sets the forward writes an export into
    promised: int = -1  # blocks the running prefills still need (AdmissionPolicy.RESERVED; -1: not counted yet)

"""Prefill/decode disaggregation roles on top of :class:`~hybridkv.scheduler_adapter.scheduler.Scheduler`.

A **prefill role** runs each request up to its first token, then hands it over: the request's
blocks are pinned in an export plan (not freed) while the decode instance reads them, and freed
once that instance's notification arrived (:meth:`PrefillRole.settle`). A **decode role** admits a
request whose blocks arrive from a peer: the import plan allocates them (like a swap-in reserves
device blocks), the bytes are read, and the scheduler then admits it the way it admits a prefix-cache
hit of its whole prompt, so its first row computes the first token's KV and samples the second.

Both roles use the scheduler unchanged, through what it documents: it frees a request that produced
``max_new_tokens`` through ``manager.free`` (the prefill role's manager exports instead, for the
rows that finish their prefill in that update), and admission asks ``match_prefix`` /
``plan_admission`` / ``can_allocate`` / ``allocate`` with token ids (the decode role's manager
answers for an arrived request: its KV is "cached", its blocks are already held). The decode role
needs the prompt's token ids or, without them, makes stand-in ids (only their count matters there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hybridkv.blockmgr.layout import Layout
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import AdmissionPlan, Allocation, BlockCopies, RequestId
from hybridkv.blockmgr.transfer_plans import TransferPlan
from hybridkv.blockmgr.units import cdiv
from hybridkv.scheduler_adapter.requests import StepOutputs, StepPlan, StepResult
from hybridkv.scheduler_adapter.scheduler import Scheduler, SchedulerConfig
from hybridkv.transfer.descriptors import PoolRegions
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.handoff import notification_for, offer_message, pull_request


class Handoff(NamedTuple):
    """A request whose prefill finished here: send ``offer`` to the decode instance with the first token."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...] | None
    num_prompt_tokens: int
    first_token: int
    stopped: bool  # the first token ended the request (a stop condition): drop it, nothing to decode
    offer: bytes


class _PrefillManager(HybridBlockManager):
    """Exports (instead of freeing) the requests the prefill role hands over in the current update."""

    def __init__(self, layout: Layout, **kwargs: object) -> None:
        super().__init__(layout, **kwargs)  # type: ignore[arg-type]
        self.handing_over: frozenset[RequestId] = frozenset()
        self.exports: dict[RequestId, TransferPlan] = {}

    def free(self, request_id: RequestId) -> None:
        if request_id in self.handing_over:
            self.exports[request_id] = self.export_request(request_id)
            return
        super().free(request_id)


class PrefillRole:
    """A scheduler that prefills and hands requests over. ``pool``: this instance's registered pool.

    Each request runs with ``max_new_tokens=1``; :meth:`update` returns the :class:`Handoff` of every
    request that sampled its first token. Its blocks stay held (pinned) until :meth:`settle` sees the
    decode instance's notification (then they are freed) or :meth:`cancel` gives up on the peer.
    """

    def __init__(self, layout: Layout, pool: PoolRegions, config: SchedulerConfig | None = None, **manager_kwargs):
        self.manager = _PrefillManager(layout, **manager_kwargs)
        self.scheduler = Scheduler(self.manager, config)
        self.pool = pool
        self._plan: StepPlan | None = None

    def add_request(self, request_id: RequestId, prompt: int | Sequence[int], priority: int = 0) -> None:
        self.scheduler.add_request(request_id, prompt, 1, priority)

    def step(self) -> StepPlan:
        self._plan = self.scheduler.step()
        return self._plan

    def update(self, outputs: StepOutputs) -> list[Handoff]:
        """Apply the forward's outputs; requests whose first token was sampled are exported, not freed."""
        if self._plan is None:
            raise TransferError("update() without a step: call step() first")
        plan, self._plan = self._plan, None
        self.manager.handing_over = frozenset(r.request_id for r in plan.scheduled if r.samples)
        try:
            result: StepResult = self.scheduler.update(outputs)
        finally:
            self.manager.handing_over = frozenset()
        out = []
        for rid in result.finished:
            req = self.scheduler.finished.pop(rid)
            export = self.manager.exports[rid]
            out.append(
                Handoff(
                    rid,
                    req.prompt_token_ids,
                    req.num_prompt_tokens,
                    req.output_token_ids[0],
                    rid in outputs.finished,
                    offer_message(export, self.pool),
                )
            )
        return out

    @property
    def num_pending_handoffs(self) -> int:
        return len(self.manager.exports)

    def settle(self, engine: TransferEngine, peer: str) -> list[RequestId]:
        """Free every handed-over request whose notification from ``peer`` arrived (non-blocking)."""
        done = [rid for rid in self.manager.exports if engine.take_notification(peer, notification_for(rid))]
        for rid in done:
            self.manager.exports.pop(rid).commit()
        return done

    def cancel(self, request_id: RequestId) -> None:
        """The decode instance failed or refused the request: abort its export and free it here."""
        self.manager.exports.pop(request_id).abort()
        self.manager.free(request_id)


class _DecodeManager(HybridBlockManager):
    """Presents a request that arrived from a peer as a prefix hit of its whole prompt."""

    def __init__(self, layout: Layout, **kwargs: object) -> None:
        if kwargs.get("prefix_cache") is not None:
            raise ValueError("the decode role's manager takes no prefix cache: arrived requests hold their own blocks")
        super().__init__(layout, **kwargs)  # type: ignore[arg-type]
        self.arrived: dict[RequestId, tuple[int, ...]] = {}  # request -> token ids its imported KV holds
        self._by_ids: dict[tuple[int, ...], int] = {}  # token ids -> arrivals holding them

    def arrive(self, request_id: RequestId, token_ids: tuple[int, ...]) -> None:
        self.arrived[request_id] = token_ids
        self._by_ids[token_ids] = self._by_ids.get(token_ids, 0) + 1

    def _arrival(self, token_ids: Sequence[int] | None, num_tokens: int) -> int:
        """Tokens an arrival holding a prefix of ``token_ids`` covers (0: none)."""
        if token_ids is None or not self._by_ids:
            return 0
        for n in sorted({len(ids) for ids in self._by_ids}, reverse=True):  # the longest held prefix
            if n <= num_tokens and tuple(token_ids[:n]) in self._by_ids:
                return n
        return 0

    def _growth(self, held: int, num_tokens: int, num_speculative: int) -> int:
        kv = max(0, cdiv(num_tokens, self.block_size) - cdiv(held, self.block_size)) if self._has_kv else 0
        return kv + num_speculative * self.num_state_blocks

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        held = self._arrival(token_ids, len(token_ids) if max_tokens is None else max_tokens)
        return held or super().match_prefix(token_ids, max_tokens)

    def plan_admission(
        self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None
    ) -> AdmissionPlan:
        held = self._arrival(token_ids, num_tokens)
        if held:
            return AdmissionPlan(self._growth(held, num_tokens, num_speculative), held)
        return super().plan_admission(num_tokens, num_speculative, token_ids)

    def can_allocate(self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None) -> bool:
        held = self._arrival(token_ids, num_tokens)
        if held:
            need = self._growth(held, num_tokens, num_speculative)
            return need + self.watermark_blocks <= self.num_available_blocks
        return super().can_allocate(num_tokens, num_speculative, token_ids)

    def allocate(
        self,
        request_id: RequestId,
        num_tokens: int,
        num_speculative: int = 0,
        token_ids: Sequence[int] | None = None,
    ) -> Allocation:
        ids = self.arrived.get(request_id)
        if ids is None:
            return super().allocate(request_id, num_tokens, num_speculative, token_ids)
        if num_tokens != len(ids):
            raise TransferError(f"request {request_id!r} arrived with {len(ids)} tokens, admitted with {num_tokens}")
        if num_speculative:
            self.begin_speculation(request_id, num_speculative)
        del self.arrived[request_id]
        self._by_ids[ids] -= 1
        if not self._by_ids[ids]:
            del self._by_ids[ids]
        return Allocation(len(ids), BlockCopies.empty())


class DecodeRole:
    """A scheduler that decodes requests whose KV and state arrive from prefill instances."""

    def __init__(self, layout: Layout, pool: PoolRegions, config: SchedulerConfig | None = None, **manager_kwargs):
        self.manager = _DecodeManager(layout, **manager_kwargs)
        self.scheduler = Scheduler(self.manager, config)
        self.pool = pool
        self._num_stand_ins = 0

    def can_receive(self, num_prompt_tokens: int) -> bool:
        return self.manager.can_import(num_prompt_tokens)

    def pull(
        self, engine: TransferEngine, peer: str, handoff: Handoff, max_new_tokens: int, timeout_s: float
    ) -> TransferPlan:
        """Import the handed-over request, READ its blocks from ``peer`` (who is notified), and queue it
        to decode ``max_new_tokens - 1`` more tokens (its first came from the prefill instance).

        Raises :class:`TransferError` (nothing is left here; tell the prefill side to ``cancel``) or the
        manager's allocation errors (retry when blocks are free).
        """
        plan = pull_request(self.manager, engine, peer, handoff.offer, timeout_s)
        ids = handoff.prompt_token_ids
        if ids is None:  # stand-in ids, negative so no real prompt shares them: only their count matters
            self._num_stand_ins += 1
            ids = (-self._num_stand_ins,) * handoff.num_prompt_tokens
        self.manager.arrive(handoff.request_id, tuple(ids))
        self.scheduler.add_request(handoff.request_id, [*ids, handoff.first_token], max(1, max_new_tokens - 1))
        return plan

    def step(self) -> StepPlan:
        return self.scheduler.step()

    def update(self, outputs: StepOutputs) -> StepResult:
        return self.scheduler.update(outputs)

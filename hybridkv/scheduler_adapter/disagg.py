"""Prefill/decode disaggregation roles on top of :class:`~hybridkv.scheduler_adapter.scheduler.Scheduler`.

A **prefill role** runs each request up to its first token, then hands it over: the request's
blocks are pinned in an export plan (not freed) while the decode instance reads them, and freed
once that instance's notification arrived (:meth:`PrefillRole.settle`). A request whose first token
was a stop is freed at once (nothing to decode). A **decode role** admits a request whose blocks
arrive from a peer: the import plan allocates them, the bytes are read, and the request waits as an
**arrival**, holding its blocks, until the scheduler admits it; its first row computes the first
token's KV at position ``num_prompt_tokens`` and samples the second.

Both roles use the scheduler's queues and planning unchanged. The prefill role's manager exports
(instead of freeing) the rows that finish their prefill in an update. The decode role's scheduler
admits arrivals before it resumes swapped requests or admits waiting ones, since arrivals already
hold their blocks and need at most their first row's growth: a request preempted by recompute that
waits ahead of an arrival cannot block it. A hand-off is pulled only when its import, its first
row's growth and the growth promised to the arrivals already held fit together, so held arrivals
alone never fill the pool.

Requests handed over without their prompt's token ids get stand-in ids (``-1``), so the decode
role can never recompute them: they are preempted by swap only. The decode role reserves host
blocks for each such request (for its largest size) when it pulls it, refuses one it has no host
pool or room for (before anything changes), and keeps the host room they need free of other swaps.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestId, SwapPlan
from hybridkv.blockmgr.transfer_plans import TransferPlan
from hybridkv.errors import (
    DuplicateRequestError,
    HostPoolExhaustedError,
    NoFreeBlocksError,
    RequestStateError,
    RequestTooLargeError,
    UnknownRequestError,
)
from hybridkv.planner.layout import Layout
from hybridkv.scheduler_adapter.gpu import PreemptionMode
from hybridkv.scheduler_adapter.preemption import Preemptor
from hybridkv.scheduler_adapter.requests import (
    RequestState,
    SchedRequest,
    StepOutputs,
    StepPlan,
    StepResult,
)
from hybridkv.scheduler_adapter.scheduler import Scheduler, SchedulerConfig
from hybridkv.transfer.descriptors import PoolRegions, check_compatible, layout_signature
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import HandoffRefusedError, TransferError
from hybridkv.transfer.handoff import (
    check_engine,
    check_peer,
    check_timeout,
    notification_for,
    offer_message,
    parse_offer,
    read_offered,
    wire_request_id,
)
from hybridkv.units import as_count, cdiv

STAND_IN_TOKEN = -1
"""The token id the decode role puts in place of prompt ids it was not given (never computed)."""


class Handoff(NamedTuple):
    """A request whose prefill finished here: send ``offer`` to the decode instance with the first token.

    ``stopped``: the first token ended the request (a stop condition). Its blocks were freed here at
    once and ``offer`` is None: there is nothing to decode, nothing to send and nothing to cancel.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...] | None
    num_prompt_tokens: int
    first_token: int
    stopped: bool
    offer: bytes | None


def _check_role_args(layout: object, pool: object, config: object) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"pool must be PoolRegions (this instance's registered pool), got {type(pool).__name__}")
    if config is not None and not isinstance(config, SchedulerConfig):
        raise TypeError(f"config must be a SchedulerConfig or None, got {type(config).__name__}")
    check_compatible(layout, layout_signature(pool.layout))
    if pool.num_blocks < layout.num_blocks:
        raise ValueError(
            f"the registered pool has {pool.num_blocks} blocks, the layout {layout.num_blocks}: register the whole pool"
        )


def _token_ids(prompt: object, what: str) -> int | tuple[int, ...]:
    """A prompt as a token count (``int >= 1``) or a tuple of Python ints; ``TypeError`` otherwise."""
    if isinstance(prompt, int | np.integer) and not isinstance(prompt, bool | np.bool_):
        return as_count(prompt, what, 1)
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | np.ndarray):
        raise TypeError(f"{what} must be a token count or a sequence of token ids, got {type(prompt).__name__}")
    ids = []
    for t in prompt:
        if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
            raise TypeError(f"{what}: token ids must be integers, got {t!r} ({type(t).__name__})")
        ids.append(int(t))
    if not ids:
        raise ValueError(f"{what} must hold at least one token")
    return tuple(ids)


# ---- prefill -------------------------------------------------------------------------------------
class _PrefillManager(HybridBlockManager):
    """Exports (instead of freeing) the requests the prefill role hands over in the current update."""

    def __init__(self, layout: Layout, **kwargs: Any) -> None:
        super().__init__(layout, **kwargs)
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
    decode instance's notification (then they are freed) or :meth:`cancel` gives up on the peer; a
    request stopped by its first token is freed at once.
    """

    def __init__(
        self, layout: Layout, pool: PoolRegions, config: SchedulerConfig | None = None, **manager_kwargs: Any
    ) -> None:
        _check_role_args(layout, pool, config)
        self.manager = _PrefillManager(layout, **manager_kwargs)
        self.scheduler = Scheduler(self.manager, config)
        self.pool = pool
        self._plan: StepPlan | None = None

    def add_request(self, request_id: RequestId, prompt: int | Sequence[int], priority: int = 0) -> None:
        """Queue a request to prefill. ``request_id``: a ``str`` or an ``int`` (numpy integers are
        converted), since it travels in the hand-off's JSON messages; anything else raises
        ``TypeError``. Raises :class:`DuplicateRequestError` for an id that is queued, running,
        finished and not popped, or still handed over (its export pending), and the scheduler's errors."""
        rid = wire_request_id(request_id)
        ids = _token_ids(prompt, f"request {rid!r} prompt")
        priority = as_count(priority, "priority", -(1 << 62))
        if rid in self.manager.requests:
            raise DuplicateRequestError(
                f"request {rid!r} is still handed over (its export is pending): settle or cancel it first"
            )
        self.scheduler.add_request(rid, ids, 1, priority)

    def step(self) -> StepPlan:
        """Plan the next forward (the scheduler's :meth:`~Scheduler.step`)."""
        self._plan = self.scheduler.step()
        return self._plan

    def update(self, outputs: StepOutputs) -> list[Handoff]:
        """Apply the forward's outputs; requests whose first token was sampled are exported, not freed,
        except those the first token stopped (``outputs.finished``): those are freed and their
        :class:`Handoff` says ``stopped``. On ``ValueError`` (bad outputs) nothing changed and the same
        plan can be updated again."""
        if self._plan is None:
            raise TransferError("update() without a step: call step() first")
        if not isinstance(outputs, StepOutputs):
            raise TypeError(f"outputs must be StepOutputs, got {type(outputs).__name__}")
        plan = self._plan
        stops = frozenset(outputs.finished)
        for row in plan.scheduled:
            req = self.scheduler.requests.get(row.request_id)
            if row.request_id in stops and not row.samples and req is not None and req.state is RequestState.RUNNING:
                raise ValueError(
                    f"request {row.request_id!r} is reported finished by a row that samples nothing (a prefill "
                    "chunk): only a sampled token can stop it"
                )
        self.manager.handing_over = frozenset(r.request_id for r in plan.scheduled if r.samples) - stops
        try:
            result: StepResult = self.scheduler.update(outputs)
        finally:
            self.manager.handing_over = frozenset()
        self._plan = None
        out = []
        for rid in result.finished:
            req = self.scheduler.finished.pop(rid)
            export = self.manager.exports.get(rid)
            offer = offer_message(export, self.pool) if export is not None else None
            out.append(
                Handoff(rid, req.prompt_token_ids, req.num_prompt_tokens, req.output_token_ids[0], offer is None, offer)
            )
        return out

    @property
    def num_pending_handoffs(self) -> int:
        """Handed-over requests whose export is not settled yet."""
        return len(self.manager.exports)

    def settle(self, engine: TransferEngine, peer: str) -> list[RequestId]:
        """Free every handed-over request whose notification from ``peer`` arrived (non-blocking)."""
        check_engine(engine)
        check_peer(peer)
        done = [rid for rid in self.manager.exports if engine.take_notification(peer, notification_for(rid))]
        for rid in done:
            self.manager.exports.pop(rid).commit()
        return done

    def cancel(self, request_id: RequestId) -> None:
        """The decode instance failed or refused the request: abort its export and free it here.

        Raises :class:`UnknownRequestError` when ``request_id`` has no pending hand-off (it was
        settled, cancelled, stopped at its first token, or never handed over)."""
        plan = self.manager.exports.get(request_id) if isinstance(request_id, str | int | np.integer) else None
        if plan is None:
            raise UnknownRequestError(
                f"request {request_id!r} has no pending hand-off here: it was settled (the peer read it), cancelled, "
                "stopped at its first token (freed at once) or never handed over"
            )
        del self.manager.exports[request_id]
        plan.abort()
        self.manager.free(request_id)


# ---- decode --------------------------------------------------------------------------------------
class _DecodeManager(HybridBlockManager):
    """A manager that holds arrivals (imported, committed, not admitted by the scheduler yet) and the
    host blocks reserved for requests that can only be swapped."""

    def __init__(self, layout: Layout, **kwargs: Any) -> None:
        if kwargs.get("prefix_cache") is not None:
            raise ValueError("the decode role's manager takes no prefix cache: arrived requests hold their own blocks")
        super().__init__(layout, **kwargs)
        self.arrived: dict[RequestId, int] = {}  # arrival -> tokens its imported KV holds
        self.swap_only: dict[RequestId, int] = {}  # request without token ids -> host blocks reserved for it

    def free(self, request_id: RequestId) -> None:
        super().free(request_id)
        self.arrived.pop(request_id, None)
        self.swap_only.pop(request_id, None)

    def first_row_blocks(self, num_tokens: int, num_speculative: int) -> int:
        """Blocks an arrival holding ``num_tokens`` takes when admitted: its first row's token, its sets."""
        kv = cdiv(num_tokens + 1, self.block_size) - cdiv(num_tokens, self.block_size) if self._has_kv else 0
        return kv + num_speculative * self.num_state_blocks

    def promised_blocks(self, num_speculative: int) -> int:
        """The first-row blocks of every held arrival."""
        return sum(self.first_row_blocks(n, num_speculative) for n in self.arrived.values())

    def host_reserved_unused(self) -> int:
        """Host blocks reserved for swap-only requests and not held by them now."""
        return sum(n - self.requests[rid].host_blocks.size for rid, n in self.swap_only.items())


class _DecodePreemptor(Preemptor):
    """Never recomputes a request without its token ids (swap only), and keeps the host room
    reserved for those requests free of other swaps."""

    manager: _DecodeManager

    def mode_for(self, req: SchedRequest) -> PreemptionMode:
        m = self.manager
        if req.request_id in m.swap_only:
            return PreemptionMode.SWAP
        mode = super().mode_for(req)
        if mode is PreemptionMode.SWAP:
            rec = m.requests[req.request_id]
            size = rec.num_kv_blocks + m.num_state_blocks
            assert m.host_pool is not None
            if m.host_pool.num_free - size < m.host_reserved_unused():
                return PreemptionMode.RECOMPUTE  # the room is promised to requests that can only swap
        return mode

    def preempt(
        self, req: SchedRequest, allow_swap: bool = True, keep_state: bool = False
    ) -> tuple[PreemptionMode, SwapPlan | None]:
        if req.request_id not in self.manager.swap_only:
            return super().preempt(req, allow_swap, keep_state)
        if not allow_swap:
            raise RequestStateError(f"request {req.request_id!r} has no token ids here: it cannot be recomputed")
        plan = self.manager.swap_out(req.request_id)  # its host room is reserved
        if not self.settle(plan):
            raise RequestStateError(
                f"the swap executor failed on {req.request_id!r}, which has no token ids here and cannot be recomputed"
            )
        return PreemptionMode.SWAP, plan


class _DecodeScheduler(Scheduler):
    """The scheduler of a decode role: arrivals are admitted first (they hold their blocks), ahead of
    swapped requests and of waiting ones, and independent of them."""

    manager: _DecodeManager

    def __init__(self, manager: _DecodeManager, config: SchedulerConfig | None = None) -> None:
        super().__init__(manager, config)
        p = self.preemptor
        self.preemptor = _DecodePreemptor(p.manager, p.mode, p.gpu, p.swap_executor)

    def _is_arrival(self, req: SchedRequest) -> bool:
        return req.request_id in self.manager.arrived

    def _admit_arrivals(self, s: Any) -> None:
        k = self.config.num_speculative_tokens
        m = self.manager
        for req in [r for r in self.waiting if self._is_arrival(r)]:
            if s.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            rid = req.request_id
            held = m.arrived[rid]
            if m.first_row_blocks(held, k) + m.watermark_blocks > m.num_available_blocks:
                continue  # a later arrival may need less (its last block has room)
            if k:
                m.begin_speculation(rid, k)
            del m.arrived[rid]
            self.waiting.remove(req)
            req.state = RequestState.RUNNING
            req.num_spec_sets = k
            req.num_computed_tokens = req.num_allocated_tokens = req.num_cached_tokens = held
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            s.admitted.append(rid)
            n, drafts = self._demand(req, s.budget)
            self._run(req, n, drafts, s, self._export_positions(req, n))

    def _resume_swapped(self, s: Any) -> None:
        self._admit_arrivals(s)
        super()._resume_swapped(s)

    def _admit_waiting(self, s: Any) -> None:
        queue = self.waiting
        held = [r for r in queue if self._is_arrival(r)]
        if not held:
            super()._admit_waiting(s)
            return
        self.waiting = [r for r in queue if not self._is_arrival(r)]  # the others, as if arrivals were not there
        try:
            super()._admit_waiting(s)
        finally:
            queue[:] = sorted([*held, *self.waiting], key=lambda r: r.sort_key)
            self.waiting = queue

    def abort(self, request_id: RequestId) -> None:
        super().abort(request_id)
        if request_id in self.manager.arrived:  # waiting, but holding its imported blocks
            self.manager.free(request_id)

    def fork(self, parent_id: RequestId, child_id: RequestId, max_new_tokens: int) -> SchedRequest:
        if parent_id in self.manager.swap_only:
            raise RequestStateError(
                f"request {parent_id!r} arrived without its token ids: its children could not be recomputed"
            )
        return super().fork(parent_id, child_id, max_new_tokens)


class DecodeRole:
    """A scheduler that decodes requests whose KV and state arrive from prefill instances.

    ``manager_kwargs`` go to the manager (``num_host_blocks``, ``watermark``; no prefix cache). A
    host pool (``num_host_blocks``) is needed for hand-offs without prompt token ids.
    """

    def __init__(
        self, layout: Layout, pool: PoolRegions, config: SchedulerConfig | None = None, **manager_kwargs: Any
    ) -> None:
        _check_role_args(layout, pool, config)
        self.manager = _DecodeManager(layout, **manager_kwargs)
        self.scheduler: Scheduler = _DecodeScheduler(self.manager, config)
        self.pool = pool
        self.in_flight: dict[RequestId, TransferPlan] = {}
        """Imports whose READ the engine could not cancel (``TransferError.in_flight``): their blocks stay
        held; abort each plan once the connection to its peer is dropped."""

    def _room_needed(self, num_prompt_tokens: int) -> int:
        k = self.scheduler.config.num_speculative_tokens
        m = self.manager
        return (
            m.blocks_to_admit(num_prompt_tokens)
            + m.first_row_blocks(num_prompt_tokens, k)
            + m.promised_blocks(k)
            + m.watermark_blocks
        )

    def can_receive(self, num_prompt_tokens: int) -> bool:
        """Whether a hand-off of ``num_prompt_tokens`` fits now: its import, its first row's growth and
        the first rows of the arrivals already held (what :meth:`pull` checks)."""
        n = as_count(num_prompt_tokens, "num_prompt_tokens", 1)
        return self._room_needed(n) <= self.manager.num_available_blocks

    def pull(
        self, engine: TransferEngine, peer: str, handoff: Handoff, max_new_tokens: int, timeout_s: float
    ) -> TransferPlan:
        """Import the handed-over request, READ its blocks from ``peer`` (who is notified), and queue it
        to decode ``max_new_tokens - 1`` more tokens (its first came from the prefill instance).

        Everything is checked before anything changes: the arguments, the offer (layout, the peer's
        pool, the blocks), that the id is new here, what the scheduler's ``add_request`` checks
        (``max_new_tokens >= 2`` that fits the pool), room for the import and its first row, and, for a
        hand-off without token ids, a host pool with room to swap it. Raises ``TypeError`` /
        ``ValueError`` (bad arguments), :class:`DuplicateRequestError`, :class:`RequestTooLargeError`,
        :class:`HandoffRefusedError` (no host pool for a hand-off without token ids),
        :class:`NoFreeBlocksError` / :class:`HostPoolExhaustedError` (retry when blocks are free), all
        with nothing changed, or :class:`TransferError` (a malformed offer, or a failed READ: nothing is
        left here; tell the prefill side to ``cancel``). Any exception of the engine undoes the import.
        """
        check_engine(engine)
        check_peer(peer)
        timeout_s = check_timeout(timeout_s)
        if not isinstance(handoff, Handoff):
            raise TypeError(f"handoff must be a Handoff, got {type(handoff).__name__}")
        rid = wire_request_id(handoff.request_id)
        max_new = as_count(max_new_tokens, "max_new_tokens", 1)
        if max_new < 2:
            raise ValueError(
                f"request {rid!r}: max_new_tokens={max_new} is done with the first token, which the prefill side "
                "sampled: nothing to decode, cancel it there"
            )
        if handoff.stopped or handoff.offer is None:
            raise ValueError(
                f"request {rid!r} stopped at its first token: nothing to decode (the prefill side freed it)"
            )
        n = as_count(handoff.num_prompt_tokens, "num_prompt_tokens", 1)
        first = handoff.first_token
        if isinstance(first, bool | np.bool_) or not isinstance(first, int | np.integer):
            raise TypeError(f"request {rid!r}: first_token must be an integer, got {first!r}")
        ids: tuple[int, ...] | None = None
        if handoff.prompt_token_ids is not None:
            given = _token_ids(handoff.prompt_token_ids, f"request {rid!r} prompt_token_ids")
            if isinstance(given, int):
                raise TypeError(f"request {rid!r}: prompt_token_ids must be a sequence of token ids or None")
            if len(given) != n:
                raise ValueError(f"request {rid!r}: {len(given)} prompt token ids for {n} prompt tokens")
            ids = given
        msg, remote = parse_offer(self.manager.layout, handoff.offer)
        if type(msg.request_id) is not type(rid) or msg.request_id != rid:
            raise TransferError(f"the offer is for {msg.request_id!r}, the hand-off for {rid!r}")
        if msg.blocks.num_tokens != n:
            raise TransferError(f"the offer holds {msg.blocks.num_tokens} tokens, the hand-off's prompt {n}")
        sched, m, k = self.scheduler, self.manager, self.scheduler.config.num_speculative_tokens
        if rid in sched.requests or rid in sched.finished or rid in m.requests:
            raise DuplicateRequestError(
                f"request {rid!r} is already here (queued, running, or finished and not popped): use a new id"
            )
        if not sched.config.chunked_prefill and n + max_new > sched.config.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: {n + max_new} tokens exceed max_num_batched_tokens="
                f"{sched.config.max_num_batched_tokens} without chunked prefill: enable it or raise the budget"
            )
        m.check_fits(n + max_new, k)  # what add_request checks for the prompt and the first token
        host_blocks = 0
        if ids is None:
            host_blocks = m.layout.num_kv_blocks(n + max_new + k) + m.num_state_blocks
            if m.host_pool is None:
                raise HandoffRefusedError(
                    f"request {rid!r} came without its prompt's token ids, so it can only be preempted by swap, and "
                    "this decode role has no host pool: give it num_host_blocks, or send the token ids"
                )
            if host_blocks > m.host_pool.num_usable:
                raise RequestTooLargeError(host_blocks, m.host_pool.num_usable, f"host room to swap {rid!r}")
            free = m.host_pool.num_free - m.host_reserved_unused()
            if host_blocks > free:
                raise HostPoolExhaustedError(host_blocks, max(0, free))
        need = self._room_needed(n)
        if need > m.num_available_blocks:
            raise NoFreeBlocksError(
                f"hand-off of {rid!r} ({n} tokens, with its first row and the held arrivals' first rows)",
                need,
                m.num_available_blocks,
                "retry when blocks are free (can_receive)",
            )
        prompt = [*(ids if ids is not None else (STAND_IN_TOKEN,) * n), int(first)]
        plan = m.import_request(rid, n)
        try:
            sched.add_request(rid, prompt, max_new - 1)
        except Exception:
            plan.abort()
            raise
        try:
            read_offered(engine, peer, remote, msg.blocks, plan, timeout_s)
        except Exception as e:
            sched.abort(rid)  # it was only queued: nothing of it ran
            sched.finished.pop(rid, None)
            if not plan.settled:
                self.in_flight[rid] = plan
            raise e
        plan.commit()
        m.arrived[rid] = n
        if ids is None:
            m.swap_only[rid] = host_blocks
        return plan

    def step(self) -> StepPlan:
        """Plan the next forward (the scheduler's :meth:`~Scheduler.step`)."""
        return self.scheduler.step()

    def update(self, outputs: StepOutputs) -> StepResult:
        """Apply the forward's outputs (the scheduler's :meth:`~Scheduler.update`)."""
        if not isinstance(outputs, StepOutputs):
            raise TypeError(f"outputs must be StepOutputs, got {type(outputs).__name__}")
        return self.scheduler.update(outputs)

    def abort(self, request_id: RequestId) -> None:
        """Drop a request in any state here, arrivals included (their imported blocks go back)."""
        self.scheduler.abort(request_id)

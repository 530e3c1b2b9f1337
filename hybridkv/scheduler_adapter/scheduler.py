"""A continuous-batching scheduler over :class:`~hybridkv.blockmgr.manager.HybridBlockManager`.

One step, in this order (DESIGN.md "Scheduler adapter"):

1. running requests, by priority then arrival: each row grows the request by the tokens it runs
   (a prefill chunk, or a decode's ``1 + drafts`` plus its speculative state sets). When one cannot
   grow, the lowest-priority, newest running request not yet scheduled this step is preempted
   (itself, when it is the last); :class:`~hybridkv.scheduler_adapter.gpu.PreemptionMode` says how.
2. swapped requests resume (swap-in) before anything new is admitted;
3. waiting requests are admitted, FCFS within a priority, by the manager's one count
   (``can_allocate`` of the first chunk: KV + live state sets + speculative sets + watermark;
   prefix-cache hits lower it) and the :class:`AdmissionPolicy` (default ``RESERVED``: the whole
   request's known tokens and its next decode steps fit next to what running prefills were
   promised), up to ``max_num_seqs`` running. Steps that preempted admit nothing.

With a prefix cache (requests submitted with token ids), admission takes the hit, chunks end where
the checkpoint policy wants a checkpoint (``vllm_align``: :mod:`.align`), and ``checkpoint`` runs
after every forward. :meth:`Scheduler.step` returns a :class:`StepPlan`; :meth:`Scheduler.update`
takes the :class:`StepOutputs` of that plan before the next step.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import numpy as np

from hybridkv.blockmgr.records import BlockCopies, RequestId
from hybridkv.errors import DuplicateRequestError, RequestStateError, UnknownRequestError
from hybridkv.scheduler_adapter.admission import AdmissionMixin, _StepBuilder
from hybridkv.scheduler_adapter.align import (
    aligned_chunk,
    branch_stop,
)
from hybridkv.scheduler_adapter.gpu import PreemptionCost, PreemptionMode
from hybridkv.scheduler_adapter.interface import ManagerInterface
from hybridkv.scheduler_adapter.preemption import Preemptor, SwapExecutor
from hybridkv.scheduler_adapter.requests import (
    AdmissionPolicy,  # noqa: F401  (re-exported: imported from here)
    Preemption,
    RequestState,
    SchedRequest,
    ScheduledRequest,
    StateExport,
    StepOutputs,
    StepPlan,
    StepResult,
)
from hybridkv.scheduler_adapter.scheduler_config import SchedulerConfig, check_hashable, request_key, token_ids
from hybridkv.units import as_count, cdiv, is_integer


class Scheduler(AdmissionMixin):
    """Waiting / running / swapped queues over one manager. Not thread-safe.

    ``swap_executor``: optional; runs a swap plan's copies before the scheduler commits it (a
    failure aborts the plan: a swap-out falls back to recompute, a swap-in stays swapped). Without
    it plans are committed at once and returned in the :class:`StepPlan` for the executor to run
    before the forward.
    """

    def __init__(
        self,
        manager: ManagerInterface,
        config: SchedulerConfig | None = None,
        swap_executor: SwapExecutor | None = None,
    ) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        if self.config.preemption_mode is PreemptionMode.AUTO and manager.layout.model.params_active is None:
            raise ValueError(
                f"preemption 'auto' weighs recompute FLOPs against swap bytes and needs the model's params_active, "
                f"which model {manager.layout.model.name!r} does not give: set params_active in its spec file "
                "(active parameters per token, e.g. 45.9e9) or choose preemption 'recompute' or 'swap'"
            )
        cache_config = manager.prefix_cache.config if manager.prefix_cache is not None else None
        if cache_config is not None and cache_config.in_place_state and self.config.num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens={self.config.num_speculative_tokens} with "
                "PrefixCacheConfig(in_place_state=True): lent live sets do not follow speculative sets; "
                "set num_speculative_tokens=0 or in_place_state=False"
            )
        self.preemptor = Preemptor(manager, self.config.preemption_mode, self.config.gpu, swap_executor)
        self.requests: dict[RequestId, SchedRequest] = {}  # waiting, running and swapped
        self.finished: dict[RequestId, SchedRequest] = {}  # finished and aborted, until popped
        self.waiting: list[SchedRequest] = []  # each queue sorted by (priority, arrival)
        self.running: list[SchedRequest] = []
        self.swapped: list[SchedRequest] = []
        self.num_steps = 0
        # prefill chunks cut short at a checkpoint position (the kernel exports none there), and
        # states exported from inside chunks (StepPlan.exports)
        self.num_checkpoint_stops = self.num_exports = 0
        self._arrivals = 0
        self._pending: StepPlan | None = None
        self._has_kv = manager.layout.kv_group is not None
        # requests submitted with token ids are admitted with them (a prefix hit when the manager
        # caches prefixes, else a miss); with a prefix cache, checkpoints are taken after forwards
        # and chunks end where the policy wants one (ManagerInterface: no feature probing)
        self._checkpoints = manager.prefix_cache is not None
        # _exports: the recurrent prefill kernel writes states inside a chunk (export_alignment), so
        # chunks run through checkpoint positions on its grid and the forward writes them into sets
        # reserved with the chunk (StepPlan.exports)
        cache = manager.prefix_cache
        self._exports = cache is not None and cache.config.export_alignment is not None
        # vllm_align: vLLM writes the state of a chunk's end into a block it allocated for it, so
        # a checkpoint is a must (made room for by preempting, never dropped), and the last
        # checkpoints' pins end with the forward that ran their copies (vLLM frees the block two
        # chunks back as it allocates the next); _owed: running requests whose checkpoint at their
        # position found no room in update(): made at their turn in the next step
        self._in_place = cache is not None and cache.aligns_chunks
        # in-place checkpoints (PrefixCacheConfig.in_place_state, any policy): a request whose live
        # sets are a checkpoint takes new ones at its next append
        self._lends = cache is not None and cache.config.in_place_state
        self._owed: set[RequestId] = set()
        self._carried_copies = BlockCopies.empty()  # checkpoint copies for the next plan
        # pin epochs (HybridBlockManager.begin_pin_epoch): copies handed out in update() run at the
        # start of the next plan, so their blocks stay pinned one step longer than the step's own
        self._update_epoch = 0
        self._forked: set[RequestId] = set()  # children whose state copy is in _carried_copies

    # ---- submission ------------------------------------------------------------------------------
    def add_request(
        self, request_id: RequestId, prompt: int | Sequence[int], max_new_tokens: int, priority: int = 0
    ) -> SchedRequest:
        """Queue a request. ``prompt``: its token ids (used for prefix-cache lookups) or a token count.

        Every argument is checked before anything changes: ``TypeError`` for an unhashable id, token
        ids that are not integers (bools and floats included), a count or a priority that is not an
        integer; :class:`DuplicateRequestError`, ``ValueError`` on empty prompts or outputs, and
        :class:`RequestTooLargeError` when ``prompt + max_new_tokens`` can never fit in the pool.
        """
        check_hashable(request_id)
        if request_id in self.requests or request_id in self.finished:
            raise DuplicateRequestError(f"request {request_id!r} was already submitted: use a new id")
        if not (is_integer(prompt) or isinstance(prompt, Iterable)):
            raise TypeError(f"request {request_id!r}: prompt must be token ids or a token count, got {prompt!r}")
        ids = None if is_integer(prompt) else token_ids(prompt, f"request {request_id!r}: prompt")
        num_prompt = as_count(prompt, "prompt") if ids is None else len(ids)
        max_new_tokens = as_count(max_new_tokens, "max_new_tokens")
        if not is_integer(priority):
            raise TypeError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        priority = int(priority)
        if num_prompt < 1 or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: prompt and max_new_tokens must be >= 1")
        if not self.config.chunked_prefill and num_prompt + max_new_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r}: {num_prompt + max_new_tokens} tokens exceed max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} without chunked prefill: enable it or raise the budget"
            )
        # vllm_align: past a block boundary the request's checkpoint set is pinned beside its own sets
        # until its copy runs, and this policy grows only by dropping it when that lets it run: a
        # request that cannot hold both would preempt itself for ever (as in vLLM), so it never fits
        total = num_prompt + max_new_tokens
        held = self.manager.num_state_blocks if self._in_place and total > self.manager.block_size else 0
        self.manager.check_fits(total, self.config.num_speculative_tokens, extra_blocks=held)
        req = SchedRequest(request_id, num_prompt, max_new_tokens, priority, self._arrivals, ids)
        self._arrivals += 1
        self.requests[request_id] = req
        bisect.insort(self.waiting, req, key=request_key)
        return req

    def fork(self, parent_id: RequestId, child_id: RequestId, max_new_tokens: int) -> SchedRequest:
        """Fork a running request between ``update()`` and the next ``step()`` (parallel sampling,
        beam-style branching): the child shares the parent's KV (copy-on-write), gets a copy of its
        live state (the copy runs with the next plan's ``checkpoint_copies``) and its tokens so far,
        and generates ``max_new_tokens`` more. Raises :class:`RequestStateError` inside a step, when
        the parent is not running or has a pending plan, :class:`DuplicateRequestError`, and
        :class:`~hybridkv.errors.NoFreeBlocksError` (nothing changed) when the pool cannot
        hold the child's state sets now."""
        if self._pending is not None:
            raise RequestStateError(f"step {self._pending.step} has no outputs yet: fork after update()")
        if child_id in self.requests or child_id in self.finished:
            raise DuplicateRequestError(f"request {child_id!r} was already submitted: use a new id")
        parent = self.requests.get(parent_id)
        if parent is None or parent.state is not RequestState.RUNNING:
            raise RequestStateError(f"request {parent_id!r} is not running: only a running request can be forked")
        check_hashable(child_id)
        if as_count(max_new_tokens, "max_new_tokens") < 1:
            raise ValueError(f"fork {child_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(self.running) >= self.config.max_num_seqs:
            raise RequestStateError(f"fork {child_id!r}: max_num_seqs={self.config.max_num_seqs} requests run already")
        outputs = list(parent.output_token_ids)
        # as add_request: the child drafts too, so its speculative sets must fit next to its tokens
        self.manager.check_fits(
            parent.num_prompt_tokens + len(outputs) + max_new_tokens, self.config.num_speculative_tokens
        )
        copies = self.manager.fork(parent_id, child_id)  # raises before any change when it does not fit
        child = SchedRequest(
            request_id=child_id,
            num_prompt_tokens=parent.num_prompt_tokens,
            max_new_tokens=len(outputs) + max_new_tokens,
            priority=parent.priority,
            arrival=self._arrivals,
            prompt_token_ids=parent.prompt_token_ids,
            output_token_ids=outputs,
            num_computed_tokens=parent.num_computed_tokens,
            num_allocated_tokens=parent.num_allocated_tokens,
            num_spec_sets=0,  # the child gets its own speculative sets when it drafts
            token_ids_given=parent.token_ids_given,
            state=RequestState.RUNNING,
        )
        self._arrivals += 1
        self.requests[child_id] = child
        bisect.insort(self.running, child, key=request_key)
        carried = self._carried_copies
        if len(carried):  # a parent whose own state is still being copied in (a fork of a fork):
            pending = dict(zip(carried.dst.tolist(), carried.src.tolist(), strict=True))  # copy from the source
            src = np.array([pending.get(b, b) for b in copies.src.tolist()], dtype=copies.src.dtype)
            copies = BlockCopies(src, copies.dst)
        self._carried_copies = carried.concat(copies)
        self._forked.add(child_id)
        return child

    def abort(self, request_id: RequestId) -> None:
        """Drop a request in any state, giving its blocks back; a plan that scheduled it stays valid
        for the other rows and :meth:`update` ignores this one. Raises :class:`UnknownRequestError`."""
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r}: it finished, was aborted, or never came")
        if req.state is not RequestState.WAITING:
            self.manager.free(request_id)
        self._queue(req).remove(req)
        self._retire(req, RequestState.ABORTED)
        if self._pending is None:  # (inside a step, update() is where the loop's end is decided)
            self._release_if_idle()

    def pop_finished(self) -> dict[RequestId, SchedRequest]:
        out, self.finished = self.finished, {}
        return out

    @property
    def has_unfinished(self) -> bool:
        """Requests to run, or copies still to hand out: the checkpoint copies of the last
        ``update()`` ride in the next plan, so a loop ``while has_unfinished: step, forward,
        update`` ends with one step that carries only them (no rows). After it the manager is idle:
        no pins, nothing pending-free, every checkpoint written."""
        return bool(self.requests) or bool(len(self._carried_copies))

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> StepPlan:
        """Plan the next forward. Raises :class:`RequestStateError` if the last plan was not updated."""
        if self._pending is not None:
            raise RequestStateError(f"step {self._pending.step} has no outputs yet: call update() first")
        # the executor ran the last plan: the copies of its step are done, but the checkpoint
        # copies taken in the last update() run at the start of this plan, after the swaps a
        # swap executor runs inside this step: their blocks stay pinned until the next step
        self.manager.release_pins(before=self._update_epoch)
        self.manager.begin_pin_epoch()
        s = _StepBuilder(self.config.max_num_batched_tokens)
        s.checkpoints, self._carried_copies = self._carried_copies, BlockCopies.empty()
        self._schedule_running(s)
        if not s.preempted:
            self._resume_swapped(s)
        if not s.preempted and not self.swapped:
            self._admit_waiting(s)
        exports = ()
        if s.exports:  # (a row preempted after its chunk was scheduled gave its export back)
            running = {r.request_id for r in s.scheduled}
            exports = tuple(e for e in s.exports if e.request_id in running)
        plan = StepPlan(
            self.num_steps,
            tuple(s.scheduled),
            tuple(s.preempted),
            tuple(s.resumed),
            tuple(s.admitted),
            tuple(s.swap_out),
            tuple(s.swap_in),
            s.checkpoints,
            s.copies,
            self.config.max_num_batched_tokens - s.budget,
            self.manager.take_tier_copies(),  # (since the last plan: the last update's included)
            exports,
        )
        self.num_steps += 1
        self._pending = plan
        self._forked.clear()  # their copies are in this plan
        return plan

    def update(self, outputs: StepOutputs) -> StepResult:
        """Apply the forward's outputs to the last plan: commit speculation, extend outputs, finish.

        Raises ``ValueError`` when a sampling row has no tokens or an accepted count is out of range.
        """
        plan = self._pending
        if plan is None:
            raise RequestStateError("update() without a step: call step() first")
        rows = self._check_outputs(plan, outputs)  # raises before anything changes
        self._pending = None
        last_update, self._update_epoch = self._update_epoch, self.manager.begin_pin_epoch()
        if self._in_place:  # the plan's copies ran with its forward (the last update's checkpoints: below)
            self.manager.release_pins(before=self._update_epoch, checkpoints_from=last_update + 1)
        done: list[RequestId] = []
        exported: dict[RequestId, list[int]] = {}  # what the forward wrote into reserved sets
        for e in plan.exports:
            exported.setdefault(e.request_id, []).append(e.position)
        for row, req, tokens, accepted in rows:
            rid = row.request_id
            if row.num_drafts:
                self.manager.commit_speculation(rid, accepted, row.num_drafts)
                req.num_allocated_tokens -= row.num_drafts - accepted
                req.num_computed_tokens += 1 + accepted
            else:
                req.num_computed_tokens += row.num_scheduled_tokens
            if row.samples:
                out = req.output_token_ids
                out.extend(tokens[: req.max_new_tokens - len(out)])
            if self._checkpoints and req.token_ids_given:
                # KV and live sets now hold num_computed_tokens: their full blocks enter the cache
                # (mark_computed) and the policy may keep the state (pinned until the copy ran)
                copies = self.manager.checkpoint(rid, exported=exported.get(rid))
                if len(copies):
                    self._carried_copies = self._carried_copies.concat(copies)
                elif self._in_place and self.manager.checkpoint_blocks_due(rid):
                    self._owed.add(rid)
            elif req.token_ids_given:
                self.manager.mark_computed(rid, req.num_computed_tokens)
            if len(req.output_token_ids) >= req.max_new_tokens or rid in outputs.finished:
                self.manager.free(rid)
                self.running.remove(req)
                self._retire(req, RequestState.FINISHED)
                done.append(rid)
        if self._in_place:  # the checkpoints were held while this update's were made (vLLM
            # allocates a chunk's state block before it frees the block of the chunk before)
            self.manager.release_pins(before=self._update_epoch)
        self._release_if_idle()
        return StepResult(tuple(done))

    def _release_if_idle(self) -> None:
        """Between an update and the next step with no request left and no copy carried, every copy
        handed out has run (each plan's before its forward): the manager's pins are released, so it
        is idle (nothing pending-free) for its next user."""
        if not self.requests and not len(self._carried_copies):
            self.manager.release_pins()

    def _check_outputs(
        self, plan: StepPlan, outputs: StepOutputs
    ) -> list[tuple[ScheduledRequest, SchedRequest, Sequence[int], int]]:
        """The rows ``update`` applies, with their tokens and accepted drafts; raises ``ValueError``
        on any bad output before ``update`` changes anything (rows aborted since the step are skipped)."""
        rows = []
        for row in plan.scheduled:
            rid = row.request_id
            req = self.requests.get(rid)
            if req is None or req.state is not RequestState.RUNNING:
                continue  # aborted after the step was planned
            tokens = outputs.sampled.get(rid, ())
            if tokens:
                tokens = token_ids(tokens, f"request {rid!r}: sampled tokens")
            accepted = 0
            if row.num_drafts:
                accepted = outputs.num_accepted.get(rid, len(tokens) - 1)
                if not is_integer(accepted):
                    raise TypeError(f"request {rid!r}: num_accepted must be an integer, got {accepted!r}")
                accepted = int(accepted)
                if not 0 <= accepted <= row.num_drafts or len(tokens) != accepted + 1:
                    raise ValueError(
                        f"request {rid!r}: {len(tokens)} sampled tokens and {accepted} accepted of "
                        f"{row.num_drafts} drafts: expect accepted in [0, drafts] and accepted + 1 tokens"
                    )
            if row.samples and not tokens:
                raise ValueError(f"request {rid!r} sampled this step but got no token")
            rows.append((row, req, tokens, accepted))
        return rows

    # ---- phases ----------------------------------------------------------------------------------
    def _schedule_running(self, s: _StepBuilder) -> None:
        exact = self._in_place or not self._all_fit(s.budget)
        for req in list(self.running):
            if s.budget <= 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            n, drafts = self._demand(req, s.budget)
            if not n:
                continue  # vllm_align: the budget holds no block-aligned chunk (vLLM skips it too)
            owed = self.manager.checkpoint_blocks_due(req.request_id) if req.request_id in self._owed else 0
            export_at = self._export_positions(req, n)
            export = self.manager.num_state_blocks * len(export_at)
            if exact or owed or export:
                while not self._can_grow(req, n + drafts, drafts, owed + export):
                    if not self._in_place and len(s.checkpoints) and self._cancel_checkpoints(s):
                        continue  # the last update's checkpoints (not handed out yet) gave way
                    victim = self.preemptor.choose_victim(self.running, req)
                    # alone, it would preempt itself for nothing: its checkpoints, then the last
                    # update's, give way (vLLM preempts itself, and can so livelock)
                    alone = victim is req and len(self.running) == 1
                    if alone and owed + export:
                        owed = export = 0
                        continue
                    if alone and self._lends and self.manager.reclaim_lent(req.request_id):
                        continue  # (in_place_state: it runs on in its lent sets rather than preempt itself)
                    rescues = alone and self._in_place and len(s.checkpoints)
                    if rescues and self._cancel_rescues(req, n, drafts, owed + export, s):
                        continue  # (only when that lets it run: else it preempts itself, as vLLM does)
                    self._preempt(victim, s)
                    if victim is req:
                        break
                if req.state is not RequestState.RUNNING:
                    break  # it preempted itself: everything after it is gone too
            if owed:  # its copy runs with this plan's copies, before the forward moves the state
                s.copies = s.copies.concat(self.manager.checkpoint(req.request_id))
            self._owed.discard(req.request_id)
            self._run(req, n, drafts, s, export_at)
            # its checkpoint copy and export sets took blocks the step's bound left out: check the rest
            exact = exact or bool(owed or export)

    def _cancel_rescues(self, req: SchedRequest, n: int, drafts: int, extra: int, s: _StepBuilder) -> bool:
        """Cancel the last update's checkpoints if their blocks let ``req`` grow by ``n + drafts``;
        True when it did."""
        cache = self.manager.prefix_cache
        if cache is None:
            return False
        held = sum(1 for e in cache.pinned.values() if e == self._update_epoch) * self.manager.num_state_blocks
        if not self._can_grow(req, n + drafts, drafts, extra - held):
            return False
        return self._cancel_checkpoints(s)

    def _cancel_checkpoints(self, s: _StepBuilder) -> bool:
        """Drop the checkpoints of the last update (their copies are still in this step's hands)
        rather than preempt a running request: they are pinned until their copy runs, so otherwise a
        request whose own checkpoint fills the pool would preempt itself every time it gets there."""
        if not self._checkpoints:
            return False
        dropped = self.manager.cancel_checkpoints(self._update_epoch)
        if not dropped.size:
            return False
        keep = ~np.isin(s.checkpoints.dst, dropped)
        s.checkpoints = BlockCopies(s.checkpoints.src[keep], s.checkpoints.dst[keep])
        return True

    def _all_fit(self, budget: int) -> bool:
        """An O(1) upper bound on what the running requests can take this step (``budget`` tokens
        over the rows, a partial block and a copy-on-write block per row, missing speculative
        sets, new live sets for lent ones); when it fits, the per-request checks are skipped."""
        k, rows = self.config.num_speculative_tokens, len(self.running)
        kv = cdiv(budget, self.manager.block_size) + 2 * rows if self._has_kv else 0
        sets = rows * (k + self._lends) * self.manager.num_state_blocks
        return kv + sets <= self.manager.num_available_blocks

    def _resume_swapped(self, s: _StepBuilder) -> None:
        for req in list(self.swapped):
            if s.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            n, drafts = self._demand(req, s.budget, cut=False)
            host = self.manager.requests[req.request_id].host_blocks.size
            grow = self._kv_growth(req.num_allocated_tokens, n + drafts)  # blocks come back private: no copy
            need = host + grow + drafts * self.manager.num_state_blocks + self.manager.watermark_blocks
            if need > self.manager.num_available_blocks:
                return
            plan = self.manager.swap_in(req.request_id)
            if not self.preemptor.settle(plan):
                return
            s.swap_in.append(plan)
            s.resumed.append(req.request_id)
            self.swapped.remove(req)
            req.state = RequestState.RUNNING
            bisect.insort(self.running, req, key=request_key)
            n, drafts = self._demand(req, s.budget)
            self._run(req, n, drafts, s, self._export_positions(req, n))

    # ---- helpers ---------------------------------------------------------------------------------
    def _demand(self, req: SchedRequest, budget: int, cut: bool = True) -> tuple[int, int]:
        """(tokens, drafts) the request runs with ``budget`` tokens left: a decode (its last sampled
        token, plus drafts) or a prefill chunk, ended early where the prefix cache wants a checkpoint."""
        to_compute = req.num_prompt_tokens + len(req.output_token_ids) - req.num_computed_tokens
        if to_compute == 1 and req.output_token_ids:
            return 1, self._drafts(req, budget)
        n = min(to_compute, budget)
        if cut and self._checkpoints and req.token_ids_given and self.config.chunked_prefill:
            # (without chunked prefill a prompt runs whole: the policy's positions inside it are lost)
            n = aligned_chunk(self.manager, self.config, req, req.num_computed_tokens, n)
            start = req.num_computed_tokens
            pos = self.manager.next_checkpoint_position(req.request_id)
            if pos is not None and start < pos < start + n:
                # positions the kernel exports from inside the chunk: no cut (vllm_align: unless it
                # is the branch point, where vLLM stops whatever the kernel exports)
                stop = self.manager.prefill_stop(req.request_id, start, start + n) if self._exports else pos
                if self._in_place and pos == branch_stop(self.manager, req.request_id, start):
                    stop = pos
                self.num_checkpoint_stops += stop < start + n
                n = stop - start
        return n, 0

    def _drafts(self, req: SchedRequest, budget: int) -> int:
        """Drafts a decode row of ``req`` (its last sampled token to compute) runs with ``budget``."""
        k = self.config.num_speculative_tokens
        return max(0, min(k, req.max_new_tokens - len(req.output_token_ids) - 1, budget - 1)) if k else 0

    def _kv_growth(self, num_tokens: int, n: int) -> int:
        bs = self.manager.block_size
        return cdiv(num_tokens + n, bs) - cdiv(num_tokens, bs) if self._has_kv else 0

    def _can_grow(self, req: SchedRequest, n: int, drafts: int, extra: int = 0) -> bool:
        need = extra + self.manager.num_new_kv_blocks(req.request_id, n)
        need += max(0, drafts - req.num_spec_sets) * self.manager.num_state_blocks
        return need <= self.manager.num_available_blocks

    def _run(self, req: SchedRequest, n: int, drafts: int, s: _StepBuilder, export_at: tuple[int, ...]) -> None:
        """Grow the request by ``n + drafts`` token slots (and speculative sets) and add its row;
        ``export_at``: the positions the prefill kernel exports from inside the chunk (their sets
        reserved now, best effort)."""
        rid = req.request_id
        if drafts > req.num_spec_sets:  # commit_speculation gets num_drafted, so no call otherwise
            self.manager.begin_speculation(rid, drafts)
            req.num_spec_sets = drafts
        given, outputs = req.token_ids_given, req.output_token_ids
        if given and given < req.num_prompt_tokens + len(outputs):
            new_ids = outputs[given - req.num_prompt_tokens :]  # sampled since: for the prefix cache
            req.token_ids_given += len(new_ids)
            copies = self.manager.append(rid, n + drafts, token_ids=new_ids)
        else:
            copies = self.manager.append(rid, n + drafts)
        if copies.src.size:
            s.copies = s.copies.concat(copies)
        req.num_allocated_tokens += n + drafts
        for at in export_at:  # the kernel writes the state there in the forward
            sets = self.manager.reserve_export(rid, at)
            if sets is None:
                break  # (no blocks: the rest are not exported either)
            s.exports.append(StateExport(rid, at, sets))
            self.num_exports += 1
        self._row(req, n, drafts, s)

    @staticmethod
    def _row(req: SchedRequest, n: int, drafts: int, s: _StepBuilder) -> None:
        computed, outputs = req.num_computed_tokens, len(req.output_token_ids)
        known = req.num_prompt_tokens + outputs
        prefill = not outputs or n != 1 or computed != known - 1
        row = (req.request_id, computed, n, drafts, prefill, computed + n == known)
        s.scheduled.append(tuple.__new__(ScheduledRequest, row))  # NamedTuple.__new__ without its overhead
        s.budget -= n + drafts

    def _preempt(self, victim: SchedRequest, s: _StepBuilder) -> None:
        # a child forked since the last update holds no state until this plan's first copies run:
        # a swap-out (run inside step() by a swap executor) would save nothing, so it recomputes
        # vllm_align: a victim owing the checkpoint at its position leaves its live state there
        # (vLLM's block of the chunk's end state is cached in place before the next chunk)
        keep = self._in_place and victim.request_id in self._owed
        mode, plan = self.preemptor.preempt(victim, allow_swap=victim.request_id not in self._forked, keep_state=keep)
        self.running.remove(victim)
        victim.num_preemptions += 1
        victim.num_spec_sets = 0  # a swap-out commit and a free both drop the speculative sets
        if plan is not None:
            s.swap_out.append(plan)
            victim.state = RequestState.SWAPPED
            bisect.insort(self.swapped, victim, key=request_key)
        else:
            victim.num_computed_tokens = victim.num_allocated_tokens = victim.token_ids_given = 0
            victim.state = RequestState.WAITING
            bisect.insort(self.waiting, victim, key=request_key)
        s.preempted.append(Preemption(victim.request_id, mode))
        self._owed.discard(victim.request_id)

    def preemption_cost(self, req: SchedRequest) -> PreemptionCost:
        """The cost model's view of preempting ``req`` (running) now."""
        return self.preemptor.cost(req)

    def _queue(self, req: SchedRequest) -> list[SchedRequest]:
        return {RequestState.WAITING: self.waiting, RequestState.RUNNING: self.running}.get(req.state, self.swapped)

    def _retire(self, req: SchedRequest, state: RequestState) -> None:
        self._owed.discard(req.request_id)
        req.state = state
        del self.requests[req.request_id]
        self.finished[req.request_id] = req

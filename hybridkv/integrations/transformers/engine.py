"""The engine loop around an unmodified transformers model: scheduler -> copies and swaps -> forwards -> update.

:class:`HFEngine` owns the manager, the scheduler, the device and host pools and a
:class:`~.paged_cache.PagedCache`. One :meth:`HFEngine.step`:

1. ``Scheduler.step()``; the plan's copies in the order of docs/contract.md: ``checkpoint_copies``,
   every swap-out, every swap-in, then ``copies`` (copy-on-write, prefix hits' checkpoint -> live);
2. the rows' forwards (:mod:`.forward`): rows cut into pieces, batched as ``generate`` batches
   (fresh prompts of any length left padded into one forward, every decode in one forward), each
   forward with explicit ``position_ids``, the masks transformers' models honour, and a fresh cache
   built from the pools and stored back after it;
3. sampling (:mod:`.sampling`) and draft verification; ``Scheduler.update()``; a request with
   ``n > 1`` branches where it samples its first token: each other sample draws its own first token
   from the same logits and is forked there (or queued, when the fork finds no room).

An exception inside a step abandons the step's plan and aborts its requests (:meth:`HFEngine.step`);
the engine goes on with the others.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.errors import DuplicateRequestError, HybridKVError, RequestTooLargeError
from hybridkv.integrations.transformers.checks import (
    check_length,
    check_prefix_cache,
    max_positions,
    prompt_token_ids,
    too_large,
)
from hybridkv.integrations.transformers.families import Family, UnsupportedModelError, family_of
from hybridkv.integrations.transformers.forward import Forwards
from hybridkv.integrations.transformers.paged_cache import PagedCache
from hybridkv.integrations.transformers.sampling import Drafter, SamplingParams, sample
from hybridkv.models.hf import spec_from_hf_config
from hybridkv.models.spec import ModelSpec, with_state_dtype
from hybridkv.ops import allocate_host_pools, allocate_pools, copy_blocks, swap_blocks
from hybridkv.ops._framework import torch_dtype
from hybridkv.planner.layout import Layout, plan
from hybridkv.scheduler_adapter import (
    PreemptionMode,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
    StepPlan,
    build_step_metadata,
)


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """hybridkv's description of ``model`` read from its config (``hybridkv.models.hf``), with the
    model's active parameters counted (dense parameters + ``experts_per_token`` experts)."""
    cfg = model.config.to_dict()
    cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")  # what the weights are in
    spec = spec_from_hf_config(cfg, f"{type(model).__name__}.config")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    e = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", None)
    e = e or getattr(model.config, "n_routed_experts", None)
    k = getattr(model.config, "num_experts_per_tok", None)
    active = total - experts + (experts * k / e if experts and e and k else experts)
    return dataclasses.replace(spec, params_active=float(active))


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and features of an :class:`HFEngine`.

    ``num_blocks``: device pool blocks (null block included); ``num_host_blocks``: host pool for swap
    (0: recompute only); ``num_speculative_tokens`` with ``drafter``; ``prefix_cache`` None disables
    prefix caching. ``record_logits``: keep every logit computed for a real token (for comparisons).
    """

    num_blocks: int = 256
    block_size: int = 16
    num_host_blocks: int = 0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    num_speculative_tokens: int = 0
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    prefix_cache: PrefixCacheConfig | None = field(default_factory=PrefixCacheConfig)
    record_logits: bool = False
    scheduler_options: dict = field(default_factory=dict)  # more SchedulerConfig fields (e.g. admission)
    pool_fill: str | None = "nan"  # unwritten pool bytes read as NaN, so a stray read shows in the logits
    # how hybridkv stores the recurrent states (int8 / fp8 with row scales, float16, ...; None: as the model
    # keeps them); the model computes in its own dtype, the states are quantized / dequantized at the pool
    state_dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


@dataclass
class Events:
    """What happened in a run (counts)."""

    steps: int = 0
    forwards: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swapped_in: int = 0
    prefix_hit_tokens: int = 0
    checkpoint_copies: int = 0
    forks: int = 0
    drafts: int = 0
    accepted: int = 0
    rejected: int = 0
    aborted: int = 0
    failed: int = 0  # requests aborted because a step raised (HFEngine.failed)
    forks_queued: int = 0  # samples of n > 1 requests queued because their fork found no room
    tier_offloaded: int = 0  # blocks the prefix cache's host tier copied device -> host
    tier_onloaded: int = 0  # blocks of host-tier hits copied host -> device


class StepStats(NamedTuple):
    """One step: rows, tokens, HF forwards, preempted / resumed / admitted requests."""

    step: int
    num_rows: int
    num_tokens: int
    num_forwards: int
    num_preempted: int
    num_resumed: int
    num_admitted: int
    num_finished: int


class _Progress:
    """How far one step got (what :meth:`HFEngine._abandon` must undo)."""

    __slots__ = ("copied", "updated", "branching")

    def __init__(self) -> None:
        self.copied = False  # the plan's copies all ran
        self.updated = False  # Scheduler.update() took the plan
        self.branching: list[tuple[Any, Any]] = []  # (parent, sample) drawn in this step, not placed yet


class HFEngine(Forwards):
    """Serves ``model`` (an unmodified transformers causal LM of a family in
    :data:`~.families.FAMILIES`) through hybridkv. Not thread-safe.

    ``drafter``: proposes draft tokens when ``config.num_speculative_tokens > 0``. ``mixer_hook``:
    optional callable ``(engine, pieces, meta, past_lens, src_tables, dst_tables, has_initial_state)
    -> context manager`` entered around every HF forward (:mod:`.lightning` uses it to route
    MiniMax's lightning layers to hybridkv's in-place kernels).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, drafter: Drafter | None = None):
        self.config = config = config or EngineConfig()
        check_prefix_cache(config.prefix_cache)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.family: Family = family_of(model_type)
        if config.num_speculative_tokens and drafter is None:
            raise ValueError("num_speculative_tokens > 0 needs a drafter (NgramDrafter() or ModelDrafter(model))")
        window = getattr(model.config, "sliding_window", None)
        kinds = set(getattr(model.config, "layer_types", None) or ())
        if window is not None or kinds & {"sliding_attention", "chunked_attention"}:
            raise UnsupportedModelError(
                f"{model_type} with sliding-window or chunked attention (sliding_window={window}): the runner builds "
                "full causal masks only; set sliding_window=None"
            )
        self.model = model.eval()
        self.spec = model_spec(model)
        if config.state_dtype is not None:
            self.spec = with_state_dtype(self.spec, config.state_dtype)
        self._check_dtypes()
        probe = plan(self.spec, 1 << 40, block_size=config.block_size)
        self.layout: Layout = plan(self.spec, probe.bytes_per_block * config.num_blocks, block_size=config.block_size)
        self.manager = HybridBlockManager(
            self.layout, num_host_blocks=config.num_host_blocks, prefix_cache=config.prefix_cache
        )
        try:  # the smallest request: one prompt token, one new token, its speculative sets
            self.manager.check_fits(2, config.num_speculative_tokens)
        except RequestTooLargeError as e:
            what = "the pool can never hold one request: the smallest (1 prompt + 1 new token)"
            raise too_large(what, e, config.num_blocks, config.num_speculative_tokens, request=False) from None
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                num_speculative_tokens=config.num_speculative_tokens,
                preemption_mode=config.preemption_mode,
                **config.scheduler_options,
            ),
        )
        self.pools = allocate_pools(self.layout, "cpu", fill=config.pool_fill)
        self.host = (
            allocate_host_pools(self.layout, config.num_host_blocks, fill=config.pool_fill)
            if config.num_host_blocks
            else None
        )
        self.cache = PagedCache(self.family, model.config, self.layout, self.pools, config.max_num_seqs)
        self._has_state = bool(self.cache.states)  # (kept: the paged lightning hook empties cache.states)
        self.drafter = drafter
        self.params: dict[Any, SamplingParams] = {}
        self.tokens: dict[Any, list[int]] = {}  # prompt + outputs, kept after the request finishes
        self.logits: dict[Any, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.events = Events()
        self.stats: list[StepStats] = []
        self.mixer_hook = None
        self.failed: dict[Any, BaseException] = {}  # request -> the exception of the step that aborted it
        self._forks: dict[Any, list[tuple[Any, SamplingParams]]] = {}  # parent -> its samples, until it branches
        self._samples: set[Any] = set()  # the ids of those samples (taken)
        self._heads: dict[Any, list[int]] = {}  # queued samples -> their first token (the end of their prompt)
        self._done: dict[Any, list[int]] = {}  # samples done at their first token (max_new_tokens 1)
        self._fresh_forks: list[Any] = []  # forked since the last step: their state copy rides in the next plan
        self._update_epoch: int | None = None  # the manager's pin epoch of the last Scheduler.update()
        self._offloaded = True  # the last plan's host-tier offloads ran (run_copies)
        # transformers 5.24 names the cache argument ``cache`` (``past_key_values`` before)
        # every kind of layer the model looks a mask up for (LFM2: "conv"): None (recurrent layers)
        kinds = [
            *(getattr(model.config, "layer_types", None) or ()),
            *(getattr(model.config, "layers_block_type", None) or ()),
            "linear_attention",
        ]
        self._mask_kinds: dict[str, Any] = dict.fromkeys(k for k in kinds if isinstance(k, str))
        self._kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _check_dtypes(self) -> None:
        """The pool keeps K/V in the model's dtype (another one would change the logits): checked on
        hybridkv's description before any pool is allocated."""
        dt = next(self.model.parameters()).dtype
        for lid in self.spec.attention_layer_ids:
            layer = self.spec.layers[lid]
            attn = getattr(layer, "attention", layer)
            if torch_dtype(attn.dtype) != dt:
                raise UnsupportedModelError(
                    f"layer {lid}: hybridkv's description keeps K/V in {attn.dtype.value}, the model runs in {dt}"
                )

    # ---- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: Any, prompt: list[int], max_new_tokens: int, params: SamplingParams | None = None
    ) -> None:
        """Queue a request (token ids: a list, or a 1-D integer array / tensor). Everything is checked
        before anything is queued: ``params`` (a :class:`SamplingParams`, ``TypeError`` otherwise), the
        prompt's token ids (:func:`~.checks.prompt_token_ids`), its length against the model's
        ``max_position_embeddings`` (``ValueError``), the sizes (the scheduler's checks:
        :class:`~hybridkv.errors.RequestTooLargeError`, naming ``num_blocks``, when the request can never
        fit in the pool) and the ids of its samples; a refused request leaves no trace.

        ``params.n > 1``: ``n`` outputs, the request's and those of ``n - 1`` samples ``(request_id, i)``
        (seeds ``params.child(i)``). Where the request samples its first token, each sample draws its
        own from the same logits and is forked there (:meth:`Scheduler.fork`: the prompt's KV shared,
        its state copied); a sample whose fork finds no room (blocks or ``max_num_seqs``) waits in the
        queue as a request of its own (prompt + its first token), and one with nothing left to generate
        (``max_new_tokens == 1``) is done. A sample needs no more room than the request alone, so every
        request that is accepted gives its ``n`` outputs."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: params must be a SamplingParams, got {params!r}")
        params.check()  # (a frozen dataclass can still be changed through object.__setattr__)
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request id {request_id!r} is not hashable") from None
        ids = prompt_token_ids(request_id, prompt, self.model.config.vocab_size)
        check_length(request_id, len(ids), max_new_tokens, max_positions(self.model.config))
        samples = [(request_id, i) for i in range(1, params.n)]
        for rid in (request_id, *samples):
            if rid in self._samples or rid in self._done:
                raise DuplicateRequestError(f"request {rid!r}: the id is the one of a sample of request {rid[0]!r}")
            if rid != request_id and (rid in self.scheduler.requests or rid in self.scheduler.finished):
                raise DuplicateRequestError(
                    f"request {request_id!r}: the id of its sample {rid!r} was already submitted: use another id"
                )
        try:
            self.scheduler.add_request(request_id, ids, max_new_tokens)  # (its own checks, before it queues)
        except RequestTooLargeError as e:
            what = f"request {request_id!r} ({len(ids)} prompt + {max_new_tokens} new tokens)"
            raise too_large(what, e, self.config.num_blocks, self.config.num_speculative_tokens) from None
        self.params[request_id] = params
        self.tokens[request_id] = ids
        if samples:
            self._forks[request_id] = [(rid, params.child(rid[1])) for rid in samples]
            self._samples.update(samples)

    def fork(self, parent_id: Any, child_id: Any, max_new_tokens: int, params: SamplingParams | None = None) -> None:
        """Fork a running request now (between steps): ``Scheduler.fork``."""
        if child_id in self._samples or child_id in self._done:
            raise DuplicateRequestError(f"request {child_id!r} was already submitted: use a new id")
        self.scheduler.fork(parent_id, child_id, max_new_tokens)
        self.params[child_id] = params or self.params[parent_id]
        self.tokens[child_id] = list(self.tokens[parent_id])
        self.events.forks += 1
        self._fresh_forks.append(child_id)

    def abort(self, request_id: Any) -> None:
        """Drop a request (its samples still to branch go with it; samples forked already stay)."""
        self.scheduler.abort(request_id)
        for rid, _ in self._forks.pop(request_id, ()):
            self._samples.discard(rid)
        self.events.aborted += 1

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step ----------------------------------------------------------------------------------
    def run_copies(self, plan: StepPlan) -> None:
        """The plan's copies, in the executor order of docs/contract.md (the host tier's included)."""
        backend, tier = self.cache.backend, plan.tier_copies
        self._offloaded = not len(tier.offload)
        if len(tier) or len(plan.checkpoint_copies) or plan.swap_out or plan.swap_in or len(plan.copies):
            # the resident states into the pool first (the copies read them); the next forward
            # gathers (before the copies: one that raises half way leaves the pool unknown)
            self.cache.invalidate()
        if len(tier.offload):  # 0. the host tier's offloads: before anything writes the blocks they free
            swap_blocks(self.pools, self.host, tier.offload, backend=backend).synchronize()
            self._offloaded = True
        copy_blocks(self.pools, plan.checkpoint_copies, backend=backend)
        for p in plan.swap_out:
            swap_blocks(self.pools, self.host, p, backend=backend).synchronize()
        for p in plan.swap_in:
            swap_blocks(self.pools, self.host, p, backend=backend).synchronize()
        if len(tier.onload):  # 3b. host hits, after the swaps, before the copies and the forward
            swap_blocks(self.pools, self.host, tier.onload, backend=backend).synchronize()
        copy_blocks(self.pools, plan.copies, backend=backend)
        self.events.tier_offloaded += len(tier.offload)
        self.events.tier_onloaded += len(tier.onload)

    @torch.no_grad()
    def step(self) -> StepPlan:
        """One step (see the module docstring).

        An exception inside it (a copy, the drafter, the model's forward, sampling) abandons the
        step's plan and is re-raised with a note naming the requests it aborted: every request the
        step scheduled (a forward that ran may have moved its state sets past what the scheduler
        records, and the scheduler commits a plan's rows all together or not at all), with its
        samples still to branch; when the plan's copies did not all run, also what they were writing
        (requests swapped out or forked for the plan; the prefix-cache checkpoints of the last update
        are dropped). The aborted requests are in :attr:`failed` (id -> the exception) and not in
        :meth:`outputs`; every other request keeps its place and the next :meth:`step` / :meth:`run`
        goes on. This is vLLM's behaviour at request level (the requests of a failed batch are
        reported as errored, the forward is not retried: a fault that repeats would repeat for ever).
        """
        plan = self.scheduler.step()
        forked, self._fresh_forks = self._fresh_forks, []
        progress, forwards = _Progress(), self.events.forwards
        try:
            self._execute(plan, progress)
        except BaseException as exc:
            self._abandon(plan, progress, forked, forwards, exc)
            raise
        return plan

    def _execute(self, plan: StepPlan, progress: _Progress) -> None:
        sched, ev = self.scheduler, self.events
        self.run_copies(plan)
        progress.copied = True
        ev.checkpoint_copies += len(plan.checkpoint_copies)
        for pre in plan.preempted:
            if pre.mode is PreemptionMode.SWAP:
                ev.preempted_swap += 1
            else:
                ev.preempted_recompute += 1
        ev.swapped_in += len(plan.swap_in)
        if plan.is_empty:
            sched.update(StepOutputs({}))
            progress.updated = True
            self._update_epoch = self.manager.pin_epoch
            ev.steps += 1
            self.stats.append(StepStats(plan.step, 0, 0, 0, len(plan.preempted), 0, 0, 0))
            return
        meta = build_step_metadata(self.manager, plan)
        inputs, drafts = [], {}
        hit_tokens = 0
        for row in plan.scheduled:
            rid = row.request_id
            req = sched.requests[rid]
            known = list(req.token_ids() or [])
            if req.num_cached_tokens and row.num_computed_tokens == req.num_cached_tokens and rid in plan.admitted:
                hit_tokens += req.num_cached_tokens
            run = known[row.num_computed_tokens : row.num_computed_tokens + row.num_scheduled_tokens]
            d = []
            if row.num_drafts:
                d = list(self.drafter.propose(rid, known, row.num_drafts))[: row.num_drafts]
                d += [d[-1] if d else run[-1]] * (row.num_drafts - len(d))  # pad a short proposal
            drafts[rid] = d
            inputs.append(run + d)
        forwards_before = ev.forwards
        logits = self.forward(plan, meta, inputs)
        sampled, accepted, recorded = {}, {}, []
        branch: dict[Any, list[tuple[Any, SamplingParams, int]]] = {}
        for b, row in enumerate(plan.scheduled):
            rid, start, n = row.request_id, row.num_computed_tokens, row.num_scheduled_tokens
            rows = logits[b]
            base = n - 1 if self.config.record_logits else 0  # (rows: from the last scheduled token on, or all)
            if self.config.record_logits:
                recorded.extend((rid, (start + t, rows[t])) for t in range(n))
            if not row.samples:
                continue
            params, pos = self.params[rid], start + n - 1
            out, a = [sample(rows[base], params, pos)], 0
            for j, d in enumerate(drafts[rid]):  # draft j stands while it equals the token sampled there
                if out[-1] != d:
                    break
                a += 1
                if self.config.record_logits:
                    recorded.append((rid, (pos + j + 1, rows[base + 1 + j])))
                out.append(sample(rows[base + 1 + j], params, pos + j + 1))
            sampled[rid] = out
            if row.num_drafts:
                accepted[rid] = a
            if rid in self._forks and not sched.requests[rid].output_token_ids:
                # its first token: each other sample draws its own here, from the same logits
                branch[rid] = [(child, p, sample(rows[base], p, pos)) for child, p in self._forks[rid]]
        result = sched.update(StepOutputs(sampled, frozenset(), accepted))
        progress.updated = True
        self._update_epoch = self.manager.pin_epoch
        progress.branching = [(parent, child) for parent, kids in branch.items() for child, _, _ in kids]
        ev.prefix_hit_tokens += hit_tokens
        for row in plan.scheduled:
            if row.num_drafts and row.request_id in accepted:
                ev.drafts += row.num_drafts
                ev.accepted += accepted[row.request_id]
                ev.rejected += row.num_drafts - accepted[row.request_id]
        for rid, entry in recorded:
            self.logits[rid].append(entry)
        for rid in sampled:
            req = sched.requests.get(rid) or sched.finished.get(rid)
            if req is not None:
                self.tokens[rid] = list(req.token_ids() or [])
        for parent, kids in branch.items():
            self._branch(parent, kids, progress)
        ev.steps += 1
        self.stats.append(
            StepStats(
                plan.step,
                len(plan.scheduled),
                int(meta.positions.shape[0]),
                ev.forwards - forwards_before,
                len(plan.preempted),
                len(plan.resumed),
                len(plan.admitted),
                len(result.finished),
            )
        )

    def _branch(self, parent: Any, kids: list[tuple[Any, SamplingParams, int]], progress: _Progress) -> None:
        """After the update where ``parent`` sampled its first token: its samples, each with its own
        first token ``first`` (not computed yet, so a fork's tokens may differ from the parent's in
        it), forked where the parent is now, queued when the fork finds no room, done when nothing
        is left to generate."""
        sched = self.scheduler
        req = sched.requests.get(parent) or sched.finished[parent]
        remaining = req.max_new_tokens - len(req.output_token_ids)
        prompt = self.tokens[parent][: req.num_prompt_tokens]
        self._forks.pop(parent, None)
        for child, params, first in kids:
            self._samples.discard(child)
            if remaining < 1:
                self._done[child] = [first]
            else:
                try:
                    self.fork(parent, child, remaining, params)
                except HybridKVError:  # no blocks or no sequence slot now: it waits in the queue
                    sched.add_request(child, [*prompt, first], remaining)
                    self._heads[child] = [first]
                    self.events.forks_queued += 1
                else:  # its own first token (Scheduler.fork gives it the parent's outputs)
                    sched.requests[child].output_token_ids[-1] = first
            self.params[child] = params
            self.tokens[child] = [*prompt, first]
            progress.branching.remove((parent, child))

    def _abandon(self, plan: StepPlan, progress: _Progress, forked: list[Any], forwards: int, exc: BaseException):
        """Close ``plan`` after ``exc`` (see :meth:`step`): abort what it may have left inconsistent."""
        sched, ev = self.scheduler, self.events
        try:
            self.cache.invalidate()
        except Exception:  # (the scatter of the resident states raised: the next forward gathers)
            self.cache.discard()
        if not self._offloaded:
            self._drop_unwritten_offloads(plan.tier_copies.offload)
        lost: list[Any] = []
        if not progress.updated:
            at_risk = [row.request_id for row in plan.scheduled]
            if not progress.copied:  # what the copies write may be unwritten
                at_risk += [p.request_id for p in plan.preempted if p.mode is PreemptionMode.SWAP]
                holding = [sched.requests[c] for c in forked if c in sched.requests]  # (recomputed: nothing held)
                at_risk += [r.request_id for r in holding if r.state is not RequestState.WAITING]
                if self._update_epoch is not None and len(plan.checkpoint_copies):
                    self.manager.cancel_checkpoints(self._update_epoch)
            for rid in dict.fromkeys(at_risk):
                if rid in sched.requests:
                    sched.abort(rid)
                    lost.append(rid)
            sched.update(StepOutputs({}))  # every row aborted: it applies none and closes the plan
            self._update_epoch = self.manager.pin_epoch
        for rid in list(lost):
            for child, _ in self._forks.pop(rid, ()):
                lost.append(child)
        for parent, child in progress.branching:  # drawn, never placed
            self._forks.pop(parent, None)
            lost.append(child)
        lost = list(dict.fromkeys(lost))
        for rid in lost:
            self._samples.discard(rid)
            self.failed[rid] = exc
        ev.failed += len(lost)
        ev.steps += 1
        self.stats.append(
            StepStats(
                plan.step,
                len(plan.scheduled),
                0,
                ev.forwards - forwards,
                len(plan.preempted),
                len(plan.resumed),
                len(plan.admitted),
                0,
            )
        )
        exc.add_note(
            f"HFEngine: step {plan.step} was abandoned; requests aborted (HFEngine.failed): {lost}; "
            "the others go on with the next step() / run()"
        )

    def _drop_unwritten_offloads(self, offload) -> None:
        """The host tier's offloads of a plan did not all run: the units they were to fill leave the
        tier (their host blocks are free again), so no host hit ever copies back unwritten bytes."""
        cache = self.manager.prefix_cache
        tier = cache.tier if cache is not None else None
        if tier is None:
            return
        tier.drop_unwritten(offload.host_blocks)
        self._offloaded = True

    def run(self, max_steps: int = 100_000, progress=None) -> None:
        """Step until every request finished (``progress``: called with the number finished per step).
        An exception in a step propagates once the step is abandoned (:meth:`step`); ``run()`` again
        goes on with the requests it did not abort."""
        while self.scheduler.has_unfinished and self.events.steps < max_steps:
            self.step()
            if progress is not None:
                progress(self.stats[-1].num_finished)
        self.cache.flush()  # (the pool holds every state once run() returns)

    # ---- results -------------------------------------------------------------------------------------
    def outputs(self) -> dict[Any, list[int]]:
        """Generated tokens of every finished request (samples of ``n > 1`` requests included; aborted
        and failed requests left out)."""
        out = {
            rid: self._heads.get(rid, []) + list(req.output_token_ids)
            for rid, req in self.scheduler.finished.items()
            if req.state is RequestState.FINISHED
        }
        out.update((rid, list(toks)) for rid, toks in self._done.items())
        return out


__all__ = ["EngineConfig", "Events", "HFEngine", "StepStats", "model_spec"]

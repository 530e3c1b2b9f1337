"""The simulator: a workload through the real :class:`Scheduler` and :class:`HybridBlockManager`.

Discrete steps on a simulated clock. Each step: submit the requests that have arrived, ``step()``,
run the plan on :class:`~hybridkv.sim.executor.SimExecutor` (no data moves; the cost model prices
it), advance the clock by the step time, sample tokens with the synthetic engine, ``update()``.
When nothing is in flight the clock jumps to the next arrival. ``check_integrity()`` runs every
``integrity_every`` steps and at the end.

Arrived requests wait in a backlog and are submitted while the scheduler's waiting queue is shorter
than ``max_num_seqs``: the scheduler admits FCFS and at most ``max_num_seqs`` per step, so this
changes no decision, and it keeps the token ids of a long overloaded trace out of memory.

What memory pressure cost is recorded per step (flows, see :data:`FLOWS`): the host link's swap
seconds, the prefix cache's host tier's blocks and seconds on the same link, what the link added to
the step, the tokens recomputed after recompute preemptions and their compute seconds
(:class:`~hybridkv.sim.executor.SimExecutor`), the request-seconds spent swapped out, waiting to be
recomputed and queued, and whether the step was *memory-held*: a request waited (waiting queue,
backlog or swapped) while the step left room in both the token budget and ``max_num_seqs``, or the
step preempted. The scheduler admits and resumes in order while budget and seats allow and the pool
fits the next request, so in such a step only the pool held the waiting back; a step whose budget
or seats were full is *batch-full*. Gaps of the clock with nothing running are recorded too
(``gaps``). All of it is simulated time, never wall time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

import numpy as np

from hybridkv.errors import HybridKVError
from hybridkv.scheduler_adapter.gpu import PreemptionMode
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine
from hybridkv.sim.config import SimConfig, build
from hybridkv.sim.engines import engine_config
from hybridkv.sim.executor import SimExecutor
from hybridkv.sim.workload import SimRequest, Workload

# per-step series: stocks (sampled at the step's end) and flows (summed over the step)
STOCKS = (
    "free",
    "kv_live",
    "state_live",
    "state_speculative",
    "kv_cached",
    "checkpoints",
    "pending_free",
    "host_used",
    "host_cached",  # host blocks of the prefix cache's host tier (--host-cache), not counted in host_used
    "waiting",
    "running",
    "swapped",
    "recompute_waiting",  # preempted by recompute, not admitted again yet (also counted in waiting)
)
FLOWS = (
    "dt_s",
    "batched_tokens",
    "preempt_recompute",
    "preempt_swap",
    "resumed",  # swapped in (resumed) this step
    "swap_out_blocks",
    "swap_in_blocks",
    "copy_blocks",
    "admitted",
    "cached_tokens",
    "finished",
    "swap_link_s",  # host link busy with this step's swap-outs and swap-ins
    "tier_offload_blocks",  # the host tier's copies: device -> host (cached blocks evicted from the device)
    "tier_onload_blocks",  # and host -> device (host hits)
    "tier_link_s",  # host link busy with the tier's copies (both directions, as the swaps)
    "swap_stall_s",  # what the host link added to the step: total - forward (swap-ins and tier onloads, and
    # swap-outs and tier offloads past the forward)
    "recomputed_tokens",  # tokens computed a second time after a recompute preemption
    "recompute_s",  # their FLOPs at the effective FLOP rate
    "hbm_bound_s",  # the step's forward when its HBM bytes, not its FLOPs, set the roofline time
    "memory_held_s",  # dt of a memory-held step (module docstring)
    "batch_full_s",  # dt of a step with requests waiting while the token budget or max_num_seqs was full
    "queued_memory_rs",  # request-seconds queued (never admitted yet) in memory-held steps
    "queued_batch_rs",  # request-seconds queued in the other steps
    "swapped_rs",  # request-seconds swapped out
    "recompute_wait_rs",  # request-seconds waiting to be recomputed
)


class _Request:
    """Per-request outcome the simulator tracks (the scheduler's record is popped when done)."""

    __slots__ = (
        "req",
        "first_token_s",
        "finish_s",
        "num_outputs",
        "num_preemptions",
        "cached_tokens",
        "status",
        "reason",
        "admitted_s",
        "preempted_s",
        "swapped_s",
        "recompute_wait_s",
    )

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.num_outputs = 0
        self.num_preemptions = 0
        self.cached_tokens = 0  # served from the prefix cache, summed over admissions
        self.status = "pending"
        self.reason = ""
        self.admitted_s: float | None = None  # first admission (simulated seconds)
        self.preempted_s: float | None = None  # when the current preemption began
        self.swapped_s = 0.0  # time spent swapped out, summed over preemptions
        self.recompute_wait_s = 0.0  # time spent waiting to be readmitted after a recompute preemption


def simulate(cfg: SimConfig, workload: Workload, progress: bool = False, position: int = 0) -> dict[str, Any]:
    """Run ``workload`` under ``cfg``; returns the raw result (see :func:`hybridkv.sim.report.summarize`).

    Deterministic: the same config and workload give the same result. Raises ``HybridKVError``
    subclasses for bad configurations and :class:`~hybridkv.errors.IntegrityError` if the
    manager's books stop balancing; ``TypeError`` / ``ValueError`` (before any work) for a
    ``workload`` that is not a :class:`~hybridkv.sim.workload.Workload` or holds no request.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"simulate needs a Workload, got {type(workload).__name__}")
    workload.check_runnable()
    cfg = engine_config(cfg)  # the report states the policies the run used
    built = build(cfg)
    sched, manager = built.scheduler, built.manager
    executor = SimExecutor(manager, built.cost)
    engine = SyntheticEngine(cfg.accept_rate, cfg.seed)
    with_ids = manager.prefix_cache is not None
    arrivals = deque(workload.requests)
    backlog: deque[SimRequest] = deque()
    track: dict[str, _Request] = {r.request_id: _Request(r) for r in workload.requests}
    series: dict[str, list[float]] = {k: [] for k in ("t_s", *STOCKS, *FLOWS)}
    clock, integrity_checks, stalled = 0.0, 0, 0
    gaps = {"idle_s": 0.0, "memory_held_s": 0.0, "queued_memory_rs": 0.0}
    computed: dict[str, int] = {}  # the most tokens each unfinished request has computed
    lost: dict[str, int] = {}  # recompute victims: tokens computed before, until computed again
    awaiting_recompute: set[str] = set()
    max_seqs, max_tokens = sched.config.max_num_seqs, sched.config.max_num_batched_tokens
    link_s_per_block = built.layout.bytes_per_block / built.cost.gpu.host_link_bytes_per_s
    bar = _progress(len(workload), cfg.label, progress, position)

    def reject(rid: str, reason: str) -> None:
        track[rid].status, track[rid].reason = "rejected", reason

    while arrivals or backlog or sched.has_unfinished:
        while arrivals and arrivals[0].arrival_s <= clock:
            backlog.append(arrivals.popleft())
        while backlog and len(sched.waiting) < cfg.max_num_seqs:
            r = backlog.popleft()
            prompt = workload.token_ids(r) if with_ids else r.num_prompt_tokens
            try:
                sched.add_request(r.request_id, prompt, r.max_new_tokens)
            except (HybridKVError, ValueError) as e:
                reject(r.request_id, f"{type(e).__name__}: {e}")
                bar.update(1)
        if not sched.has_unfinished:
            if arrivals:
                gaps["idle_s"] += max(0.0, arrivals[0].arrival_s - clock)
                clock = max(clock, arrivals[0].arrival_s)
            continue
        plan = sched.step()
        start_s = clock
        for p in plan.preempted:
            track[p.request_id].preempted_s = start_s
            if p.mode is not PreemptionMode.SWAP:
                awaiting_recompute.add(p.request_id)
                lost[p.request_id] = max(lost.get(p.request_id, 0), computed.get(p.request_id, 0))
        for rid in (*plan.resumed, *plan.admitted):
            t = track[rid]
            if t.admitted_s is None:
                t.admitted_s = start_s
            if t.preempted_s is not None:
                if rid in awaiting_recompute:
                    t.recompute_wait_s += start_s - t.preempted_s
                else:
                    t.swapped_s += start_s - t.preempted_s
                t.preempted_s = None
            awaiting_recompute.discard(rid)
        if plan.is_empty and not sched.running:
            sched.update(engine.run(plan))
            if arrivals:  # nothing fits now and nothing runs: wait for the next arrival
                gap = max(0.0, arrivals[0].arrival_s - clock)
                queued = len(sched.waiting) + len(backlog)
                gaps["memory_held_s" if queued else "idle_s"] += gap
                gaps["queued_memory_rs"] += queued * gap
                clock = max(clock, arrivals[0].arrival_s)
                continue
            stalled = len(sched.requests)  # cannot happen with a correct scheduler: report it, do not hang
            for rid in list(sched.requests):
                sched.abort(rid)
                reject(rid, "stalled: nothing running and the next request cannot be admitted")
            sched.pop_finished()
            break
        waiting = len(sched.waiting) + len(backlog)
        swapped = len(sched.swapped)
        held = bool(plan.preempted) or bool(
            (waiting or swapped) and len(sched.running) < max_seqs and plan.num_batched_tokens < max_tokens
        )
        done = executor.run(plan, lost)
        dt = done.time.total_s
        clock += dt
        result = sched.update(engine.run(plan))
        for row in plan.scheduled:
            rid = row.request_id
            if row.samples:
                t = track[rid]
                if t.first_token_s is None:
                    t.first_token_s = clock
            req = sched.requests.get(rid)
            if req is not None and req.num_computed_tokens > computed.get(rid, 0):
                computed[rid] = req.num_computed_tokens
                if rid in lost and req.num_computed_tokens >= lost[rid]:
                    del lost[rid]
        cached = 0
        for rid in plan.admitted:
            req = sched.requests.get(rid)
            if req is not None:
                track[rid].cached_tokens += req.num_cached_tokens
                cached += req.num_cached_tokens
        for rid, req in sched.pop_finished().items():
            t = track[rid]
            t.finish_s, t.status = clock, "finished"
            t.num_outputs, t.num_preemptions = len(req.output_token_ids), req.num_preemptions
            computed.pop(rid, None)
            lost.pop(rid, None)
        bar.update(len(result.finished))
        u = manager.usage()
        swaps = sum(1 for p in plan.preempted if p.mode is PreemptionMode.SWAP)
        row_values = (
            clock,
            u.free,
            u.kv_live,
            u.state_live,
            u.state_speculative,
            u.kv_cached,
            u.checkpoints,
            u.pending_free,
            u.host_used,
            u.host_cached,
            len(sched.waiting) + len(backlog),
            len(sched.running),
            len(sched.swapped),
            len(awaiting_recompute),
            dt,
            plan.num_batched_tokens,
            len(plan.preempted) - swaps,
            swaps,
            len(plan.resumed),
            done.swap_out_blocks,
            done.swap_in_blocks,
            done.copy_blocks + done.checkpoint_copy_blocks,
            len(plan.admitted),
            cached,
            len(result.finished),
            (done.swap_out_blocks + done.swap_in_blocks) * link_s_per_block,
            done.tier_offload_blocks,
            done.tier_onload_blocks,
            (done.tier_offload_blocks + done.tier_onload_blocks) * link_s_per_block,
            dt - done.time.forward_s,
            done.recomputed_tokens,
            done.recompute_s,
            done.time.forward_s if done.time.memory_s > done.time.compute_s else 0.0,
            dt if held else 0.0,
            dt if (waiting or swapped) and not held else 0.0,
            (waiting - len(awaiting_recompute)) * dt if held else 0.0,
            (waiting - len(awaiting_recompute)) * dt if not held else 0.0,
            swapped * dt,
            len(awaiting_recompute) * dt,
        )
        for key, value in zip(series, row_values, strict=True):
            series[key].append(value)
        if sched.num_steps % cfg.integrity_every == 0:
            manager.check_integrity()
            integrity_checks += 1
    manager.check_integrity()
    integrity_checks += 1
    bar.close()
    return {
        "config": cfg.as_dict(),
        "resolved": _resolved(cfg, built),
        "gpu": asdict(built.gpu),
        "layout": _layout_dict(built.layout),
        "workload": workload.summary(),
        "num_steps": sched.num_steps,
        "checkpoint_stops": sched.num_checkpoint_stops,  # prefill chunks cut short for a checkpoint
        "exports": sched.num_exports,  # states a prefill kernel exported from inside a chunk
        "sim_time_s": clock,
        "integrity_checks": integrity_checks,
        "stalled": stalled,
        "gaps": gaps,
        "executor_totals": dict(executor.totals),
        "host_hit_tokens": manager.prefix_cache.stats.hit_tokens_host if manager.prefix_cache is not None else 0,
        "series": {k: np.asarray(v) for k, v in series.items()},
        "requests": [_request_dict(t) for t in track.values()],
    }


def _progress(total: int, label: str, enabled: bool, position: int) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", position=position, leave=True, mininterval=0.5, dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _resolved(cfg: SimConfig, built: Any) -> dict[str, Any]:
    """The values a run used where its config says "the default" (``None``): the state dtypes, the
    block size, the GPU figures' source."""
    model = built.layout.model
    state: dict[str, str] = {}
    for _, layer in model.recurrent_layers():
        for c in layer.components:
            state.setdefault(f"{layer.mixer}.{c.name}", c.dtype.value)
    return {
        "state_dtype": ", ".join(f"{k} {v}" for k, v in state.items()) or "no recurrent state",
        "block_size": built.layout.block_size,
        "gpu_calibration": cfg.gpu_calibration or "none: roofline figures of the GPU preset",
    }


def _layout_dict(layout: Any) -> dict[str, Any]:
    return {
        "kind": layout.kind.value,
        "block_size": layout.block_size,
        "bytes_per_block": layout.bytes_per_block,
        "num_blocks": layout.num_blocks,
        "blocks_per_state": list(layout.blocks_per_state),
        "state_blocks_per_request": layout.num_state_blocks_per_request,
        "kv_bytes_per_token": layout.kv_bytes_per_token,
        "state_bytes_per_request": layout.model.state_bytes,
        "budget_bytes": layout.budget_bytes,
    }


def _request_dict(t: _Request) -> dict[str, Any]:
    r = t.req
    d: dict[str, Any] = {
        "id": r.request_id,
        "status": t.status,
        "arrival_s": r.arrival_s,
        "prompt_tokens": r.num_prompt_tokens,
        "max_new_tokens": r.max_new_tokens,
        "outputs": t.num_outputs,
        "preemptions": t.num_preemptions,
        "cached_tokens": t.cached_tokens,
    }
    if t.admitted_s is not None:
        d["queued_s"] = t.admitted_s - r.arrival_s  # arrival to first admission
        d["swapped_s"] = t.swapped_s
        d["recompute_wait_s"] = t.recompute_wait_s
    if t.first_token_s is not None:
        d["ttft_s"] = t.first_token_s - r.arrival_s
    if t.finish_s is not None:
        d["e2e_s"] = t.finish_s - r.arrival_s
        if t.num_outputs > 1 and t.first_token_s is not None:
            d["tpot_s"] = (t.finish_s - t.first_token_s) / (t.num_outputs - 1)
    if t.status == "rejected":
        d["reason"] = t.reason
    return d

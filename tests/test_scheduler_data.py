"""Scheduler property test that checks data: every KV slot and state byte follows its request.

Everything on at once: prefix caching (every policy), preemption by recompute, swap or auto, a
swap executor that runs swaps inside ``step()`` (or none: the executor runs them from the plan),
speculative decoding with rejections, aborts before a step, between ``step()`` and ``update()``
(the executor then skips the row, or runs it anyway into the blocks it had), state groups of
different sizes, state-only models, tiny pools. A :class:`~tests.shadow.Shadow` is the device and
host memory; the executor applies each plan in the documented order (docs/contract.md):
checkpoint copies, swap-outs, swap-ins, copies, then the forward, which first checks that each row
reads exactly its own KV and state and then writes its new KV and state.

``SCHEDULER_DATA_EXAMPLES`` sets the number of examples per test (CI runs the default).
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.scheduler_adapter import PreemptionMode, RequestState, Scheduler, SchedulerConfig, StepOutputs
from tests.shadow import Shadow, prefix_hashes
from tests.test_scheduler_property import play

EXAMPLES = int(os.environ.get("SCHEDULER_DATA_EXAMPLES", "100"))


def _model(kind: str) -> ModelSpec:
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    small = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))  # 256 B
    big = RecurrentLayerSpec("gla", (StateComponent("kv", (5, 8, 4), DType.FLOAT32),))  # 640 B
    layers = {
        "uniform": (attn, small, small),
        "mixed": (attn, small, big),  # state groups of 2 and 5 blocks
        "state_only": (small, big),
    }[kind]
    return ModelSpec(kind, layers, params_active=1e6)


def _manager(kind, num_blocks, num_host_blocks, watermark, prefix) -> HybridBlockManager:
    model = _model(kind)
    probe = plan(model, 1 << 24, block_size=4)
    layout = plan(model, num_blocks * probe.bytes_per_block, block_size=4)
    return HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark, prefix_cache=prefix)


def event(value: str) -> None:
    """Hypothesis statistics, ignored when a regression test runs one workload directly."""
    try:
        _hypothesis_event(value)
    except InvalidArgument:
        pass


class DataExecutor:
    """Runs plans on the shadow, checking each row's reads, and plays the model's sampling."""

    def __init__(self, scheduler: Scheduler, shadow: Shadow, accept_rate: float, seed: int) -> None:
        self.s, self.m, self.shadow = scheduler, scheduler.manager, shadow
        self.rng = random.Random(seed)
        self.accept_rate = accept_rate
        self.sync_swaps = False

    def swap_executor(self, swap_plan) -> None:  # called inside step() when installed
        self.shadow.swap(swap_plan)

    def tables(self, step_plan):
        """What a real executor captures when it builds the step's metadata."""
        out = {}
        for row in step_plan.scheduled:
            rid = row.request_id
            rec = self.m.requests[rid]
            out[rid] = (rec.kv_blocks.copy(), rec.state.copy(), self.m.speculative_table(rid).copy())
        return out

    def run(self, step_plan, tables, run_aborted: bool) -> StepOutputs:
        sh = self.shadow
        sh.copy(step_plan.checkpoint_copies)
        if not self.sync_swaps:
            for p in step_plan.swap_out:
                sh.swap(p)
            for p in step_plan.swap_in:
                sh.swap(p)
        sh.copy(step_plan.copies)
        sampled, accepted = {}, {}
        for row in step_plan.scheduled:
            rid = row.request_id
            req = self.s.requests.get(rid)
            alive = req is not None and req.state is RequestState.RUNNING
            if not alive and not run_aborted:
                continue
            req = req or self.s.finished[rid]
            kv, live, spec = tables[rid]
            c, n, d = row.num_computed_tokens, row.num_scheduled_tokens, row.num_drafts
            known = [*req.prompt_token_ids, *req.output_token_ids]
            drafts = [self.rng.randrange(50) for _ in range(d)]
            tokens = known[: c + n] + drafts
            h = prefix_hashes(tokens)
            if alive:  # reads: the row sees exactly its own bytes
                sh.check_kv(f"step {step_plan.step} row {rid}", kv, h, c)
                if c:
                    sh.check_state(f"step {step_plan.step} row {rid}", live, h[c])
            sh.write_kv(kv, h, c, c + n + d)
            sh.write_state(live, h[c + n])
            for j in range(d):
                sh.write_state(spec[j], h[c + n + j + 1])
            if alive and row.samples:
                a = 0
                while a < d and self.rng.random() < self.accept_rate:
                    a += 1
                sampled[rid] = drafts[:a] + [self.rng.randrange(50)]
                if d:
                    accepted[rid] = a
        return StepOutputs(sampled, frozenset(), accepted)

    def check_all(self) -> None:
        """After update: every running request's KV and live state, every swapped request's host copy."""
        for rid, req in self.s.requests.items():
            tokens = [*req.prompt_token_ids, *req.output_token_ids]
            h = prefix_hashes(tokens)
            rec = self.m.requests.get(rid)
            c = req.num_computed_tokens
            if req.state is RequestState.RUNNING:
                self.shadow.check_kv(f"running {rid}", rec.kv_blocks, h, c)
                if c:
                    self.shadow.check_state(f"running {rid}", rec.state, h[c])
            elif req.state is RequestState.SWAPPED:
                self.shadow.check_host(f"swapped {rid}", rec.host_blocks, h, c, h[c])


add = st.tuples(
    st.just("add"),
    st.integers(1, 16),  # own prompt tokens
    st.integers(1, 30),  # max_new_tokens
    st.integers(0, 2),  # priority
    st.integers(0, 2),  # shared prefix template
    st.sampled_from([0, 4, 8, 12, 16]),  # shared prefix tokens
)
abort = st.tuples(st.just("abort"), st.integers(0, 1000))
fork = st.tuples(st.just("fork"), st.integers(0, 1000), st.integers(1, 12))  # parent, tokens the child adds
step = st.tuples(st.just("step"), st.one_of(st.none(), st.none(), st.integers(0, 1000)))  # abort mid-step
actions = st.lists(st.one_of(add, abort, fork, step, step, step), min_size=1, max_size=50)
burst = st.lists(add, min_size=2, max_size=10)
prefix_configs = st.one_of(
    st.none(),
    st.builds(PrefixCacheConfig, st.sampled_from(CheckpointPolicy), st.sampled_from(EvictionPolicy), st.integers(1, 3)),
)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    kind=st.sampled_from(["uniform", "uniform", "mixed", "state_only"]),
    actions=st.tuples(burst, actions).map(lambda t: t[0] + t[1]),
    mode=st.sampled_from(list(PreemptionMode)),
    k=st.integers(0, 2),
    num_blocks=st.integers(16, 48),
    num_host_blocks=st.sampled_from([0, 16, 48]),
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
    max_num_seqs=st.integers(1, 5),
    max_tokens=st.integers(4, 24),
    prefix=prefix_configs,
    sync_swaps=st.booleans(),
    run_aborted=st.booleans(),
    accept_rate=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_every_request_reads_exactly_its_own_bytes(**kw):
    run_data_workload(**kw)


def run_data_workload(
    kind,
    actions,
    mode,
    k,
    num_blocks,
    num_host_blocks,
    watermark,
    max_num_seqs,
    max_tokens,
    prefix,
    sync_swaps,
    run_aborted,
    accept_rate,
    seed,
):
    """One workload through the scheduler with the data-checking executor (also used by regression tests)."""
    m = _manager(kind, num_blocks, num_host_blocks, watermark, prefix)
    shadow = Shadow(m)
    executor_box: list[DataExecutor] = []
    swap_exec = (lambda p: executor_box[0].swap_executor(p)) if sync_swaps else None
    s = Scheduler(m, SchedulerConfig(max_num_seqs, max_tokens, k, mode), swap_executor=swap_exec)
    ex = DataExecutor(s, shadow, accept_rate, seed)
    ex.sync_swaps = sync_swaps
    executor_box.append(ex)
    aborted: set = set()

    def one_step(abort_mid):
        p = s.step()
        m.check_integrity()
        tables = ex.tables(p)
        if abort_mid is not None and p.scheduled:
            rid = p.scheduled[abort_mid % len(p.scheduled)].request_id
            if rid in s.requests:
                s.abort(rid)
                aborted.add(rid)
                event("abort between step and update")
        for pre in p.preempted:
            event(f"preempted by {pre.mode.value}")
        if len(p.checkpoint_copies):
            event("checkpoint copies")
        s.update(ex.run(p, tables, run_aborted))
        m.check_integrity()
        ex.check_all()

    play(s, actions, one_step, aborted)
    if prefix is not None and any(r.num_cached_tokens for r in s.finished.values()):
        event("prefix hit")

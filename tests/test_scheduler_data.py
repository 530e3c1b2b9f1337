"""Scheduler property test that checks data: every KV slot and state byte follows its request.

Everything on at once: prefix caching (every checkpoint and eviction policy; its host tier in the
host pool the swaps use: offloads, host hits, host eviction, swap-outs winning host blocks, the tier's
copies taken once per plan and run as its stage 0, and by a swap executor before each swap it runs
inside ``step()``), preemption by
recompute, swap or auto, a swap executor that runs swaps inside ``step()`` (or none: the executor
runs them from the plan), speculative decoding with rejections (up to 5 drafts on blocks of 4), every admission policy,
forks (of forks), aborts before a
step, between ``step()`` and ``update()`` (the executor then skips the row, or runs it anyway into
the blocks it had), state groups of different sizes, state-only models, attention with side tensors
(K only, with per-token indexer keys and int64 positions in the slot), tiny pools.

A :class:`~tests.shadow.Shadow` is the device and host memory, run by a LAZY executor
(:class:`~tests.shadow.Ledger`): every copy and swap the manager hands out (inside ``step()``,
``update()`` or ``fork()``) is queued with the bytes its source holds at that moment, and runs as late
as docs/contract.md allows: the checkpoint copies of an update and the fork copies after it only in
stage 1 of the next plan (after the swaps a swap executor ran inside that ``step()``), a plan's own
swaps in stages 2 and 3 (or inside ``step()`` with a swap executor), its copy-on-write and prefix-hit
copies in stage 4, right before the forward: no copy can run later, since the forward reads what it
writes. When an op runs its source must still hold the bytes of hand-out; the manager may never give
a block that a copy not yet run touches, or whose pin epoch was not released, to a new holder
(HOLDER). The forward then checks that each row reads exactly its own KV and state and writes its new
KV and state.

A serving loop ``while has_unfinished: step, forward, update`` must end idle: every op handed out ran,
no pins, nothing pending-free, every cached KV block and checkpoint holds its bytes. Then a SECOND
batch (a new :class:`Scheduler` on the same manager, prompts that continue the first batch's
requests) runs with the same checks, and a direct ``allocate`` of each finished request's tokens
reads its prefix hit.

Two generators: every feature at once (``WORKLOAD``), and parallel sampling (``BRANCHES``: short
requests forked near their ends, at block edges, into short children, on pools the prefix cache keeps
full, so that a step's copy-on-write, the finish of a branch, its block entering the cache and an
eviction for another row's checkpoint or a fork come in one update).

``SCHEDULER_DATA_EXAMPLES`` sets the number of examples per test (CI runs the default).
"""

from __future__ import annotations

import dataclasses
import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from hybridkv.blockmgr.errors import AllocationError, RequestStateError, RequestTooLargeError
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.models.spec import SideTensor
from hybridkv.scheduler_adapter import PreemptionMode, RequestState, Scheduler, SchedulerConfig, StepOutputs
from hybridkv.scheduler_adapter.scheduler_config import AdmissionPolicy
from tests.shadow import Ledger, Shadow, prefix_hashes
from tests.test_scheduler_property import check_outcomes

EXAMPLES = int(os.environ.get("SCHEDULER_DATA_EXAMPLES", "300"))


def _model(kind: str) -> ModelSpec:
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    small = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))  # 256 B
    big = RecurrentLayerSpec("gla", (StateComponent("kv", (5, 8, 4), DType.FLOAT32),))  # 640 B
    small_q = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.INT8),))
    big_q = RecurrentLayerSpec("gla", (StateComponent("kv", (5, 8, 4), DType.FLOAT8_E4M3),))
    layers = {
        "uniform": (attn, small, small),
        "mixed": (attn, small, big),  # state groups of 2 and 5 blocks
        "state_only": (small, big),
        # MLA-shaped attention (K only) with per-token side tensors in the slot after it
        "side": (AttentionLayerSpec(1, 8, DType.BFLOAT16, v_head_dim=0, side=(
            SideTensor("index_k", 8, DType.BFLOAT16), SideTensor("pos", 3, DType.INT64))), small, big),
        # quantized states: int8 / fp8 values then float32 row scales in the set (128 B and 320 B)
        "quantized": (attn, small_q, big_q),
    }[kind]
    return ModelSpec(kind, layers, params_active=1e6)


def _manager(kind, num_blocks, num_host_blocks, watermark, prefix, host_tier=False) -> HybridBlockManager:
    model = _model(kind)
    if prefix is not None and host_tier and num_host_blocks:  # the host tier shares the swap pool
        prefix = dataclasses.replace(prefix, host_tier=True)
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
    """Runs plans on the ledger's shadow as late as the contract allows, checking each row's reads,
    and plays the model's sampling."""

    def __init__(self, scheduler: Scheduler, ledger: Ledger, accept_rate: float, seed: int) -> None:
        self.s, self.m, self.ledger = scheduler, scheduler.manager, ledger
        self.shadow = ledger.real
        self.rng = random.Random(seed)
        self.accept_rate = accept_rate
        self.sync_swaps = False

    def swap_executor(self, swap_plan) -> None:  # called inside step() when installed
        # the host tier's copies handed out so far run first (a swap-in may get a block whose offload
        # has not run: docs/contract.md, stage 0)
        self.run_tier(f"{self.ledger.phase}: the swap executor's stage 0")
        self.ledger.run_swap(swap_plan, f"{self.ledger.phase}: the swap executor")

    def run_tier(self, what: str, parts=("offload", "onload")):
        """Take the host tier's copies (everything handed out since the last take) and run ``parts``
        of them (offloads: stage 0; onloads: after the swaps); returns the plan."""
        take = getattr(self.m, "take_tier_copies", None)
        if take is None:
            return None
        plan = take()
        if len(plan.offload):
            event("host tier: offloads")
        if len(plan.onload):
            event("host tier: host hits (onloads)")
        self.ledger.run_tier(plan, what, parts)
        return plan

    def tables(self, step_plan):
        """What a real executor captures when it builds the step's metadata."""
        out = {}
        for row in step_plan.scheduled:
            rid = row.request_id
            rec = self.m.requests[rid]
            out[rid] = (rec.kv_blocks.copy(), rec.state.copy(), self.m.speculative_table(rid).copy())
        return out

    def run(self, step_plan, tables, run_aborted: bool) -> StepOutputs:
        led, sh = self.ledger, self.shadow
        what = f"plan {step_plan.step}"
        tier = step_plan.tier_copies  # the scheduler took the tier's copies into the plan
        if len(tier.offload):
            event("host tier: offloads")
        if len(tier.onload):
            event("host tier: host hits (onloads)")
        led.run_tier(tier, f"{what} stage 0 (host tier offloads)", ("offload",))
        led.run_copies(step_plan.checkpoint_copies, f"{what} stage 1 (checkpoint and fork copies)")
        if not self.sync_swaps:
            for p in step_plan.swap_out:
                led.run_swap(p, f"{what} stage 2 (swap-out)")
            for p in step_plan.swap_in:
                led.run_swap(p, f"{what} stage 3 (swap-in)")
        led.run_tier(tier, f"{what} stage 3b (host tier onloads)", ("onload",))
        led.run_copies(step_plan.copies, f"{what} stage 4 (copy-on-write, prefix hits)")
        assert not led.queue, f"{what}: handed out before its forward but in no plan (they never run): {led.queue}"
        sampled, accepted = {}, {}
        exports = {}  # the kernel writes them in the forward
        for e in step_plan.exports:
            exports.setdefault(e.request_id, []).append(e)
        if exports:
            event("prefill kernel exports")
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
            led.note_prefixes(tokens, h)
            if alive:  # reads: the row sees exactly its own bytes
                sh.check_kv(f"step {step_plan.step} row {rid}", kv, h, c)
                if c:
                    sh.check_state(f"step {step_plan.step} row {rid}", live, h[c])
            led.write_kv(kv, h, c, c + n + d)
            for e in exports.get(rid, ()):
                assert c < e.position < c + n, f"{what}: export at {e.position} outside {rid}'s chunk [{c}, {c + n})"
                led.write_state(e.sets, h[e.position])
            led.write_state(live, h[c + n])
            for j in range(d):
                led.write_state(spec[j], h[c + n + j + 1])
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
    st.one_of(st.integers(1, 4), st.integers(1, 16)),  # own prompt tokens
    st.one_of(st.integers(1, 3), st.integers(1, 30)),  # max_new_tokens
    st.integers(0, 2),  # priority
    st.integers(0, 2),  # shared prefix template
    st.sampled_from([0, 4, 8, 12, 16, 24, 32]),  # shared prefix tokens
)
abort = st.tuples(st.just("abort"), st.integers(0, 1000))
abort_all = st.just(("abort_all",))  # the client cancels the whole batch (between an update and a step)
# (parent, tokens the child adds, which parents: bit 0 those closest to their end (the copy-on-write
# of the next step and the finish come in one update), bit 1 those whose next token fills a block (the
# block copied on write enters the prefix cache in that update); a fork waits a few steps for one)
fork = st.tuples(
    st.just("fork"), st.integers(0, 1000), st.one_of(st.integers(1, 2), st.integers(1, 12)), st.integers(0, 3)
)
step = st.tuples(st.just("step"), st.one_of(st.none(), st.none(), st.integers(0, 1000)))  # abort mid-step
# each action, then 0 to 3 steps
actions = st.lists(
    st.tuples(st.one_of(add, abort, abort_all, fork, fork.map(tuple), fork.map(list), step), st.integers(0, 3)),
    min_size=2,
    max_size=40,
).map(lambda pairs: [x for action, n in pairs for x in (action, *[("step", None)] * n)])
burst = st.lists(add, min_size=2, max_size=10)
def _own_exports(cfg: PrefixCacheConfig) -> PrefixCacheConfig:
    """Exports under hybridkv's own policies (vllm_align's are tests/test_vllm_in_place.py's)."""
    if cfg.checkpoint is CheckpointPolicy.VLLM_ALIGN:
        return dataclasses.replace(cfg, export_alignment=None)
    return cfg


prefix_on = st.builds(
    PrefixCacheConfig,
    # every_n_blocks twice: checkpoints at (nearly) every block boundary keep the pool short of blocks
    st.sampled_from([*CheckpointPolicy, CheckpointPolicy.EVERY_N_BLOCKS]),
    st.sampled_from(EvictionPolicy),
    st.sampled_from([1, 1, 2, 3]),
    evict_batch_fraction=st.sampled_from([0.01, 0.01, 0.3]),  # 0.3: each eviction takes many blocks
    demote_tail=st.booleans(),
    export_alignment=st.sampled_from([None, None, 4, 8]),  # a prefill kernel that writes states inside a chunk
).map(_own_exports)
prefix_configs = st.one_of(st.none(), prefix_on, prefix_on.map(lambda c: c))
# the second batch: (a first-batch request to continue, its tokens kept, new tokens, max_new_tokens)
second = st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 64), st.integers(0, 6), st.integers(1, 8)), max_size=8)


WORKLOAD = dict(
    kind=st.sampled_from(["uniform", "uniform", "mixed", "state_only", "side", "quantized"]),
    actions=st.tuples(burst, actions).map(lambda t: t[0] + t[1]),
    mode=st.sampled_from(list(PreemptionMode)),
    k=st.one_of(st.integers(0, 2), st.integers(0, 5)),  # (block size 4: k >= 4 drafts fill a block)
    admission=st.sampled_from(list(AdmissionPolicy)),
    num_blocks=st.one_of(st.integers(16, 28), st.integers(16, 48)),
    num_host_blocks=st.sampled_from([0, 16, 48]),
    host_tier=st.booleans(),  # the prefix cache's host tier, in the host pool the swaps use
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
    max_num_seqs=st.integers(1, 8),
    max_tokens=st.integers(4, 24),
    prefix=prefix_configs,
    sync_swaps=st.booleans(),
    run_aborted=st.booleans(),
    accept_rate=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    second_batch=second,
    second_config=st.tuples(st.integers(1, 5), st.integers(4, 24), st.integers(0, 2)),
    cancel_at_end=st.booleans(),
)


# Parallel sampling: short requests branching near their ends, at block edges, into short children, on
# pools the cache keeps full (the copy-on-write of a step, the finish of its writer or of the branch it
# copied from, the block entering the cache, and an eviction for another row's checkpoint or a fork, all
# in one update: eviction must respect the pins of the copies of that step)
short_add = st.tuples(
    st.just("add"), st.integers(1, 12), st.integers(1, 6), st.integers(0, 1), st.integers(0, 2),
    st.sampled_from([0, 8, 16, 24]),
)  # fmt: skip
branch = st.tuples(st.just("fork"), st.integers(0, 1000), st.integers(1, 2), st.sampled_from([1, 2, 3, 3]))
BRANCHES = dict(
    WORKLOAD,
    kind=st.sampled_from(["uniform", "mixed"]),
    actions=st.tuples(
        st.lists(short_add, min_size=3, max_size=8),
        st.lists(
            st.tuples(st.one_of(short_add, branch, branch.map(tuple), step), st.integers(0, 2)), min_size=4, max_size=30
        ),
    ).map(lambda t: t[0] + [x for action, n in t[1] for x in (action, *[("step", None)] * n)]),
    num_blocks=st.integers(20, 44),
    max_num_seqs=st.integers(3, 8),
    prefix=prefix_on,
)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(**WORKLOAD)
def test_every_request_reads_exactly_its_own_bytes(**kw):
    run_data_workload(**kw)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(**BRANCHES)
def test_branches_that_end_at_once_read_their_own_bytes(**kw):
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
    second_batch=((0, 64, 2, 3), (1, 8, 0, 2), (2, 64, 0, 1)),
    second_config=(3, 16, 1),
    cancel_at_end=False,
    host_tier=False,
    admission=AdmissionPolicy.RESERVED,
):
    """One workload through the scheduler with the lazy data-checking executor, to idle; then a
    second batch on the same manager, to idle; then direct prefix-hit reads (also used by regression
    tests)."""
    m = _manager(kind, num_blocks, num_host_blocks, watermark, prefix, host_tier)
    if m.prefix_cache is not None and m.prefix_cache.tier is not None:
        event("host tier")
    ledger = Ledger(m, Shadow(m), take_tier=False)  # the executor takes the tier's copies per plan
    if cancel_at_end:  # the client cancels what is left of the batch (between an update and a step)
        actions = [*actions, ("abort_all",)]
    history = serve_batch(
        m, ledger, actions, mode, k, max_num_seqs, max_tokens, sync_swaps, run_aborted, accept_rate, seed, "batch 1",
        admission,
    )
    if prefix is not None and history:
        event("prefix cache, batch 1 finished")
    # the next user of the manager: a new scheduler for the next batch, prompts continuing batch 1's
    seqs2, tokens2, k2 = second_config
    adds = []
    for i, (which, keep, new, max_new) in enumerate(second_batch):
        base = history[which % len(history)][:keep] if history else []
        adds.append(("add2", [*base, *((i + 1) * 7_000_000 + j for j in range(new))] or [1], max_new))
    more = serve_batch(
        m, ledger, adds, mode, k2, seqs2, tokens2, sync_swaps, run_aborted, accept_rate, seed + 1, "batch 2", admission
    )
    # and a direct user: allocate each finished request's tokens, run the hit's copy, read it
    probe_hits(m, ledger, history + more)


def serve_batch(
    m, ledger, actions, mode, k, max_num_seqs, max_tokens, sync_swaps, run_aborted, accept_rate, seed, name,
    admission=AdmissionPolicy.RESERVED,
) -> list[list[int]]:
    """Serve ``actions`` with a new scheduler on ``m`` until ``has_unfinished`` is False; check the
    manager is idle then. Returns the token ids (prompt and output) of every request that finished."""
    executor_box: list[DataExecutor] = []
    swap_exec = (lambda p: executor_box[0].swap_executor(p)) if sync_swaps else None
    config = SchedulerConfig(max_num_seqs, max_tokens, min(k, max_tokens - 1), mode, admission=admission)
    s = Scheduler(m, config, swap_executor=swap_exec)
    ex = DataExecutor(s, ledger, accept_rate, seed)
    ex.sync_swaps = sync_swaps
    executor_box.append(ex)
    aborted: set = set()

    def one_step(abort_mid):
        ledger.phase = f"{name} step {s.num_steps}"
        p = s.step()
        m.check_integrity()
        tables = ex.tables(p)
        if abort_mid is not None and p.scheduled:
            rid = p.scheduled[abort_mid % len(p.scheduled)].request_id
            if rid in s.requests:
                ledger.phase = f"{name} abort of {rid!r} between step {p.step} and its update"
                s.abort(rid)
                aborted.add(rid)
                event("abort between step and update")
        for pre in p.preempted:
            event(f"preempted by {pre.mode.value}")
        if len(p.checkpoint_copies):
            event("checkpoint copies")
        if len(p.copies):
            event("copies")
        ledger.phase = f"{name} executor of plan {p.step}"
        outputs = ex.run(p, tables, run_aborted)
        ledger.phase = f"{name} update of step {p.step}"
        dst = set(p.copies.dst.tolist())
        cow = {rid for rid, (kv, _, _) in tables.items() if dst.intersection(kv.tolist())}
        s.update(outputs)
        if cow & set(s.finished):
            event("copy-on-write and finish in one step")
        m.check_integrity()
        ex.check_all()
        ledger.check_agree(f"{name} after update of step {p.step}")

    wanted = play(s, ledger, name, actions, one_step, aborted)
    # the tier's copies of the last update (if it evicted without a checkpoint copy to carry) run
    # with any plan; here, as the executor's last stage 0
    ex.run_tier(f"{name}: stage 0 after the loop")
    # the loop ended: the manager must be idle (the last update's checkpoint copies were handed out
    # in a plan and ran; no pins, nothing pending-free, every cached block holds its bytes)
    ledger.phase = f"{name} ended"
    ledger.check_idle(f"{name}: after `while has_unfinished` ended")
    u = m.usage()
    assert not m.requests and u.used == 0 and u.host_used == 0 and u.free + u.evictable == u.total - 1, u
    out = []
    for rid in wanted:
        req = s.finished[rid]
        if req.state is RequestState.FINISHED:
            out.append([*req.prompt_token_ids, *req.output_token_ids])
    return out


def play(s: Scheduler, ledger: Ledger, name: str, actions, step, aborted: set, max_steps: int = 3000) -> dict:
    """Submit, fork, abort and step as ``actions`` say (``step(abort_mid)`` runs one step; aborts go
    into ``aborted``; a fork waits for a running parent, tried after each step), then step while
    ``has_unfinished``. Checks that each request finished with all
    its tokens or was aborted. Returns {request id: max_new_tokens}."""
    wanted = {}
    forks: list = []  # [action index, action, steps waited]: forks waiting for a parent (tried after each step)
    bs = s.manager.block_size

    def try_forks(after_step: bool):
        for entry in list(forks):
            i, action, waited = entry
            running = [r for r in s.running if r.state is RequestState.RUNNING]
            if not running or len(s.running) >= s.config.max_num_seqs:
                return  # (a fork needs a running parent and room for one more row)
            pick = action[3] if len(action) > 3 else 0
            if pick & 2 and waited < 4:  # the parent's next token fills a block
                edge = [r for r in running if (r.num_computed_tokens + 1) % bs == 0]
                if not edge:
                    entry[2] += after_step
                    continue
                running = edge
            if pick & 1:
                left = min(r.max_new_tokens - len(r.output_token_ids) for r in running)
                running = [r for r in running if r.max_new_tokens - len(r.output_token_ids) <= left + 1]
            parent = running[action[1] % len(running)]
            ledger.phase = f"{name} fork of {parent.request_id!r} after step {s.num_steps - 1}"
            try:
                child = s.fork(parent.request_id, 100_000 + i, action[2])
            except (AllocationError, RequestStateError):
                entry[2] += after_step
                if entry[2] > 8:
                    forks.remove(entry)  # the pool stays too full: give up
                continue
            forks.remove(entry)
            wanted[100_000 + i] = child.max_new_tokens
            event("fork")

    for i, action in enumerate(actions):
        if action[0] == "add":
            _, own, max_new, prio, template, shared = action
            ids = [template * 1000 + j for j in range(shared)] + [(i + 1) * 10_000 + j for j in range(own)]
            try:
                s.add_request(i, ids, max_new, prio)
                wanted[i] = max_new
            except RequestTooLargeError:
                pass
        elif action[0] == "add2":
            _, ids, max_new = action
            try:
                s.add_request(i, ids, max_new)
                wanted[i] = max_new
            except RequestTooLargeError:
                pass
        elif action[0] == "fork":
            forks.append([i, action, 0])
            try_forks(False)
        elif action[0] == "abort_all":
            ledger.phase = f"{name} abort of every request before step {s.num_steps}"
            for rid in sorted(s.requests):
                s.abort(rid)
                aborted.add(rid)
        elif action[0] == "abort":
            live = sorted(s.requests)
            if live:
                rid = live[action[1] % len(live)]
                ledger.phase = f"{name} abort of {rid!r} before step {s.num_steps}"
                s.abort(rid)
                aborted.add(rid)
        else:
            step(action[1])
            try_forks(True)
    for _ in range(max_steps):
        if not s.has_unfinished:
            break
        step(None)
        try_forks(True)
    check_outcomes(s, wanted, aborted)
    return wanted


def probe_hits(m: HybridBlockManager, ledger: Ledger, token_lists: list[list[int]]) -> None:
    """A direct user after the batches: allocate each token list with its ids, run the hit's copy,
    check the hit's KV and the state it copied, free; the manager is idle after each."""
    seen = set()
    for i, tokens in enumerate(token_lists):
        if tuple(tokens) in seen or m.prefix_cache is None:
            continue
        seen.add(tuple(tokens))
        n = len(tokens)
        try:
            m.check_fits(n)
        except RequestTooLargeError:
            continue
        if not m.can_allocate(n, 0, tokens):
            continue
        ledger.phase = f"probe {i}: direct allocate of a finished request's {n} tokens"
        alloc = m.allocate(("probe", i), n, 0, token_ids=tokens)
        c = alloc.num_cached_tokens
        if getattr(m, "take_tier_copies", None) is not None:
            ledger.run_tier(m.take_tier_copies(), f"probe {i}: the tier's copies")  # (stage 0 first)
        ledger.run_all(f"probe {i}: the hit's copy")
        if c:
            event("probe hit")
            h = prefix_hashes(tokens)
            rec = m.requests[("probe", i)]
            ledger.real.check_kv(f"probe {i} (hit of {c} tokens)", rec.kv_blocks, h, c)
            ledger.real.check_state(f"probe {i} (hit of {c} tokens)", rec.state, h[c])
        m.free(("probe", i))
        m.release_pins()  # the executor ran every copy handed out
        ledger.check_idle(f"probe {i}")

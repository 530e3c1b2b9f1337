"""Random arrivals, lengths, priorities, aborts (also between step and update), drafts and acceptances:
integrity after every step, every surviving request gets exactly its tokens, nothing leaks."""

import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.errors import AllocationError, RequestStateError, RequestTooLargeError
from hybridkv.scheduler_adapter import PreemptionMode, RequestState, Scheduler, SchedulerConfig, build_step_metadata
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine
from tests.test_scheduler import tiny_manager

# (prompt tokens of its own, max_new_tokens, priority, shared prefix template, shared prefix tokens)
add = st.tuples(
    st.just("add"),
    st.integers(1, 16),
    st.integers(1, 40),
    st.integers(0, 2),
    st.integers(0, 1),
    st.sampled_from([0, 8, 12, 16]),
)
abort = st.tuples(st.just("abort"), st.integers(0, 1000))
step = st.tuples(st.just("step"), st.one_of(st.none(), st.integers(0, 1000)))  # optional abort mid-step
actions = st.lists(st.one_of(add, abort, step, step), min_size=1, max_size=60)
burst = st.lists(add, min_size=2, max_size=12)


def _step(s: Scheduler, engine: SyntheticEngine, abort_mid: int | None, aborted: set) -> None:
    plan = s.step()
    s.manager.check_integrity()
    md = build_step_metadata(s.manager, plan, batch_size=s.config.max_num_seqs)
    assert md.num_tokens == plan.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(plan.scheduled) <= s.config.max_num_seqs
    if abort_mid is not None and plan.scheduled:
        rid = plan.scheduled[abort_mid % len(plan.scheduled)].request_id
        if rid in s.requests:
            s.abort(rid)
            aborted.add(rid)
    for pre in plan.preempted:
        event(f"preempted by {pre.mode.value}")
    if plan.resumed:
        event("resumed from swap")
    if any(r.num_cached_tokens for r in map(s.requests.get, plan.admitted) if r is not None):
        event("prefix hit")
    s.update(engine.run(plan))
    s.manager.check_integrity()


EXAMPLES = int(os.environ.get("SCHEDULER_PROPERTY_EXAMPLES", "200"))
workload = dict(
    actions=st.tuples(burst, actions).map(lambda t: t[0] + t[1]),
    mode=st.sampled_from(list(PreemptionMode)),
    k=st.integers(0, 2),
    num_blocks=st.integers(20, 40),
    num_host_blocks=st.sampled_from([0, 12, 40, 40]),
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
    max_num_seqs=st.integers(1, 5),
    max_tokens=st.integers(4, 24),
    accept_rate=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
prefix_configs = st.builds(
    PrefixCacheConfig, st.sampled_from(CheckpointPolicy), st.sampled_from(EvictionPolicy), st.integers(1, 3)
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**workload)
def test_random_workloads(**kw):
    run_workload(prefix=None, **kw)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(prefix=prefix_configs, **workload)
def test_random_workloads_with_prefix_cache(**kw):
    run_workload(**kw)


def run_workload(
    actions, mode, k, num_blocks, num_host_blocks, watermark, max_num_seqs, max_tokens, prefix, accept_rate, seed
):
    m = tiny_manager(num_blocks, num_host_blocks, watermark, prefix)
    cfg = SchedulerConfig(max_num_seqs, max_tokens, k, mode)
    s = Scheduler(m, cfg)
    engine = SyntheticEngine(accept_rate, seed)
    aborted: set = set()
    play(s, actions, lambda abort_mid: _step(s, engine, abort_mid, aborted), aborted, give_ids=prefix is not None)


def play(s: Scheduler, actions, step, aborted: set, give_ids: bool = True, max_steps: int = 3000, manager=None) -> None:
    """Submit, abort and step as ``actions`` say (``step(abort_mid)`` runs one step; aborts go into
    ``aborted``), then step until every request is done. Checks that each request finished with all
    its tokens or was aborted, and that every block came back (in ``manager``, default ``s.manager``)."""
    wanted = {}
    for i, action in enumerate(actions):
        if action[0] == "add":
            _, own, max_new, prio, template, shared = action
            ids = [template * 1000 + j for j in range(shared)] + [(i + 1) * 10_000 + j for j in range(own)]
            try:
                s.add_request(i, ids if give_ids else len(ids), max_new, prio)
                wanted[i] = max_new
            except RequestTooLargeError:
                pass
        elif action[0] == "fork":
            running = [r for r in s.running if r.state is RequestState.RUNNING]
            if running and hasattr(s, "fork"):
                parent = running[action[1] % len(running)]
                try:
                    child = s.fork(parent.request_id, 100_000 + i, action[2])
                    wanted[100_000 + i] = child.max_new_tokens
                except (AllocationError, RequestStateError):
                    pass
        elif action[0] == "abort":
            live = sorted(s.requests)
            if live:
                rid = live[action[1] % len(live)]
                s.abort(rid)
                aborted.add(rid)
        else:
            step(action[1])
    for _ in range(max_steps):
        if not s.has_unfinished:
            break
        step(None)
    check_outcomes(s, wanted, aborted)
    m = s.manager if manager is None else manager
    m.release_pins()  # the executor ran every copy handed out: pending-free blocks go back
    m.check_integrity()
    u = m.usage()
    assert not m.requests and u.free + u.evictable == u.total - 1 and u.used == 0 and u.host_used == 0


def check_outcomes(s: Scheduler, wanted: dict, aborted: set) -> None:
    """The loop ended, and each request finished with all its ``wanted`` tokens or was aborted."""
    assert not s.has_unfinished, "the scheduler stopped making progress"
    for rid, n in wanted.items():
        req = s.finished[rid]
        if rid in aborted:
            assert req.state is RequestState.ABORTED
        else:
            assert req.state is RequestState.FINISHED and len(req.output_token_ids) == n

"""End-to-end isolation: a model computing through hybridkv under continuous batching produces, at every
token, the logits each request produces alone (fp64: 1e-9, fp32: 1e-4).

The tiny hybrid model (``examples/tiny_hybrid.py``: lightning layers + one softmax-attention layer) runs
30+ requests with random arrivals and lengths through the real :class:`Scheduler` on a pool small
enough to preempt by recompute and by swap, with forks, prefix-cache hits (checkpoints restored) and
speculative decoding whose drafter is deliberately imperfect. Every logit the engine computed is
compared with the sequential reference (one request alone, fresh state, no paging). Two deliberately
broken engines must fail the same check: all requests sharing one state set (FastDeploy #7199), and
a speculative commit that keeps a rejected draft's state.

The oracle of each test (this file checks the project's own kernels; tests/test_hf_serving.py checks
hybridkv's state handling against transformers' model code, with transformers as the oracle):

- ``test_every_token_equals_the_sequential_reference_fp64`` / ``_fp32`` / ``test_more_seeds``:
  ``TinyHybrid.reference_logits``, the project's own sequential reference (the token recurrence of
  ``hybridkv.ops.lightning.lightning_recurrent_naive`` and dense causal attention, no paging), with
  the naive (torch) paged kernels in the loop;
- ``test_triton_kernels_in_the_loop_equal_the_sequential_reference``: the same reference, with the
  Triton decode and prefill kernels (``TRITON_INTERPRET=1``) in the loop;
- ``test_the_run_covers_what_the_isolation_claim_is_about``: no numerical oracle; the engine's event
  counts (preemptions by mode, swap-ins, forks, prefix hits, checkpoint copies, drafts);
- ``test_deliberately_broken_engines_fail_the_check``: the sequential reference again, which the two
  broken engines must miss by more than 1e-3.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.ops import copy_blocks
from hybridkv.ops.testing import interpreter_enabled
from hybridkv.scheduler_adapter import H200, PreemptionMode, Preemptor, Scheduler, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_hybrid import Engine, TinyConfig, TinyHybrid, tiny_layout  # noqa: E402

NUM_REQUESTS = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: torch's thread pool costs far more than it saves on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class AlternatingPreemptor(Preemptor):
    """Swap and recompute in turn (swap only when the host pool has room), so one run sees both."""

    def __init__(self, manager: HybridBlockManager) -> None:
        super().__init__(manager, PreemptionMode.SWAP, H200)
        self.turn = 0

    def mode_for(self, req):
        self.turn += 1
        if self.turn % 2:
            return PreemptionMode.RECOMPUTE
        return super().mode_for(req)


def run_workload(
    engine_cls=Engine, dtype=torch.float64, seed: int = 0, num_requests: int = NUM_REQUESTS, **engine_kwargs
) -> Engine:
    """``num_requests`` requests (and a few forks) through a small pool; returns the finished engine."""
    cfg = TinyConfig(dtype=dtype, lightning_head_dim=8)  # a lightning state spans 4 blocks, a head 2
    layout = tiny_layout(cfg, num_blocks=80, block_size=4)
    # branch_and_last: the default policy (branch_spaced) keeps no checkpoint closer than a state's
    # worth of KV tokens, more than these 8-12-token shared prefixes, so it would make no prefix hits
    prefix = PrefixCacheConfig(checkpoint="branch_and_last", eviction="lru")
    manager = HybridBlockManager(layout, num_host_blocks=48, prefix_cache=prefix)
    # first_chunk over-admits, so this small pool preempts by recompute and by swap, which this run must cover
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=24, num_speculative_tokens=2, admission="first_chunk"
    )
    scheduler = Scheduler(manager, config)
    scheduler.preemptor = AlternatingPreemptor(manager)
    engine = engine_cls(TinyHybrid(cfg), scheduler, num_host_blocks=48, **engine_kwargs)

    rng = random.Random(seed)
    prefixes = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (8, 12)]
    arrivals: dict[int, list] = {}
    for i in range(num_requests):
        shared = prefixes[i % 3] if i % 3 < 2 else []
        prompt = shared + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 10))]
        arrivals.setdefault(rng.randint(0, 40 * num_requests // NUM_REQUESTS), []).append(
            (f"r{i}", prompt, rng.randint(2, 9))
        )
    forks, step = 0, 0
    while step < 2000 and (scheduler.has_unfinished or any(s >= step for s in arrivals)):
        for rid, prompt, n in arrivals.get(step, []):
            engine.add_request(rid, prompt, n)
        if step % 7 == 3 and forks < 4 and scheduler.running:
            parent = rng.choice(scheduler.running).request_id
            if engine.fork(parent, f"{parent}/f{forks}", rng.randint(2, 5)):
                forks += 1
        if scheduler.has_unfinished:
            engine.step()
        step += 1
    assert not scheduler.has_unfinished, "the workload did not finish"
    return engine


@pytest.fixture(scope="module")
def fp64_run() -> Engine:
    return run_workload()


def test_every_token_equals_the_sequential_reference_fp64(fp64_run):
    err, rid, pos = fp64_run.max_error()
    assert err <= 1e-9, f"request {rid} at position {pos}: |logits - reference| = {err:.3e}"
    assert len(fp64_run.logits) >= NUM_REQUESTS
    assert sum(len(v) for v in fp64_run.logits.values()) > 300


def test_the_run_covers_what_the_isolation_claim_is_about(fp64_run):
    ev = fp64_run.events
    assert ev.preempted_recompute > 0 and ev.preempted_swap > 0 and ev.swapped_in > 0, ev
    assert ev.forks > 0 and ev.prefix_hit_tokens > 0 and ev.checkpoint_copies > 0, ev
    assert ev.accepted > 0 and ev.rejected_steps > 0 and ev.accepted < ev.drafts, ev  # an imperfect drafter


def test_every_token_equals_the_sequential_reference_fp32():
    engine = run_workload(dtype=torch.float32, seed=1)
    err, rid, pos = engine.max_error()
    assert err <= 1e-4, f"request {rid} at position {pos}: |logits - reference| = {err:.3e}"


@pytest.mark.skipif(
    not interpreter_enabled(), reason="the Triton decode kernel runs on CPU only under TRITON_INTERPRET=1"
)
def test_triton_kernels_in_the_loop_equal_the_sequential_reference():
    """The same check with the in-place Triton decode and prefill kernels (interpreted) on a shorter stream."""
    engine = run_workload(seed=2, num_requests=8, backend="triton")
    err, rid, pos = engine.max_error()
    assert err <= 1e-9, f"request {rid} at position {pos}: |logits - reference| = {err:.3e}"
    assert engine.events.accepted > 0 and engine.events.preempted_recompute + engine.events.preempted_swap > 0


@pytest.mark.parametrize("seed", range(1, 1 + int(os.environ.get("HYBRIDKV_E2E_SEEDS", "0"))))
def test_more_seeds(seed):
    """Longer runs on demand: ``HYBRIDKV_E2E_SEEDS=20 python -m pytest tests/test_e2e_isolation.py``."""
    engine = run_workload(seed=seed)
    err, rid, pos = engine.max_error()
    assert err <= 1e-9, f"seed {seed}, request {rid} at position {pos}: |logits - reference| = {err:.3e}"


class SharedStateEngine(Engine):
    """Broken on purpose: every row reads and writes the first row's state set (one ``_kv_history``)."""

    def forward_state_tables(self, meta):
        tables = meta.state_tables.copy()
        tables[:, : meta.num_rows] = tables[:, :1]
        return tables


class KeepsRejectedDraftEngine(Engine):
    """Broken on purpose: after a verify step with a rejected draft, the live state is the last draft's."""

    def after_update(self, plan, meta, accepted):
        m = self.manager
        for row in plan.scheduled:
            a = accepted.get(row.request_id)
            if a is None or a == row.num_drafts or row.request_id not in m.requests:
                continue
            last = m.speculative_table(row.request_id)[row.num_drafts - 1]
            live = m.state_table([row.request_id])[:, 0]
            keep = live != 0
            copy_blocks(self.pools, last[keep].ravel(), live[keep].ravel())


@pytest.mark.parametrize("broken", [SharedStateEngine, KeepsRejectedDraftEngine], ids=["shared_state", "keeps_draft"])
def test_deliberately_broken_engines_fail_the_check(broken):
    # the shared-state engine runs without the ops' duplicate-write guard, as a device table would
    engine = run_workload(broken, validate=False) if broken is SharedStateEngine else run_workload(broken)
    err, _, _ = engine.max_error()
    assert err > 1e-3
    if broken is KeepsRejectedDraftEngine:
        assert engine.events.rejected_steps > 0

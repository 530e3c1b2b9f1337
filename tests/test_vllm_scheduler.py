"""hybridkv's vLLM engine against vLLM 0.33's real v1 ``Scheduler`` + ``KVCacheManager`` (issue 29).

The same trace requests (all queued at step 0, one fake token per sampling row, 256 rows and
8,192 tokens per step) go through vLLM's scheduler, built from per-layer KV cache specs by vLLM's own
grouping and sizing code (``benchmarks/vllm_replay.py``), and through ``hybridkv simulate --engine
vllm``'s scheduler (``hybridkv.sim.engines``). Prefix caching off, checked at every step: the same
rows (request, first position, tokens) and the same preempted requests; with vLLM's default
admission (``scheduler_reserve_full_isl``) and with it off (hybridkv's ``first_chunk``), which
preempts often and so checks the victim order. Then hybridkv's default scheduler on the same
requests, in both layouts: no more preemptions than vLLM and at most 1.01x its scheduled tokens.
Prefix caching on (vLLM's Mamba cache mode ``align``, the engine's ``vllm_align``, prompts as token
ids): whole runs with the same prefix-hit tokens and preemptions, two of them identical at every
step, and the two known gaps as strict xfails (``ALIGN_RUNS``).

Skips without vLLM (CI installs it, ``.ci/run``) or without the trace.
"""

import os

import pytest

# before vLLM is first imported: the README's test command does not set it
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from benchmarks.vllm_replay import (  # noqa: E402
    GiB,
    engine_scheduler,
    first_difference,
    hybridkv_scheduler,
    model_spec,
    replay_hybridkv,
    replay_vllm,
    trace_requests,
    vllm_aligned_block_size,
    vllm_scheduler,
)
from hybridkv.planner.layout import plan, vllm_block_size  # noqa: E402
from hybridkv.sim.trace import DEFAULT_TRACE  # noqa: E402

NUM_REQUESTS = 300

pytestmark = pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"needs the Mooncake trace at {DEFAULT_TRACE}")


@pytest.fixture(scope="module")
def requests():
    return trace_requests(NUM_REQUESTS)


@pytest.fixture(scope="module")
def vllm_runs(requests):
    """vLLM's replays, shared by the tests: (model, GiB, reserve_full_isl) -> (Run, KVCacheConfig)."""
    cache = {}

    def get(model, gib, reserve=True):
        key = (model, gib, reserve)
        if key not in cache:
            sched, kv = vllm_scheduler(model, int(gib * GiB), reserve_full_isl=reserve)
            cache[key] = (replay_vllm(sched, requests), kv)
        return cache[key]

    return get


CASES = [("qwen3-next", 4, True), ("minimax-m1", 2, True), ("qwen3-next", 4, False), ("minimax-m1", 4, False)]


@pytest.mark.parametrize("model", ["qwen3-next", "minimax-m1"])
def test_vllm_block_size_rule_is_vllms_own(model):
    """hybridkv's vllm_block_size against vLLM's _align_hybrid_block_size (H200 inputs: FlashAttention's
    16-token kernel blocks; with prefix caching FlashInfer GDN's 64-token checkpoint grid)."""
    spec = model_spec(model)
    gdn = model == "qwen3-next"
    assert vllm_block_size(spec) == vllm_aligned_block_size(model) == (544 if gdn else 512)
    caching = vllm_block_size(spec, prefix_caching=True, checkpoint_alignment=64 if gdn else None)
    assert caching == vllm_aligned_block_size(model, prefix_caching=True) == (576 if gdn else 512)


@pytest.mark.parametrize(("model", "gib", "reserve"), CASES)
def test_vllm_engine_schedules_as_vllm_row_for_row(requests, vllm_runs, model, gib, reserve):
    theirs, kv = vllm_runs(model, gib, reserve)
    sched = engine_scheduler(model, int(gib * GiB), admission=None if reserve else "first_chunk")
    layout = sched.manager.layout
    # vLLM's own grouping and sizing of the same memory gives the engine's layout
    assert kv.num_blocks == layout.num_blocks
    assert [len(g.layer_names) for g in kv.kv_cache_groups] == [layout.group_size] * len(layout.groups)
    assert kv.kv_cache_groups[0].kv_cache_spec.block_size == layout.block_size
    ours = replay_hybridkv(sched, requests)
    assert first_difference(theirs, ours) is None
    assert ours.totals() == theirs.totals()
    if not reserve:  # the victim order was exercised
        assert theirs.num_preemptions > 20


@pytest.mark.parametrize(("model", "gib"), [(m, g) for m, g, r in CASES if r])
@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_default_scheduler_never_preempts_more_than_vllm(requests, vllm_runs, model, gib, layout):
    theirs, _ = vllm_runs(model, gib)
    ours = replay_hybridkv(hybridkv_scheduler(plan(model_spec(model), int(gib * GiB), layout=layout)), requests)
    assert ours.num_preemptions <= theirs.num_preemptions
    assert ours.num_scheduled_tokens <= 1.01 * theirs.num_scheduled_tokens
    assert sum(r.num_prompt_tokens + r.max_new_tokens - 1 for r in requests) <= ours.num_scheduled_tokens


# prefix caching on, whole runs (300 requests, measured on 2026-12-02): identical rows at every
# step, and so the same prefix-hit tokens and preemptions, for both models at 8, 4 and 2 GiB (the
# pool never fills at 8 GiB for MiniMax-M1; Qwen3-Next at 2 GiB evicts exports whose copies were not
# handed out yet, dropping the copies).
ALIGN_RUNS = [
    ("minimax-m1", 8, True),
    ("minimax-m1", 4, True),
    ("minimax-m1", 2, True),
    ("qwen3-next", 8, True),
    ("qwen3-next", 4, True),
    ("qwen3-next", 2, True),
]


@pytest.mark.parametrize(("model", "gib", "every_step"), ALIGN_RUNS)
def test_vllm_engine_align_mode_schedules_as_vllm(model, gib, every_step):
    """vLLM's align mode (its default ``prefix_cache_retention_interval=0``) against ``--engine
    vllm`` with prefix caching, over whole runs: the same prefix-hit tokens and preemptions, and
    where measured so, the same rows at every step (chunks cut to block boundaries, at the branch
    point and at the prompt's last block; states matchable only there; a hit on a state cached in
    the same step waits a step; states kept where the forward wrote them)."""
    requests = trace_requests(NUM_REQUESTS, token_ids=True)
    sched, kv = vllm_scheduler(model, int(gib * GiB), prefix_caching=True)
    theirs = replay_vllm(sched, requests)
    ours_sched = engine_scheduler(model, int(gib * GiB), prefix_caching=True)
    assert ours_sched.manager.layout.num_blocks == kv.num_blocks
    assert ours_sched.manager.block_size == kv.kv_cache_groups[0].kv_cache_spec.block_size
    ours = replay_hybridkv(ours_sched, requests)
    assert theirs.prefix_hit_tokens > 0 and (theirs.num_preemptions > 0 or gib == 8)
    assert ours.prefix_hit_tokens == theirs.prefix_hit_tokens
    assert ours.num_preemptions == theirs.num_preemptions
    assert abs(ours.num_steps - theirs.num_steps) <= 1
    if every_step:
        assert first_difference(theirs, ours) is None
    # the chunks were cut: some chunk ends short of its prompt's end on a block boundary
    assert any(n < 8192 and (s + n) % kv.kv_cache_groups[0].kv_cache_spec.block_size == 0
               for step in ours.steps[1:] for s, n in step.rows.values() if n > 1)

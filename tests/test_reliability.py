"""Regression tests for the twelve defects of the reliability issue, one (or more) per defect, each
named after what it checks. Defect 10 (malformed spec files) lives in tests/test_cli.py and
tests/test_plan_fuzz.py. Each of these failed on the code before the fix."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.errors import RequestStateError
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import PreemptionMode, Scheduler, SchedulerConfig, StepOutputs
from tests.shadow import Shadow, prefix_hashes
from tests.test_scheduler_data import run_data_workload

ATTN = AttentionLayerSpec(1, 8, DType.BFLOAT16)  # 16 B per token and segment
SMALL = RecurrentLayerSpec("gla", (StateComponent("kv", (8,), DType.FLOAT32),))  # 32 B
BIG = RecurrentLayerSpec("gla", (StateComponent("kv", (200,), DType.FLOAT32),))  # 800 B
UNIFORM = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))  # 256 B


def manager(layers, num_blocks=64, block_size=4, prefix=None, watermark=0.0, num_host_blocks=16, params=1e6):
    model = ModelSpec("m", tuple(layers), params_active=params)
    probe = plan(model, 1 << 24, block_size=block_size)
    layout = plan(model, num_blocks * probe.bytes_per_block, block_size=block_size)
    return HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark, prefix_cache=prefix)


# ---- 1 ---------------------------------------------------------------------------------------------
def test_state_groups_of_different_sizes_keep_their_state_ids_through_growth_and_free():
    m = manager([ATTN, SMALL, BIG])
    assert len(set(m.layout.blocks_per_state)) == 2, "the layout must mix two state sizes"
    m.allocate("a", 5)
    sets = m.state_table(["a"])[:, 0, :]
    assert (sets[m._state_mask] != 0).all(), "the live state table holds real blocks, not the null block"
    assert (sets[~m._state_mask] == 0).all()
    m.check_integrity()
    m.append("a", 20)  # KV growth
    m.check_integrity()
    m.free("a")
    m.check_integrity()
    assert m.pool.free_extents() == [(1, m.layout.num_blocks)], "every block is back, the null block never"
    m.allocate("b", 4)
    assert 0 not in m.block_table(["b"])[0, : m.requests["b"].num_kv_blocks]


# ---- 2 ---------------------------------------------------------------------------------------------
def test_fork_during_a_verify_step_copies_the_shared_tail_before_the_parent_writes_it():
    m = manager([ATTN, UNIFORM])
    shadow = Shadow(m)
    m.allocate("p", 4)
    m.begin_speculation("p", 3)
    m.append("p", 4)  # the sampled token + 3 drafts: 8 tokens, 2 full blocks
    tokens = list(range(8))
    h = prefix_hashes(tokens)
    shadow.write_kv(m.requests["p"].kv_blocks, h, 0, 8)
    shadow.copy(m.fork("p", "c"))
    m.commit_speculation("p", 0)  # all drafts rejected: p holds 5 tokens, its tail block shared with c
    copies = m.append("p", 1)
    assert len(copies) == 1, "the shared, partly filled tail is copied before p writes position 5"
    shadow.copy(copies)
    p_tokens = tokens[:5] + [99]
    shadow.write_kv(m.requests["p"].kv_blocks, prefix_hashes(p_tokens), 5, 6)
    shadow.check_kv("child", m.requests["c"].kv_blocks, h, 8)  # the child's drafts are intact
    shadow.check_kv("parent", m.requests["p"].kv_blocks, prefix_hashes(p_tokens), 6)
    m.check_integrity()


# ---- 3, 4 (found by tests/test_scheduler_data.py on the old code; deterministic here) ---------------
def _pins_on(m):
    return getattr(m, "begin_pin_epoch", lambda: 0)()  # (a no-op on managers without pins)


def test_a_checkpoint_never_gets_the_live_blocks_of_a_request_freed_in_the_same_update():
    """Request a checkpoints and finishes in one update; b's new checkpoint used to get a's live
    blocks, so the step's checkpoint copies had blocks that were both source and destination."""
    m = manager([ATTN, UNIFORM], num_blocks=40, prefix=PrefixCacheConfig("every_n_blocks", "lru", 1))
    _pins_on(m)  # the step
    m.allocate("a", 4, token_ids=list(range(10, 19)))
    m.allocate("b", 4, token_ids=list(range(20, 29)))
    _pins_on(m)  # the update: copies run with the next plan
    copies = m.checkpoint("a")
    m.free("a")
    copies = copies.concat(m.checkpoint("b"))
    assert len(copies) == 2 * m.num_state_blocks
    Shadow(m).copy(copies)  # rejects a block that is both source and destination
    m.check_integrity()


def test_checkpoint_copies_keep_their_blocks_pinned_through_the_swaps_of_the_next_step():
    """With pins on, a checkpoint taken in an update survives the next step's evictions, so a swap-in
    run inside step() (a swap executor) cannot receive its blocks before its copy ran."""
    m = manager([ATTN, UNIFORM], num_blocks=20, prefix=PrefixCacheConfig("every_n_blocks", "lru", 1))
    m.begin_pin_epoch()  # step
    m.allocate("a", 4, token_ids=list(range(9)))
    update = m.begin_pin_epoch()  # update: the checkpoint copy runs with the next plan
    copies = m.checkpoint("a")
    assert len(copies)
    m.release_pins(before=update)  # next step: the last step's copies ran, the update's did not
    m.begin_pin_epoch()
    assert m.prefix_cache.num_evictable == 0, "the pending checkpoint is not evictable"
    m.free("a")
    assert set(copies.src.tolist()) <= set(m.pending_free_blocks().tolist()), "its source waits, not free"
    rest = m.num_available_blocks
    m.allocate("b", rest * m.block_size - 4 * m.block_size)  # take everything that is really available
    taken = set(m.requests["b"].kv_blocks.tolist()) | set(m.requests["b"].state[m._state_mask].tolist())
    assert not taken & set(copies.src.tolist()) and not taken & set(copies.dst.tolist())
    m.release_pins()
    m.check_integrity()


# ---- 5 ---------------------------------------------------------------------------------------------
def test_blocks_of_a_row_aborted_before_its_forward_never_become_prefix_hits():
    m = manager([ATTN], prefix=PrefixCacheConfig("none", "lru"))  # attention only: hits need KV alone
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    prompt = list(range(100, 113))  # 3 full blocks + 1
    s.add_request("a", prompt, 4)
    p = s.step()
    assert p.scheduled[0].num_scheduled_tokens == 13
    s.abort("a")  # the executor drops the row: nothing was written
    s.update(StepOutputs({}))
    s.add_request("b", prompt, 4)
    s.step()
    assert s.requests["b"].num_cached_tokens == 0, "never-written blocks were served as a prefix hit"


def test_blocks_enter_the_prefix_cache_once_computed():
    m = manager([ATTN], prefix=PrefixCacheConfig("none", "lru"))
    tokens = list(range(100, 113))
    m.allocate("a", 13, token_ids=tokens)
    assert m.match_prefix(tokens) == 0
    m.mark_computed("a", 8)
    assert m.match_prefix(tokens) == 8
    m.free("a")
    assert m.match_prefix(tokens) == 8


# ---- 6 ---------------------------------------------------------------------------------------------
def test_admission_counts_only_the_checkpoint_a_hit_reads():
    m = manager([ATTN, UNIFORM], num_blocks=80, prefix=PrefixCacheConfig("every_n_blocks", "lru", 1))
    tokens = list(range(100, 117))  # 4 full blocks + 1: checkpoints at 4, 8, 12, 16
    m.allocate("a", 4, token_ids=tokens)
    m.checkpoint("a")
    while m.requests["a"].num_tokens < 17:
        m.append("a", min(4, 17 - m.requests["a"].num_tokens))
        m.checkpoint("a")
    m.free("a")
    m.release_pins()
    assert m.prefix_cache.num_checkpoints == 4
    b = tokens[:16] + [7, 8]
    plan_b = m.plan_admission(17, 0, b)
    assert plan_b.num_cached_tokens == 16
    before = m.num_available_blocks
    m.allocate("b", 17, token_ids=b)
    assert before - m.num_available_blocks == plan_b.num_blocks, "plan_admission counts what allocate takes"


# ---- 7 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["allocate 2.5", "allocate 8.0", "append 4.0", "speculate 1.0", "admit 3.0"])
def test_float_token_counts_are_rejected_before_any_change(call):
    m = manager([ATTN, UNIFORM])
    m.allocate("a", 4)
    before = (m.pool.free_extents(), m.use.copy(), m.requests["a"].num_tokens)
    op, value = call.split()
    with pytest.raises(TypeError, match="integer"):
        {
            "allocate": lambda: m.allocate("x", float(value)),
            "append": lambda: m.append("a", float(value)),
            "speculate": lambda: m.begin_speculation("a", float(value)),
            "admit": lambda: m.blocks_to_admit(float(value)),
        }[op]()
    m.check_integrity()
    assert m.pool.free_extents() == before[0] and (m.use == before[1]).all() and m.requests["a"].num_tokens == before[2]
    m.allocate("y", np.int64(8))  # numpy integers stay accepted
    m.append("y", np.int32(3))
    m.check_integrity()


# ---- 8 ---------------------------------------------------------------------------------------------
def test_auto_preemption_without_params_active_is_refused_at_construction():
    m = manager([ATTN, UNIFORM], params=None)
    with pytest.raises(ValueError, match="params_active"):
        Scheduler(m, SchedulerConfig(preemption_mode=PreemptionMode.AUTO))
    Scheduler(m, SchedulerConfig(preemption_mode=PreemptionMode.RECOMPUTE))  # the others need no FLOPs


# ---- 9 ---------------------------------------------------------------------------------------------
def test_state_only_prefix_cache_keeps_a_bounded_number_of_chain_nodes():
    m = manager([UNIFORM], num_blocks=64, prefix=PrefixCacheConfig("branch_and_last", "lru"))
    cache = m.prefix_cache
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(3000):
        tokens = rng.integers(0, 1 << 30, size=int(rng.integers(40, 160))).tolist()
        n = len(tokens)
        m.allocate(i, n, token_ids=tokens)
        m.checkpoint(i)
        m.free(i)
        m.release_pins()
        sizes.append(cache.num_nodes)
    m.check_integrity()
    bound = max(1024, 4 * m.pool.num_usable) + cache.num_checkpoints  # bare nodes + checkpoint nodes
    assert max(sizes) <= bound, f"{max(sizes)} chain nodes, bound {bound}"
    assert sizes[-1] == sizes[1500], "the node count stopped growing"


# ---- 11 --------------------------------------------------------------------------------------------
def test_negative_counts_and_short_tables_are_rejected():
    m = manager([ATTN, UNIFORM])
    m.allocate("a", 4)
    m.allocate("b", 4)
    with pytest.raises(ValueError):
        m.begin_speculation("a", -1)
    for call in (lambda: m.blocks_to_admit(-100), lambda: m.can_allocate(-100), lambda: m.check_fits(-100)):
        with pytest.raises(ValueError, match=">= 0"):
            call()
    with pytest.raises(ValueError, match="num_rows"):
        m.block_table(["a", "b"], num_rows=1)
    with pytest.raises(ValueError, match="num_rows"):
        m.state_table(["a", "b"], num_rows=1)
    m.check_integrity()


def test_can_swap_in_and_swap_in_agree_under_a_watermark():
    m = manager([ATTN, UNIFORM], num_blocks=20, watermark=0.2, num_host_blocks=20)
    assert m.pool.num_usable == 19 and m.watermark_blocks == 3
    m.allocate("a", 8)  # 2 KV + 2 state blocks
    m.swap_out("a").commit()
    m.allocate("b", 48)  # 12 KV + 2 state blocks: 5 left, a needs 4 (+ 3 of watermark)
    assert m.num_available_blocks == 5
    ok = m.can_swap_in("a")
    try:
        m.swap_in("a").commit()
        succeeded = True
    except Exception:
        succeeded = False
    assert ok == succeeded
    m.check_integrity()


# ---- 12 --------------------------------------------------------------------------------------------
def test_update_with_a_missing_sampled_token_changes_nothing():
    m = manager([ATTN, UNIFORM])
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", 6, 3)
    p = s.step()
    with pytest.raises(ValueError, match="no token"):
        s.update(StepOutputs({}))
    assert s.requests["a"].num_computed_tokens == 0, "nothing changed"
    s.update(StepOutputs({"a": [1]}))  # the same plan, now with its token
    assert s.requests["a"].num_computed_tokens == 6 and s.requests["a"].output_token_ids == [1]
    assert p.scheduled[0].num_scheduled_tokens == 6
    nxt = s.step()
    assert nxt.scheduled[0].num_scheduled_tokens == 1, "no 0-token row"


# ---- liveness of the pins (found by test_scheduler_property after the fixes above) -------------------
def test_a_request_whose_own_checkpoint_fills_the_pool_still_finishes():
    from hybridkv.scheduler_adapter.synthetic import SyntheticEngine

    m = manager([ATTN, UNIFORM], num_blocks=20, num_host_blocks=0, prefix=PrefixCacheConfig("every_n_blocks", "lru", 1))
    s = Scheduler(m, SchedulerConfig(1, 4, 0, PreemptionMode.RECOMPUTE))
    engine = SyntheticEngine(0.0, 0)
    s.add_request(0, [8000 + j for j in range(8)] + [40_000], 37)  # 46 tokens: 12 KV + 2 state of 19 blocks
    for _ in range(400):
        if not s.has_unfinished:
            break
        s.update(engine.run(s.step()))
        m.check_integrity()
    assert not s.has_unfinished, "the request kept preempting itself"
    assert s.finished[0].num_preemptions <= 1


# ---- Scheduler.fork (its copies ride with the next plan's checkpoint copies) -------------------------
@pytest.mark.parametrize("sync_swaps", [False, True])
def test_forks_of_forks_and_preempted_fork_children_keep_their_state(sync_swaps):
    """A fork of a child whose own state copy is still pending copies from the original source; a
    child preempted before its copy ran recomputes instead of swapping out state it does not hold."""
    actions = (
        [("add", 3, 10, 0, 1, 8)] * 3
        + [("step", None)] * 3
        + [("fork", 0, 5), ("fork", 1, 5), ("step", None), ("fork", 2, 3), ("step", 0)]
        + [("step", None)] * 5
    )
    run_data_workload(
        kind="mixed",
        actions=actions,
        mode=PreemptionMode.SWAP,
        k=2,
        num_blocks=40,
        num_host_blocks=48,
        watermark=0.0,
        max_num_seqs=5,
        max_tokens=16,
        prefix=PrefixCacheConfig("every_n_blocks", "lru", 1),
        sync_swaps=sync_swaps,
        run_aborted=False,
        accept_rate=0.5,
        seed=1,
    )


def test_fork_between_update_and_step_only():
    m = manager([ATTN, UNIFORM])
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", 6, 4)
    s.step()
    with pytest.raises(RequestStateError, match="after update"):
        s.fork("a", "b", 2)
    s.update(StepOutputs({"a": [1]}))
    child = s.fork("a", "b", 2)
    assert child.output_token_ids == [1] and child.max_new_tokens == 3
    p = s.step()
    assert len(p.checkpoint_copies) == m.num_state_blocks, "the state copy runs first in the next plan"
    m.check_integrity()

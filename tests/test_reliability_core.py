"""Regression tests for the manager and scheduler defects of the second reliability review (issue 25:
items 1, 2, 10, 11, 12, 15, 16 and the float prompt ids), one or more per defect, each named after
what it checks. Each failed on the code before the fix (commit 813a2ae)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig, StepOutputs
from tests.shadow import UNWRITTEN, Shadow, prefix_hashes
from tests.test_reliability import ATTN, UNIFORM, manager


# ---- 1: eviction honours pins ------------------------------------------------------------------------
def test_a_cached_copy_on_write_source_is_not_evicted_before_its_copy_ran():
    """A fork shares a partly filled tail; the child's append copies it (copy-on-write, pinned). The
    parent then fills that block (now cached) and finishes: the block is cached with no owner while
    the copy that reads it has not run. An allocation that needs every available block must not
    get it: it stays held until release_pins, then it is evictable like any cached block."""
    m = manager([ATTN, UNIFORM], num_blocks=24, prefix=PrefixCacheConfig())
    m.begin_pin_epoch()
    tokens = list(range(100, 108))
    m.allocate("p", 6, token_ids=tokens)
    m.mark_computed("p", 6)
    m.fork("p", "c")
    cow = m.append("c", 1)
    assert len(cow) == 1, "the child's write into the shared tail is a copy-on-write"
    src = int(cow.src[0])
    m.append("p", 2)
    m.mark_computed("p", 8)  # the tail block is full now: it enters the prefix cache
    m.free("p")
    m.check_integrity()
    available = m.num_available_blocks
    m.allocate("big", available * m.block_size - m.num_state_blocks * m.block_size)
    m.check_integrity()
    assert src not in m.requests["big"].kv_blocks.tolist(), "the copy's source was handed to a new request"
    before = m.num_available_blocks
    m.release_pins()
    m.check_integrity()
    assert m.num_available_blocks > before and m.pool.ref_counts[src] == 0, "after the copy ran it is available"
    assert src in m.prefix_cache.cached_kv_blocks().tolist() or m.pool.free_mask()[src]


# ---- 2: the end of a serving loop --------------------------------------------------------------------
def _serve(s: Scheduler, shadow: Shadow, m) -> int:
    """The README loop with an executor that runs each plan's copies and writes each row's KV and
    state into the shadow; returns the number of steps."""
    tokens = {rid: list(req.prompt_token_ids) for rid, req in s.requests.items()}
    steps = 0
    while s.has_unfinished:
        plan = s.step()
        steps += 1
        shadow.copy(plan.checkpoint_copies)
        shadow.copy(plan.copies)
        sampled = {}
        for row in plan.scheduled:
            rid = row.request_id
            toks = tokens[rid]
            h = prefix_hashes(toks)
            end = row.num_computed_tokens + row.num_scheduled_tokens
            rec = m.requests[rid]
            shadow.check_kv(f"{rid} reads", rec.kv_blocks, h, row.num_computed_tokens)
            shadow.write_kv(rec.kv_blocks, h, row.num_computed_tokens, end)
            shadow.write_state(rec.state, h[end])
            if row.samples:
                t = 1000 + len(toks)
                toks.append(t)
                sampled[rid] = [t]
        s.update(StepOutputs(sampled))
    return steps


@pytest.mark.parametrize("policy", [CheckpointPolicy.EVERY_N_BLOCKS, CheckpointPolicy.BRANCH_AND_LAST])
def test_a_serving_loop_ends_with_its_checkpoints_written_and_the_manager_idle(policy):
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=PrefixCacheConfig(checkpoint=policy, every_n=1))
    shadow = Shadow(m)
    s = Scheduler(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    prompt = list(range(12))
    second = [*prompt[:8], 50, 51, 52, 53]
    s.add_request("a", prompt, 1)
    s.add_request("b", second, 1)  # both finish with their prompt: the last update takes checkpoints at 12
    _serve(s, shadow, m)
    assert not s.has_unfinished
    assert m.prefix_cache.num_checkpoints, "the workload leaves checkpoints"
    ck = m.prefix_cache.checkpoint_blocks()
    assert (shadow.state[ck] != UNWRITTEN).all(), "a checkpoint kept by the cache was never written"
    assert m.pending_free_blocks().size == 0 and not m._pin_chunks, "the manager is not idle after the loop"
    m.check_integrity()
    # the next batch on the same manager: a hit reads written, correct bytes
    s2 = Scheduler(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    third = [*second, 7, 7]
    s2.add_request("c", third, 2)
    plan = s2.step()
    assert plan.scheduled[0].num_computed_tokens == 12, "the second batch hits the first one's last checkpoint"
    shadow.copy(plan.checkpoint_copies)
    shadow.copy(plan.copies)
    row = plan.scheduled[0]
    h = prefix_hashes(third)
    shadow.check_kv("c reads", m.requests["c"].kv_blocks, h, row.num_computed_tokens)
    shadow.check_state("c reads", m.requests["c"].state, h[row.num_computed_tokens])


def test_the_last_step_of_a_loop_carries_only_the_checkpoint_copies():
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=PrefixCacheConfig(checkpoint=CheckpointPolicy.BRANCH_AND_LAST))
    s = Scheduler(m)
    s.add_request("a", list(range(8)), 1)
    plan = s.step()
    s.update(StepOutputs({"a": [5]}))
    assert not s.requests and s.has_unfinished, "the finished request's checkpoint copy is still to hand out"
    last = s.step()
    assert not last.scheduled and len(last.checkpoint_copies) and plan.step + 1 == last.step
    s.update(StepOutputs({}))
    assert not s.has_unfinished and m.pending_free_blocks().size == 0
    m.check_integrity()


# ---- 10: sampled tokens are integers -------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["x", 7.5, None, 2**63, True])
def test_update_refuses_sampled_tokens_that_are_not_integer_ids_and_changes_nothing(bad):
    m = manager([ATTN, UNIFORM], num_blocks=64)
    s = Scheduler(m)
    s.add_request("a", list(range(6)), 3)
    s.step()
    with pytest.raises(TypeError):
        s.update(StepOutputs({"a": [bad]}))
    s.update(StepOutputs({"a": [np.int64(9)]}))  # the same plan, corrected
    assert s.requests["a"].output_token_ids == [9]
    for _ in range(2):
        s.step()
        s.update(StepOutputs({"a": [3]}))
    assert not s.requests and s.pop_finished()["a"].output_token_ids == [9, 3, 3]


def test_update_refuses_a_non_integer_accepted_count():
    m = manager([ATTN, UNIFORM], num_blocks=64)
    s = Scheduler(m, SchedulerConfig(num_speculative_tokens=2))
    s.add_request("a", 4, 5)
    s.step()
    s.update(StepOutputs({"a": [1]}))
    plan = s.step()
    assert plan.scheduled[0].num_drafts == 2
    with pytest.raises(TypeError):
        s.update(StepOutputs({"a": [1, 2]}, num_accepted={"a": 1.0}))
    s.update(StepOutputs({"a": [1, 2]}, num_accepted={"a": 1}))


# ---- 11 and the float prompt ids: add_request checks everything before it registers ---------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"priority": None},
        {"priority": "high"},
        {"priority": 1.5},
        {"prompt": [1.5, 2.0]},
        {"prompt": [1, None]},
        {"prompt": [True, 2]},
        {"prompt": "hello"},
        {"prompt": 4.0},
        {"max_new_tokens": 2.0},
        {"max_new_tokens": "3"},
    ],
)
def test_add_request_with_a_bad_argument_registers_nothing(kwargs):
    m = manager([ATTN, UNIFORM], num_blocks=64)
    s = Scheduler(m)
    args = {"prompt": [1, 2, 3], "max_new_tokens": 2, "priority": 0, **kwargs}
    with pytest.raises(TypeError):
        s.add_request("a", args["prompt"], args["max_new_tokens"], priority=args["priority"])
    assert not s.has_unfinished and not s.requests and not s.waiting
    s.add_request("a", [1, 2, 3], 2, priority=np.int32(1))  # the id is free; numpy integers are integers
    assert s.requests["a"].priority == 1


def test_add_request_refuses_an_unhashable_id_before_anything():
    s = Scheduler(manager([ATTN, UNIFORM], num_blocks=64))
    with pytest.raises(TypeError, match="hashable"):
        s.add_request(["a"], 4, 2)
    assert not s.has_unfinished


# ---- 12: append checks its token ids before the request grows ---------------------------------------------
@pytest.mark.parametrize("bad", [["x"], [1.5], [None], "ab"])
def test_append_with_bad_token_ids_raises_before_growing_the_request(bad):
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=PrefixCacheConfig())
    m.allocate("a", 4, token_ids=list(range(4)))
    before = (m.requests["a"].num_tokens, m.requests["a"].kv_blocks.tolist(), m.num_available_blocks)
    with pytest.raises(TypeError):
        m.append("a", 5, token_ids=bad)
    rec = m.requests["a"]
    assert (rec.num_tokens, rec.kv_blocks.tolist(), m.num_available_blocks) == before
    m.check_integrity()


# ---- 15: no chunked prefill means whole prompts, prefix cache or not ----------------------------------------
def test_without_chunked_prefill_a_prompt_runs_whole_even_where_the_policy_wants_checkpoints():
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=PrefixCacheConfig(every_n=1))
    s = Scheduler(m, SchedulerConfig(chunked_prefill=False))
    s.add_request("a", list(range(10)), 2)
    plan = s.step()
    assert [r.num_scheduled_tokens for r in plan.scheduled] == [10]


@pytest.mark.parametrize("grid", [None, 1, 8])
def test_without_chunked_prefill_a_prompt_that_runs_whole_still_leaves_the_checkpoints_its_kernel_exports(grid):
    """A kernel that exports (``export_alignment``) writes the states the policy wants inside the one
    forward of a whole prompt: they become checkpoints a later prompt hits; a kernel that cannot
    leaves none inside it (the 18-token prompt ends off a block boundary)."""
    cfg = PrefixCacheConfig(CheckpointPolicy.EVERY_N_BLOCKS, every_n=1, export_alignment=grid)
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=cfg)
    s = Scheduler(m, SchedulerConfig(chunked_prefill=False))
    s.add_request("a", list(range(18)), 2)
    plan = s.step()
    assert [r.num_scheduled_tokens for r in plan.scheduled] == [18]
    exported = sorted(e.position for e in plan.exports)
    assert exported == {None: [], 1: [4, 8, 12, 16], 8: [8, 16]}[grid]
    s.update(StepOutputs({"a": [1]}))  # the forward wrote them
    for p in range(4, 18, 4):  # a hit ends at the deepest checkpoint at or below where it leaves
        assert m.match_prefix(list(range(p)) + [99]) == max([q for q in exported if q <= p], default=0), p


# ---- 16: typed errors for bad counts, with or without a prefix cache -----------------------------------------
@pytest.mark.parametrize("bad, error", [(True, TypeError), (-1, ValueError), (1.5, TypeError), ("1", TypeError)])
def test_cancel_checkpoints_checks_its_epoch_without_a_prefix_cache(bad, error):
    m = manager([ATTN, UNIFORM], num_blocks=64)
    with pytest.raises(error):
        m.cancel_checkpoints(bad)


@pytest.mark.parametrize("prefix", [None, PrefixCacheConfig()])
@pytest.mark.parametrize("bad, error", [(1.5, TypeError), (-3, ValueError), ("x", TypeError), (False, TypeError)])
def test_next_checkpoint_position_checks_its_count(prefix, bad, error):
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=prefix)
    m.allocate("a", 4)
    with pytest.raises(error):
        m.next_checkpoint_position("a", bad)


# ---- found by the scheduler data test (its database) while fixing the above -----------------------------
def test_a_fork_whose_child_cannot_fit_with_its_speculative_sets_is_refused_not_left_to_livelock():
    """``fork`` checked the child's tokens without its speculative sets (``add_request`` counts them):
    a child that fits only without them preempted itself by recompute forever."""
    from hybridkv.errors import RequestTooLargeError
    from tests.test_scheduler_data import _manager

    m = _manager("uniform", 16, 0, 0.0, None)
    s = Scheduler(m, SchedulerConfig(4, 5, 1))
    s.add_request("p", list(range(24)), 2)
    while not s.requests["p"].output_token_ids:
        s.step()
        s.update(StepOutputs({"p": [1]}))
    total = 24 + 1 + 12
    assert m.blocks_to_admit(total) <= m.pool.num_usable < m.blocks_to_admit(total, 1), "fits only without drafts"
    with pytest.raises(RequestTooLargeError):
        s.fork("p", "c", 12)
    assert "c" not in s.requests


def test_aborting_the_last_request_between_steps_leaves_the_manager_idle():
    """A loop that ends because its last request was aborted (between update and step) is idle too:
    no pins, nothing pending-free (found by the lazy executor of the scheduler data test)."""
    m = manager([ATTN, UNIFORM], num_blocks=64, prefix=PrefixCacheConfig())
    s = Scheduler(m)
    s.add_request("a", list(range(6)), 4)
    s.step()
    s.update(StepOutputs({"a": [1]}))
    plan = s.step()
    assert plan.scheduled
    s.update(StepOutputs({"a": [2]}))
    s.abort("a")
    assert not s.has_unfinished
    assert m.pending_free_blocks().size == 0 and not m._pin_chunks
    m.check_integrity()


# ---- issue 43, 16: a cached tail the request's rejected drafts left is copied before it is written ----
def test_a_tail_block_cached_under_rejected_drafts_is_copied_before_the_request_writes_it():
    """A verify step whose drafts fill the tail block; a branch forked in that step keeps the drafts
    and puts the block in the prefix cache, then leaves; the parent rejects the drafts. Its tail is a
    partly filled block again, held by it alone but cached under the drafts' tokens: its next append
    must copy it (copy-on-write) so the cached node keeps its bytes, and the node stays on that block."""
    m = manager([ATTN, UNIFORM], num_blocks=32, prefix=PrefixCacheConfig())
    m.begin_pin_epoch()
    m.allocate("p", 6, token_ids=list(range(100, 106)))
    m.mark_computed("p", 6)
    m.begin_speculation("p", 2)
    m.append("p", 2, token_ids=[900, 901])  # the drafts fill block 1
    m.fork("p", "c")
    m.mark_computed("c", 8)
    cached_tail = int(m.requests["c"].kv_blocks[1])
    assert any(n.kv_block == cached_tail for n in m.prefix_cache.nodes.values()), "the branch cached the tail"
    m.free("c")
    m.commit_speculation("p", 0, 1)  # the drafts rejected: 7 tokens, block 1 partly filled
    assert int(m.requests["p"].kv_blocks[1]) == cached_tail and m.pool.ref_counts[cached_tail] == 1
    copies = m.append("p", 1, token_ids=[555])
    m.check_integrity()
    assert len(copies) == 1 and int(copies.src[0]) == cached_tail, "the write into a cached block was not copied"
    assert int(m.requests["p"].kv_blocks[1]) != cached_tail
    node = [n for n in m.prefix_cache.nodes.values() if n.kv_block == cached_tail]
    assert len(node) == 1 and node[0].tokens == (104, 105, 900, 901), "the cached node left its block"
    m.free("p")
    m.check_integrity()


# ---- issue 43, 15: admission counts the drafts a re-admitted decode appends ------------------------------
@pytest.mark.parametrize("admission", ["first_chunk", "full_prompt"])
def test_a_readmitted_decode_is_admitted_only_with_room_for_its_drafts(admission):
    """A request preempted by recompute after it sampled comes back with its prompt and its sampled
    token; when the prefix cache holds all but that token, its first row is a decode that appends the
    token and k drafts. With exactly the blocks the token alone needs available, admitting it would
    leave the step unable to append the drafts: it must wait (and run once there is room)."""
    from tests.test_scheduler_data import _manager

    m = _manager("uniform", 60, 0, 0.0, PrefixCacheConfig("every_n_blocks", "lru", 1))
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, num_speculative_tokens=4, admission=admission,
                                     preemption_mode="recompute"))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # two blocks of 4: a checkpoint at 8
    s.add_request("a", prompt, 1)
    while s.has_unfinished:
        plan = s.step()
        s.update(StepOutputs({r.request_id: [3] for r in plan.scheduled if r.samples}))
    b = s.add_request("b", prompt, 10)
    b.output_token_ids.append(3)  # what preemption by recompute leaves of a request that sampled once
    ids = b.token_ids()
    assert m.match_prefix(ids, b.num_tokens) == b.num_tokens - 1, "the hit covers all but the sampled token"
    need = m.blocks_to_admit(b.num_tokens, 4, ids) + m.watermark_blocks
    hog = m.num_available_blocks - need - m.num_state_blocks  # KV blocks of a request that leaves exactly `need`
    m.allocate("hog", hog * m.block_size)
    assert m.can_allocate(b.num_tokens, 4, token_ids=ids), "the first chunk alone (the sampled token) fits"
    plan = s.step()  # raised NoFreeBlocksError: admitted on the token's blocks, then the drafts did not fit
    m.check_integrity()
    assert "b" not in plan.admitted and not plan.scheduled, "admitted without room for its drafts"
    s.update(StepOutputs({}))
    m.free("hog")
    plan = s.step()
    assert [(r.request_id, r.num_drafts) for r in plan.scheduled] == [("b", 4)]
    m.check_integrity()

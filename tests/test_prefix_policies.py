"""Checkpoint policies whose value does not hang on the block size, and the multi-turn workloads
of ``benchmarks/bench_prefix.py`` (session reconstruction from hash ids, synthetic conversations)."""

import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.prefix.placement_rules import aligned_end, branch_last_aligned
from hybridkv.blockmgr.prefix.vllm_align import vllm_align_stops, vllm_exported_checkpoint
from hybridkv.planner.layout import plan
from hybridkv.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

from .manager_fixtures import tiny_model


def test_branch_last_aligned_positions():
    grids = (16, 64)
    # a request that shared a prefix (branch 8): branch, and the input end on every grid
    wanted = [p for p in range(4, 101, 4) if branch_last_aligned(p, 100, 8, 4, grids)]
    assert wanted == [8, 64, 96]
    # one that shared nothing: only the coarsest grid's back-off point (never the exact end)
    assert [p for p in range(4, 101, 4) if branch_last_aligned(p, 100, 0, 4, grids)] == [64]
    # cold: the coarsest *nonzero* point; shorter than every grid: the block-aligned end
    assert [p for p in range(4, 61, 4) if branch_last_aligned(p, 60, 0, 4, grids)] == [48]
    assert [p for p in range(4, 15, 4) if branch_last_aligned(p, 14, 0, 4, grids)] == [12]
    # a grid that is not a multiple of the block size lands on the block boundary below it
    assert aligned_end(aligned_end(1500, 512), 544) == 544
    assert branch_last_aligned(544, 1500, 0, 544, (512,)) and not branch_last_aligned(1088, 1500, 0, 544, (512,))


def test_config_normalizes_and_checks_align_tokens():
    assert PrefixCacheConfig(align_tokens=512).align_tokens == (512,)
    assert PrefixCacheConfig(align_tokens=[16, 64]).align_tokens == (16, 64)
    for bad in (0, (), (16, -4)):
        with pytest.raises(ValueError):
            PrefixCacheConfig(align_tokens=bad)


def manager(checkpoint, align=(16, 64), num_blocks=400):
    layout = plan(tiny_model(), num_blocks * 256, block_size=4)
    config = PrefixCacheConfig(CheckpointPolicy(checkpoint), EvictionPolicy.LRU, align_tokens=align)
    return HybridBlockManager(layout, prefix_cache=config)


def run(m, rid, tokens, output=None):
    """Admit, prefill (chunks end where the policy wants a checkpoint), decode ``output`` with a
    ``final`` checkpoint at its last block boundary; returns the cached tokens at admission."""
    hit = m.match_prefix(tokens)
    alloc = m.allocate(rid, min(len(tokens), hit + 4), token_ids=tokens)
    m.checkpoint(rid)
    while m.requests[rid].num_tokens < len(tokens):
        m.release_pins()
        stop = m.next_checkpoint_position(rid) or len(tokens)
        m.append(rid, stop - m.requests[rid].num_tokens)
        m.checkpoint(rid)
    m.release_pins()
    if output:
        cut = (len(tokens) + len(output)) // 4 * 4 - len(tokens)
        m.append(rid, cut, token_ids=output[:cut])
        m.checkpoint(rid, final=True)
        m.release_pins()
        m.append(rid, len(output) - cut, token_ids=output[cut:])
    m.free(rid)
    m.check_integrity()
    return alloc.num_cached_tokens


def test_sibling_that_rewrites_the_last_message_hits_the_back_off_point():
    """B repeats A's first 90 of 102 tokens: branch_and_last (checkpoint at A's end, 100) gives it
    nothing, branch_last_aligned (64-token grid) gives it 64."""
    a = list(range(1000, 1102))
    b = a[:90] + list(range(5000, 5030))
    m_old, m_new = manager("branch_and_last"), manager("branch_last_aligned")
    run(m_old, "a", a), run(m_new, "a", a)
    assert run(m_old, "b", b) == 0
    assert run(m_new, "b", b) == 64
    # C, a third sibling, hits the branch point B left A's prefix at (88: B's match, block-aligned)
    c = a[:90] + list(range(7000, 7040))
    assert run(m_new, "c", c) == 88


def test_next_turn_hits_the_end_of_the_previous_reply():
    """Turn 2 = turn 1's prompt + reply + a message: the final checkpoint at the reply's last block
    boundary serves it (without ``final``, branch_last_aligned would serve only the grid point)."""
    prompt, reply = list(range(100, 150)), list(range(900, 923))
    turn2 = prompt + reply + list(range(3000, 3020))
    m = manager("branch_last_aligned")
    run(m, "t1", prompt, reply)
    assert run(m, "t2", turn2) == (len(prompt) + len(reply)) // 4 * 4 == 72
    m2 = manager("branch_last_aligned")
    run(m2, "t1", prompt)  # reply decoded without its ids: no final checkpoint, no reply in the cache
    # t1 shared nothing, so it backs off to the coarsest nonzero grid point only (64 -> 0, 16 -> 48)
    assert run(m2, "t2", turn2) == 48


def req(i, n_in, n_out, ids):
    return TraceRequest(i, i, n_in, n_out, tuple(ids))


def test_session_reconstruction_links_a_partial_block_to_the_next_turn():
    bench = pytest.importorskip("benchmarks.bench_prefix")
    bt = MOONCAKE_BLOCK_TOKENS
    a = req(0, 2 * bt + 100, 30, [1, 2, 3])  # two whole blocks and 100 tokens of block 3
    b = req(1, 3 * bt + 50, 10, [1, 2, 4, 5])  # A's whole blocks, then its own
    other = req(2, bt + 10, 5, [9, 10])
    items, info = bench.trace_session_items([a, b, other])
    assert info["linked_turns"] == 1 and info["replies_reused"] == 1
    ta, tb = items[0].input_ids.tolist(), items[1].input_ids.tolist()
    assert tb[: len(ta)] == ta  # the partial block is a prefix of the next turn's block
    assert items[0].output_ids == tb[len(ta) : len(ta) + 30]  # A's reply is what B repeats
    assert items[1].output_ids is None and items[2].output_ids is None
    # the plain reading shares only the whole blocks
    plain = bench.trace_items([a, b, other])
    p0, p1 = plain[0].input_ids.tolist(), plain[1].input_ids.tolist()
    assert p1[: 2 * bt] == p0[: 2 * bt]
    assert p1[2 * bt : 2 * bt + 100] != p0[2 * bt :]


def test_multiturn_workload_repeats_prompt_and_reply():
    bench = pytest.importorskip("benchmarks.bench_prefix")
    items, info = bench.multiturn_items(num_sessions=12, seed=3)
    assert info["requests"] == len(items) > 12
    later = 0
    for i, it in enumerate(items):
        assert it.output_ids is not None and len(it.output_ids) == it.output_length
        # a later turn of the same conversation starts with this prompt and this reply
        ids = it.input_ids.tolist()
        nxt = [j.input_ids.tolist() for j in items[i + 1 :] if j.input_ids[: len(ids)].tolist() == ids]
        if nxt:
            later += 1
            n = len(ids)
            assert nxt[0][n : n + it.output_length] == it.output_ids
    assert later == len(items) - 12  # every turn but each session's last


def test_vllm_align_stops_and_export():
    """vLLM 0.33's align mode (Scheduler._mamba_block_aligned_split): a chunk stops at the next block
    boundary when it starts mid-block, at the branch point floored to a block, and at the input's
    last block boundary before its last token; a kernel that exports checkpoints keeps that last
    one from inside a chunk that reaches the input's end and starts a block or more below it."""
    assert vllm_align_stops(0, 100, 0, 16) == [96]
    assert vllm_align_stops(0, 96, 0, 16) == [80]  # (the last token is recomputed: never at the end)
    assert vllm_align_stops(5, 100, 40, 16) == [16, 37, 96]  # mid-block; branch 40 floored from 5
    assert vllm_align_stops(96, 100, 0, 16) == []
    assert vllm_exported_checkpoint(0, 100, 100, 16, 16) == 96
    assert vllm_exported_checkpoint(0, 90, 100, 16, 16) is None  # the chunk stops short of the end
    assert vllm_exported_checkpoint(88, 100, 100, 16, 16) is None  # starts mid-block
    assert vllm_exported_checkpoint(80, 100, 100, 16, 16) == 96
    assert vllm_exported_checkpoint(96, 100, 100, 16, 16) is None  # no block between start and it
    assert vllm_exported_checkpoint(16, 100, 100, 16, 64) is None  # off the kernel's grid
    with pytest.raises(ValueError):
        PrefixCacheConfig(export_alignment=0)


def test_vllm_align_keeps_state_where_forwards_end():
    """The scheduler ends chunks on block boundaries and stops at the prompt's last block; the state
    is kept at every block boundary a forward ends on, and a second identical prompt hits there."""
    from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig, StepOutputs

    layout = plan(tiny_model(), 400 * 256, block_size=4)
    prompt = list(range(1, 31))  # 30 tokens: last block boundary before the last token: 28
    for export in (None, 4):
        mgr = HybridBlockManager(layout, prefix_cache=PrefixCacheConfig("vllm_align", export_alignment=export))
        sched = Scheduler(mgr, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=11))
        sched.add_request("a", prompt, 2)
        chunks = []
        while sched.has_unfinished:
            p = sched.step()
            chunks += [(x.num_computed_tokens, x.num_scheduled_tokens) for x in p.scheduled if x.is_prefill]
            sched.update(StepOutputs({x.request_id: [7] for x in p.scheduled if x.samples}))
        # budget 11 floored to 8-token chunks; without an export the last block splits off at 28
        tail = [(24, 4), (28, 2)] if export is None else [(24, 6)]
        assert chunks == [(0, 8), (8, 8), (16, 8), *tail]
        sched.add_request("b", prompt, 2)
        sched.step()
        assert sched.requests["b"].num_cached_tokens == 28

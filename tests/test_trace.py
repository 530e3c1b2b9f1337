"""The Mooncake trace loader and a short replay through the manager's prefix cache (skips without
``../shared/traces``)."""

import pytest

from hybridkv.sim.trace import DEFAULT_TRACE, MOONCAKE_BLOCK_TOKENS, TokenMaker, load_trace

needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"trace not found at {DEFAULT_TRACE}")


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass --trace"):
        load_trace(tmp_path / "none.jsonl")


@needs_trace
def test_tokens_follow_the_hash_ids():
    trace = load_trace(limit=200)
    maker = TokenMaker()
    for req in trace:
        tokens = maker.tokens(req)
        assert len(tokens) == req.input_length
        assert len(req.hash_ids) == -(-req.input_length // MOONCAKE_BLOCK_TOKENS)
    pairs = [
        (a, b)
        for i, a in enumerate(trace)
        for b in trace[i + 1 :]
        if len(a.hash_ids) > 1 and a.hash_ids[:2] == b.hash_ids[:2]
    ]
    assert pairs, "the first 200 requests share prefixes"
    a, b = pairs[0]
    assert maker.tokens(a)[: 2 * MOONCAKE_BLOCK_TOKENS] == maker.tokens(b)[: 2 * MOONCAKE_BLOCK_TOKENS]
    assert maker.tokens(trace[0])[:MOONCAKE_BLOCK_TOKENS] != maker.tokens(trace[1])[:MOONCAKE_BLOCK_TOKENS]


@needs_trace
def test_short_replay_hits_the_cache_and_balances():
    from benchmarks.bench_prefix import replay, trace_items

    trace = load_trace(limit=60)
    r = replay("qwen3-next-80b-a3b", 16, "paged", "every_n_blocks", "lru", 8, trace_items(trace), 4)
    assert r["skipped"] == 0 and 0 <= r["token_hit_rate"] < 1
    assert r["checkpoints_made"] > 0

"""The Mooncake trace loader and a short replay through the manager's prefix cache (skips without
``../shared/traces``)."""

import json

import pytest

from hybridkv.sim.trace import DEFAULT_TRACE, MOONCAKE_BLOCK_TOKENS, TokenMaker, TraceError, load_trace

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


def _trace_file(tmp_path, *records, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("input_length", 10.7, "input_length must be an integer, got 10.7"),
        ("input_length", True, "input_length must be an integer, got true"),
        ("input_length", 600.0, r"input_length must be an integer, got 600.0 \(JSON integers only"),
        ("input_length", "600", 'input_length must be an integer, got "600"'),
        ("output_length", None, "output_length must be an integer, got null"),
        ("output_length", 0, "output_length must be >= 1, got 0"),
        ("timestamp", 1.5, "timestamp must be an integer, got 1.5"),
        ("timestamp", -1, "timestamp must be >= 0, got -1"),
        ("hash_ids", "12", 'hash_ids must be a list of integers, got "12"'),
        ("hash_ids", [1, 2.0], "hash_ids must be integers >= 0, got 2.0"),
        ("hash_ids", [1, False], "hash_ids must be integers >= 0, got false"),
        ("hash_ids", [1, -2], "hash_ids must be integers >= 0, got -2"),
    ],
)
def test_trace_fields_must_be_json_integers_and_the_error_names_the_line(tmp_path, field, value, message):
    path = _trace_file(tmp_path, GOOD, GOOD | {field: value})
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {message}"):
        load_trace(path)


def test_an_empty_trace_or_an_empty_window_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(TraceError, match=r"empty\.jsonl: the trace holds no request"):
        load_trace(empty)
    path = _trace_file(tmp_path, *({**GOOD, "timestamp": 1000 * i} for i in range(3)))
    with pytest.raises(TraceError, match=r"no request of the trace arrives in the window \[5000, end\) ms"):
        load_trace(path, start_ms=5000)
    with pytest.raises(ValueError, match=r"window \[5000, 1000\) ms is empty"):
        load_trace(path, start_ms=5000, end_ms=1000)
    with pytest.raises(ValueError, match=r"window \[1000, 1000\) ms is empty"):
        load_trace(path, start_ms=1000, end_ms=1000)
    assert len(load_trace(path, start_ms=1000, end_ms=2000)) == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, ValueError),
        ({"limit": 2.0}, TypeError),
        ({"start_ms": -1}, ValueError),
        ({"start_ms": 1.5}, TypeError),
        ({"end_ms": True}, TypeError),
        ({"rate_scale": float("nan")}, ValueError),
        ({"rate_scale": float("inf")}, ValueError),
        ({"rate_scale": 0}, ValueError),
        ({"rate_scale": True}, TypeError),
    ],
)
def test_load_trace_checks_its_arguments_before_reading(tmp_path, kwargs, error):
    with pytest.raises(error):
        load_trace(tmp_path / "not-read.jsonl", **kwargs)  # refused before the file is looked for

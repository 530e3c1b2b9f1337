"""Examples run in CI: each example script must run to the end on a CPU-only machine."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path, capsys):
    if path.name == "hf_continuous_batching.py":
        pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()


def _main_of(name: str):
    return runpy.run_path(str(next(p for p in EXAMPLES if p.name == name)))["main"]


def test_serve_loop_swaps_and_its_byte_check_covers_the_swap_path(capsys):
    # the loop asserts, for every row of every step, that the state's bytes equal the tokens its request
    # has seen: a request swapped out and back in is checked like any other
    counts = _main_of("serve_loop.py")()
    assert counts["swapped"] > 0 and counts["preempted"] >= counts["swapped"] and counts["prefix_hit_tokens"] > 0


def test_continuous_batching_preempts_both_ways_and_hits_forks_and_drafts(capsys):
    counts = _main_of("continuous_batching.py")()
    for key in ("preempted_recompute", "preempted_swap", "prefix_hit_tokens", "forks", "accepted"):
        assert counts[key] > 0, (key, counts)
    assert counts["accepted"] < counts["drafts"]  # the drafter is imperfect: some drafts are rejected

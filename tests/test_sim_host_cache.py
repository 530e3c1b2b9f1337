"""``hybridkv simulate --host-cache SIZE`` (issue 32): the prefix cache's host tier in the simulator.

The same small workload (requests sharing group prefixes, a device pool that cannot keep them all)
with and without a host tier: the tier keeps evicted prefixes matchable, so more prompt tokens hit,
its copies are counted and priced on the host link with the swaps (their seconds reported apart),
nothing changes before the device first evicts, and a configuration without the tier moves no
tier bytes. Bad input is refused before any run.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.sim.compare import expand
from hybridkv.sim.config import SimConfig, build
from hybridkv.sim.report import comparison_table, summarize
from hybridkv.sim.simulator import simulate
from hybridkv.sim.workload import SyntheticConfig, synthetic


@pytest.fixture(scope="module")
def workload():
    return synthetic(SyntheticConfig(num_requests=60, rate=20.0, prompt_median=6000, output_median=64, seed=3))


@pytest.fixture(scope="module")
def raws(workload):
    configs = expand(SimConfig(gpu_memory="3GiB", host_memory="0"), ["host-cache=0,64GiB"])
    return {c.host_cache: simulate(c, workload) for c in configs}


@pytest.fixture(scope="module")
def runs(raws):
    return {k: summarize(raw) for k, raw in raws.items()}


def test_the_host_tier_keeps_more_prefixes_and_its_copies_are_counted(runs):
    off, on = runs["0"]["totals"], runs["64GiB"]["totals"]
    assert off["finished"] == on["finished"] == 60
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert on["host_hit_tokens"] > 0 and on["host_tier_offload_bytes"] > 0 and on["host_tier_onload_bytes"] > 0
    assert off["host_hit_tokens"] == off["host_tier_offload_bytes"] == off["host_tier_onload_bytes"] == 0
    # onloads are host hits' KV and checkpoints: never more than the tier offloaded
    assert on["host_tier_onload_bytes"] <= on["host_tier_offload_bytes"]
    assert runs["64GiB"]["label"] != runs["0"]["label"] and "host-cache=64GiB" in runs["64GiB"]["label"]


def test_the_tier_shares_the_host_pool_and_is_off_without_a_prefix_cache():
    with_tier = build(SimConfig(gpu_memory="3GiB", host_memory="0", host_cache="8GiB"))
    assert with_tier.manager.prefix_cache.tier is not None
    assert with_tier.manager.host_pool is not None
    no_prefix = build(SimConfig(gpu_memory="3GiB", host_memory="0", host_cache="8GiB", prefix="none"))
    assert no_prefix.manager.prefix_cache is None and no_prefix.manager.host_pool is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host-cache", "lots"], "--host-cache lots"),
        (["--host-cache", "8GiB", "--prefix", "none"], "--host-cache with --prefix none"),
        (["--compare", "host-cache=0,8GiBx"], "--compare host-cache"),
        (["--engine", "vllm", "--host-cache", "8GiB"], "--engine vllm fixes"),
    ],
)
def test_bad_host_cache_input_is_one_line_before_any_run(args, message, capsys, monkeypatch, tmp_path):
    import hybridkv.sim.compare as compare

    monkeypatch.setattr(compare, "run_all", lambda *a, **k: pytest.fail("a simulation started"))
    assert main(["simulate", "--requests", "4", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_tiers_bytes_and_link_seconds_are_reported_apart_from_the_swaps(runs, raws):
    on, off = runs["64GiB"], runs["0"]
    t, p, link = on["totals"], on["pressure"], on["gpu"]["host_link_bytes_per_s"]
    moved = t["host_tier_offload_bytes"] + t["host_tier_onload_bytes"]
    assert t["host_tier_link_s"] == p["host_tier_link_s"] == pytest.approx(moved / link, rel=1e-6)
    assert t["host_tier_link_s"] > 0 and p["swap_link_s"] == 0.0  # no swap pool here: the link carried the tier
    # host hits' copies run before the forward: what the link added to the steps is at least their time
    assert p["swap_stall_s"] >= t["host_tier_onload_bytes"] / link * (1 - 1e-6)
    series, bpb = raws["64GiB"]["series"], on["layout"]["bytes_per_block"]
    assert int(series["tier_offload_blocks"].sum()) * bpb == t["host_tier_offload_bytes"]
    assert int(series["tier_onload_blocks"].sum()) * bpb == t["host_tier_onload_bytes"]
    assert 0 < t["peak_host_tier_bytes"] <= 64 * 2**30
    assert int(series["host_used"].max()) == 0  # the tier's blocks are not swap blocks
    assert off["totals"]["host_tier_link_s"] == off["totals"]["peak_host_tier_bytes"] == 0
    row = next(r for r in comparison_table([on]) if r[0].startswith("host tier out / in"))
    assert row[1].endswith(f"({t['host_tier_link_s']:.3g} s)")


@pytest.fixture(scope="module")
def raws_aligned(workload):
    configs = expand(SimConfig(gpu_memory="3GiB", host_memory="0", checkpoint="branch_last_aligned"),
                     ["host-cache=0,64GiB"])
    return {c.host_cache: simulate(c, workload) for c in configs}


def test_before_the_first_eviction_from_the_device_the_tier_changes_nothing(raws_aligned):
    """The tier only keeps what the device evicts: with a checkpoint policy whose positions do not
    weigh bytes (``branch_last_aligned``), until the first offload both runs are the same steps, and
    every request that had its first token by then the same TTFT (why a tail made before the device
    ever fills cannot move). (``branch_spaced`` places checkpoints closer with a tier: its gap weighs
    a checkpoint's bytes against device and host blocks together.)"""
    raws = raws_aligned
    on, off = raws["64GiB"]["series"], raws["0"]["series"]
    first = int(np.argmax(on["tier_offload_blocks"] > 0))
    assert on["tier_offload_blocks"][first] > 0 and first > 0
    for key in ("t_s", "batched_tokens", "admitted", "cached_tokens", "free", "kv_cached", "checkpoints"):
        assert np.array_equal(on[key][:first], off[key][:first]), key
    until = on["t_s"][first - 1]
    ttft = {r["id"]: r.get("ttft_s") for r in raws["0"]["requests"]}
    early = [r for r in raws["64GiB"]["requests"] if "ttft_s" in r and r["arrival_s"] + r["ttft_s"] <= until]
    assert early and all(r["ttft_s"] == ttft[r["id"]] for r in early)
    # and afterwards the tier does change the run (more prompt tokens hit)
    assert on["cached_tokens"].sum() > off["cached_tokens"].sum()


def test_bench_simulate_explains_the_ttft_tail(raws, runs, workload):
    """``bench_simulate.py --host-tier``'s tail: the requests at or above the p99, their reusable
    tokens, and TTFT over the arrivals after the device's first eviction."""
    bench = pytest.importorskip("benchmarks.bench_simulate")
    reusable = bench.reusable_tokens(workload)
    seen, by_id = set(), {r.request_id: r for r in workload.requests}
    for r in workload.requests:  # the first request to carry a block has nothing reusable
        if r.hash_ids[0] not in seen:
            assert reusable[r.request_id] == 0
        seen.update(r.hash_ids)
    assert any(v > 0 for v in reusable.values())
    assert all(v % 512 == 0 and v <= by_id[k].num_prompt_tokens for k, v in reusable.items())
    raw = raws["64GiB"]
    first = bench.first_offload_s(raw)
    i = int(np.argmax(raw["series"]["tier_offload_blocks"] > 0))
    assert first == pytest.approx(raw["series"]["t_s"][i] - raw["series"]["dt_s"][i])
    assert bench.first_offload_s(raws["0"]) is None
    out = bench.ttft_tail(raw, reusable, first)
    assert out["ttft_p99_s"] == runs["64GiB"]["latency_s"]["ttft"]["p99"]
    tail = [r for r in raw["requests"] if r.get("ttft_s", -1) >= out["ttft_p99_s"] - 1e-6]
    assert out["tail"]["requests"] == len(tail) >= 1
    assert out["tail"]["reusable_tokens"] == [reusable[r["id"]] for r in tail]
    assert out["tail"]["hit_tokens"] == [r["cached_tokens"] for r in tail]
    assert out["tail"]["arrived_before_first_eviction"] == sum(r["arrival_s"] < first for r in tail)
    late = [r for r in raw["requests"] if r["arrival_s"] >= first]
    assert out["after_first_eviction"]["requests"] == len(late)
    w = out["tail"]["window"]
    assert w["batch_full_s"] + w["memory_held_s"] <= w["busy_s"] + 1e-9 and 0 <= w["min_free_fraction"] <= 1
    assert "after_first_eviction" not in bench.ttft_tail(raws["0"], reusable, None)

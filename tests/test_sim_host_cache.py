"""``hybridkv simulate --host-cache SIZE`` (issue 32): the prefix cache's host tier in the simulator.

The same small workload (requests sharing group prefixes, a device pool that cannot keep them all)
with and without a host tier: the tier keeps evicted prefixes matchable, so more prompt tokens hit,
its copies are counted and priced on the host link with the swaps, and nothing else changes; a
configuration without the tier moves no tier bytes. Bad input is refused before any run.
"""

from __future__ import annotations

import pytest

from hybridkv.cli import main
from hybridkv.sim.compare import expand, run_all
from hybridkv.sim.config import SimConfig, build
from hybridkv.sim.workload import SyntheticConfig, synthetic


@pytest.fixture(scope="module")
def runs():
    workload = synthetic(SyntheticConfig(num_requests=60, rate=20.0, prompt_median=6000, output_median=64, seed=3))
    configs = expand(SimConfig(gpu_memory="3GiB", host_memory="0"), ["host-cache=0,64GiB"])
    return {s["config"]["host_cache"]: s for s in run_all(configs, workload, workers=1)}


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

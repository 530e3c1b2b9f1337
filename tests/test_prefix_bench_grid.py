"""``benchmarks/bench_prefix.py --grid`` (issue 32): the host tier's budget table in one command.

The command line resolves to the table's runs (trace workload, the default policy, device budgets x
host sizes, the unbounded figure) and refuses flags that would change the workload or the policy
before any work; the tier's bytes are priced at the GPU's host-link rate; a real replay with a
small device pool fills one cell per host size, and two rows for one cell are refused.
"""

from __future__ import annotations

import pytest

bench = pytest.importorskip("benchmarks.bench_prefix")


def test_grid_resolves_to_the_tables_runs():
    args = bench.parse_args(["--grid"])
    assert args.workloads == ["trace"] and args.unbounded
    assert args.config == [list(bench.GRID_CONFIG)] and bench.GRID_CONFIG == ("paged", "branch_spaced", "lru", 8)
    assert args.budgets == [16, 32, 64] and args.host_cache == [0, 64, 256, 1024]
    assert args.name == "prefix_hosttier_grid" and args.gpu.name == "H200"
    assert sorted(args.models) == sorted(bench.MODELS)
    mine = bench.parse_args(["--grid", "--budgets", "16", "--host-cache", "0", "256", "--name", "t"])
    assert mine.budgets == [16] and mine.host_cache == [0, 256] and mine.name == "t"
    plain = bench.parse_args([])  # without --grid: the defaults as before
    assert plain.workloads == ["trace", "multiturn"] and plain.host_cache == [0] and plain.config == []
    assert plain.name == "prefix" and not plain.unbounded


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "--workloads", "multiturn"], "--grid fixes the workload and the policy: drop --workloads"),
        (["--grid", "--configs", "0"], "drop --configs"),
        (["--grid", "--config", "paged", "every_n_blocks", "lru", "8"], "drop --config"),
        (["--grid", "--quick", "--legacy"], "drop --quick, --legacy"),
        (["--host-cache", "-1"], "--host-cache sizes must be >= 0 GiB"),
        (["--budgets", "0"], "--budgets must be >= 1 GiB"),
        (["--configs", "99"], "--configs indices must be in 0.."),
        (["--gpu", "tpu9"], "--gpu / --calibration: unknown GPU 'tpu9'"),
        (["--calibration", "/nonexistent.json"], "file not found"),
    ],
)
def test_bad_grid_input_exits_2_with_one_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_tiers_bytes_are_priced_on_the_host_link_and_fill_one_cell_per_host_size():
    args = bench.parse_args(["--grid"])
    items, _ = bench.multiturn_items(num_sessions=24, seed=1)
    # a device pool that cannot keep the conversations: the tier gets what the device evicts
    rows = []
    for host_gib in (0, 2):
        r = bench.replay("qwen3-next-80b-a3b", 0.4, *bench.GRID_CONFIG, items, 8, progress=False, host_gib=host_gib)
        r["workload"] = "multiturn"
        rows.append(bench.link_seconds(r, args.gpu))
    off, on = rows
    assert on["offload_bytes"] > 0 and on["onload_bytes"] > 0 and on["token_hit_rate"] > off["token_hit_rate"]
    rate = args.gpu.host_link_bytes_per_s
    assert on["offload_link_s"] == pytest.approx(on["offload_bytes"] / rate)
    assert on["onload_link_s"] == pytest.approx(on["onload_bytes"] / rate)
    assert on["link_s"] == pytest.approx(on["offload_link_s"] + on["onload_link_s"])
    assert off["link_s"] == off["offload_link_s"] == 0.0
    grid = bench.grid_table(rows, {"multiturn": {"token_hit_rate": 0.9}})
    cells = grid["cells"]["multiturn"]["qwen3-next-80b-a3b"]["0.4"]
    assert set(cells) == {"0", "2"} and grid["unbounded"] == {"multiturn": 0.9}
    assert cells["2"]["token_hit_rate"] == on["token_hit_rate"] and cells["2"]["onload_bytes"] == on["onload_bytes"]
    text = bench.format_grid(grid)
    assert f"{on['token_hit_rate']:.1%}" in text and f"{off['token_hit_rate']:.1%}" in text
    assert "unbounded 90.0%" in text and "host link" in text
    with pytest.raises(ValueError, match="a grid has one policy"):
        bench.grid_table([*rows, rows[1]], {})

"""The simulator: real scheduler and manager under a workload, its books, its reports, its CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hybridkv.sim.simulator as simulator_module
from hybridkv.cli import main
from hybridkv.models.presets import preset
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter.cost import H200, GpuSpec, StepCostModel, calibrate, load_gpu
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine
from hybridkv.sim.compare import expand, run_all
from hybridkv.sim.config import SimConfig, build
from hybridkv.sim.executor import PlanContractError, SimExecutor
from hybridkv.sim.report import summarize, write_reports
from hybridkv.sim.simulator import simulate
from hybridkv.sim.trace import TraceError, load_trace
from hybridkv.sim.workload import SimRequest, SyntheticConfig, Workload, synthetic

# 60 requests arriving at once into a 2 GiB MiniMax-M1 TP8 pool (6,553 blocks): about 37 fit, so the
# scheduler preempts under TIGHT (measured 2026-12-02: 1 swap in swap mode, 1 recompute of 4,992
# tokens in recompute mode); about 1.5 s of CPU per run
PRESSURE = SyntheticConfig(
    num_requests=60,
    rate=1000.0,
    arrivals="poisson",
    prompt_median=4000,
    prompt_sigma=0.3,
    output_median=256,
    output_sigma=0.3,
    seed=1,
)
# the prefix policies these pressure tests were tuned with (the defaults now keep fewer checkpoints,
# so the 2 GiB pool no longer needs to preempt on this workload)
# MiniMax-M1 TP8 with its lightning state in float32 (twice the preset's bf16 default): 2 GiB is tight
# first_chunk admission over-admits on purpose: the pool runs out mid-prefill, so preemption and
# swap happen (the default, reserved, admits only what fits with its decode room and hardly preempts)
TIGHT = SimConfig(
    gpu_memory="2GiB",
    state_dtype="float32",
    integrity_every=20,
    prefix="flop_aware",
    checkpoint="branch_and_last",
    admission="first_chunk",
)
SMALL_FLAGS = ["--requests", "30", "--prompt-median", "2000", "--output-median", "48", "--gpu-memory", "2GiB"]


@pytest.fixture(scope="module")
def pressure() -> Workload:
    return synthetic(PRESSURE)


def test_same_seed_same_report_json(tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main(["simulate", *SMALL_FLAGS, "--seed", "3", "--out", str(out), "--no-progress"]) == 0
        outs.append((out / "report.json").read_bytes())
        assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html"}
    assert outs[0] == outs[1]
    other = tmp_path / "c"
    assert main(["simulate", *SMALL_FLAGS, "--seed", "4", "--out", str(other), "--no-progress"]) == 0
    assert (other / "report.json").read_bytes() != outs[0]


def test_every_request_finishes_or_is_rejected_with_a_reason(pressure):
    too_big = SimRequest("huge", 0.5, 3_000_000, 16, tuple(range(10**9, 10**9 + 5860)))
    workload = Workload([*pressure.requests, too_big], {"kind": "test"})
    raw = simulate(TIGHT, workload)
    statuses = {r["id"]: r["status"] for r in raw["requests"]}
    assert set(statuses) == {r.request_id for r in workload.requests}
    assert set(statuses.values()) == {"finished", "rejected"}
    rejected = [r for r in raw["requests"] if r["status"] == "rejected"]
    assert [r["id"] for r in rejected] == ["huge"] and "RequestTooLargeError" in rejected[0]["reason"]
    for r in raw["requests"]:
        if r["status"] == "finished":
            want = next(w.max_new_tokens for w in workload.requests if w.request_id == r["id"])
            assert r["outputs"] == want and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
    s = summarize(raw)
    assert s["totals"]["finished"] + s["totals"]["rejected"] == len(workload)
    assert s["rejected"][0]["reason"] and raw["integrity_checks"] >= 2 and raw["stalled"] == 0


def test_paged_admits_at_least_as_many_as_padded_on_the_same_budget(pressure):
    paged = summarize(simulate(TIGHT, pressure))
    padded = summarize(simulate(TIGHT.with_changes(layout="padded"), pressure))
    assert paged["layout"]["budget_bytes"] == padded["layout"]["budget_bytes"]
    assert paged["totals"]["peak_running"] >= padded["totals"]["peak_running"]
    cap = paged["capacity"]
    assert all(a >= b for a, b in zip(cap["paged"], cap["padded"], strict=True))
    assert any(a > b for a, b in zip(cap["paged"], cap["padded"], strict=True))


def test_swap_moves_exactly_the_bytes_the_plans_say(pressure, monkeypatch):
    planned = {"out": 0, "in": 0}
    real_build = simulator_module.build

    def build(cfg):
        built = real_build(cfg)
        m = built.manager
        out, swap_in = m.swap_out, m.swap_in

        def swap_out(rid):
            plan_ = out(rid)
            planned["out"] += len(plan_)
            return plan_

        def swap_in_(rid):
            plan_ = swap_in(rid)
            planned["in"] += len(plan_)
            return plan_

        m.swap_out, m.swap_in = swap_out, swap_in_
        return built

    monkeypatch.setattr(simulator_module, "build", build)
    raw = simulate(TIGHT.with_changes(preemption="swap"), pressure)
    s = summarize(raw)
    bpb = s["layout"]["bytes_per_block"]
    assert s["totals"]["preemptions_swap"] > 0 and planned["out"] > 0
    assert s["totals"]["swap_out_bytes"] == planned["out"] * bpb
    assert s["totals"]["swap_in_bytes"] == planned["in"] * bpb == planned["out"] * bpb  # all came back
    series = raw["series"]
    held = np.cumsum(series["swap_out_blocks"]) - np.cumsum(series["swap_in_blocks"])
    assert np.array_equal(held, series["host_used"])  # the host pool holds exactly what went out


@pytest.mark.parametrize("changes", [{"preemption": "recompute"}, {"preemption": "swap", "host_memory": "0"}])
def test_recompute_and_swap_without_a_host_pool_move_nothing_to_the_host(pressure, changes):
    s = summarize(simulate(TIGHT.with_changes(**changes), pressure))
    assert s["totals"]["preemptions_recompute"] > 0 and s["totals"]["preemptions_swap"] == 0
    assert s["totals"]["swap_out_bytes"] == s["totals"]["swap_in_bytes"] == 0


def test_cost_model_one_step_by_hand():
    # MiniMax-M1 TP8, 64-token blocks: 10 attention layers (1 KV head of 128, q heads 64/8 = 8, bf16),
    # 70 lightning layers (8 heads of a 128 x 128 fp32 state); 45.9e9 active parameters
    layout = plan(preset("minimax-m1", "float32", tp_size=8), 2 * 2**30, 64)
    gpu = GpuSpec("test", flops_per_s=1e15, host_link_bytes_per_s=50e9, hbm_bytes_per_s=4e12, flops_efficiency=0.5)
    model = StepCostModel(layout, gpu)
    # one prefill chunk: tokens [1000, 1512); one decode at 2047 with 2 drafts; 3 copied blocks;
    # 10 blocks swapped out, 4 in
    work = model.work([(1000, 512, 0), (2047, 1, 2)], num_copy_blocks=3, num_swap_out_blocks=10, num_swap_in_blocks=4)
    linear = 2 * 45.9e9 / 8 + 4 * 70 * 8 * 128 * 128  # weights + recurrent, per token
    quadratic = 2 * 10 * 8 * 128  # per attention layer: 2 * q_heads * head_dim
    flops = linear * 512 + quadratic * (1512**2 - 1000**2) + linear * 3 + quadratic * (2050**2 - 2047**2)
    assert work.flops == pytest.approx(flops, rel=1e-12)
    kv_token = 10 * 2 * 1 * 128 * 2  # 5,120 bytes: K and V of one KV head in 10 layers
    state = 70 * 8 * 128 * 128 * 4  # 36,700,160 bytes
    assert work.weight_bytes == 45.9e9 / 8 * 2
    assert work.kv_read_bytes == (1512 + 2050) * kv_token
    assert work.kv_write_bytes == (512 + 3) * kv_token
    assert work.state_read_bytes == 2 * state
    assert work.state_write_bytes == (2 + 2) * state  # two live sets, two speculative sets
    bpb = layout.bytes_per_block
    assert bpb == 10 * 2 * 64 * 128 * 2  # 10 layer slots x (K + V) x 64 tokens x 128 x bf16
    assert work.copy_bytes == 2 * 3 * bpb
    t = model.time(work)
    hbm = work.weight_bytes + work.kv_read_bytes + work.kv_write_bytes + 6 * state + 6 * bpb
    assert t.compute_s == pytest.approx(flops / 0.5e15)
    assert t.memory_s == pytest.approx(hbm / (0.8 * 4e12))
    assert t.swap_out_s == pytest.approx(10 * bpb / 50e9) and t.swap_in_s == pytest.approx(4 * bpb / 50e9)
    assert t.total_s == pytest.approx(t.swap_in_s + max(t.compute_s, t.memory_s, t.swap_out_s))
    assert t.compute_s > t.memory_s  # a 512-token chunk of a 45.9 B-active model is compute-bound


def test_calibration_replaces_what_it_measured(tmp_path):
    ops = {"gpu": "NVIDIA H200", "copy": {"gbps": 4243.0}, "pinned": {"in_gbps": 55.3, "out_gbps": 54.0}}
    gpu, fields = calibrate(H200, ops)
    assert gpu.hbm_bytes_per_s == 4243e9 and gpu.hbm_efficiency == 1.0 and gpu.host_link_bytes_per_s == 54e9
    assert gpu.flops_per_s == H200.flops_per_s and set(fields) == {"hbm_bytes_per_s", "hbm_efficiency",
                                                                   "host_link_bytes_per_s"}  # fmt: skip
    with pytest.raises(ValueError, match="without a GPU"):
        calibrate(H200, {"gpu": None, "copy": {"gbps": 1.0}})
    custom = tmp_path / "gpu.json"
    rates = {"flops_per_s": 5e14, "host_link_bytes_per_s": 2e10, "hbm_bytes_per_s": 1e12}
    custom.write_text(json.dumps({"name": "X1", **rates}))
    assert load_gpu(str(custom)).name == "X1"
    flat = tmp_path / "measured.json"
    flat.write_text(json.dumps({"flops_efficiency": 0.6}))
    assert load_gpu("h100", flat).flops_efficiency == 0.6


def test_executor_rejects_an_unsettled_swap_plan():
    built = build(TIGHT)
    sched, m = built.scheduler, built.manager
    sched.add_request("a", 100, 4)
    plan_ = sched.step()
    sched.update(SyntheticEngine().run(plan_))
    pending = m.swap_out("a")
    executor = SimExecutor(m, built.cost)
    with pytest.raises(PlanContractError, match="unsettled"):
        executor.run(plan_._replace(swap_out=(pending,), scheduled=()))
    pending.abort()
    m.check_integrity()


def test_bad_trace_line_names_the_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(good) + "\n" + '{"timestamp": 5, "input_length": 10}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: missing output_length, hash_ids"):
        load_trace(trace)
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and ":2:" in err and err.startswith("hybridkv: error:")


def test_trace_window_rate_and_truncation(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 1000 * i, "input_length": 100, "output_length": 9, "hash_ids": [i]} for i in range(10)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = load_trace(trace, limit=3, start_ms=2000, end_ms=8000, rate_scale=2.0)
    assert [(t.arrival_ms, t.hash_ids) for t in got] == [(0, (2,)), (500, (3,)), (1000, (4,))]
    from hybridkv.sim.workload import from_trace

    w = from_trace(trace, max_output_tokens=5)
    assert len(w) == 10 and {r.max_new_tokens for r in w.requests} == {5}


@pytest.mark.parametrize(
    "flags",
    [
        ["--layout", "sideways"],
        ["--tp", "0"],
        ["--compare", "colour=red"],
        ["--gpu-memory", "lots"],
        ["--gpu", "tpu"],
        ["--trace", "/nonexistent/trace.jsonl"],
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(["simulate", *flags, "--out", str(tmp_path), "--no-progress"])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err and err.count("\n") == 0 and "error" in err


def test_synthetic_workload_is_seeded_and_has_sessions_and_groups():
    a, b = synthetic(SyntheticConfig(seed=5)), synthetic(SyntheticConfig(seed=5))
    assert a.requests == b.requests and a.requests != synthetic(SyntheticConfig(seed=6)).requests
    follow = [r for r in a.requests if r.turn > 0]
    assert follow and any(r.group >= 0 for r in a.requests)
    first = {r.session: r for r in a.requests if r.turn == 0}
    r = follow[0]
    assert r.hash_ids[: len(first[r.session].hash_ids)] == first[r.session].hash_ids  # repeats its history
    assert Workload.token_ids(r)[:512] == Workload.token_ids(first[r.session])[:512]


def test_compare_expands_and_parallel_runs_match_serial(pressure):
    configs = expand(TIGHT, ["layout=paged,padded", "preemption=swap,recompute"])
    assert [(c.layout, c.preemption) for c in configs] == [
        ("paged", "swap"), ("paged", "recompute"), ("padded", "swap"), ("padded", "recompute")
    ]  # fmt: skip
    small = Workload(pressure.requests[:12], pressure.source)
    two = configs[:2]
    assert run_all(two, small, workers=2) == run_all(two, small, workers=1)
    with pytest.raises(ValueError, match="unknown key"):
        expand(TIGHT, ["colour=red"])


def test_ray_runs_the_same_configs(pressure):
    pytest.importorskip("ray")
    small = Workload(pressure.requests[:8], pressure.source)
    configs = expand(TIGHT, ["layout=paged,padded"])
    assert run_all(configs, small, ray_address="local") == run_all(configs, small, workers=1)


def test_reports_hold_the_comparison(tmp_path, pressure):
    small = Workload(pressure.requests[:10], pressure.source)
    summaries = run_all(expand(TIGHT, ["preemption=swap,recompute"]), small, workers=1)
    paths = write_reports(summaries, tmp_path)
    doc = json.loads(paths[0].read_text())
    assert [c["label"] for c in doc["configs"]] == [s["label"] for s in summaries]
    md = paths[1].read_text()
    assert "| preemptions recompute / swap |" in md and summaries[1]["label"] in md
    page = paths[2].read_text()
    preempted = any(s["totals"]["preemptions_recompute"] + s["totals"]["preemptions_swap"] for s in summaries)
    assert page.count("data:image/png;base64,") == (5 if preempted else 4)  # no flat-zero preemption plot
    assert ("No configuration preempted a request" in page) is not preempted
    assert "http" not in page.replace("http-equiv", "")


def test_speculation_and_prefix_caching_show_in_the_report():
    # 16 requests that all start with one 2,048-token group prefix, arriving 1/s
    one_group = SyntheticConfig(
        num_requests=16, rate=1.0, prompt_median=3000, output_median=32, num_prefix_groups=1, prefix_share=1.0, seed=2
    )
    small = synthetic(one_group)
    spec, none = run_all(expand(TIGHT, ["speculative=2", "prefix=flop_aware,none"]), small, workers=1)
    assert max(spec["series"]["state_speculative"]) > 0 and spec["totals"]["finished"] == 16
    assert spec["totals"]["prefix_hit_tokens"] > 0 and none["totals"]["prefix_hit_tokens"] == 0
    assert max(none["series"]["kv_cached"]) == max(none["series"]["checkpoints"]) == 0
    # drafts accepted at 0.7 finish the same outputs in fewer steps than one token per step
    plain = run_all([TIGHT.with_changes(prefix="none")], small, workers=1)[0]
    assert none["totals"]["output_tokens"] == plain["totals"]["output_tokens"]
    assert none["totals"]["steps"] < plain["totals"]["steps"]


def _simulate_cli(tmp_path, capsys, *flags) -> tuple[int, str]:
    out = tmp_path / "report"
    code = main(["simulate", *flags, "--gpu-memory", "2GiB", "--out", str(out), "--no-progress"])
    assert not out.exists(), "refused before any work: no report"
    return code, capsys.readouterr().err.strip()


def test_simulate_refuses_an_empty_trace_or_window_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _simulate_cli(tmp_path, capsys, "--trace", str(empty))
    assert code == 2 and err.count("\n") == 0 and "empty.jsonl: the trace holds no request" in err
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 1000 * i, "input_length": 100, "output_length": 4, "hash_ids": [i]} for i in range(3)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, err = _simulate_cli(tmp_path, capsys, "--trace", str(trace), "--trace-start", "5", "--trace-end", "1")
    assert code == 2 and err == (
        "hybridkv: error: --trace-end 1 must be after --trace-start 5: the window [start, end) of trace time "
        "would hold no request"
    )
    code, err = _simulate_cli(tmp_path, capsys, "--trace", str(trace), "--trace-start", "5")
    assert code == 2 and err.count("\n") == 0 and "no request of the trace arrives in the window" in err
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(trace), "--trace-start", "nan", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "--trace-start" in capsys.readouterr().err


@pytest.mark.parametrize("value", [10.7, True, 10.0])
def test_simulate_refuses_trace_lengths_that_are_not_integers(tmp_path, capsys, value):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": value, "output_length": 4, "hash_ids": [1]}) + "\n")
    code, err = _simulate_cli(tmp_path, capsys, "--trace", str(trace))
    assert code == 2 and err.count("\n") == 0
    assert f"t.jsonl:1: input_length must be an integer, got {json.dumps(value)}" in err


def test_simulator_refuses_an_empty_workload_before_any_work():
    empty = Workload([], {"kind": "trace", "path": "none.jsonl"})
    with pytest.raises(ValueError, match=r"workload \(none\.jsonl\) holds no request"):
        simulate(SimConfig(gpu_memory="2GiB"), empty)
    with pytest.raises(ValueError, match="holds no request"):
        run_all([SimConfig(gpu_memory="2GiB")], empty, workers=1)
    with pytest.raises(TypeError, match="needs a Workload"):
        simulate(SimConfig(gpu_memory="2GiB"), [])

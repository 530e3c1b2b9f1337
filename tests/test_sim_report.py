"""What memory pressure cost, as the report says it: swap seconds and recomputed tokens priced by the
cost model, request-seconds by two independent counts, the memory / compute / arrivals verdict, the
summary in words, the definitions, and plots that can be compared (shared axes in bytes, capacity
drawn, legends outside, integer count axes, distinct styles, linear capacity bars)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import hybridkv.sim.simulator as simulator_module
from hybridkv.models.flops import prefill_flops
from hybridkv.scheduler_adapter.cost import PreemptionMode
from hybridkv.sim.compare import expand, run_all
from hybridkv.sim.config import SimConfig
from hybridkv.sim.report import comparison_table, definitions, markdown, narrative, pressure_table, summarize
from hybridkv.sim.simulator import simulate
from hybridkv.sim.workload import SyntheticConfig, Workload, synthetic
from tests.test_sim import PRESSURE, TIGHT


@pytest.fixture(scope="module")
def pressure_workload() -> Workload:
    return synthetic(PRESSURE)


def _recording_build(record: dict):
    """simulator.build, with the preemptor and the plans watched: for every recompute victim the
    tokens it had computed when preempted, and what its later rows computed again below that."""
    real_build = simulator_module.build

    def build(cfg):
        built = real_build(cfg)
        sched, model = built.scheduler, built.layout.model
        pending: dict[str, int] = {}
        preempt, step = sched.preemptor.preempt, sched.step

        def watched_preempt(req, allow_swap=True, **kwargs):
            before = req.num_computed_tokens
            mode, plan = preempt(req, allow_swap, **kwargs)
            if mode is PreemptionMode.RECOMPUTE:
                pending[req.request_id] = max(pending.get(req.request_id, 0), before)
                record["victims"] += 1
            return mode, plan

        def watched_step():
            plan = step()
            for row in plan.scheduled:
                lost = pending.get(row.request_id)
                if lost is None:
                    continue
                start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
                if min(end, lost) > start:
                    record["tokens"] += min(end, lost) - start
                    record["flops"] += prefill_flops(model, min(end, lost), start)
                if end >= lost:
                    del pending[row.request_id]
            return plan

        sched.preemptor.preempt, sched.step = watched_preempt, watched_step
        record["gpu"] = built.gpu
        return built

    return build


def test_recompute_costs_the_tokens_preemption_lost_at_the_cost_models_rate(pressure_workload, monkeypatch):
    record = {"victims": 0, "tokens": 0, "flops": 0.0}
    monkeypatch.setattr(simulator_module, "build", _recording_build(record))
    raw = simulate(TIGHT.with_changes(preemption="recompute"), pressure_workload)
    p = summarize(raw)["pressure"]
    assert record["victims"] > 0 and record["tokens"] > 0
    assert p["recomputed_tokens"] == record["tokens"] == int(raw["series"]["recomputed_tokens"].sum())
    assert p["recompute_s"] == pytest.approx(record["flops"] / record["gpu"].effective_flops_per_s, rel=1e-5)
    assert p["swap_link_s"] == p["swap_stall_s"] == 0.0 and p["swapped_request_s"] == 0.0
    # request-seconds awaiting recompute: per step (count x step time) and per request (readmission
    # time less preemption time) agree
    per_request = sum(r.get("recompute_wait_s", 0.0) for r in raw["requests"])
    # (the report rounds to 4 decimals)
    assert per_request > 0 and p["recompute_wait_request_s"] == pytest.approx(per_request, rel=1e-3, abs=5e-5)


def test_swap_costs_its_bytes_over_the_host_link(pressure_workload):
    cfg = TIGHT.with_changes(preemption="swap")
    raw = simulate(cfg, pressure_workload)
    s = summarize(raw)
    t, p, link = s["totals"], s["pressure"], s["gpu"]["host_link_bytes_per_s"]
    assert t["preemptions_swap"] > 0 and t["swap_out_bytes"] == t["swap_in_bytes"] > 0
    assert p["swap_link_s"] == pytest.approx((t["swap_out_bytes"] + t["swap_in_bytes"]) / link, rel=1e-5)
    # swap-ins are on the critical path, swap-outs overlap the forward: what the swaps add lies between
    assert t["swap_in_bytes"] / link * (1 - 1e-6) <= p["swap_stall_s"] <= p["swap_link_s"] * (1 + 1e-6)
    assert p["recomputed_tokens"] == 0 and p["recompute_s"] == 0.0
    per_request = sum(r.get("swapped_s", 0.0) for r in raw["requests"])
    assert per_request > 0 and p["swapped_request_s"] == pytest.approx(per_request, rel=1e-3, abs=5e-5)


def _burst(n: int, prompt: int, output: int, rate: float = 1000.0) -> Workload:
    return synthetic(SyntheticConfig(num_requests=n, rate=rate, arrivals="poisson", prompt_median=prompt,
                                     output_median=output, session_share=0.0, seed=1))  # fmt: skip


@pytest.mark.parametrize(
    ("workload", "budget", "bound"),
    [
        # 60 prompts of ~4k tokens at once into 1 GiB: they wait while steps have budget and seats to spare
        (_burst(60, 4000, 300), "1GiB", "memory"),
        # 40 prompts of ~8k tokens at once into 14 GiB: every step's 8,192-token budget is full
        (_burst(40, 8000, 16), "14GiB", "compute"),
        # one short request every 2 s: nothing waits
        (_burst(20, 1000, 64, rate=0.5), "2GiB", "arrivals"),
    ],
    ids=["memory", "compute", "arrivals"],
)
def test_what_bounded_the_run(workload, budget, bound):
    # (a prefill kernel that cannot export: the memory burst was sized for chunks that end at each
    # checkpoint; export sets reserved with the chunks shift its queueing from memory to the batch)
    s = summarize(simulate(SimConfig(gpu_memory=budget, checkpoint_export=0), workload))
    p = s["pressure"]
    assert p["bound"] == bound
    parts = p["memory_held_s"] + p["batch_full_s"] + p["unqueued_s"] + p["idle_s"]
    assert parts == pytest.approx(s["totals"]["sim_time_s"], rel=1e-4)
    assert all(p[k] >= 0 for k in ("memory_held_s", "batch_full_s", "unqueued_s", "idle_s"))
    if bound == "memory":
        assert p["queued_memory_request_s"] > p["queued_batch_request_s"]
    if bound == "arrivals":
        assert p["queued_memory_request_s"] == p["memory_held_s"] == 0.0


@pytest.fixture(scope="module")
def swap_vs_recompute(pressure_workload) -> list[dict]:
    return run_all(expand(TIGHT, ["preemption=swap,recompute"]), pressure_workload, workers=1)


def test_summary_names_what_differs_and_by_which_field(swap_vs_recompute):
    swap, rec = swap_vs_recompute
    assert rec["pressure"]["recomputed_tokens"] > 0 and swap["totals"]["preemptions_swap"] > 0
    lines = narrative(swap_vs_recompute)
    assert lines[0].startswith("Verdict. TTFT p50: ")  # the verdict first
    assert "The 2 configurations differ in preemption (the fields of their configurations that differ)." in lines
    # one differing field: no "preemption moves it most" (there is nothing else it could be)
    want = f"Recomputed tokens: 0 ({swap['label']}) to {rec['pressure']['recomputed_tokens']:,} ({rec['label']})."
    assert want in lines and not any("moves it most" in line for line in lines)
    assert (
        lines[-2].startswith(f"{swap['label']}: ")
        and f"{swap['totals']['preemptions_swap']} swap preemption" in lines[-2]
    )
    assert (
        lines[-1].startswith(f"{rec['label']}: ")
        and f"{rec['totals']['preemptions_recompute']} recompute preemption" in lines[-1]
    )
    one = narrative([rec])
    # alone: its no-effect line (a host pool recompute never uses), then the same paragraph
    assert one[-1] == lines[-1] and one[:-1] == [
        f"No effect in {rec['label']}: host-memory 256GiB: no swap used it (preemption=recompute never swaps)."
    ]


def test_every_figure_and_category_is_defined_once_on_both_pages(swap_vs_recompute, tmp_path):
    md = markdown(swap_vs_recompute, "t")
    assert md.index("## Summary") < md.index("## Comparison") < md.index("## What memory pressure cost")
    names = [r[0] for r in comparison_table(swap_vs_recompute)[1:] + pressure_table(swap_vs_recompute)[1:]]
    defined = [name for name, _ in definitions()]
    assert names == defined and len(set(defined)) == len(defined)
    for name, text in definitions():
        assert md.count(f"- **{name}**: {text}") == 1
    for cat in ("kv_live", "state_live", "state_speculative", "kv_cached", "checkpoints", "pending_free", "free"):
        assert md.count(f"- **{cat}**: ") == 1
    assert "peak blocks held by requests" in names and "peak blocks used" not in names


def test_bytes_have_one_unit_in_tables_and_plots(swap_vs_recompute):
    plots = pytest.importorskip("hybridkv.sim.plots")
    pytest.importorskip("matplotlib")
    swap_row = next(r for r in comparison_table(swap_vs_recompute) if r[0] == "swap out / in")
    unit = swap_row[1].split()[-1]
    assert unit in ("MiB", "GiB") and all(c.endswith(unit) for c in swap_row[1:])
    fig = plots.figure("preemption", swap_vs_recompute)
    assert fig.axes[1].get_ylabel() == f"{unit} (cumulative)"
    mib = swap_vs_recompute[0]["totals"]["swap_out_bytes"] / 2**20
    assert float(swap_row[1].split()[0].replace(",", "")) == pytest.approx(mib, rel=0.01)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plots_can_be_compared(swap_vs_recompute):
    plots = pytest.importorskip("hybridkv.sim.plots")
    pytest.importorskip("matplotlib")
    padded = summarize(simulate(TIGHT.with_changes(layout="padded"), _burst(6, 2000, 32)))
    summaries = [*swap_vs_recompute, padded]
    mem = plots.figure("memory", summaries)
    axes = mem.axes
    assert len(axes) == 3 and len({ax.get_ylim() for ax in axes}) == 1 and len({ax.get_xlim() for ax in axes}) == 1
    unit, scale = plots.byte_unit([plots.pool_bytes(s) for s in summaries])
    for ax, s in zip(axes, summaries, strict=True):
        assert ax.get_ylabel() == f"device memory ({unit})"
        caps = [ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_label() == "pool capacity"]
        lay = s["layout"]
        assert caps == [pytest.approx((lay["num_blocks"] - 1) * lay["bytes_per_block"] / scale)]
    # paged and padded hold different block sizes: one scale of bytes, not of blocks
    assert swap_vs_recompute[0]["layout"]["bytes_per_block"] != padded["layout"]["bytes_per_block"]
    labels = {t.get_text() for leg in mem.legends for t in leg.get_texts()}
    assert {"pool capacity", "preempted by recompute", "preempted by swap (swap-out)", "swapped in (resumed)"} <= labels
    for plot_id, _ in plots.PLOTS:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = plots.figure(plot_id, summaries)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        r = canvas.get_renderer()
        assert fig.patch.get_linewidth() == 0  # no coloured frame
        assert fig.legends, plot_id
        for leg in fig.legends:
            for ax in fig.axes:
                assert not _overlaps(leg.get_window_extent(r), ax.get_window_extent(r)), plot_id
    times = {plots.figure(p, summaries).axes[0].get_xlim() for p in ("memory", "preemption", "queues")}
    assert times == {(0.0, plots.t_max(summaries))}


def test_count_axes_are_integers_from_zero_and_flat_zero_panels_are_left_out():
    plots = pytest.importorskip("hybridkv.sim.plots")
    pytest.importorskip("matplotlib")
    quiet = summarize(simulate(SimConfig(gpu_memory="2GiB"), _burst(4, 1000, 16)))
    assert quiet["totals"]["preemptions_recompute"] == quiet["totals"]["preemptions_swap"] == 0
    # nothing preempted or swapped anywhere: no flat-zero panel, one line saying what did not happen
    assert plots.figure("preemption", [quiet]) is None
    assert plots.flat_lines([quiet])[0].startswith("No configuration preempted a request")
    queues = plots.figure("queues", [quiet])
    assert [ax.get_title() for ax in queues.axes if ax.get_visible()] == ["running"]  # nothing ever waited
    for ax in [ax for ax in queues.axes if ax.get_visible()]:
        assert ax.get_ylabel() == "requests" and ax.get_ylim()[0] == 0
        assert all(float(t).is_integer() for t in ax.get_yticks())


def test_twelve_configurations_get_twelve_styles_and_capacity_bars_carry_values():
    plots = pytest.importorskip("hybridkv.sim.plots")
    pytest.importorskip("matplotlib")
    styles = [tuple(sorted(plots.config_style(i).items())) for i in range(100)]
    assert len(set(styles)) == 100
    assert len({plots.config_style(i)["color"] for i in range(10)}) == 10
    assert len({plots.config_style(i)["marker"] for i in range(10)}) == 10
    one = summarize(simulate(SimConfig(gpu_memory="2GiB"), _burst(4, 1000, 16)))
    many = []
    for i in range(12):
        s = copy.deepcopy(one)
        s["label"] = f"config {i}"
        many.append(s)
    lines = [ln for ln in plots.figure("queues", many).axes[0].get_lines()]
    assert len({(ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in lines}) == 12
    cap = plots.figure("capacity", [one]).axes[0]
    assert cap.get_yscale() == "linear"
    printed = sorted(int(t.get_text().replace(",", "")) for t in cap.texts)
    assert printed == sorted([*one["capacity"]["paged"], *one["capacity"]["padded"]])
    assert np.all(np.asarray(one["capacity"]["paged"]) >= np.asarray(one["capacity"]["padded"]))

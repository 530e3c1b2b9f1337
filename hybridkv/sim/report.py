"""Memory-pressure reports: ``report.json`` (machines), ``report.md`` (reviews), ``report.html``.

:func:`summarize` turns one raw simulation result into a JSON-safe, deterministic summary (no wall
time, floats rounded); :func:`write_reports` writes the three files for one or more summaries (a
``--compare`` run). The HTML page is self-contained: plots are PNGs embedded as base64
(:mod:`hybridkv.sim.plots`), no scripts, no external links, so it opens offline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.models.spec_file import resolve_model
from hybridkv.planner.layout import LayoutKind, plan
from hybridkv.sim.plots import BLOCK_CATEGORIES, CATEGORY_DEFINITIONS, byte_unit, pool_bytes, render_html
from hybridkv.sim.verdict import engine_differences, no_effect, resolved_rows, verdict
from hybridkv.units import format_bytes, parse_bytes

MAX_POINTS = 600  # time-series points per configuration in the report
CAPACITY_CONTEXTS = (1500, 3000, 6000, 12000, 24000, 48000, 96000)  # not multiples of padded blocks
_STOCKS = (*BLOCK_CATEGORIES, "host_used", "host_cached", "waiting", "running", "swapped", "recompute_waiting")
_FLOWS = ("preempt_recompute", "preempt_swap", "resumed", "swap_out_blocks", "swap_in_blocks", "copy_blocks",
          "tier_offload_blocks", "tier_onload_blocks", "batched_tokens", "recomputed_tokens")  # fmt: skip
_SECONDS = ("dt_s", "swap_link_s", "tier_link_s", "swap_stall_s", "recompute_s", "memory_held_s", "batch_full_s")


def _r(x: float, digits: int = 6) -> float:
    return float(round(float(x), digits))


def _stats(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, (50, 90, 99))
    return {
        "count": int(a.size),
        "mean": _r(a.mean()),
        "p50": _r(p50),
        "p90": _r(p90),
        "p99": _r(p99),
        "max": _r(a.max()),
    }


def _downsample(series: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """At most MAX_POINTS points: stocks at each bucket's end, flows summed over the bucket."""
    n = int(series["t_s"].size)
    if n == 0:
        return {k: [] for k in ("t_s", *_STOCKS, *_FLOWS, *_SECONDS)}
    edges = np.unique(np.linspace(0, n, min(n, MAX_POINTS) + 1).astype(np.int64))
    ends = edges[1:] - 1
    out: dict[str, list[float]] = {"t_s": [_r(v, 4) for v in series["t_s"][ends]]}
    for k in _STOCKS:
        out[k] = [int(v) for v in series[k][ends]]
    for k in _FLOWS:
        sums = np.add.reduceat(series[k], edges[:-1])
        out[k] = [int(v) for v in sums]
    for k in _SECONDS:
        out[k] = [_r(v) for v in np.add.reduceat(np.asarray(series[k], dtype=np.float64), edges[:-1])]
    return out


def pressure(raw: dict[str, Any]) -> dict[str, Any]:
    """What memory pressure cost in one raw result (simulated seconds; see the simulator's docstring).

    ``bound``: ``memory`` when memory-held time is the largest of memory-held, batch-full and
    unqueued (busy, nothing waiting) time plus idle gaps; ``compute`` when batch-full time is;
    ``arrivals`` otherwise (the engine kept up: no request waited most of the time)."""
    s, gaps = raw["series"], raw.get("gaps", {})
    busy = float(s["dt_s"].sum())
    held = float(s["memory_held_s"].sum()) + gaps.get("memory_held_s", 0.0)
    full = float(s["batch_full_s"].sum())
    unqueued = busy - float(s["memory_held_s"].sum()) - full
    idle = gaps.get("idle_s", 0.0)
    shares = {"memory": held, "compute": full, "arrivals": unqueued + idle}
    bound = max(shares, key=lambda k: (shares[k], k == "memory"))
    total = raw["sim_time_s"] or 1.0
    return {
        "bound": bound,
        "memory_held_s": _r(held, 4),
        "batch_full_s": _r(full, 4),
        "unqueued_s": _r(unqueued, 4),
        "idle_s": _r(idle, 4),
        "memory_held_fraction": _r(held / total, 4),
        "batch_full_fraction": _r(full / total, 4),
        "hbm_bound_forward_s": _r(float(s["hbm_bound_s"].sum()), 4),
        "swap_link_s": _r(float(s["swap_link_s"].sum()), 9),
        "host_tier_link_s": _r(float(s["tier_link_s"].sum()), 9),
        "swap_stall_s": _r(float(s["swap_stall_s"].sum()), 9),
        "recomputed_tokens": int(s["recomputed_tokens"].sum()),
        "recompute_s": _r(float(s["recompute_s"].sum()), 9),
        "swapped_request_s": _r(float(s["swapped_rs"].sum()), 4),
        "recompute_wait_request_s": _r(float(s["recompute_wait_rs"].sum()), 4),
        "queued_memory_request_s": _r(float(s["queued_memory_rs"].sum()) + gaps.get("queued_memory_rs", 0.0), 4),
        "queued_batch_request_s": _r(float(s["queued_batch_rs"].sum()), 4),
    }


def capacity_table(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """Max concurrent requests per context length, paged vs padded, on the config's budget (the
    other layout at its own default block size: vLLM's 512-token blocks are not paged's)."""
    model = resolve_model(cfg["model"], cfg["state_dtype"], cfg["tp"])
    budget = parse_bytes(cfg["gpu_memory"])
    out: dict[str, list[int]] = {"context_tokens": list(CAPACITY_CONTEXTS)}
    for kind in (LayoutKind.PAGED, LayoutKind.PADDED):  # the config's block size for its own layout only
        layout = plan(model, budget, cfg["block_size"] if cfg["layout"] == kind.value else None, kind)
        out[kind.value] = [layout.capacity(c).max_requests for c in CAPACITY_CONTEXTS]
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """A JSON-safe summary of one :func:`~hybridkv.sim.simulator.simulate` result."""
    s, reqs, layout = raw["series"], raw["requests"], raw["layout"]
    bpb = layout["bytes_per_block"]
    done = [r for r in reqs if r["status"] == "finished"]
    rejected = [r for r in reqs if r["status"] == "rejected"]
    sim_time = raw["sim_time_s"]
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    cached = sum(r["cached_tokens"] for r in reqs)
    out_tokens = sum(r["outputs"] for r in done)
    used = s["kv_live"] + s["state_live"] + s["state_speculative"]
    usable = layout["num_blocks"] - 1
    not_free = usable - s["free"]
    totals = raw["executor_totals"]
    summary = {
        "label": raw["config"]["label"],
        "config": raw["config"],
        "resolved": raw.get("resolved", {}),
        "gpu": {k: (_r(v) if isinstance(v, float) else v) for k, v in raw["gpu"].items()},
        "layout": layout,
        "workload": raw["workload"],
        "totals": {
            "requests": len(reqs),
            "finished": len(done),
            "rejected": len(rejected),
            "steps": raw["num_steps"],
            "sim_time_s": _r(sim_time, 4),
            "output_tokens": out_tokens,
            "output_tokens_per_s": _r(out_tokens / sim_time if sim_time else 0.0, 2),
            "requests_per_s": _r(len(done) / sim_time if sim_time else 0.0, 4),
            "prompt_tokens": prompt_tokens,
            "prefix_hit_tokens": cached,
            "prefix_hit_rate": _r(cached / prompt_tokens if prompt_tokens else 0.0),
            "preemptions_recompute": int(s["preempt_recompute"].sum()),
            "preemptions_swap": int(s["preempt_swap"].sum()),
            "scheduled_tokens": int(s["batched_tokens"].sum()),
            "swap_out_bytes": totals["swap_out_blocks"] * bpb,
            "swap_in_bytes": totals["swap_in_blocks"] * bpb,
            "copy_bytes": (totals["copy_blocks"] + totals["checkpoint_copy_blocks"]) * bpb,
            # the prefix cache's host tier (--host-cache): its copies, priced on the host link with the swaps
            "host_tier_offload_bytes": totals.get("tier_offload_blocks", 0) * bpb,
            "host_tier_onload_bytes": totals.get("tier_onload_blocks", 0) * bpb,
            "host_hit_tokens": int(raw.get("host_hit_tokens", 0)),
            "host_tier_link_s": _r(float(s["tier_link_s"].sum()), 9),  # both directions, at the host-link rate
            "peak_host_tier_bytes": int(s["host_cached"].max(initial=0)) * bpb,
            "peak_running": int(s["running"].max(initial=0)),
            "peak_waiting": int(s["waiting"].max(initial=0)),
            "peak_swapped": int(s["swapped"].max(initial=0)),
            "peak_used_blocks": int(used.max(initial=0)),
            "peak_used_fraction": _r(used.max(initial=0) / usable),
            "peak_not_free_blocks": int(not_free.max(initial=0)),
            "peak_not_free_fraction": _r(not_free.max(initial=0) / usable),
            "pool_bytes": usable * bpb,
            "peak_host_bytes": int(s["host_used"].max(initial=0)) * bpb,
            "integrity_checks": raw["integrity_checks"],
            "stalled": raw["stalled"],
        },
        "latency_s": {
            "ttft": _stats([r["ttft_s"] for r in done if "ttft_s" in r]),
            "tpot": _stats([r["tpot_s"] for r in done if "tpot_s" in r]),
            "e2e": _stats([r["e2e_s"] for r in done if "e2e_s" in r]),
            "queued": _stats([r["queued_s"] for r in done if "queued_s" in r]),
        },
        "pressure": pressure(raw),
        "distributions": {
            "ttft_s": sorted(_r(r["ttft_s"]) for r in done if "ttft_s" in r),
            "tpot_s": sorted(_r(r["tpot_s"]) for r in done if "tpot_s" in r),
        },
        "rejected": [{"id": r["id"], "reason": r["reason"]} for r in rejected],
        "capacity": capacity_table(raw["config"]),
        "series": _downsample(s),
    }
    return summary


def write_reports(summaries: list[dict[str, Any]], out_dir: str | Path, title: str = "hybridkv simulate") -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` for one or more summaries."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"title": title, "configs": summaries}
    paths = [out / "report.json", out / "report.md", out / "report.html"]
    paths[0].write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    paths[1].write_text(markdown(summaries, title))
    page = render_html(
        summaries,
        title,
        comparison_table(summaries),
        narrative(summaries),
        pressure_table(summaries),
        definitions(),
        resolved_rows(summaries),
    )
    paths[2].write_text(page)
    return paths


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _in(value: float, unit: tuple[str, int]) -> str:
    v = value / unit[1]
    return f"{v:,.1f}" if v >= 10 or v == 0 else f"{v:,.3g}"


# (name, cell, definition) of the comparison table; a cell gets the summary and the report's units
Cell = Callable[[dict[str, Any], dict[str, tuple[str, int]]], str]
_TABLE: tuple[tuple[str, Cell, str], ...] = (
    ("finished / rejected", lambda s, u: f"{s['totals']['finished']} / {s['totals']['rejected']}",
     "requests that produced all their output tokens / refused at submission (they can never fit)"),
    ("simulated time", lambda s, u: f"{s['totals']['sim_time_s']:.1f} s",
     "the simulated clock at the last step: cost-model seconds of the GPU, not wall time"),
    ("output tokens / s", lambda s, u: f"{s['totals']['output_tokens_per_s']:,.0f}",
     "output tokens of finished requests over the simulated time"),
    ("TTFT p50 / p99", lambda s, u: _pair(s["latency_s"]["ttft"]),
     "arrival to the end of the step that sampled the first output token"),
    ("TPOT p50 / p99", lambda s, u: _pair(s["latency_s"]["tpot"], 1e3, "ms"),
     "first to last output token over the output tokens after the first"),
    ("queued p50 / p99", lambda s, u: _pair(s["latency_s"].get("queued", {})),
     "arrival to first admission (the waiting queue and the backlog; finished requests)"),
    ("peak running / waiting", lambda s, u: f"{s['totals']['peak_running']} / {s['totals']['peak_waiting']}",
     "most requests running / waiting (backlog included) at a step's end"),
    ("peak blocks held by requests", lambda s, u: _held(s, u, "peak_used_fraction", "peak_used_blocks"),
     "largest kv_live + state_live + state_speculative at a step's end, over the usable pool (all blocks but "
     "the null block); the report.json key is peak_used_fraction"),
    ("peak blocks not free", lambda s, u: _held(s, u, "peak_not_free_fraction", "peak_not_free_blocks"),
     "largest usable pool less free blocks: also counts kv_cached, checkpoints and pending_free, which an "
     "allocation can still take or soon gets back"),
    ("preemptions recompute / swap",
     lambda s, u: f"{s['totals']['preemptions_recompute']} / {s['totals']['preemptions_swap']}",
     "victims the scheduler freed to recompute later / copied to the host pool"),
    ("scheduled tokens", lambda s, u: f"{s['totals'].get('scheduled_tokens', 0):,}",
     "tokens all forwards computed (prefill chunks, decodes, recomputes; drafts not counted)"),
    ("swap out / in", lambda s, u: f"{_in(s['totals']['swap_out_bytes'], u['swap'])} / "
     f"{_in(s['totals']['swap_in_bytes'], u['swap'])} {u['swap'][0]}",
     "bytes copied device -> host / host -> device by swaps (blocks x bytes per block)"),
    ("prefix hit rate", lambda s, u: _pct(s["totals"]["prefix_hit_rate"]),
     "prompt tokens served from the prefix cache, summed over admissions, over finished requests' prompt tokens"),
    ("host tier out / in (link)", lambda s, u: f"{_in(s['totals'].get('host_tier_offload_bytes', 0), u['swap'])} / "
     f"{_in(s['totals'].get('host_tier_onload_bytes', 0), u['swap'])} {u['swap'][0]} "
     f"({s['totals'].get('host_tier_link_s', 0.0):.3g} s)",
     "bytes the prefix cache's host tier (--host-cache) copied device -> host (evicted cached blocks) / host -> "
     "device (host hits), and the seconds they kept the host link busy (both directions, at the GPU's "
     "host-link rate; host hits' copies run before the forward, offloads overlap it, as swaps)"),
    ("steps", lambda s, u: f"{s['totals']['steps']:,}", "scheduler steps (forwards) the run took"),
)  # fmt: skip


def _held(s: dict[str, Any], u: dict[str, tuple[str, int]], fraction: str, blocks: str) -> str:
    t = s["totals"]
    return f"{_pct(t[fraction])} ({_in(t[blocks] * s['layout']['bytes_per_block'], u['memory'])} {u['memory'][0]})"


_PRESSURE: tuple[tuple[str, Cell, str], ...] = (
    ("bounded by", lambda s, u: _bound(s["pressure"]),
     "memory when memory-held steps took the most simulated time, compute when batch-full steps did, arrivals "
     "when most of the time no request waited (the share of simulated time in brackets)"),
    ("memory-held / batch-full / nothing waiting",
     lambda s, u: " / ".join(_pct(_share(s, k)) for k in ("memory_held_s", "batch_full_s", "unqueued_s")),
     "shares of simulated time: steps in which requests waited (queue, backlog or swapped) while the token "
     "budget and max-num-seqs had room, or that preempted (only the pool held them back) / steps in which "
     "requests waited with the token budget or max-num-seqs full / busy steps with nothing waiting; the rest "
     "is idle, nothing in flight"),
    ("swap time on the host link / added to steps",
     lambda s, u: f"{s['pressure']['swap_link_s']:.3g} / {s['pressure']['swap_stall_s']:.3g} s",
     "seconds the host link carried swap bytes (both directions; the host tier's are in the host tier row) / "
     "what the link's copies, swaps and the host tier's, added to step times: swap-ins and host hits' copies, "
     "and swap-outs and offloads past the forward they overlap"),
    ("recomputed tokens (compute)",
     lambda s, u: f"{s['pressure']['recomputed_tokens']:,} ({s['pressure']['recompute_s']:.3g} s)",
     "tokens computed a second time after recompute preemptions (prefix-cache hits not counted), and their FLOPs "
     "at the GPU's effective FLOP rate, the price preemption auto compares with a swap"),
    ("request-s swapped / awaiting recompute",
     lambda s, u: f"{s['pressure']['swapped_request_s']:,.1f} / {s['pressure']['recompute_wait_request_s']:,.1f}",
     "summed over requests: simulated seconds spent swapped out / preempted by recompute and not readmitted"),
    ("request-s queued for memory / batch",
     lambda s, u: f"{s['pressure']['queued_memory_request_s']:,.1f} / {s['pressure']['queued_batch_request_s']:,.1f}",
     "summed over requests never admitted yet: simulated seconds in the waiting queue during memory-held steps "
     "/ during the other steps"),
    ("forward HBM-bound", lambda s, u: _pct(s["pressure"]["hbm_bound_forward_s"] / (s["totals"]["sim_time_s"] or 1)),
     "share of simulated time in forwards whose HBM bytes, not FLOPs, set the roofline time"),
)  # fmt: skip


def _share(s: dict[str, Any], key: str) -> float:
    return s["pressure"][key] / (s["totals"]["sim_time_s"] or 1.0)


def _bound(p: dict[str, Any]) -> str:
    total = p["memory_held_s"] + p["batch_full_s"] + p["unqueued_s"] + p["idle_s"] or 1.0
    part = {"memory": p["memory_held_s"], "compute": p["batch_full_s"], "arrivals": p["unqueued_s"] + p["idle_s"]}
    return f"{p['bound']} ({_pct(part[p['bound']] / total)})"


def units(summaries: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """The report's byte units: ``memory`` from the largest pool, ``swap`` from the largest swap-out
    (GiB from 1 GiB up, else MiB); the plots use the same (:func:`~hybridkv.sim.plots.byte_unit`)."""
    return {
        "memory": byte_unit([pool_bytes(s) for s in summaries]),
        "swap": byte_unit([s["totals"]["swap_out_bytes"] for s in summaries]),
    }


def _pair(st: dict[str, Any], scale: float = 1.0, unit: str = "s") -> str:
    if not st.get("count"):
        return "-"
    return f"{st['p50'] * scale:.3g} / {st['p99'] * scale:.3g} {unit}"


def _rows(summaries: list[dict[str, Any]], table: tuple[tuple[str, Cell, str], ...]) -> list[list[str]]:
    u = units(summaries)
    rows = [["", *[s["label"] for s in summaries]]]
    for name, fn, _ in table:
        rows.append([name, *[fn(s, u) for s in summaries]])
    return rows


def comparison_table(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the comparison table: a header of labels, then one row per metric."""
    return _rows(summaries, _TABLE)


def pressure_table(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the pressure-cost table: a header of labels, then one row per cost figure."""
    return _rows(summaries, _PRESSURE)


def definitions() -> list[tuple[str, str]]:
    """One line per figure of the two tables: (name, what it counts)."""
    return [(name, text) for name, _, text in (*_TABLE, *_PRESSURE)]


# metrics the comparison summary looks at: (name, value, format of a value and of a difference)
_METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float], Callable[[float], str]], ...] = (
    ("simulated time", lambda s: s["totals"]["sim_time_s"], lambda v: f"{v:,.1f} s"),
    ("output tokens / s", lambda s: s["totals"]["output_tokens_per_s"], lambda v: f"{v:,.0f}"),
    ("TTFT p50", lambda s: s["latency_s"]["ttft"].get("p50", 0.0), lambda v: f"{v:.3g} s"),
    ("TPOT p50", lambda s: s["latency_s"]["tpot"].get("p50", 0.0) * 1e3, lambda v: f"{v:.3g} ms"),
    ("preemptions", lambda s: s["totals"]["preemptions_recompute"] + s["totals"]["preemptions_swap"],
     lambda v: f"{v:,.0f}"),
    ("request-s queued for memory", lambda s: s["pressure"]["queued_memory_request_s"], lambda v: f"{v:,.1f}"),
    ("recomputed tokens", lambda s: s["pressure"]["recomputed_tokens"], lambda v: f"{v:,.0f}"),
    ("swap out", lambda s: s["totals"]["swap_out_bytes"] / 2**20, lambda v: f"{v:,.1f} MiB"),
    ("peak running", lambda s: s["totals"]["peak_running"], lambda v: f"{v:,.0f}"),
    ("prefix hit rate", lambda s: 100 * s["totals"]["prefix_hit_rate"], lambda v: f"{v:.1f}%"),
)  # fmt: skip
_POINTS = {"prefix hit rate"}  # differences of a percentage are percentage points


def _points(v: float) -> str:
    return f"{v:.1f} percentage points"


def _n(count: int, thing: str) -> str:
    return f"{count:,} {thing}" + ("" if count == 1 else "s")


def _one_line(s: dict[str, Any], u: dict[str, tuple[str, int]]) -> str:
    p, t = s["pressure"], s["totals"]
    what = {
        "memory": "memory limited it: for {0} of the simulated time requests waited while the step had token "
        "budget and seats to spare (the pool held them back)",
        "compute": "compute limited it: for {1} of the simulated time requests waited behind full batches "
        "(token budget or max-num-seqs), memory held them for {0}",
        "arrivals": "the engine kept up with arrivals: no request waited most of the time (memory held requests "
        "back for {0} of the simulated time, full batches for {1})",
    }[p["bound"]].format(_pct(_share(s, "memory_held_s")), _pct(_share(s, "batch_full_s")))
    cost = []
    if t["preemptions_swap"]:
        cost.append(f"{_n(t['preemptions_swap'], 'swap preemption')} moved {_in(t['swap_out_bytes'], u['swap'])} "
                    f"{u['swap'][0]} out, {p['swap_link_s']:.3g} s on the host link ({p['swap_stall_s']:.3g} s added "
                    "to steps)")  # fmt: skip
    if t["preemptions_recompute"]:
        cost.append(f"{_n(t['preemptions_recompute'], 'recompute preemption')} recomputed {p['recomputed_tokens']:,} "
                    f"tokens ({p['recompute_s']:.3g} s of compute)")  # fmt: skip
    if not cost:
        cost.append("Nothing was preempted")
    if t.get("host_tier_offload_bytes", 0) or t.get("host_tier_onload_bytes", 0):
        cost.append(f"the host tier served {t['host_hit_tokens']:,} prompt tokens, moving "
                    f"{_in(t['host_tier_offload_bytes'], u['swap'])} {u['swap'][0]} out and "
                    f"{_in(t['host_tier_onload_bytes'], u['swap'])} {u['swap'][0]} back, "
                    f"{t['host_tier_link_s']:.3g} s on the host link")  # fmt: skip
    said = "; ".join(cost)
    return (
        f"{s['label']}: {what}. {said[0].upper()}{said[1:]}. Requests spent "
        f"{p['queued_memory_request_s']:,.1f} request-s queued for memory, "
        f"{p['swapped_request_s']:,.1f} swapped out and {p['recompute_wait_request_s']:,.1f} awaiting recompute; "
        f"the pool's blocks held by requests peaked at {_pct(t['peak_used_fraction'])}."
    )


def _differing_fields(summaries: list[dict[str, Any]]) -> list[str]:
    keys = [k for k in summaries[0]["config"] if k != "label"]
    return [k for k in keys if len({json.dumps(s["config"][k]) for s in summaries}) > 1]


def _attribution(values: list[float], summaries: list[dict[str, Any]], fields: list[str]) -> list[tuple[str, float]]:
    """How much each differing field moves a metric: the mean absolute change between configurations
    that differ in that field only, largest first (empty when no two differ in one field only)."""
    effects: dict[str, list[float]] = {}
    for i in range(len(summaries)):
        for j in range(i + 1, len(summaries)):
            diff = [f for f in fields if summaries[i]["config"][f] != summaries[j]["config"][f]]
            if len(diff) == 1:
                effects.setdefault(diff[0], []).append(abs(values[i] - values[j]))
    mean = [(f, sum(v) / len(v)) for f, v in effects.items()]
    return sorted(mean, key=lambda fv: -fv[1])


def narrative(summaries: list[dict[str, Any]]) -> list[str]:
    """The summary in words at the top of report.md and report.html, one paragraph per item: the
    verdict, what hybridkv's engine does unlike vLLM's and the settings that had no effect
    (:mod:`hybridkv.sim.verdict`); for a comparison then the configuration fields that differ, then
    each metric that differs by more than 1% (at most four, largest relative spread first) with the
    field that moves it most (when more than one field differs); then, per configuration, what
    limited the run and what pressure cost."""
    u = units(summaries)
    lines = [_one_line(s, u) for s in summaries]
    notes = list(dict.fromkeys(n for s in summaries for n in s.get("notes", [])))
    first = verdict(summaries) + engine_differences(summaries) + no_effect(summaries) + notes
    if len(summaries) < 2 or engine_differences(summaries):  # (the engine comparison said what differs)
        return first + lines
    fields = _differing_fields(summaries)
    head = [
        f"The {len(summaries)} configurations differ in {', '.join(fields)} (the fields of their configurations "
        "that differ)."
        if fields
        else f"The {len(summaries)} configurations have the same settings."
    ]
    diffs = []
    for name, value, fmt in _METRICS:
        vals = [float(value(s)) for s in summaries]
        lo, hi = min(vals), max(vals)
        spread = (hi - lo) / max(abs(hi), abs(lo), 1e-12)
        if spread > 0.01:
            diffs.append((spread, name, vals, fmt))
    diffs.sort(key=lambda d: -d[0])
    if not diffs:
        head.append("Their headline metrics agree within 1%: " + ", ".join(n for n, _, _ in _METRICS) + ".")
    for _, name, vals, fmt in diffs[:4]:
        lo, hi = vals.index(min(vals)), vals.index(max(vals))
        text = (
            f"{name[0].upper()}{name[1:]}: {fmt(vals[lo])} ({summaries[lo]['label']}) to {fmt(vals[hi])} "
            f"({summaries[hi]['label']})"
        )
        effects = [(f, e) for f, e in _attribution(vals, summaries, fields) if e > 0 and len(fields) > 1]
        by = _points if name in _POINTS else fmt
        if effects:
            f, e = effects[0]
            text += f"; {f} moves it most: by {by(e)} on average between runs that differ only in {f}"
            if len(effects) > 1:
                text += " (" + ", ".join(f"{g}: {by(x)}" for g, x in effects[1:3]) + ")"
        head.append(text + ".")
    return first + head + lines


def _md_table(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return out + ["| " + " | ".join(r) + " |" for r in rows[1:]]


def markdown(summaries: list[dict[str, Any]], title: str) -> str:
    first = summaries[0]
    w, c, lay = first["workload"], first["config"], first["layout"]
    lines = [f"# {title}", "", "## Summary", ""]
    for p in narrative(summaries):
        lines += [p, ""]
    lines += [
        f"Workload: {w['kind']}, {w['num_requests']:,} requests over {w['arrival_span_s']:.1f} s, "
        f"mean prompt {w['mean_prompt_tokens']:,.0f} tokens, mean output {w['mean_output_tokens']:,.0f} tokens.",
        f"Model {c['model']} TP{c['tp']}, GPU {first['gpu']['name']}, cache budget {c['gpu_memory']} per GPU "
        f"({lay['num_blocks']:,} blocks of {format_bytes(lay['bytes_per_block'])} in the first configuration).",
        "",
        "## Comparison",
        "",
    ]
    lines += _md_table(comparison_table(summaries))
    lines += ["", "## What memory pressure cost", ""]
    lines += _md_table(pressure_table(summaries))
    lines += ["", "## Definitions", ""]
    lines += [f"- **{name}**: {text}" for name, text in definitions()]
    lines += ["", "Memory categories (device blocks; they add up to the pool):", ""]
    lines += [f"- **{name}**: {text}" for name, text in CATEGORY_DEFINITIONS.items()]
    cap = first["capacity"]
    lines += ["", f"Capacity on {c['gpu_memory']} (max concurrent requests of one context length):", ""]
    lines.append("| context | " + " | ".join(f"{x:,}" for x in cap["context_tokens"]) + " |")
    lines.append("|" + "---|" * (len(cap["context_tokens"]) + 1))
    for kind in ("paged", "padded"):
        lines.append(f"| {kind} | " + " | ".join(f"{x:,}" for x in cap[kind]) + " |")
    for s in summaries:
        if s["rejected"]:
            lines += ["", f"Rejected in {s['label']}:", ""]
            lines += [f"- {r['id']}: {r['reason']}" for r in s["rejected"][:20]]
            if len(s["rejected"]) > 20:
                lines.append(f"- ... and {len(s['rejected']) - 20} more (report.json)")
    lines += ["", "## Configurations", ""]
    lines += _md_table(resolved_rows(summaries))
    lines.append("")
    return "\n".join(lines)

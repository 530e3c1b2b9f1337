"""Memory-pressure reports: ``report.json`` (machines), ``report.md`` (reviews), ``report.html``.

:func:`summarize` turns one raw simulation result into a JSON-safe, deterministic summary (no wall
time, floats rounded); :func:`write_reports` writes the three files for one or more summaries (a
``--compare`` run). The HTML page is self-contained: plots are PNGs embedded as base64
(:mod:`hybridkv.sim.plots`), no scripts, no external links, so it opens offline.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.models.spec_file import resolve_model
from hybridkv.planner.layout import LayoutKind, plan
from hybridkv.sim.plots import BLOCK_CATEGORIES, render_html
from hybridkv.units import format_bytes, parse_bytes

MAX_POINTS = 600  # time-series points per configuration in the report
CAPACITY_CONTEXTS = (1500, 3000, 6000, 12000, 24000, 48000, 96000)  # not multiples of padded blocks
_STOCKS = (*BLOCK_CATEGORIES, "host_used", "waiting", "running", "swapped")
_FLOWS = ("preempt_recompute", "preempt_swap", "swap_out_blocks", "swap_in_blocks", "copy_blocks", "batched_tokens")


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
        return {k: [] for k in ("t_s", *_STOCKS, *_FLOWS)}
    edges = np.unique(np.linspace(0, n, min(n, MAX_POINTS) + 1).astype(np.int64))
    ends = edges[1:] - 1
    out: dict[str, list[float]] = {"t_s": [_r(v, 4) for v in series["t_s"][ends]]}
    for k in _STOCKS:
        out[k] = [int(v) for v in series[k][ends]]
    for k in _FLOWS:
        sums = np.add.reduceat(series[k], edges[:-1])
        out[k] = [int(v) for v in sums]
    return out


def capacity_table(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """Max concurrent requests per context length, paged vs padded, on the config's budget."""
    model = resolve_model(cfg["model"], cfg["state_dtype"], cfg["tp"])
    budget = parse_bytes(cfg["gpu_memory"])
    out: dict[str, list[int]] = {"context_tokens": list(CAPACITY_CONTEXTS)}
    for kind in (LayoutKind.PAGED, LayoutKind.PADDED):
        layout = plan(model, budget, cfg["block_size"], kind)
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
    totals = raw["executor_totals"]
    summary = {
        "label": raw["config"]["label"],
        "config": raw["config"],
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
            "peak_running": int(s["running"].max(initial=0)),
            "peak_waiting": int(s["waiting"].max(initial=0)),
            "peak_swapped": int(s["swapped"].max(initial=0)),
            "peak_used_blocks": int(used.max(initial=0)),
            "peak_used_fraction": _r(used.max(initial=0) / (layout["num_blocks"] - 1)),
            "peak_host_bytes": int(s["host_used"].max(initial=0)) * bpb,
            "integrity_checks": raw["integrity_checks"],
            "stalled": raw["stalled"],
        },
        "latency_s": {
            "ttft": _stats([r["ttft_s"] for r in done if "ttft_s" in r]),
            "tpot": _stats([r["tpot_s"] for r in done if "tpot_s" in r]),
            "e2e": _stats([r["e2e_s"] for r in done if "e2e_s" in r]),
        },
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

    paths[2].write_text(render_html(summaries, title, comparison_table(summaries)))
    return paths


_TABLE = (
    ("finished / rejected", lambda t, lat: f"{t['finished']} / {t['rejected']}"),
    ("simulated time", lambda t, lat: f"{t['sim_time_s']:.1f} s"),
    ("output tokens / s", lambda t, lat: f"{t['output_tokens_per_s']:,.0f}"),
    ("TTFT p50 / p99", lambda t, lat: _pair(lat["ttft"])),
    ("TPOT p50 / p99", lambda t, lat: _pair(lat["tpot"], 1e3, "ms")),
    ("peak running / waiting", lambda t, lat: f"{t['peak_running']} / {t['peak_waiting']}"),
    ("peak blocks used", lambda t, lat: f"{100 * t['peak_used_fraction']:.1f}%"),
    ("preemptions recompute / swap", lambda t, lat: f"{t['preemptions_recompute']} / {t['preemptions_swap']}"),
    ("scheduled tokens", lambda t, lat: f"{t.get('scheduled_tokens', 0):,}"),
    ("swap out / in", lambda t, lat: f"{format_bytes(t['swap_out_bytes'])} / {format_bytes(t['swap_in_bytes'])}"),
    ("prefix hit rate", lambda t, lat: f"{100 * t['prefix_hit_rate']:.1f}%"),
    ("steps", lambda t, lat: f"{t['steps']:,}"),
)


def _pair(st: dict[str, Any], scale: float = 1.0, unit: str = "s") -> str:
    if not st.get("count"):
        return "-"
    return f"{st['p50'] * scale:.3g} / {st['p99'] * scale:.3g} {unit}"


def comparison_table(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the comparison table: a header of labels, then one row per metric."""
    rows = [["", *[s["label"] for s in summaries]]]
    for name, fn in _TABLE:
        rows.append([name, *[fn(s["totals"], s["latency_s"]) for s in summaries]])
    return rows


def markdown(summaries: list[dict[str, Any]], title: str) -> str:
    first = summaries[0]
    w, c, lay = first["workload"], first["config"], first["layout"]
    lines = [f"# {title}", ""]
    lines += [
        f"Workload: {w['kind']}, {w['num_requests']:,} requests over {w['arrival_span_s']:.1f} s, "
        f"mean prompt {w['mean_prompt_tokens']:,.0f} tokens, mean output {w['mean_output_tokens']:,.0f} tokens.",
        f"Model {c['model']} TP{c['tp']}, GPU {first['gpu']['name']}, cache budget {c['gpu_memory']} per GPU "
        f"({lay['num_blocks']:,} blocks of {format_bytes(lay['bytes_per_block'])} in the first configuration).",
        "",
    ]
    rows = comparison_table(summaries)
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "---|" * len(rows[0]))
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
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
    lines += ["", "Configurations:", ""]
    for s in summaries:
        cfg = ", ".join(f"{k}={v}" for k, v in s["config"].items() if k != "label")
        lines.append(f"- **{html.escape(s['label'])}**: {cfg}")
    lines.append("")
    return "\n".join(lines)

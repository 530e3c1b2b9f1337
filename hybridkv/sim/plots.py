"""The plots of ``report.html`` (matplotlib, Agg, PNG embedded as base64) and the page around them.

Every plot's figure has a frame in its own marker colour (:data:`PLOTS`), so a screenshot test
can find each plot on the rendered page and check that it drew. matplotlib comes with the
``reports`` extra; without it the page still has the tables and says what to install.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import numpy as np

# (id, title, frame colour as RGB); the frame colours appear nowhere else on the page
PLOTS: tuple[tuple[str, str, tuple[int, int, int]], ...] = (
    ("blocks", "Device blocks by category over time", (1, 254, 10)),
    ("preemption", "Preemptions and swap traffic", (1, 254, 60)),
    ("queues", "Queue lengths", (1, 254, 110)),
    ("latency", "TTFT and TPOT distributions", (1, 254, 160)),
    ("capacity", "Capacity: paged vs padded on the same budget", (1, 254, 210)),
)
# device blocks by category, stacked bottom to top (they add up to the pool, less the null block)
BLOCK_CATEGORIES = ("kv_live", "state_live", "state_speculative", "kv_cached", "checkpoints", "pending_free", "free")
_CATEGORY_COLOURS = {
    "kv_live": "#1f77b4",
    "state_live": "#d62728",
    "state_speculative": "#ff9896",
    "kv_cached": "#aec7e8",
    "checkpoints": "#9467bd",
    "pending_free": "#c7c7c7",  # given back, free once the copies touching them ran
    "free": "#e8e8e8",
}
DPI = 100


def _figure(plot_id: str, nrows: int, ncols: int, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    colour = next(c for p, _, c in PLOTS if p == plot_id)
    fig = Figure(figsize=(10, height), dpi=DPI)
    fig.patch.set_edgecolor(tuple(v / 255 for v in colour))
    fig.patch.set_linewidth(8)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.9, wspace=0.25, hspace=0.45)
    fig.savefig(buf, format="png", dpi=DPI, edgecolor=fig.get_edgecolor(), metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _blocks(summaries: list[dict[str, Any]]) -> Any:

    n = len(summaries)
    fig, axes = _figure("blocks", n, 1, 2.2 + 2.0 * n)
    for ax, s in zip(axes[:, 0], summaries, strict=True):
        t = s["series"]["t_s"]
        ys = [s["series"][k] for k in BLOCK_CATEGORIES]
        ax.stackplot(t, ys, labels=BLOCK_CATEGORIES, colors=[_CATEGORY_COLOURS[k] for k in BLOCK_CATEGORIES])
        ax.set_title(s["label"], fontsize=9)
        ax.set_ylabel("blocks")
        ax.set_xlim(0, max(t[-1] if t else 1.0, 1e-9))
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    return fig


def _preemption(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure("preemption", 1, 2, 3.4)
    for s in summaries:
        se, bpb = s["series"], s["layout"]["bytes_per_block"]
        t = se["t_s"]
        axes[0, 0].step(t, np.cumsum(se["preempt_recompute"]), where="post", label=f"{s['label']}: recompute")
        axes[0, 0].step(t, np.cumsum(se["preempt_swap"]), where="post", linestyle="--", label=f"{s['label']}: swap")
        out = np.cumsum(se["swap_out_blocks"]) * bpb / 1e9
        axes[0, 1].plot(t, out, label=f"{s['label']}: out")
        axes[0, 1].plot(t, np.cumsum(se["swap_in_blocks"]) * bpb / 1e9, linestyle="--", label=f"{s['label']}: in")
    axes[0, 0].set_title("preemptions (cumulative)", fontsize=9)
    axes[0, 1].set_title("swap traffic (cumulative GB)", fontsize=9)
    for ax in axes[0]:
        ax.set_xlabel("simulated time (s)")
        ax.legend(fontsize=6)
    return fig


def _queues(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure("queues", 1, 3, 3.2)
    for s in summaries:
        for ax, key in zip(axes[0], ("waiting", "running", "swapped"), strict=True):
            ax.plot(s["series"]["t_s"], s["series"][key], label=s["label"], linewidth=1)
    for ax, key in zip(axes[0], ("waiting", "running", "swapped"), strict=True):
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("simulated time (s)")
    axes[0, 0].legend(fontsize=6)
    return fig


def _latency(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure("latency", 1, 2, 3.4)
    for s in summaries:
        for ax, key, scale in ((axes[0, 0], "ttft_s", 1.0), (axes[0, 1], "tpot_s", 1e3)):
            v = np.asarray(s["distributions"][key]) * scale
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=s["label"])
    axes[0, 0].set_title("TTFT (CDF)", fontsize=9)
    axes[0, 0].set_xlabel("seconds")
    axes[0, 1].set_title("TPOT (CDF)", fontsize=9)
    axes[0, 1].set_xlabel("milliseconds")
    for ax in axes[0]:
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=6)
    return fig


def _capacity(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure("capacity", 1, 1, 3.4)
    ax = axes[0, 0]
    cap = summaries[0]["capacity"]
    x = np.arange(len(cap["context_tokens"]))
    ax.bar(x - 0.2, cap["paged"], 0.4, label="paged", color="#1f77b4")
    ax.bar(x + 0.2, cap["padded"], 0.4, label="padded (vLLM rule)", color="#ff7f0e")
    ax.set_xticks(x, [f"{c / 1000:g}k" for c in cap["context_tokens"]])
    ax.set_xlabel("context tokens per request")
    ax.set_ylabel("max concurrent requests")
    ax.set_yscale("log")
    c = summaries[0]["config"]
    ax.set_title(f"{c['model']} TP{c['tp']}, {c['gpu_memory']} per GPU", fontsize=9)
    ax.legend(fontsize=7)
    return fig


_BUILDERS = {
    "blocks": _blocks,
    "preemption": _preemption,
    "queues": _queues,
    "latency": _latency,
    "capacity": _capacity,
}


def _table_html(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(summaries: list[dict[str, Any]], title: str, table: list[list[str]]) -> str:
    """The whole page: comparison table, plots (base64 PNG), configuration summary."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px;background:#fff}table{border-collapse:collapse;"
        "font-size:12px;margin:8px 0}td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}"
        "td:first-child{text-align:left}h2{font-size:16px;margin:18px 0 6px}img{display:block}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        "<h2>Comparison</h2>",
        _table_html(table),
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parts.append("<p>Plots need matplotlib: <code>pip install 'hybridkv[reports]'</code></p>")
    else:
        for plot_id, plot_title, _ in PLOTS:
            fig = _BUILDERS[plot_id](summaries)
            w, h = (int(round(v * DPI)) for v in fig.get_size_inches())
            parts.append(f"<h2>{html.escape(plot_title)}</h2>")
            parts.append(f"<img id='plot-{plot_id}' alt='{html.escape(plot_title)}' width='{w}' height='{h}' "
                         f"src='data:image/png;base64,{_png(fig)}'>")  # fmt: skip
    parts.append("<h2>Configurations</h2>")
    keys = [k for k in summaries[0]["config"] if k != "label"]
    rows = [["", *[s["label"] for s in summaries]]]
    rows += [[k, *[str(s["config"][k]) for s in summaries]] for k in keys]
    rows.append(["GPU", *[f"{s['gpu']['name']}" for s in summaries]])
    rows.append(
        ["blocks x bytes", *[f"{s['layout']['num_blocks']:,} x {s['layout']['bytes_per_block']:,}" for s in summaries]]
    )
    rows.append(["block size (tokens)", *[str(s["layout"]["block_size"]) for s in summaries]])
    parts.append(_table_html(rows))
    w = summaries[0]["workload"]
    parts.append("<h2>Workload</h2>" + _table_html([["field", "value"], *[[k, str(v)] for k, v in w.items()]]))
    parts.append("</body></html>\n")
    return "\n".join(parts)

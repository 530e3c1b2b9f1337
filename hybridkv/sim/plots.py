"""The plots of ``report.html`` (matplotlib, Agg, PNG embedded as base64) and the page around them.

Plots are made to be compared across configurations: device memory in bytes (blocks x the
configuration's bytes per block) on one y axis shared by every configuration's panel, with the
pool's capacity drawn; one x axis (simulated seconds) shared by every time plot; legends outside
the axes; every configuration its own colour and marker (modes add a line style), so more than ten
lines stay apart; integer ticks and a label on count axes; one byte unit per quantity, the same in
the plots and the tables (:func:`byte_unit`). matplotlib comes with the ``reports`` extra; without
it the page still has the summary, the tables and the definitions, and says what to install.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import numpy as np

# (id, title) of the plots, in page order
PLOTS: tuple[tuple[str, str], ...] = (
    ("memory", "Device memory by category over time, with preemption and swap events"),
    ("preemption", "Preemptions and swap traffic"),
    ("queues", "Queue lengths"),
    ("latency", "TTFT and TPOT distributions"),
    ("capacity", "Capacity: paged vs padded on the same budget"),
)
# device blocks by category, stacked bottom to top (they add up to the pool, less the null block)
BLOCK_CATEGORIES = ("kv_live", "state_live", "state_speculative", "kv_cached", "checkpoints", "pending_free", "free")
CATEGORY_DEFINITIONS = {
    "kv_live": "KV blocks referenced by running requests (a prefix block shared by several counts once)",
    "state_live": "recurrent-state blocks of running requests (one live set each)",
    "state_speculative": "state blocks of speculative-decoding sets (one set per draft token)",
    "kv_cached": "KV blocks no request references, kept by the prefix cache; evictable",
    "checkpoints": "recurrent-state checkpoints owned by the prefix cache; evictable",
    "pending_free": "blocks given back while a copy handed out earlier still touches them; free once it ran",
    "free": "unallocated blocks",
    "host_used": "host (swap pool) blocks holding swapped-out requests; not device memory",
    "host_cached": "host blocks of the prefix cache's host tier (--host-cache): cached KV and checkpoints evicted "
    "from the device, still matchable; a swap-out takes them first; not device memory",
}
_CATEGORY_COLOURS = {
    "kv_live": "#1f77b4",
    "state_live": "#d62728",
    "state_speculative": "#ff9896",
    "kv_cached": "#9ecae1",
    "checkpoints": "#9467bd",
    "pending_free": "#bdbdbd",
    "free": "#f0f0f0",
}
# preemption and swap events, marked above the memory stack: (series key, legend text, marker, colour)
EVENTS: tuple[tuple[str, str, str, str], ...] = (
    ("preempt_recompute", "preempted by recompute", "x", "#d62728"),
    ("preempt_swap", "preempted by swap (swap-out)", "v", "#6a3d9a"),
    ("resumed", "swapped in (resumed)", "^", "#2ca02c"),
)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
DPI = 100
MARK_EVERY = 0.1  # a line's markers, evenly spaced along it on the screen (a fraction of the axes' diagonal)
WIDTH_IN = 11.0


def byte_unit(values: list[float] | list[int]) -> tuple[str, int]:
    """``("GiB", 2**30)`` when the largest of ``values`` (bytes) is at least 1 GiB, else ``("MiB", 2**20)``."""
    top = max((float(v) for v in values), default=0.0)
    return ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)


def config_style(i: int) -> dict[str, Any]:
    """Colour and marker of the ``i``-th configuration: distinct pairs for the first 100, and the
    first ten differ in both."""
    return {"color": COLOURS[i % len(COLOURS)], "marker": MARKERS[(i + i // len(COLOURS)) % len(MARKERS)]}


def pool_bytes(s: dict[str, Any]) -> int:
    """Usable device pool of a summary in bytes: every block but the null block."""
    lay = s["layout"]
    return (lay["num_blocks"] - 1) * lay["bytes_per_block"]


def _figure(nrows: int, ncols: int, height: float, **share: Any) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **share)
    return fig, axes


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _time_axis(ax: Any, t_max: float) -> None:
    ax.set_xlim(0, t_max)
    ax.set_xlabel("simulated time (s)")


def _count_axis(ax: Any, top: float, label: str) -> None:
    """Integer ticks from 0; a count that stays 0 gets the axis 0..1, not a symmetric sliver."""
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(0, max(1.0, float(top) * 1.05))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label)


def t_max(summaries: list[dict[str, Any]]) -> float:
    """The shared x range of the time plots: the longest simulated run."""
    ends = [s["series"]["t_s"][-1] for s in summaries if s["series"]["t_s"]]
    return max([*ends, 1e-9])


def _memory(summaries: list[dict[str, Any]]) -> Any:
    n = len(summaries)
    unit, scale = byte_unit([pool_bytes(s) for s in summaries])
    fig, axes = _figure(n, 1, 1.2 + 2.1 * n, sharex=True, sharey=True)
    top = max(pool_bytes(s) for s in summaries) / scale
    x_end = t_max(summaries)
    for ax, s in zip(axes[:, 0], summaries, strict=True):
        se, bpb = s["series"], s["layout"]["bytes_per_block"]
        t = np.asarray(se["t_s"], dtype=np.float64)
        # a point at time 0 so the first bucket is drawn from the y axis
        start = [(s["layout"]["num_blocks"] - 1) * (k == "free") for k in BLOCK_CATEGORIES]
        ys = [
            np.asarray([v0, *se[k]], dtype=np.float64) * bpb / scale
            for v0, k in zip(start, BLOCK_CATEGORIES, strict=True)
        ]
        colours = [_CATEGORY_COLOURS[k] for k in BLOCK_CATEGORIES]
        # a sample is the stock at its bucket's end: drawn over the bucket (step "pre")
        ax.stackplot(np.concatenate(([0.0], t)), ys, labels=BLOCK_CATEGORIES, colors=colours, step="pre")
        cap = pool_bytes(s) / scale
        ax.axhline(cap, color="black", linewidth=1.2, label="pool capacity")
        for j, (key, text, marker, colour) in enumerate(EVENTS):
            if not _any(summaries, key):
                continue  # (an event no configuration had: no legend entry for it)
            v = np.asarray(se[key])
            hit = v > 0
            y = np.full(int(hit.sum()), top * (1.04 + 0.045 * j))
            ax.scatter(t[hit], y, marker=marker, s=22, color=colour, label=text, linewidths=1, zorder=3)
        lay = s["layout"]
        ax.set_title(
            f"{s['label']}: {lay['num_blocks'] - 1:,} blocks x {lay['bytes_per_block'] / 2**10:,.0f} KiB",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel(f"device memory ({unit})")
        ax.set_ylim(0, top * 1.2)
        _time_axis(ax, x_end)
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside right upper", fontsize=8, title="device memory",
               title_fontsize=8)  # fmt: skip
    return fig


def _any(summaries: list[dict[str, Any]], *keys: str) -> bool:
    """Whether any configuration's series ``keys`` is ever non-zero."""
    return any(any(s["series"].get(k, [])) for s in summaries for k in keys)


def _preemption_panels(summaries: list[dict[str, Any]]) -> list[str]:
    return [k for k, keys in (("preemptions", ("preempt_recompute", "preempt_swap")),
                              ("swap", ("swap_out_blocks", "swap_in_blocks"))) if _any(summaries, *keys)]  # fmt: skip


def _preemption(summaries: list[dict[str, Any]]) -> Any:
    panels = _preemption_panels(summaries)
    if not panels:
        return None
    fig, axes = _figure(1, len(panels), 3.6, sharex=True)
    ax_of = dict(zip(panels, axes[0], strict=True))
    unit, scale = byte_unit([s["totals"]["swap_out_bytes"] for s in summaries])
    top_n = top_b = 0.0
    for i, s in enumerate(summaries):
        se, bpb, st = s["series"], s["layout"]["bytes_per_block"], config_style(i)
        t = se["t_s"]
        rec, swp = np.cumsum(se["preempt_recompute"]), np.cumsum(se["preempt_swap"])
        out = np.cumsum(se["swap_out_blocks"]) * bpb / scale
        back = np.cumsum(se["swap_in_blocks"]) * bpb / scale
        kw = {"markevery": MARK_EVERY, "markersize": 4, "linewidth": 1.2, **st}
        if "preemptions" in ax_of:
            ax_of["preemptions"].step(t, rec, where="post", linestyle="-", label=f"{s['label']}: recompute", **kw)
            ax_of["preemptions"].step(t, swp, where="post", linestyle="--", label=f"{s['label']}: swap", **kw)
        if "swap" in ax_of:
            ax_of["swap"].plot(t, out, linestyle="-", label=f"{s['label']}: out", **kw)
            ax_of["swap"].plot(t, back, linestyle=":", label=f"{s['label']}: in", **kw)
        top_n = max(top_n, float(rec[-1]) if len(rec) else 0.0, float(swp[-1]) if len(swp) else 0.0)
        top_b = max(top_b, float(out[-1]) if len(out) else 0.0)
    if "preemptions" in ax_of:
        _count_axis(ax_of["preemptions"], top_n, "preemptions (cumulative)")
        ax_of["preemptions"].set_title("preemptions: solid recompute, dashed swap", fontsize=9)
    if "swap" in ax_of:
        ax_of["swap"].set_ylim(0, max(top_b * 1.05, 1.0))
        ax_of["swap"].set_ylabel(f"{unit} (cumulative)")
        ax_of["swap"].set_title("swap traffic: solid out, dotted in", fontsize=9)
    for ax in axes[0]:
        _time_axis(ax, t_max(summaries))
    _config_legend(fig, summaries)
    return fig


def _config_legend(fig: Any, summaries: list[dict[str, Any]]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], linewidth=1.2, markersize=5, **config_style(i)) for i in range(len(summaries))]
    fig.legend(handles, [s["label"] for s in summaries], loc="outside right upper", fontsize=8, title="configuration",
               title_fontsize=8)  # fmt: skip


_QUEUES = (("waiting", "waiting (incl. backlog)"), ("running", "running"), ("swapped", "swapped out"),
           ("recompute_waiting", "waiting to be recomputed"))  # fmt: skip


def _queues(summaries: list[dict[str, Any]]) -> Any:
    keys = [(k, title) for k, title in _QUEUES if _any(summaries, k)]
    if not keys:
        return None
    rows = (len(keys) + 1) // 2
    fig, axes = _figure(rows, 2 if len(keys) > 1 else 1, 1.0 + 2.3 * rows, sharex=True)
    flat = axes.reshape(-1)
    for i, s in enumerate(summaries):
        t = s["series"]["t_s"]
        for ax, (key, _) in zip(flat, keys, strict=False):
            ax.step(t, s["series"].get(key, [0] * len(t)), where="pre", linewidth=1, markevery=MARK_EVERY,
                    markersize=4, **config_style(i))  # fmt: skip
    for ax, (key, title) in zip(flat, keys, strict=False):
        top = max((max(s["series"].get(key, [0]) or [0]) for s in summaries), default=0)
        _count_axis(ax, top, "requests")
        ax.set_title(title, fontsize=9)
        _time_axis(ax, t_max(summaries))
    for ax in flat[len(keys) :]:
        ax.set_visible(False)
    for ax in axes[:-1].reshape(-1):
        ax.set_xlabel("")
    _config_legend(fig, summaries)
    return fig


def flat_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """What did not happen in any configuration, one line each, in place of a panel that would be
    flat zero for every configuration (:func:`figure` leaves those panels out)."""
    out = []
    if not _any(summaries, "preempt_recompute", "preempt_swap"):
        out.append("No configuration preempted a request: no preemption panel, and no request was swapped out "
                   "or waited to be recomputed.")  # fmt: skip
    elif not _any(summaries, "swap_out_blocks", "swap_in_blocks"):
        out.append("No configuration swapped: every preemption recomputed (no swap-traffic panel).")
    elif not _any(summaries, "recompute_waiting"):
        out.append("No request waited to be recomputed in any configuration (every preemption swapped).")
    return out


def _latency(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure(1, 2, 3.6)
    for i, s in enumerate(summaries):
        for ax, key, scale in ((axes[0, 0], "ttft_s", 1.0), (axes[0, 1], "tpot_s", 1e3)):
            v = np.asarray(s["distributions"][key], dtype=np.float64) * scale
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, linewidth=1.2, markevery=MARK_EVERY,
                        markersize=4, **config_style(i))  # fmt: skip
    axes[0, 0].set_title("TTFT (CDF)", fontsize=9)
    axes[0, 0].set_xlabel("seconds")
    axes[0, 1].set_title("TPOT (CDF)", fontsize=9)
    axes[0, 1].set_xlabel("milliseconds")
    for ax in axes[0]:
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.set_ylabel("fraction of finished requests")
    _config_legend(fig, summaries)
    return fig


def _capacity(summaries: list[dict[str, Any]]) -> Any:
    fig, axes = _figure(1, 1, 3.8)
    ax = axes[0, 0]
    first = next((s for s in summaries if s["config"]["engine"] == "hybridkv"), summaries[0])
    cap = first["capacity"]
    x = np.arange(len(cap["context_tokens"]))
    bars = (
        ax.bar(x - 0.2, cap["paged"], 0.4, label="paged", color="#1f77b4"),
        ax.bar(x + 0.2, cap["padded"], 0.4, label="padded (vLLM rule)", color="#ff7f0e", hatch="//", edgecolor="white"),
    )
    for b in bars:
        ax.bar_label(b, labels=[f"{int(v):,}" for v in b.datavalues], fontsize=7, padding=2)
    ax.set_xticks(x, [f"{c / 1000:g}k" for c in cap["context_tokens"]])
    ax.set_xlabel("context tokens per request")
    _count_axis(ax, max([*cap["paged"], *cap["padded"], 0]) * 1.08, "max concurrent requests")
    c = first["config"]
    ax.set_title(f"{c['model']} TP{c['tp']}, {c['gpu_memory']} per GPU", fontsize=9)
    fig.legend(loc="outside right upper", fontsize=8)
    return fig


_BUILDERS = {
    "memory": _memory,
    "preemption": _preemption,
    "queues": _queues,
    "latency": _latency,
    "capacity": _capacity,
}


def figure(plot_id: str, summaries: list[dict[str, Any]]) -> Any:
    """The matplotlib ``Figure`` of one plot (ids: :data:`PLOTS`), or ``None`` when every panel of it
    would be flat zero for every configuration (:func:`flat_lines` says what did not happen); needs
    matplotlib."""
    return _BUILDERS[plot_id](summaries)


def render_plot(plot_id: str, summaries: list[dict[str, Any]]) -> tuple[str, int, int] | None:
    """One plot as base64 PNG with its width and height in pixels; ``None`` for no plot (:func:`figure`)."""
    fig = figure(plot_id, summaries)
    if fig is None:
        return None
    w, h = (int(round(v * DPI)) for v in fig.get_size_inches())
    return _png(fig), w, h


def _table_html(rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    attr = f" class='{cls}'" if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _definitions_html(items: list[tuple[str, str]], cls: str) -> str:
    rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items)
    return f"<dl class='{cls}'>{rows}</dl>"


def _event_caption(summaries: list[dict[str, Any]]) -> str:
    """The memory plot's event legend as text (the PNG's legend, readable without the image)."""
    parts = []
    for key, text, marker, _ in EVENTS:
        if not _any(summaries, key):
            continue  # (no configuration had it: flat_lines says so)
        counts = [int(np.asarray(s["series"][key]).sum()) for s in summaries]
        per = "; ".join(f"{s['label']} {n:,}" for s, n in zip(summaries, counts, strict=True))
        parts.append(f"<li class='event' data-event='{key}' data-counts='{','.join(map(str, counts))}'>marker "
                     f"{html.escape(marker)}: {html.escape(text)} ({html.escape(per)})</li>")  # fmt: skip
    return "<ul class='events'>" + "".join(parts) + "</ul>" if parts else ""


def render_html(
    summaries: list[dict[str, Any]],
    title: str,
    table: list[list[str]],
    summary: list[str],
    pressure: list[list[str]],
    definitions: list[tuple[str, str]],
    configurations: list[list[str]],
) -> str:
    """The whole page, conclusions first: the summary in words (verdict first), the comparison
    table, the plots (base64 PNG; a plot flat zero for every configuration is one line instead),
    the pressure-cost table, the configurations as run, the definitions, the workload."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px;background:#fff;max-width:1140px}table{border-collapse:collapse;"
        "font-size:12px;margin:8px 0}td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}"
        "td:first-child{text-align:left}h2{font-size:16px;margin:18px 0 6px}h3{font-size:13px;margin:10px 0 4px}"
        "img{display:block}"
        "dl{font-size:12px;display:grid;grid-template-columns:max-content auto;gap:2px 12px}dt{font-weight:bold}"
        "dd{margin:0}figure{margin:8px 0}figcaption,ul.events{font-size:12px}#summary p{margin:4px 0}"
        "#summary p:first-of-type{font-weight:bold}p.absent{font-size:12px;font-style:italic}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        "<section id='summary'><h2>Summary</h2>" + "".join(f"<p>{html.escape(p)}</p>" for p in summary) + "</section>",
        "<h2>Comparison</h2>",
        _table_html(table, "comparison"),
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parts.append("<p>Plots need matplotlib: <code>pip install 'hybridkv[reports]'</code></p>")
    else:
        for plot_id, plot_title in PLOTS:
            rendered = render_plot(plot_id, summaries)
            if rendered is None:
                continue
            data, w, h = rendered
            parts.append(f"<h2>{html.escape(plot_title)}</h2><figure>")
            parts.append(f"<img id='plot-{plot_id}' alt='{html.escape(plot_title)}' width='{w}' height='{h}' "
                         f"src='data:image/png;base64,{data}'>")  # fmt: skip
            if plot_id == "memory":
                events = _event_caption(summaries)
                said = " Events, marked above the stack at the time of the report's sample:" if events else ""
                parts.append("<figcaption>Bytes are blocks x each configuration's bytes per block, on one scale "
                             "for all panels; the black line is the pool's capacity (all blocks but the null "
                             f"block).{said}{events}</figcaption>")  # fmt: skip
            parts.append("</figure>")
            if plot_id == "memory":
                parts += [f"<p class='absent'>{html.escape(line)}</p>" for line in flat_lines(summaries)]
    parts += [
        "<h2>What memory pressure cost</h2>",
        _table_html(pressure, "pressure"),
        "<h2>Configurations</h2>",
        _table_html(configurations, "configurations"),
        "<h2>Definitions</h2>",
        "<h3>Figures in the tables</h3>",
        _definitions_html(definitions, "figures"),
        "<h3>Memory categories (device blocks; they add up to the pool)</h3>",
        _definitions_html(list(CATEGORY_DEFINITIONS.items()), "categories"),
    ]
    w = summaries[0]["workload"]
    parts.append("<h2>Workload</h2>" + _table_html([["field", "value"], *[[k, str(v)] for k, v in w.items()]]))
    parts.append("</body></html>\n")
    return "\n".join(parts)

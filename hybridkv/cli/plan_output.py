"""What ``hybridkv plan`` shows: the dtype facts and engine notes of a model, the per-layout summary,
the table / md / csv renderings of a plan and its capacity plot. :mod:`hybridkv.cli.plan` builds the
plan and calls these; nothing here reads the command line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.cli.common import UserError
from hybridkv.models.spec import DType, ModelSpec
from hybridkv.planner.layout import Layout
from hybridkv.units import format_bytes


# ---- facts shown with every plan ---------------------------------------------------------------
def model_dtypes(model: ModelSpec) -> dict[str, Any]:
    """``{"kv": dtype or None, "state": {"<mixer>.<component>": dtype}}`` of a model's caches."""
    kv = sorted({a.dtype.value for _, a in model.attention_layers()})
    state: dict[str, str] = {}
    for _, layer in model.recurrent_layers():
        for c in layer.components:
            state.setdefault(f"{layer.mixer}.{c.name}", c.dtype.value)
    return {"kv": ", ".join(kv) or None, "state": state}


# What engines keep, for the note beside the defaults: vLLM keeps Mamba-style states (conv and SSM)
# in the model dtype unless --mamba-ssm-cache-dtype / --mamba-cache-dtype say otherwise; FastDeploy's
# GDN state pool keeps the SSM state float32 and the conv window bfloat16, its MiniMax port the
# lightning state in the activation dtype.
_FASTDEPLOY = {"gdn.ssm": DType.FLOAT32, "gdn.conv": DType.BFLOAT16, "lightning.kv": DType.BFLOAT16}
_VLLM_MIXERS = ("mamba", "mamba2", "gdn", "kda", "short_conv", "lightning")


def engine_dtype_note(model: ModelSpec) -> str | None:
    """One line naming the components whose dtype here differs from what vLLM or FastDeploy keeps
    by default (None when both agree with every component)."""
    kv = next((a.dtype for _, a in model.attention_layers()), DType.BFLOAT16)
    model_dtype = kv if kv.itemsize > 1 else DType.BFLOAT16
    vllm, fd = [], []
    for key, dtype in model_dtypes(model)["state"].items():
        mixer = key.split(".")[0]
        if mixer in _VLLM_MIXERS and DType(dtype) is not model_dtype:
            vllm.append(f"{key} {model_dtype.value}")
        if key in _FASTDEPLOY and DType(dtype) is not _FASTDEPLOY[key]:
            fd.append(f"{key} {_FASTDEPLOY[key].value}")
    parts = []
    if vllm:
        f32 = any(v == DType.FLOAT32.value for v in model_dtypes(model)["state"].values())
        parts.append(
            f"vLLM keeps {', '.join(vllm)} (the model dtype; --mamba-ssm-cache-dtype float32 keeps the SSM state "
            "float32" + (" as here)" if f32 else "; it has no int8 / fp8 state)")
        )
    if fd:
        parts.append(f"FastDeploy keeps {', '.join(fd)}")
    return "engines differ from these dtypes: " + "; ".join(parts) if parts else None


def _dtype_line(dtypes: dict[str, Any], source: str) -> str:
    parts = []
    if dtypes["kv"]:
        parts.append(f"KV {dtypes['kv']}")
    if dtypes["state"]:
        parts.append("state " + ", ".join(f"{k} {v}" for k, v in dtypes["state"].items()))
    return f"dtypes: {'; '.join(parts)} ({source})"


def _layout_summary(layout: Layout, context: int) -> dict[str, Any]:
    cap = layout.capacity(context)
    fp = cap.footprint
    has_kv = layout.kv_group is not None
    return {
        "layout": layout.kind.value,
        "context_tokens": context,
        "block_size": layout.block_size if has_kv else None,
        "block_bytes": layout.block_bytes,
        "bytes_per_block": layout.bytes_per_block,
        "num_layer_slots": layout.num_layer_slots,
        "num_groups": len(layout.groups),
        "num_state_groups": layout.num_state_groups,
        "blocks_per_state": list(layout.blocks_per_state),
        "num_blocks": layout.num_blocks,
        "kv_blocks_per_request": fp.num_kv_blocks,
        "state_blocks_per_request": fp.num_state_blocks,
        "blocks_per_request": fp.num_blocks,
        "kv_bytes_per_request": fp.kv_bytes,
        "state_bytes_per_request": fp.state_bytes,
        "allocated_bytes_per_request": fp.allocated_bytes,
        "waste_bytes_per_request": fp.waste._asdict() | {"total_bytes": fp.waste.total_bytes},
        "max_requests": cap.max_requests,
        "free_blocks_at_capacity": cap.free_blocks,
        "notes": list(layout.notes),
    }


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _waste_total(s: dict[str, Any]) -> str:
    total = s["waste_bytes_per_request"]["total_bytes"]
    return f"{format_bytes(total)} ({_pct(total, s['allocated_bytes_per_request'])})"


def _context_text(value: int | None) -> str:
    return "any (no KV)" if value is None else (f"{value:,}" if value else "0 (does not fit)")


def _context_cell(s: dict[str, Any]) -> str:
    """The context a column is shown at; a layout in which the asked requests fit at no context says
    so instead of showing its 1-token column as an answer."""
    if s.get("longest_context_tokens") == 0:
        return "none fits (1 shown)"
    return f"{s['context_tokens']:,}"


_Row = tuple[str, Callable[[dict[str, Any]], str], str]  # label, cell, which models show it


def _rows(out: dict[str, Any]) -> list[list[str]]:
    """The rows of the table / md / csv outputs: a header row, then one row per quantity."""
    summaries = out["layouts"].values()
    has_kv = out["kv_bytes_per_token"] > 0
    waste = "waste_bytes_per_request"
    spec: list[_Row] = [
        ("context (tokens)", _context_cell, "kv"),
        ("block size (tokens)", lambda s: f"{s['block_size']}", "kv"),
        ("block bytes per layer slot", lambda s: format_bytes(s["block_bytes"]), "all"),
        (
            "layer slots x groups (state)",
            lambda s: f"{s['num_layer_slots']} x {s['num_groups']} ({s['num_state_groups']})",
            "all",
        ),
        ("blocks per state", lambda s: ", ".join(str(b) for b in sorted(set(s["blocks_per_state"]))) or "-", "all"),
        ("blocks in pool", lambda s: f"{s['num_blocks']:,}", "all"),
        ("KV bytes / request", lambda s: format_bytes(s["kv_bytes_per_request"]), "kv"),
        ("state bytes / request", lambda s: format_bytes(s["state_bytes_per_request"]), "all"),
        (
            "blocks / request (KV + state)",
            lambda s: (
                f"{s['blocks_per_request']:,} ({s['kv_blocks_per_request']:,} + {s['state_blocks_per_request']:,})"
            ),
            "kv",
        ),
        ("blocks / request (state)", lambda s: f"{s['state_blocks_per_request']:,}", "nokv"),
        ("allocated / request", lambda s: format_bytes(s["allocated_bytes_per_request"]), "all"),
        (
            "  waste: state tail",
            lambda s: (
                f"{format_bytes(s[waste]['state_tail_bytes'])} "
                f"({_pct(s[waste]['state_tail_bytes'], s['state_bytes_per_request'])} of state)"
            ),
            "all",
        ),
        ("  waste: padded slack", lambda s: format_bytes(s[waste]["padded_slack_bytes"]), "all"),
        ("  waste: padding layers", lambda s: format_bytes(s[waste]["padding_layer_bytes"]), "all"),
        ("  waste: KV last-block tail", lambda s: format_bytes(s[waste]["kv_tail_bytes"]), "kv"),
        # per-token side tensors (indexer keys) narrower than their segments on some layers
        ("  waste: side-tensor slack", lambda s: format_bytes(s[waste].get("side_slack_bytes", 0)), "side"),
        ("  waste total", _waste_total, "all"),
        ("max concurrent requests", lambda s: f"{s['max_requests']:,}", "all"),
    ]
    if out.get("longest_context") is not None and not has_kv:  # with KV, the context row above is it
        spec.append(
            (
                f"longest context, {out['num_requests']} requests",
                lambda s: _context_text(s["longest_context_tokens"]),
                "all",
            )
        )
    if out.get("memory_for_requests") is not None:
        n = out["num_requests"]
        spec.append((f"cache for {n} requests", lambda s: format_bytes(s["memory_for_requests"]["cache_bytes"]), "all"))
        spec.append((f"{n} requests fit", lambda s: "yes" if s["memory_for_requests"]["fits"] else "no", "all"))
        if out.get("gpu"):
            spec.append(
                (
                    f"GPU memory for {n} at {out['gpu']['utilization']:g}",
                    lambda s: format_bytes(s["memory_for_requests"]["gpu_bytes_needed"]),
                    "all",
                )
            )
    show = {"all", "kv" if has_kv else "nokv"}
    if any(s[waste].get("side_slack_bytes", 0) for s in summaries):  # (indexed attention's side tensors)
        show.add("side")
    rows = [["", *(s["layout"] for s in summaries)]]
    rows += [[label, *(cell(s) for s in summaries)] for label, cell, which in spec if which in show]
    return rows


def _header(out: dict[str, Any]) -> list[str]:
    ctx = out["context_tokens"]
    what = f"context {ctx:,} tokens" if ctx is not None else f"{out['num_requests']} requests"
    gpu = out.get("gpu") or {}
    where = (
        f" (assumed: one {gpu['name'].upper()} per rank at {gpu['utilization']:g}, less the weights and the reserve; "
        "--gpu NAME or --gpu-memory SIZE to change)"
        if gpu.get("assumed")
        else ""
    )
    lines = [
        f"{out['model']}, TP{out['tp_size']}, cache budget {format_bytes(out['budget_bytes'])} per GPU{where}, {what}",
        _dtype_line(out["dtypes"], out["dtypes_source"]),
    ]
    lines += [f"  {k}: {v}" for k, v in out.get("dtype_sources", {}).items()]
    lines += out["explain"]
    return lines


def _format_table(out: dict[str, Any]) -> str:
    rows = _rows(out)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [*_header(out), ""]
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if out["notes"]:
        lines += ["", *(f"note: {n}" for n in out["notes"])]
    return "\n".join(lines)


def _format_md(out: dict[str, Any]) -> str:
    rows = _rows(out)
    rows[0][0] = "quantity"
    lines = [*(f"{line}  " for line in _header(out)), ""]
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
    lines += ["| " + " | ".join(c.strip() for c in r) + " |" for r in rows[1:]]
    if out["notes"]:
        lines += ["", *(f"- note: {n}" for n in out["notes"])]
    return "\n".join(lines)


def _format_csv(out: dict[str, Any]) -> str:
    rows = _rows(out)
    rows[0][0] = "quantity"
    n = len(rows[0]) - 1
    meta = [
        ["model", *[out["model"]] * n],
        ["tp_size", *[str(out["tp_size"])] * n],
        ["cache budget per GPU", *[format_bytes(out["budget_bytes"])] * n],
        ["dtypes", *[_dtype_line(out["dtypes"], out["dtypes_source"]).removeprefix("dtypes: ")] * n],
    ]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([rows[0], *meta, *([c.strip() for c in r] for r in rows[1:])])
    return buf.getvalue().rstrip("\n")


def plot_capacity(out: dict[str, Any], layouts: dict[str, Layout], path: Path) -> None:
    """Write one PNG or SVG: max concurrent requests against context length, one line per layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'hybridkv[reports]'") from None
    contexts = sorted({int(512 * 2 ** (i / 4)) for i in range(0, 4 * 11 + 1)})  # 512 .. 1M tokens
    caps = {kind: [layout.capacity(c).max_requests for c in contexts] for kind, layout in layouts.items()}
    two = "paged" in caps and "padded" in caps
    fig, axes = plt.subplots(2 if two else 1, 1, figsize=(7, 6 if two else 4), dpi=110, sharex=True, squeeze=False)
    ax = axes[0][0]
    for kind, ys in caps.items():
        ax.plot(contexts, [y if y > 0 else float("nan") for y in ys], marker=".", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("max concurrent requests")
    dt = _dtype_line(out["dtypes"], "").removeprefix("dtypes: ").removesuffix(" ()")
    ax.set_title(
        f"{out['model']} TP{out['tp_size']}, cache {format_bytes(out['budget_bytes'])} per GPU\n{dt}", fontsize=9
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if two:
        ratio = [p / q if q else float("nan") for p, q in zip(caps["paged"], caps["padded"], strict=True)]
        ax2 = axes[1][0]
        ax2.plot(contexts, ratio, marker=".", color="tab:green")
        ax2.axhline(1.0, color="grey", lw=0.8)
        ax2.set_ylabel("paged / padded requests")
        ax2.grid(True, which="both", alpha=0.3)
    axes[-1][0].set_xlabel("context per request (tokens)")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UserError(f"--plot: cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)

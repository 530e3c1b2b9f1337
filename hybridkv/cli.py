"""Command line: ``hybridkv plan`` (capacity and waste of a model in one block pool).

Every user error is one line on stderr starting with ``hybridkv: error:`` and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hybridkv.blockmgr.errors import HybridKVError
from hybridkv.blockmgr.layout import Layout, LayoutKind, plan
from hybridkv.blockmgr.presets import PRESET_NAMES
from hybridkv.blockmgr.spec_io import resolve_model
from hybridkv.blockmgr.units import format_bytes, parse_bytes, parse_tokens


class _UserError(Exception):
    pass


def _layout_summary(layout: Layout, context: int) -> dict[str, Any]:
    cap = layout.capacity(context)
    fp = cap.footprint
    return {
        "layout": layout.kind.value,
        "block_size": layout.block_size,
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


def _table(model_name: str, tp: int, budget: int, context: int, summaries: list[dict[str, Any]]) -> str:
    def row(label: str, fn) -> list[str]:
        return [label] + [fn(s) for s in summaries]

    rows = [
        ["", *[s["layout"] for s in summaries]],
        row("block size (tokens)", lambda s: f"{s['block_size']}"),
        row("block bytes per layer slot", lambda s: format_bytes(s["block_bytes"])),
        row(
            "layer slots x groups (state)",
            lambda s: f"{s['num_layer_slots']} x {s['num_groups']} ({s['num_state_groups']})",
        ),
        row("blocks per state", lambda s: ", ".join(str(b) for b in sorted(set(s["blocks_per_state"]))) or "-"),
        row("blocks in pool", lambda s: f"{s['num_blocks']:,}"),
        row("KV bytes / request", lambda s: format_bytes(s["kv_bytes_per_request"])),
        row("state bytes / request", lambda s: format_bytes(s["state_bytes_per_request"])),
        row(
            "blocks / request (KV + state)",
            lambda s: (
                f"{s['blocks_per_request']:,} ({s['kv_blocks_per_request']:,} + {s['state_blocks_per_request']:,})"
            ),
        ),
        row("allocated / request", lambda s: format_bytes(s["allocated_bytes_per_request"])),
        row("  waste: state tail", lambda s: format_bytes(s["waste_bytes_per_request"]["state_tail_bytes"])),
        row("  waste: padded slack", lambda s: format_bytes(s["waste_bytes_per_request"]["padded_slack_bytes"])),
        row("  waste: padding layers", lambda s: format_bytes(s["waste_bytes_per_request"]["padding_layer_bytes"])),
        row("  waste: KV last-block tail", lambda s: format_bytes(s["waste_bytes_per_request"]["kv_tail_bytes"])),
        row("  waste total", _waste_total),
        row("max concurrent requests", lambda s: f"{s['max_requests']:,}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{model_name}, TP{tp}, cache budget {format_bytes(budget)} per GPU, context {context:,} tokens",
        "",
    ]
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [n for s in summaries for n in s["notes"]]
    if notes:
        lines += ["", *(f"note: {n}" for n in dict.fromkeys(notes))]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        budget = parse_bytes(args.gpu_memory)
        context = parse_tokens(args.context)
    except ValueError as e:
        raise _UserError(str(e)) from None
    model = resolve_model(args.model, args.state_dtype, args.tp)
    kinds = [LayoutKind(args.layout)] if args.layout else [LayoutKind.PAGED, LayoutKind.PADDED]
    summaries = [_layout_summary(plan(model, budget, args.block_size, k), context) for k in kinds]
    if args.json:
        out = {
            "model": model.name,
            "tp_size": model.tp_size,
            "budget_bytes": budget,
            "context_tokens": context,
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "state_bytes_per_request": model.state_bytes,
            **{k: summaries[0][k] for k in ("layout", "block_size", "blocks_per_state", "max_requests")},
            "layouts": {s["layout"]: s for s in summaries},
        }
        print(json.dumps(out, indent=2))
    else:
        print(_table(model.name, model.tp_size, budget, context, summaries))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv", description="One paged memory manager for KV cache and recurrent state."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="capacity and waste of a model in one block pool, paged vs padded")
    p.add_argument(
        "--model", default="minimax-m1", help=f"preset ({', '.join(PRESET_NAMES)}) or spec file (.json/.toml)"
    )
    p.add_argument("--tp", type=_positive_int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--gpu-memory", default="80GiB", help="cache budget per GPU, e.g. 80GiB, 141GB (default 80GiB)")
    p.add_argument("--context", default="32k", help="tokens per request, e.g. 32k (default 32k)")
    p.add_argument(
        "--block-size", type=_positive_int, default=None, help="tokens per KV block (default 64; padded: minimum)"
    )
    p.add_argument(
        "--state-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the main recurrent state (default per model)",
    )
    p.add_argument(
        "--layout", choices=["paged", "padded"], default=None, help="show one layout (default: both side by side)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (HybridKVError, _UserError) as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

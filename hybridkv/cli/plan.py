"""``hybridkv plan``: capacity and waste of a model in one block pool, paged vs padded.

Every user error is one line on stderr starting with ``hybridkv: error:`` (or ``hybridkv plan:
error:`` for a bad option) and exit code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridkv.cli.common import UserError, number, positive_int, resolve_model_arg, size_arg
from hybridkv.cli.plan_output import (
    _context_text,
    _format_csv,
    _format_md,
    _format_table,
    _layout_summary,
    _pct,
    engine_dtype_note,
    model_dtypes,
    plot_capacity,
)
from hybridkv.errors import HybridKVError
from hybridkv.models import presets as P
from hybridkv.models.spec import (
    CONV_COLUMNS,
    KV_CACHE_DTYPES,
    STATE_SCALES,
    ModelSpec,
    state_scale_bytes,
    with_conv_columns,
    with_kv_dtype,
    with_state_scales,
)
from hybridkv.models.spec_file import is_spec_path, resolve_model
from hybridkv.planner.budget import DEFAULT_RESERVE_BYTES, cache_budget
from hybridkv.planner.layout import Layout, LayoutKind, plan
from hybridkv.units import format_bytes, parse_bytes, parse_tokens

# Re-exported: the formatting lives in plan_output, these names stay importable from here.
__all__ = ["build_plan", "cmd_plan", "engine_dtype_note", "longest_context", "model_dtypes", "plot_capacity"]

DEFAULT_GPU = P.DEFAULT_TP_GPU  # without --gpu / --gpu-memory: one of these per rank, at DEFAULT_UTILIZATION
DEFAULT_CONTEXT = "32k"
DEFAULT_UTILIZATION = P.DEFAULT_GPU_UTILIZATION

EXAMPLES = """\
examples:
  hybridkv plan                                         MiniMax-M1 at its default TP on H200s (0.9 of each), 32k context
  hybridkv plan --model gla-1.3b                        any preset; its default TP and dtypes are shown
  hybridkv plan --model qwen3-next-80b-a3b --gpu h200 --gpu-memory-utilization 0.9 --max-requests 64
                                                        the longest context 64 requests can have
  hybridkv plan --model qwen3-next-80b-a3b --max-model-len 128k --max-num-seqs 32
                                                        the cache 32 requests of 128k tokens need
  hybridkv plan --model path/to/model-dir --tp 2        a HuggingFace model directory (config.json)
  hybridkv plan --model examples/specs/my-hybrid.toml --format md
  hybridkv plan --model minimax-m1 --plot capacity.png  capacity against context, paged vs padded
"""


# ---- the question asked ------------------------------------------------------------------------
def longest_context(layout: Layout, num_requests: int) -> int | None:
    """Longest context (tokens) at which ``num_requests`` requests fit in ``layout``'s pool.

    ``None``: any length fits (no KV: a request's blocks do not grow with its tokens);
    ``0``: not even one token each fits.
    """
    if layout.capacity(1).max_requests < num_requests:
        return 0
    if layout.kv_group is None:
        return None
    lo, hi = 1, layout.num_usable_blocks * layout.block_size  # capacity(lo) >= n, capacity(hi + 1) < n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout.capacity(mid).max_requests >= num_requests:
            lo = mid
        else:
            hi = mid - 1
    return lo


def model_max_positions(model_path: str | None, preset_name: str | None) -> tuple[int, str] | None:
    """The longest context the model was built for, and where that figure was read: a config.json's
    ``max_position_embeddings``, or the figure from a preset's config.json (:data:`PRESET_MAX_POSITIONS`)."""
    if model_path is not None:
        from hybridkv.models.spec_file import read_spec_file

        try:
            data = read_spec_file(model_path)
        except HybridKVError:
            return None
        cfg = data.get("text_config", data) if isinstance(data, dict) else {}
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        return (value, "max_position_embeddings in its config.json") if isinstance(value, int) and value > 0 else None
    if preset_name in PRESET_MAX_POSITIONS:
        return PRESET_MAX_POSITIONS[preset_name], "max_position_embeddings in its config.json"
    return None


# max_position_embeddings of the preset's config.json (MiniMaxAI/MiniMax-M1-80k,
# Qwen/Qwen3-Next-80B-A3B-Instruct); presets not listed: unknown
PRESET_MAX_POSITIONS = {"minimax-m1": 10_240_000, "qwen3-next-80b-a3b": 262_144}


def check_answerable(
    model: ModelSpec, layouts: list[Layout], context: int | None, num_requests: int | None, model_path: str | None
) -> None:
    """Refuse (:class:`UserError`, one line) a question whose answer would be "nothing fits" or a
    context beyond the model's own maximum, instead of printing a table that contradicts it."""
    preset_name = None if model_path is not None else _preset_name(model.name)
    most = model_max_positions(model_path, preset_name)
    if context is not None and most is not None and context > most[0]:
        raise UserError(
            f"--context {context:,}: beyond {model.name}'s maximum of {most[0]:,} tokens ({most[1]}); "
            "ask for at most that"
        )
    if context is not None:
        fits = {lay.kind.value: lay.capacity(context).max_requests for lay in layouts}
        if not any(fits.values()):
            one = layouts[0]
            need = (one.footprint(context).num_blocks + 1) * one.bytes_per_block
            best = {lay.kind.value: longest_context(lay, 1) for lay in layouts}
            raise UserError(
                f"--context {context:,}: not even one request of that length fits: it needs "
                f"{format_bytes(need)} of cache per GPU ({one.kind.value}), the budget is "
                f"{format_bytes(one.budget_bytes)}; the longest context one request can have here: "
                + ", ".join(f"{k} {_context_text(v)}" for k, v in best.items())
            )
    if num_requests is not None and context is None:
        most_requests = {lay.kind.value: lay.capacity(1).max_requests for lay in layouts}
        if all(n < num_requests for n in most_requests.values()):
            raise UserError(
                f"--max-requests {num_requests:,}: that many requests do not fit even at one token each (each "
                "holds its state sets): at most "
                + ", ".join(f"{k} {n:,}" for k, n in most_requests.items())
                + " fit; lower --max-requests or raise the budget"
            )


# ---- the plan command ----------------------------------------------------------------------------
def _budget(args: argparse.Namespace, model: ModelSpec, preset_name: str | None) -> tuple[int, dict | None, list]:
    """Cache budget per GPU, the GPU facts (with ``--gpu``, or the default GPU when neither ``--gpu``
    nor ``--gpu-memory`` is given) and the lines that explain them."""
    if args.gpu_memory is not None:
        if args.gpu is not None:
            raise UserError(
                "give either --gpu NAME (a fraction of its memory) or --gpu-memory SIZE (the cache), not both"
            )
        for flag in ("gpu_memory_utilization", "weights", "reserve"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')} needs --gpu NAME (--gpu-memory SIZE is the cache itself)")
        asked = size_arg(args.gpu_memory, "--gpu-memory")
        return asked, None, _beyond_gpus(asked, model, preset_name)
    assumed = args.gpu is None
    gpu_name = DEFAULT_GPU if assumed else args.gpu
    util = DEFAULT_UTILIZATION if args.gpu_memory_utilization is None else args.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {util:g}")
    total = P.gpu_memory_bytes(gpu_name)
    if args.weights is not None:
        weights = size_arg(args.weights, "--weights", allow_zero=True)
        how = "--weights"
    elif preset_name is not None:
        weights = P.weight_bytes_per_gpu(preset_name, model.tp_size, args.weight_dtype)
        per = P.WEIGHT_DTYPE_BYTES[args.weight_dtype]
        how = f"{P.params_total(preset_name) / 1e9:g} B params x {per:g} bytes {args.weight_dtype} / TP{model.tp_size}"
    elif assumed:
        weights = 0
        how = "unknown, not subtracted: --weights SIZE per GPU, or the cache as --gpu-memory SIZE"
    else:
        raise UserError(f"the weights of {model.name!r} are unknown: give --weights SIZE (per GPU) with --gpu")
    reserve = DEFAULT_RESERVE_BYTES
    if args.reserve is not None:
        reserve = size_arg(args.reserve, "--reserve", allow_zero=True)
    rule = cache_budget(gpu_name, total, weights, util, reserve)
    budget = rule.budget_bytes
    line = rule.sum_text(how)
    if budget <= 0:
        raise UserError(f"no memory left for the cache: {line}; raise --tp or the utilization, or lower --reserve")
    gpu = {
        "name": gpu_name.lower(),
        "assumed": assumed,
        "memory_bytes": total,
        "utilization": util,
        "weights_bytes": weights,
        "reserve_bytes": reserve,
    }
    lines = [line + " (the rule hybridkv simulate uses too; --reserve SIZE to change the reserve)"]
    return budget, gpu, lines


def _beyond_gpus(asked: int, model: ModelSpec, preset_name: str | None) -> list[str]:
    """A line where a ``--gpu-memory`` cache is more than every GPU hybridkv knows can hold next to the
    model's weights per GPU (unknown weights: the GPU's whole memory), the check ``hybridkv simulate``
    refuses the same budget with; none otherwise."""
    weights = P.weight_bytes_per_gpu(preset_name, model.tp_size) if preset_name is not None else 0
    room = {gpu: P.gpu_memory_bytes(gpu) - weights for gpu in P.GPU_MEMORY_BYTES}
    largest = max(room, key=room.__getitem__)
    if asked <= room[largest]:
        return []
    of = f" less {format_bytes(weights)} of {preset_name} TP{model.tp_size} weights" if weights else ""
    return [
        f"--gpu-memory {format_bytes(asked)} is more cache than any GPU hybridkv knows holds: the largest, "
        f"one {largest.upper()}, has {format_bytes(P.gpu_memory_bytes(largest))}{of}, so at most "
        f"{format_bytes(room[largest])} (hybridkv simulate refuses this budget; the figures below assume it)"
    ]


def _size(text: str, flag: str, allow_zero: bool = False) -> int:
    if allow_zero and text.strip() in ("0", "0B", "0b"):
        return 0
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None


def spec_kind(path: str) -> str:
    """What a model path is, in words: ``a config.json`` (HuggingFace) or ``a hybridkv spec file``."""
    p = Path(path)
    return "a config.json" if p.is_dir() or p.name == "config.json" else "a hybridkv spec file"


def _preset_name(name: str) -> str | None:
    try:
        return P._canonical(name)
    except HybridKVError:
        return None


def build_plan(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Layout]]:
    """Everything ``hybridkv plan`` prints, as one JSON-ready dict (``layouts``: per layout kind), and the
    planned layouts by kind."""
    args.model, mapped = resolve_model_arg(args.model)
    from_file = is_spec_path(args.model)
    preset_name = None if from_file else _preset_name(args.model)
    explain: list[str] = [mapped] if mapped else []
    tp = args.tp
    if tp is None:
        if preset_name is None:
            tp = 1
            explain.append(f"TP1: {spec_kind(args.model)} names no tensor-parallel size (--tp N to shard it)")
        else:
            ref_gpu = args.gpu or P.DEFAULT_TP_GPU
            tp = P.default_tp(preset_name, ref_gpu, args.weight_dtype)
            explain.append(
                f"TP{tp}: default for {preset_name}, the smallest TP at which its {args.weight_dtype} weights "
                f"({P.params_total(preset_name) / 1e9:g} B params) take <= "
                f"{P.DEFAULT_TP_WEIGHT_FRACTION:.0%} of one {ref_gpu.upper()} (--tp to change)"
            )
    state_dtype = None if args.state_dtype in (None, "auto") else args.state_dtype
    conv_dtype = None if args.conv_dtype in (None, "auto") else args.conv_dtype
    model = _convert(resolve_model(args.model, state_dtype, tp, conv_dtype), args)
    budget, gpu, lines = _budget(args, model, preset_name)
    explain += lines
    num_requests = args.max_requests
    try:
        context = parse_tokens(args.context) if args.context is not None else None
    except ValueError as e:
        raise UserError(f"--context: {e}") from None
    if context is None and num_requests is None:
        context = parse_tokens(DEFAULT_CONTEXT)
    state_block = _size(args.state_block_bytes, "--state-block-bytes") if args.state_block_bytes else None
    has_kv = bool(model.attention_layer_ids)
    if state_block is not None and has_kv:
        raise UserError("--state-block-bytes is for models without attention (with attention, use --block-size)")
    kinds = [LayoutKind(args.layout)] if args.layout else [LayoutKind.PAGED, LayoutKind.PADDED]
    layouts = [plan(model, budget, args.block_size, k, state_block_bytes=state_block) for k in kinds]

    check_answerable(model, layouts, context, num_requests, args.model if from_file else None)
    scales = state_scale_bytes(model)
    if scales:  # a quantized state: its scale bytes, and the capacity beside a float32 state
        base = _convert(resolve_model(args.model, "float32", tp, conv_dtype), args)
        explain.append(_quantized_state_line(model, base, scales, budget, args, kinds, context or 1))
    summaries = []
    longest: dict[str, int | None] = {}
    for layout in layouts:
        ctx = context
        if context is None:
            longest[layout.kind.value] = best = longest_context(layout, num_requests)
            ctx = best if best else parse_tokens(DEFAULT_CONTEXT) if best is None else 1
        s = _layout_summary(layout, ctx)
        if context is None:
            s["longest_context_tokens"] = longest[layout.kind.value]
        if context is not None and num_requests is not None:
            cache = (num_requests * s["blocks_per_request"] + 1) * layout.bytes_per_block  # + the null block
            need = {"requests": num_requests, "cache_bytes": cache, "fits": num_requests <= s["max_requests"]}
            if gpu is not None:
                need["gpu_bytes_needed"] = int(
                    (cache + gpu["weights_bytes"] + gpu["reserve_bytes"]) / gpu["utilization"]
                )
            s["memory_for_requests"] = need
        summaries.append(s)
    notes = list(dict.fromkeys([*model.notes, *(n for s in summaries for n in s["notes"])]))
    engines = engine_dtype_note(model)
    if engines is not None:
        notes.append(engines)
    if model.conv_columns == "kernel":
        notes.append("conv windows keep kernel_size columns (--conv-columns kernel, as transformers keeps them)")
    if not has_kv and len(summaries) > 1:
        summaries.sort(key=lambda s: (-s["max_requests"], s["waste_bytes_per_request"]["total_bytes"]))
        paged = next(s for s in summaries if s["layout"] == "paged")
        paged_waste = _pct(paged["waste_bytes_per_request"]["total_bytes"], paged["allocated_bytes_per_request"])
        notes.append(
            f"no attention: blocks hold only states. paged splits each state into {format_bytes(paged['block_bytes'])} "
            f"blocks (waste {paged_waste}"
            "; smaller blocks make checkpoints and swaps finer), padded gives each state one block of its own size. "
            f"Shown first: {summaries[0]['layout']} (more requests, then less waste); "
            "--state-block-bytes SIZE sets paged's block"
        )
    if num_requests is not None and context is None:
        explain.append(
            f"longest context for {num_requests} requests: "
            + ", ".join(f"{k} {_context_text(v)}" for k, v in longest.items())
            + " (table columns at that context)"
        )
    first = summaries[0]
    by_kind = {layout.kind.value: layout for layout in layouts}
    out = {
        "model": model.name,
        "tp_size": model.tp_size,
        "budget_bytes": budget,
        "gpu": gpu,
        "context_tokens": context,
        "num_requests": num_requests,
        "longest_context": longest or None,
        "memory_for_requests": first.get("memory_for_requests"),
        "dtypes": model_dtypes(model),
        "dtypes_source": "this model's defaults; --state-dtype to change"
        if state_dtype is None or from_file
        else "--state-dtype",
        "dtype_sources": dict(model.dtype_sources),
        "state_tail_fraction": {s["layout"]: by_kind[s["layout"]].state_tail_fraction for s in summaries},
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "state_bytes_per_request": model.state_bytes,
        "state_scale_bytes_per_request": scales,
        **{k: first[k] for k in ("layout", "block_size", "blocks_per_state", "max_requests")},
        "layouts": {s["layout"]: s for s in summaries},
        "explain": explain,
        "notes": notes,
    }
    return out, {s["layout"]: by_kind[s["layout"]] for s in summaries}


def _convert(model: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """``model`` with the --kv-dtype, --state-scales and --conv-columns choices applied."""
    if args.kv_dtype not in (None, "auto"):
        model = with_kv_dtype(model, args.kv_dtype)  # attention only; states keep their dtype
    if getattr(args, "state_scales", None):
        model = with_state_scales(model, args.state_scales)
    if args.conv_columns:
        model = with_conv_columns(model, args.conv_columns)
    return model


def _quantized_state_line(
    model: ModelSpec, base: ModelSpec, scales: int, budget: int, args: argparse.Namespace, kinds: list, context: int
) -> str:
    """One line: the quantized state's bytes and scale bytes per request, and the requests that fit
    against the same model with a float32 state (same budget, block size and layouts)."""
    state_block = _size(args.state_block_bytes, "--state-block-bytes") if args.state_block_bytes else None
    fits = []
    for k in kinds:
        n = plan(model, budget, args.block_size, k, state_block_bytes=state_block).capacity(context).max_requests
        b = plan(base, budget, args.block_size, k, state_block_bytes=state_block).capacity(context).max_requests
        fits.append(f"{k.value} {n:,} vs {b:,} ({n / b:.2f}x)" if b else f"{k.value} {n:,} vs 0")
    return (
        f"quantized state: {format_bytes(model.state_bytes)} per request, of which {format_bytes(scales)} "
        f"float32 scales ({scales / model.state_bytes:.1%}); float32 state {format_bytes(base.state_bytes)}. "
        f"Requests of {context:,} tokens that fit, against a float32 state: " + ", ".join(fits)
    )


def cmd_plan(args: argparse.Namespace) -> int:
    if args.json:
        args.format = "json"
    if args.plot is not None and Path(args.plot).suffix.lower() not in (".png", ".svg"):
        raise UserError(f"--plot {args.plot!r}: the file name must end in .png or .svg")
    out, layouts = build_plan(args)
    if args.format == "json":
        text = json.dumps(out, indent=2)
    else:
        text = {"table": _format_table, "md": _format_md, "csv": _format_csv}[args.format](out)
    print(text)
    if args.plot is not None:
        plot_capacity(out, layouts, Path(args.plot))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="capacity and waste of a model in one block pool, paged vs padded",
        description="Capacity and waste of a model's KV cache and recurrent state in one block pool, "
        "paged (this library) against padded (vLLM v1's one-state-per-page rule).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="minimax-m1",
        help=f"preset ({', '.join(P.PRESET_NAMES)}), a spec file (.json/.toml), a HuggingFace config.json "
        "or a model directory holding one (default minimax-m1)",
    )
    m.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        dest="tp",
        type=positive_int,
        default=None,
        help="tensor-parallel size (default: per preset, shown; spec files: 1)",
    )
    m.add_argument(
        "--state-dtype",
        "--mamba-ssm-cache-dtype",
        dest="state_dtype",
        choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "float8_e4m3"],
        default=None,
        help="dtype of the main recurrent state (ssm / kv / wkv; default/auto: what the model's config or "
        "code keeps, shown with its source in the output); int8 / fp8: quantized, with float32 scales "
        "stored in the state set (--state-scales)",
    )
    m.add_argument(
        "--state-scales",
        choices=list(STATE_SCALES),
        default=None,
        help="scale granularity of an int8 / fp8 state: row (default: one per head and row), head or tensor",
    )
    m.add_argument(
        "--conv-dtype",
        "--mamba-conv-cache-dtype",
        dest="conv_dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the conv windows and token shifts (default/auto: the model dtype)",
    )
    m.add_argument(
        "--conv-columns",
        choices=list(CONV_COLUMNS),
        default=None,
        help="conv window columns: kernel-1 (default: all a decode reads; vLLM, FastDeploy) or kernel "
        "(what transformers keeps)",
    )
    m.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        choices=["auto", *KV_CACHE_DTYPES],
        default=None,
        help="KV cache dtype as FastDeploy serves it: int8 / fp8 (uint8 storage), block_wise_fp8 "
        "(+ float32 scales per token and head); the recurrent state keeps its own dtype",
    )
    b = p.add_argument_group("memory: an absolute cache budget, or a fraction of a named GPU")
    b.add_argument(
        "--gpu-memory",
        "--kv-cache-memory",
        dest="gpu_memory",
        default=None,
        help=f"cache budget per GPU, e.g. 80GiB, 141GB (default: {DEFAULT_UTILIZATION:g} of one "
        f"{DEFAULT_GPU.upper()} less the weights)",
    )
    b.add_argument(
        "--gpu",
        default=None,
        help=f"GPU ({', '.join(P.GPU_MEMORY_BYTES)}): cache = its memory x utilization - weights - reserve",
    )
    b.add_argument(
        "--gpu-memory-utilization",
        type=number,
        default=None,
        help=f"fraction of the GPU's memory the engine may use (default {DEFAULT_UTILIZATION}, as vLLM)",
    )
    b.add_argument(
        "--weight-dtype",
        choices=list(P.WEIGHT_DTYPE_BYTES),
        default="bfloat16",
        help="bytes per weight for presets: total params x this / TP (default bfloat16)",
    )
    b.add_argument(
        "--weights", default=None, help="weight bytes per GPU (overrides the preset's; needed for spec files)"
    )
    b.add_argument(
        "--reserve", default=None, help="bytes per GPU kept for activations and CUDA graphs (default 6GiB, as simulate)"
    )
    q = p.add_argument_group("question: capacity at a context, or the longest context / memory for N requests")
    q.add_argument(
        "--context",
        "--max-model-len",
        dest="context",
        default=None,
        help=f"tokens per request, e.g. 32k (default {DEFAULT_CONTEXT}; with --max-requests only: "
        "the longest context is computed)",
    )
    q.add_argument(
        "--max-requests",
        "--max-num-seqs",
        dest="max_requests",
        type=positive_int,
        default=None,
        help="N concurrent requests: alone, the longest context they can have; with --context, the cache they need",
    )
    lay = p.add_argument_group("layout")
    lay.add_argument(
        "--block-size", type=positive_int, default=None, help="tokens per KV block (default 64; padded: minimum)"
    )
    lay.add_argument(
        "--state-block-bytes",
        default=None,
        help="models without attention: paged block bytes per layer slot, e.g. 64KiB "
        "(default: largest power of two from 256 KiB with < 1%% state tail)",
    )
    lay.add_argument(
        "--layout", choices=["paged", "padded"], default=None, help="show one layout (default: both side by side)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--format", choices=["table", "json", "csv", "md"], default="table", help="default table")
    o.add_argument("--json", action="store_true", help="same as --format json")
    o.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also write capacity against context, paged vs padded, as FILE (.png or .svg; needs matplotlib)",
    )
    p.set_defaults(func=cmd_plan)
    return p


add_parser = add_plan_parser  # the command module's interface (hybridkv.cli.COMMAND_MODULES)
run = cmd_plan

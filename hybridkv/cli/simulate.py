"""``hybridkv simulate``: preemption and swap simulation runs and memory-pressure reports.

A command module of :mod:`hybridkv.cli` (``add_parser`` / ``run``). Imports of the simulator happen in
:func:`run`, so other commands start without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from typing import Any

from hybridkv.cli.common import positive_int

ACTIVATION_RESERVE_GIB = 6  # kept free per GPU for activations and CUDA graphs by the default cache budget
# keys of --compare that change the model or the GPU: the default budget (computed for one) would not fit
_BUDGET_KEYS = ("model", "tp", "gpu")

EXAMPLES = """\
examples:
  hybridkv simulate                                   MiniMax-M1 TP8, H200, 14 GiB cache, synthetic workload
  hybridkv simulate --compare layout=paged,padded preemption=recompute,swap,auto
  hybridkv simulate --engine vllm                     vLLM 0.33's policies on its own layout (emulated)
  hybridkv simulate --compare engine=hybridkv,vllm    vLLM 0.33 (emulated), then one column per policy switched
  hybridkv simulate --trace ../shared/traces/mooncake_synthetic_trace.jsonl --trace-limit 500 --rate-scale 0.5
  hybridkv simulate --model qwen3-next                Qwen3-Next at its default TP2 and budget on H200s
  hybridkv simulate --model qwen3-next --tp 2 --gpu-memory 40GiB --speculative 2 --out qwen-report
"""


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``subparsers``; returns its parser (``run`` is its function)."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a workload through the real scheduler and manager; memory-pressure reports",
        description="Replay a workload (synthetic, or a Mooncake-style jsonl trace) through the real scheduler "
        "and block manager on a roofline GPU cost model; writes report.json, report.md and report.html.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model and GPU")
    m.add_argument("--model", default="minimax-m1", help="preset or spec file (default minimax-m1)")
    m.add_argument(
        "--tp", type=positive_int, default=None, help="tensor-parallel size (default: the preset's, as hybridkv plan)"
    )
    m.add_argument("--state-dtype", choices=["float32", "bfloat16", "float16"], default=None)
    m.add_argument("--gpu", default="h200", help="h200, h100, a100 or a GPU JSON file (default h200)")
    m.add_argument("--calibration", default=None, help="measured JSON replacing roofline figures (ops benchmark)")
    m.add_argument(
        "--gpu-memory",
        default=None,
        help="cache budget per GPU (default: 0.9 of the --gpu preset less the weights per GPU and "
        f"{ACTIVATION_RESERVE_GIB} GiB for activations, whole GiB; MiniMax-M1 TP8 on H200: 14GiB)",
    )
    m.add_argument("--host-memory", default="256GiB", help="host swap pool per GPU, 0 = none (default 256GiB)")
    s = p.add_argument_group("layout and scheduler")
    s.add_argument("--engine", choices=["hybridkv", "vllm"], default="hybridkv",
                   help="vllm: vLLM 0.33's policies on its own layout, emulated (fixes layout, block size, "
                   "admission, preemption, host pool, watermark, prefix caching; see docs/simulate.md)")
    s.add_argument("--admission", choices=["reserved", "full_prompt", "first_chunk"], default="reserved",
                   help="when a waiting request is admitted (default reserved: its prompt and decode room fit "
                   "next to what running prefills were promised; full_prompt: vLLM's rule)")
    s.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block (default 64)")
    s.add_argument("--layout", choices=["paged", "padded"], default="paged")
    s.add_argument("--preemption", choices=["recompute", "swap", "auto"], default="auto")
    s.add_argument("--prefix", choices=["none", "lru", "flop_aware"], default="lru", help="prefix cache eviction")
    s.add_argument("--checkpoint", default="branch_spaced", help="checkpoint policy",
                   choices=["none", "every_n_blocks", "branch_and_last", "branch_last_aligned", "branch_spaced",
                            "vllm_align"])
    s.add_argument("--speculative", type=_nonneg_int, default=0, help="draft tokens per decode step")
    s.add_argument("--accept-rate", type=_fraction, default=0.7, help="draft acceptance probability")
    s.add_argument("--max-num-seqs", type=positive_int, default=256)
    s.add_argument("--max-batched-tokens", type=positive_int, default=8192)
    s.add_argument("--watermark", type=_fraction, default=0.01)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="Mooncake-style jsonl trace (default: the synthetic workload)")
    w.add_argument("--trace-limit", type=positive_int, default=None, help="first N requests of the window")
    w.add_argument("--trace-start", type=_seconds, default=0.0, help="window start, seconds of trace time")
    w.add_argument("--trace-end", type=_seconds, default=None, help="window end (after the start), seconds")
    w.add_argument("--rate-scale", type=_positive_float, default=1.0, help="arrival rate multiplier")
    w.add_argument("--max-output-tokens", type=positive_int, default=None, help="truncate outputs")
    w.add_argument("--requests", type=positive_int, default=None, help="synthetic: number of requests")
    w.add_argument("--rate", type=_positive_float, default=None, help="synthetic: requests per second")
    w.add_argument("--arrivals", choices=["poisson", "gamma"], default=None, help="synthetic arrival process")
    w.add_argument("--prompt-median", type=positive_int, default=None, help="synthetic: median prompt tokens")
    w.add_argument("--output-median", type=positive_int, default=None, help="synthetic: median output tokens")
    w.add_argument("--seed", type=int, default=0, help="workload and acceptance seed (default 0)")
    r = p.add_argument_group("runs and reports")
    r.add_argument("--compare", nargs="+", default=None, metavar="KEY=V1,V2", help="configurations to compare")
    r.add_argument("--workers", type=positive_int, default=None, help="processes for --compare (default: CPUs)")
    r.add_argument("--ray", default=None, metavar="ADDRESS", help="run --compare on Ray ('local' starts one)")
    r.add_argument("--out", default="hybridkv-report", help="report folder (default ./hybridkv-report)")
    r.add_argument("--integrity-every", type=positive_int, default=500, help="steps between integrity checks")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _workload(args: argparse.Namespace) -> Any:
    from hybridkv.sim.workload import Arrivals, SyntheticConfig, from_trace, synthetic

    if args.trace is not None:
        try:
            return from_trace(
                args.trace, args.trace_limit, args.trace_start, args.trace_end, args.rate_scale, args.max_output_tokens
            )
        except OSError as e:  # a missing or unreadable file: one line, exit 2
            raise ValueError(str(e)) from None
    changes: dict[str, Any] = {"seed": args.seed}
    for flag, field in (("requests", "num_requests"), ("rate", "rate"), ("prompt_median", "prompt_median")):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if args.output_median is not None:
        changes["output_median"] = args.output_median
    if args.arrivals is not None:
        changes["arrivals"] = Arrivals(args.arrivals)
    if args.max_output_tokens is not None:
        changes["max_output_tokens"] = args.max_output_tokens
    cfg = SyntheticConfig(**changes)
    if args.rate_scale != 1.0:
        cfg = SyntheticConfig(**(changes | {"rate": cfg.rate * args.rate_scale}))
    return synthetic(cfg)


def check_args(args: argparse.Namespace) -> None:
    """Checks across flags, before any work: raises ``ValueError`` (one line, exit 2) naming them."""
    if args.trace_end is not None and args.trace_end <= args.trace_start:
        raise ValueError(
            f"--trace-end {args.trace_end:g} must be after --trace-start {args.trace_start:g}: the window "
            "[start, end) of trace time would hold no request"
        )


def model_defaults(args: argparse.Namespace) -> list[str]:
    """Fill ``args.tp`` and ``args.gpu_memory`` where not given, from the model and the GPU as
    ``hybridkv plan`` does (TP: the preset's default; cache: 0.9 of the GPU less the weights per GPU
    and :data:`ACTIVATION_RESERVE_GIB`, rounded down to whole GiB). Returns the lines that say what
    was assumed; raises ``ValueError`` (exit 2) where it cannot be known, before any work."""
    from hybridkv.models import presets as P
    from hybridkv.models.spec_file import is_spec_path

    name = None if is_spec_path(args.model) else P._canonical(args.model)  # (an unknown name raises)
    said = []
    if args.tp is None:
        if name is None:
            args.tp = 1
            said.append("TP1: spec files default to TP1 (--tp to change)")
        else:
            args.tp = P.default_tp(name, args.gpu if args.gpu.lower() in P.GPU_MEMORY_BYTES else P.DEFAULT_TP_GPU)
            said.append(f"TP{args.tp}: the default for {name} (--tp to change)")
    if args.gpu_memory is None:
        varied = [a.partition("=")[0].strip() for a in args.compare or []]
        if any(k in _BUDGET_KEYS for k in varied):
            raise ValueError("--compare varies the model, TP or GPU: give the cache budget as --gpu-memory SIZE")
        if name is None or args.gpu.lower() not in P.GPU_MEMORY_BYTES:
            raise ValueError(
                "--gpu-memory SIZE is needed: the default budget subtracts the weights of a preset model from a "
                f"named GPU ({', '.join(P.GPU_MEMORY_BYTES)})"
            )
        total, weights = P.gpu_memory_bytes(args.gpu), P.weight_bytes_per_gpu(name, args.tp)
        budget = int(P.DEFAULT_GPU_UTILIZATION * total) - weights - ACTIVATION_RESERVE_GIB * 2**30
        if budget < 2**30:
            raise ValueError(
                f"{name} at TP{args.tp} leaves no cache on one {args.gpu.upper()} (weights "
                f"{weights / 2**30:.1f} GiB per GPU): raise --tp or give --gpu-memory SIZE"
            )
        args.gpu_memory = f"{budget // 2**30}GiB"
        said.append(
            f"cache {args.gpu_memory} per GPU: {P.DEFAULT_GPU_UTILIZATION:g} x {args.gpu.upper()} "
            f"{total / 2**30:.1f} GiB - weights {weights / 2**30:.1f} GiB - {ACTIVATION_RESERVE_GIB} GiB for "
            "activations, rounded down (--gpu-memory to change)"
        )
    return said


def run(args: argparse.Namespace) -> int:
    """Run the simulation(s), write the reports, print where they are and the comparison table.
    Bad flags, an empty trace or an empty trace window are refused before any simulation runs."""
    check_args(args)
    assumed = model_defaults(args)  # said once every check passed (an error stays one line)
    from hybridkv.sim.compare import expand, run_all
    from hybridkv.sim.config import SimConfig
    from hybridkv.sim.report import comparison_table, write_reports

    t0 = time.perf_counter()
    base = SimConfig(
        model=args.model,
        tp=args.tp,
        state_dtype=args.state_dtype,
        gpu=args.gpu,
        gpu_calibration=args.calibration,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        block_size=args.block_size,
        layout=args.layout,
        preemption=args.preemption,
        prefix=args.prefix,
        checkpoint=args.checkpoint,
        speculative=args.speculative,
        accept_rate=args.accept_rate,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        watermark=args.watermark,
        admission=args.admission,
        engine=args.engine,
        integrity_every=args.integrity_every,
        seed=args.seed,
    )
    configs = expand(base, args.compare) if args.compare else [base]
    if importlib.util.find_spec("matplotlib") is None:
        print("hybridkv: note: report.html will have no plots: pip install 'hybridkv[reports]'", file=sys.stderr)
    from hybridkv.sim.config import build_layout

    for c in configs:  # bad sizes and models fail here, in one line, before any run starts
        build_layout(c)
    workload = _workload(args)
    workload.check_runnable()  # an empty trace or window: one line, exit 2, no zero-step run
    for line in assumed:
        print(f"hybridkv simulate: {line}", file=sys.stderr)
    summaries = run_all(configs, workload, args.workers, progress=not args.no_progress, ray_address=args.ray)
    paths = write_reports(summaries, args.out)
    for row in comparison_table(summaries):
        print("  ".join(f"{c:<28}" if i == 0 else f"{c:>22}" for i, c in enumerate(row)))
    print(f"\nreports ({time.perf_counter() - t0:.1f} s wall): {', '.join(str(p) for p in paths)}")
    return 0

"""``hybridkv simulate``: preemption and swap simulation runs and memory-pressure reports.

A command module of :mod:`hybridkv.cli` (``add_parser`` / ``run``). Imports of the simulator happen in
:func:`run`, so other commands start without them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import sys
import time
from typing import Any

from hybridkv.cli.common import positive_int, resolve_model_arg, size_arg
from hybridkv.planner.budget import GIB, cache_budget

# keys of --compare that change the model or the GPU: the default budget (computed for one) would not fit
_BUDGET_KEYS = ("model", "tp", "gpu")

EXAMPLES = """\
examples:
  hybridkv simulate                                   MiniMax-M1 TP8, H200, 14 GiB cache, synthetic workload:
                                                      hybridkv's defaults beside vLLM 0.33's (emulated)
  hybridkv simulate --compare layout=paged,padded preemption=recompute,swap,auto
  hybridkv simulate --engine hybridkv                 hybridkv alone (--engine vllm: vLLM 0.33's policies alone)
  hybridkv simulate --compare engine=hybridkv,vllm    vLLM 0.33 (emulated), then one column per policy switched
  hybridkv simulate --trace ../shared/traces/mooncake_synthetic_trace.jsonl --trace-limit 500 --rate-scale 0.5
  hybridkv simulate --model qwen3-next                Qwen3-Next at its default TP2 and budget on H200s
  hybridkv simulate --model qwen3-next --tp 2 --gpu-memory 40GiB --speculative 2 --out hybridkv-report-qwen
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


class _Given(argparse.Action):
    """argparse's ``store``, and the flag's ``dest`` added to ``namespace.given``: the flags the user
    wrote, so that one the chosen mode would ignore is refused even when it repeats the default."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = set(getattr(namespace, "given", ())) | {self.dest}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``subparsers``; returns its parser (``run`` is its function). The parsed
    namespace has ``given``: the ``dest`` of every option written on the command line."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a workload through the real scheduler and manager; memory-pressure reports",
        description="Replay a workload (synthetic, or a Mooncake-style jsonl trace) through the real scheduler "
        "and block manager on a roofline GPU cost model; writes report.json, report.md and report.html. "
        "A flag that the chosen mode ignores is an error (e.g. --requests with --trace).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.register("action", None, _Given)  # every plain option records that it was given (argparse's default action)
    p.register("action", "store", _Given)
    p.set_defaults(given=set())
    m = p.add_argument_group("model and GPU")
    m.add_argument("--model", default="minimax-m1", help="preset or spec file (default minimax-m1)")
    m.add_argument(
        "--tp", type=positive_int, default=None, help="tensor-parallel size (default: the preset's, as hybridkv plan)"
    )
    m.add_argument("--state-dtype", choices=["float32", "bfloat16", "float16", "int8", "fp8"], default=None)
    m.add_argument("--gpu", default="h200", help="h200, h100, a100 or a GPU JSON file (default h200)")
    m.add_argument("--calibration", default=None, help="measured JSON replacing roofline figures (ops benchmark)")
    m.add_argument(
        "--gpu-memory",
        default=None,
        help="cache budget per GPU (default: 0.9 x the --gpu's memory - the weights per GPU - 6 GiB for "
        "activations, rounded down to whole GiB, as hybridkv plan; MiniMax-M1 TP8 on H200: 14GiB)",
    )
    m.add_argument("--host-memory", default="256GiB", help="host swap pool per GPU, 0 = none (default 256GiB)")
    m.add_argument(
        "--host-cache",
        default="0",
        help="the prefix cache's host tier per GPU, added to the host pool swaps use (swaps win); 0 = none (default)",
    )
    s = p.add_argument_group("layout and scheduler")
    s.add_argument("--engine", choices=["hybridkv", "vllm"], default=None,
                   help="run one engine only (default: hybridkv's configuration and, beside it on the same "
                   "workload, vLLM 0.33's policies on its own layout, emulated: its layout, block size, admission, "
                   "preemption, host pool, watermark and prefix caching; see docs/simulate.md)")
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
    s.add_argument("--checkpoint-export", type=_nonneg_int, default=-1, metavar="TOKENS",
                   help="the recurrent prefill kernel writes states inside a chunk on this grid; 0: it cannot, a "
                   "chunk ends at each checkpoint (default: hybridkv's kernels: MiniMax's lightning can, GDN cannot)")
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
    r.add_argument("--out", default="hybridkv-report", help="report folder, written once every run finished "
                   "(default ./hybridkv-report; git ignores hybridkv-report*/)")
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


# flags that only the synthetic workload reads, and only a trace (argparse dests)
_SYNTHETIC_ONLY = ("requests", "rate", "arrivals", "prompt_median", "output_median")
_TRACE_ONLY = ("trace_limit", "trace_start", "trace_end")
# --compare key (as expand spells it) -> the flag (argparse dest) that sets the same field
_COMPARE_FLAG = {"layout": "layout", "preemption": "preemption", "prefix": "prefix", "checkpoint": "checkpoint",
                 "gpu-memory": "gpu_memory", "budget": "gpu_memory", "host-memory": "host_memory",
                 "host-cache": "host_cache", "checkpoint-export": "checkpoint_export",
                 "block-size": "block_size", "speculative": "speculative", "max-num-seqs": "max_num_seqs",
                 "max-batched-tokens": "max_batched_tokens", "model": "model", "tp": "tp", "gpu": "gpu",
                 "watermark": "watermark", "admission": "admission", "engine": "engine",
                 "state-dtype": "state_dtype"}
# what --engine vllm fixes (hybridkv.sim.engines.VLLM_POLICIES and its block size / checkpoints): flag dests
_VLLM_FIXES = ("layout", "admission", "preemption", "host_memory", "host_cache", "watermark", "speculative",
               "accept_rate", "block_size", "checkpoint", "checkpoint_export")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _compared(args: argparse.Namespace) -> dict[str, list[str]]:
    """``--compare``'s keys (spelt as :func:`~hybridkv.sim.compare.expand` spells them) -> values as written."""
    out: dict[str, list[str]] = {}
    for axis in args.compare or []:
        key, _, text = axis.partition("=")
        out[key.strip().replace("_", "-")] = [v.strip() for v in text.split(",")]
    return out


def check_out(out: str) -> None:
    """Refuse, before any work, a report folder that cannot be written: an existing path that is not a
    folder, a file on the way to it, or a place where this user cannot create or write files."""
    import os
    import tempfile
    from pathlib import Path

    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder (report.json, .md and .html go into a folder)")
    probe = p
    while not probe.exists():  # the deepest part of the path that exists must be a folder we may write into
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ValueError(f"--out {out}: {probe} is a file, not a folder")
    try:  # the real test (permissions, a read-only or pseudo file system, root's access too)
        os.rmdir(tempfile.mkdtemp(prefix=".hybridkv-write-check-", dir=probe))
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write into {probe} ({e.strerror or e})") from None


def write_atomically(summaries: list[dict[str, Any]], out: str) -> list[Any]:
    """:func:`~hybridkv.sim.report.write_reports` into a hidden temporary folder, then moved to
    ``out`` (renamed to it when it does not exist, each file replaced in it when it does), so an
    interrupted or failed write leaves no partial report. Returns the final paths."""
    import os
    import secrets
    import shutil
    from pathlib import Path

    from hybridkv.sim.report import write_reports

    dest = Path(out)
    home = dest if dest.is_dir() else dest.parent
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".hybridkv-report-partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # (mkdir, not mkdtemp: the folder keeps the umask's permissions once renamed)
    try:
        paths = write_reports(summaries, tmp)
        if not dest.exists():
            tmp.rename(dest)
            return [dest / p.relative_to(tmp) for p in paths]
        for entry in sorted(tmp.iterdir()):
            target = dest / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
        return [dest / p.relative_to(tmp) for p in paths]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _quantized(name: str | None) -> bool:
    """Whether a state dtype name is a quantized (int8 / fp8) one (an unknown name: refused later)."""
    from hybridkv.models.spec import DType

    with contextlib.suppress(Exception):
        return name is not None and DType.parse(name, quantized=True).quantized
    return False


def check_args(args: argparse.Namespace) -> None:
    """Checks across flags, before any work: raises ``ValueError`` (one line, exit 2) naming them. A
    flag that the chosen mode ignores (a workload flag of the other workload, a flag that ``--compare``
    or ``--engine vllm`` overrides, ``--workers`` / ``--ray`` without ``--compare``) is refused."""
    given = set(getattr(args, "given", ()))
    compared = _compared(args)
    if args.trace is not None:
        bad = [d for d in _SYNTHETIC_ONLY if d in given]
        if bad:
            raise ValueError(
                f"{_flag(bad[0])} is for the synthetic workload: --trace replays the trace's own requests "
                "(choose them with --trace-limit / --trace-start / --trace-end, the rate with --rate-scale)"
            )
    else:
        bad = [d for d in _TRACE_ONLY if d in given]
        if bad:
            raise ValueError(f"{_flag(bad[0])} needs --trace FILE: the synthetic workload has no trace window")
    for dest in ("gpu_memory", "host_memory", "host_cache"):  # sizes: named by their flag (--compare's by their key)
        text = getattr(args, dest)
        if text is not None:
            size_arg(text, _flag(dest), allow_zero=dest != "gpu_memory")
    for key in ("gpu-memory", "budget", "host-memory", "host-cache"):
        for text in compared.get(key, []):
            size_arg(text, f"--compare {key}=", allow_zero=key.startswith("host"))
    if args.trace_end is not None and args.trace_end <= args.trace_start:
        raise ValueError(
            f"--trace-end {args.trace_end:g} must be after --trace-start {args.trace_start:g}: the window "
            "[start, end) of trace time would hold no request"
        )
    for key in compared:
        dest = _COMPARE_FLAG.get(key)
        if dest is not None and dest in given:
            raise ValueError(f"{_flag(dest)} and --compare {key}=... both set it: drop one")
    engines = compared.get("engine", [args.engine or "hybridkv"])
    if engines and all(e == "vllm" for e in engines):  # every configuration runs vLLM's policies
        fixed = [d for d in _VLLM_FIXES if d in given] + [k for k in compared if _COMPARE_FLAG.get(k) in _VLLM_FIXES]
        if fixed:
            what = f"--compare {fixed[0]}=..." if fixed[0] in compared else _flag(fixed[0])
            raise ValueError(
                f"--engine vllm fixes what {what} sets (vLLM 0.33's policies, see docs/simulate.md): drop it, "
                "or compare both engines with --compare engine=hybridkv,vllm"
            )
        if args.prefix not in ("none", "lru"):
            raise ValueError(f"--prefix {args.prefix}: vLLM's prefix cache evicts lru (--prefix lru or none)")
    default = args.compare is None and args.engine is None  # (vLLM 0.33 beside hybridkv)
    narrow = [d for d in compared.get("state-dtype", [args.state_dtype]) if _quantized(d)]
    if narrow and ("vllm" in compared.get("engine", []) or args.engine == "vllm" or default):
        raise ValueError(
            f"state dtype {narrow[0]}: vLLM 0.33 keeps no int8 / fp8 recurrent state, so its column would "
            "not be vLLM's: run hybridkv alone (--engine hybridkv, or --compare state-dtype=... --engine hybridkv)"
        )
    if "checkpoint" in given and args.prefix == "none" and "prefix" not in compared:
        raise ValueError("--checkpoint with --prefix none changes nothing: checkpoints are the prefix cache's")
    if "host_cache" in given and args.host_cache != "0" and args.prefix == "none" and "prefix" not in compared:
        raise ValueError("--host-cache with --prefix none changes nothing: the host tier is the prefix cache's")
    speculative = "speculative" in compared or args.speculative > 0
    if "accept_rate" in given and not speculative:
        raise ValueError("--accept-rate needs --speculative K > 0 (or --compare speculative=...): no draft to accept")
    if "seed" in given and args.trace is not None and not speculative:
        raise ValueError("--seed with --trace changes nothing without --speculative (it seeds synthetic "
                         "workloads and draft acceptance)")
    if args.compare is None and args.engine is not None:
        for dest in ("workers", "ray"):
            if dest in given:
                raise ValueError(
                    f"{_flag(dest)} is for several configurations (--compare, or the default vLLM / hybridkv "
                    f"comparison): --engine {args.engine} runs one, in this process"
                )
    elif "workers" in given and "ray" in given:
        raise ValueError("--workers and --ray: Ray places the runs on its own workers (drop --workers)")
    check_out(args.out)


# The most blocks one pool (device, or host: swaps and the host tier share it) may have. Block ids are
# int32 everywhere (the pools' books, block tables, copies), so ids 0 .. 2**31 - 2 are the most any
# pool can index, on every machine: past it the manager cannot even build its books (a host pool of
# 100000TiB is 335,545,158,860 blocks of MiniMax-M1 TP8 and died in numpy with a MemoryError). A
# bound on the host RAM of a real machine was not chosen: it depends on the machine, and the
# simulator never allocates the pool's bytes, only a few bytes of books per block, so simulating a
# host pool larger than the RAM of the machine running the simulation is legitimate.
MAX_POOL_BLOCKS = 2**31 - 1


def check_pool_sizes(cfg: Any, layout: Any, compared: dict[str, list[str]]) -> None:
    """Refuse (``ValueError``, one line naming the flag or the ``--compare`` value) a device or host
    pool of configuration ``cfg`` over :data:`MAX_POOL_BLOCKS` blocks of ``layout``, before any work.
    Counted as :func:`hybridkv.sim.config.build` counts them (the engine's policies applied)."""
    from hybridkv.sim.engines import engine_config
    from hybridkv.units import format_bytes, parse_bytes

    cfg = engine_config(cfg)
    bpb = layout.bytes_per_block

    def where(dest: str, keys: tuple[str, ...]) -> str:
        key = next((k for k in keys if k in compared), None)
        text = getattr(cfg, dest)
        return f"--compare {key}={text}" if key is not None else f"{_flag(dest)} {text}"

    def blocks(text: str) -> int:
        return parse_bytes(text) // bpb if text not in ("0", "") else 0

    host, tier = blocks(cfg.host_memory), blocks(cfg.host_cache) if cfg.prefix != "none" else 0
    most = f"at most {format_bytes(MAX_POOL_BLOCKS * bpb)} for this layout"
    if layout.num_blocks > MAX_POOL_BLOCKS:
        raise ValueError(
            f"{where('gpu_memory', ('gpu-memory', 'budget'))}: {layout.num_blocks:,} blocks of {format_bytes(bpb)} "
            f"exceed the {MAX_POOL_BLOCKS:,} a pool can index (int32 block ids): {most}"
        )
    if host + tier > MAX_POOL_BLOCKS:
        if host > MAX_POOL_BLOCKS or not tier:
            what = where("host_memory", ("host-memory",))
        elif tier > MAX_POOL_BLOCKS or not host:
            what = where("host_cache", ("host-cache",))
        else:
            what = f"{where('host_memory', ('host-memory',))} and {where('host_cache', ('host-cache',))} together"
        raise ValueError(
            f"{what}: {host + tier:,} host blocks of {format_bytes(bpb)} exceed the {MAX_POOL_BLOCKS:,} a pool can "
            f"index (int32 block ids; the host tier shares the swap pool): {most}"
        )


def model_defaults(args: argparse.Namespace) -> list[str]:
    """Fill ``args.tp`` and ``args.gpu_memory`` where not given, from the model and the GPU as
    ``hybridkv plan`` does (TP: the preset's default; cache: 0.9 of the GPU less the weights per GPU
    and a 6 GiB reserve, rounded down to whole GiB: :mod:`hybridkv.planner.budget`). Returns the lines that say what
    was assumed; raises ``ValueError`` (exit 2) where it cannot be known, before any work."""
    from hybridkv.models import presets as P
    from hybridkv.models.spec_file import is_spec_path

    args.model, mapped = resolve_model_arg(args.model)
    name = None if is_spec_path(args.model) else P._canonical(args.model)
    compared = _compared(args)
    if "model" in compared:  # each value read as --model reads it (a repo id becomes its preset)
        compared["model"] = [resolve_model_arg(m, "--compare model=")[0] for m in compared["model"]]
        args.compare = [a if a.partition("=")[0].strip() != "model" else "model=" + ",".join(compared["model"])
                        for a in args.compare]
    said = [mapped] if mapped else []
    budget_compared = "gpu-memory" in compared or "budget" in compared
    if args.gpu_memory is None and not budget_compared and any(k in _BUDGET_KEYS for k in compared):
        raise ValueError(
            "--compare varies the model, TP or GPU: give the cache budget as --gpu-memory SIZE "
            "(or --compare gpu-memory=...)"
        )
    if args.tp is None and "tp" in compared:
        args.tp = 1  # (the base's: every configuration sets its own from --compare tp=...)
    elif args.tp is None:
        # the default of every model and GPU that --compare runs: one TP for all, or --tp is needed
        tps: dict[str, int] = {}
        for model in compared.get("model", [args.model]):
            canon = None if is_spec_path(model) else P._canonical(model)
            for gpu in compared.get("gpu", [args.gpu]):
                known = gpu.lower() in P.GPU_MEMORY_BYTES
                tp = 1 if canon is None else P.default_tp(canon, gpu if known else P.DEFAULT_TP_GPU)
                tps[f"{canon or model} on {gpu.upper() if known else gpu}"] = tp
        if len(set(tps.values())) > 1:
            each = ", ".join(f"{k}: TP{v}" for k, v in tps.items())
            raise ValueError(f"the default TP differs across --compare ({each}): give --tp N or --compare tp=...")
        args.tp = next(iter(tps.values()))
        if name is None and "model" not in compared:
            from hybridkv.cli.plan import spec_kind

            said.append(f"TP1: {spec_kind(args.model)} names no tensor-parallel size (--tp N to shard it)")
        else:
            which = name if "model" not in compared else ", ".join(compared["model"])
            said.append(f"TP{args.tp}: the default for {which} (--tp to change)")
    if args.gpu_memory is None and budget_compared:
        args.gpu_memory = "1GiB"  # (the base's: every configuration sets its own from --compare)
    elif args.gpu_memory is None:
        if name is None or args.gpu.lower() not in P.GPU_MEMORY_BYTES:
            raise ValueError(
                "--gpu-memory SIZE is needed: the default budget subtracts the weights of a preset model from a "
                f"named GPU ({', '.join(P.GPU_MEMORY_BYTES)})"
            )
        total, weights = P.gpu_memory_bytes(args.gpu), P.weight_bytes_per_gpu(name, args.tp)
        rule = cache_budget(args.gpu, total, weights, P.DEFAULT_GPU_UTILIZATION)
        if rule.budget_bytes < GIB:
            raise ValueError(
                f"{name} at TP{args.tp} leaves no cache on one {args.gpu.upper()} ({rule.sum_text()}): raise --tp "
                "or give --gpu-memory SIZE"
            )
        args.gpu_memory = f"{rule.budget_bytes // GIB}GiB"
        said.append(f"{rule.sum_text()}, as hybridkv plan (--gpu-memory to change)")
    check_budgets_fit(args, name, compared)
    return said


def check_budgets_fit(args: argparse.Namespace, name: str | None, compared: dict[str, list[str]]) -> None:
    """Refuse (``ValueError``, one line) a cache budget that one GPU of a named kind cannot hold: more
    than its memory less the weights per GPU of a preset model (a spec file's weights are unknown: its
    whole memory), for ``--gpu-memory`` and every ``--compare gpu-memory=`` value, before any work."""
    from hybridkv.models import presets as P
    from hybridkv.units import format_bytes, parse_bytes

    gpus = compared.get("gpu", [args.gpu])
    key = "gpu-memory" if "gpu-memory" in compared else "budget" if "budget" in compared else None
    texts = compared[key] if key else [args.gpu_memory]
    if "model" in compared or "tp" in compared:
        return  # (each configuration's model or TP differs: checked where the weights are one figure)
    for gpu in gpus:
        if gpu.lower() not in P.GPU_MEMORY_BYTES:
            continue  # a GPU JSON file: its memory is the file's business
        total = P.gpu_memory_bytes(gpu)
        weights = P.weight_bytes_per_gpu(name, args.tp) if name is not None else 0
        for text in texts:
            try:
                asked = parse_bytes(text)
            except ValueError:
                continue  # (refused with its flag by check_args / build_layout)
            if asked > total - weights:
                flag = f"--compare {key}={text}" if key else f"--gpu-memory {text}"
                of = f" less {format_bytes(weights)} of {name} TP{args.tp} weights" if weights else ""
                rule = cache_budget(gpu, total, weights, P.DEFAULT_GPU_UTILIZATION)
                raise ValueError(
                    f"{flag}: one {gpu.upper()} has {format_bytes(total)}{of}, so at most "
                    f"{format_bytes(total - weights)} of cache; the default rule gives "
                    f"{max(rule.budget_bytes, 0) // GIB} GiB (leave --gpu-memory out), or raise --tp"
                )


_PREFIX_FIELDS = ("prefix", "checkpoint", "checkpoint_export")


def default_pair(base: Any) -> list[Any]:
    """What ``hybridkv simulate`` runs without ``--compare`` or ``--engine``: vLLM 0.33 (emulated),
    hybridkv's engine with vLLM's prefix caching, and hybridkv (``base``), so that the report can
    split each difference between the prefix policy and the rest (layout, admission, preemption).
    Two configurations where the prefix policies are the same."""
    from hybridkv.sim.engines import ladder

    steps = ladder(base)
    last = steps[-1].with_changes(label="hybridkv")
    if len(steps) >= 3 and any(getattr(steps[-2], k) != getattr(last, k) for k in _PREFIX_FIELDS):
        others = [k for k in ("layout", "admission", "preemption") if getattr(steps[0], k) != getattr(last, k)]
        if others:
            return [steps[0], steps[-2].with_changes(label="hybridkv, vLLM's prefix caching"), last]
    return [steps[0], last]


def run(args: argparse.Namespace) -> int:
    """Run the simulation(s), write the reports, print where they are and the comparison table.
    Every flag, the output folder, each configuration's layout, GPU and host pool, and the workload
    (an empty trace or window) are checked before any simulation runs; the report folder is written
    only once every configuration finished (:func:`write_atomically`)."""
    check_args(args)
    assumed = model_defaults(args)  # said once every check passed (an error stays one line)
    from hybridkv.scheduler_adapter.cost import load_gpu
    from hybridkv.sim.compare import check_ray_address, expand, run_all
    from hybridkv.sim.config import SimConfig, build_layout
    from hybridkv.sim.report import comparison_table, narrative, pressure_table
    from hybridkv.units import parse_bytes

    t0 = time.perf_counter()
    base = SimConfig(
        model=args.model, tp=args.tp, state_dtype=args.state_dtype, gpu=args.gpu, gpu_calibration=args.calibration,
        gpu_memory=args.gpu_memory, host_memory=args.host_memory, host_cache=args.host_cache,
        block_size=args.block_size, layout=args.layout, preemption=args.preemption, prefix=args.prefix,
        checkpoint=args.checkpoint,
        checkpoint_export=args.checkpoint_export,
        speculative=args.speculative, accept_rate=args.accept_rate, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, watermark=args.watermark, admission=args.admission,
        engine=args.engine or "hybridkv", integrity_every=args.integrity_every, seed=args.seed,
    )  # fmt: skip
    configs = expand(base, args.compare) if args.compare else [base]
    notes = []
    if args.compare is None and args.engine is None:  # the default: vLLM 0.33's behaviour beside hybridkv's
        from hybridkv.sim.engines import VLLM_LABEL

        configs = default_pair(base)
        given = set(getattr(args, "given", ()))
        # (--prefix none reaches vLLM too: its Mamba cache mode none; flop_aware does not: vLLM evicts lru)
        mine = [_flag(d) for d in _VLLM_FIXES if d in given] + (["--prefix"] if args.prefix == "flop_aware" else [])
        if mine:
            notes.append(f"{', '.join(mine)}: set for hybridkv's columns only; {VLLM_LABEL} keeps vLLM's own "
                         "policies (--engine hybridkv runs hybridkv alone)")
    for c in configs:  # bad sizes, models, GPU files: one line each, before any run starts
        layout = build_layout(c)
        load_gpu(c.gpu, c.gpu_calibration)
        for size in (c.host_memory, c.host_cache):
            if size not in ("0", ""):
                parse_bytes(size)
        check_pool_sizes(c, layout, _compared(args))
    workload = _workload(args)
    workload.check_runnable()  # an empty trace or window: one line, exit 2, no zero-step run
    if args.ray is not None:
        check_ray_address(args.ray)  # Ray imports, and a HOST:PORT answers
    if importlib.util.find_spec("matplotlib") is None:
        print("hybridkv: note: report.html will have no plots: pip install 'hybridkv[reports]'", file=sys.stderr)
    for line in assumed:
        print(f"hybridkv simulate: {line}", file=sys.stderr)
    for line in notes:
        print(f"hybridkv simulate: {line}", file=sys.stderr)
    summaries = run_all(configs, workload, args.workers, progress=not args.no_progress, ray_address=args.ray)
    for s in summaries:
        s["notes"] = notes
    paths = write_atomically(summaries, args.out)
    for line in narrative(summaries):
        print(line)
    print()
    for table in (comparison_table(summaries), pressure_table(summaries)):
        for row in table:
            print("  ".join(f"{c:<28}" if i == 0 else f"{c:>22}" for i, c in enumerate(row)))
        print()
    print(f"reports ({time.perf_counter() - t0:.1f} s wall): {', '.join(str(p) for p in paths)}")
    return 0

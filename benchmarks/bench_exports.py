"""Checkpoints exported from inside prefill chunks (issue 39), in the simulator: hybridkv's default
policy (``branch_spaced``) with a recurrent prefill kernel that cannot export (every checkpoint
position ends a chunk) and with one that can (``--checkpoint-export 64``: no chunk ends early for a
checkpoint on that grid).

For MiniMax-M1 TP8 and Qwen3-Next-80B-A3B TP2 (``bench_simulate.py``'s budgets and state dtypes), on
the whole Mooncake synthetic trace and on a long-prompt synthetic workload: prefill chunks cut short
for a checkpoint, states exported, steps, TTFT p50 / p99 and the prefix hit rate. Saves
``benchmarks/results/exports_<date>_<time>.json`` (machine facts included).

    python benchmarks/bench_exports.py                    # both workloads, both models
    python benchmarks/bench_exports.py --limit 300 --long-requests 40   # a documented subset
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_simulate import MODELS  # noqa: E402
from hybridkv.sim.config import SimConfig  # noqa: E402
from hybridkv.sim.report import summarize  # noqa: E402
from hybridkv.sim.simulator import simulate  # noqa: E402
from hybridkv.sim.trace import DEFAULT_TRACE  # noqa: E402
from hybridkv.sim.workload import SyntheticConfig, from_trace, synthetic  # noqa: E402

GRID = 64  # the kernel's export grid in tokens (FlashInfer's GDN prefill grid; one block of 64 tokens)


def _workload(name: str, args: argparse.Namespace):
    if name == "mooncake":
        return from_trace(args.trace, args.limit)
    # long prompts: median 48k tokens, up to 128k, a quarter follow-up turns (their hits need checkpoints)
    return synthetic(SyntheticConfig(num_requests=args.long_requests, rate=0.5, prompt_median=48000,
                                     max_prompt_tokens=131072, output_median=256, max_output_tokens=1024))


def _run(model: str, work: str, export: int, args: argparse.Namespace) -> dict[str, Any]:
    tp, budget, dtype = MODELS[model]
    cfg = SimConfig(model=model, tp=tp, gpu_memory=budget, state_dtype=dtype, checkpoint_export=export)
    t0 = time.perf_counter()
    raw = simulate(cfg, _workload(work, args))
    wall = time.perf_counter() - t0
    s = summarize(raw)
    t, ttft = s["totals"], s["latency_s"]["ttft"]
    return {
        "model": model, "tp": tp, "gpu_memory": budget, "state_dtype": dtype, "workload": work,
        "checkpoint_export": export, "checkpoint_stops": raw["checkpoint_stops"], "exports": raw["exports"],
        "steps": t["steps"], "finished": t["finished"], "ttft_p50_s": ttft.get("p50"), "ttft_p99_s": ttft.get("p99"),
        "prefix_hit_rate": t["prefix_hit_rate"], "preemptions": t["preemptions_recompute"] + t["preemptions_swap"],
        "sim_time_s": t["sim_time_s"], "wall_s": round(wall, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N trace requests (default: all)")
    parser.add_argument("--long-requests", type=int, default=120, help="requests of the long-prompt workload")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--workloads", nargs="+", default=["mooncake", "long_prompt"],
                        choices=["mooncake", "long_prompt"])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jobs = [(m, w, e) for w in args.workloads for m in args.models for e in (0, GRID)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        runs = [f.result() for f in [pool.submit(_run, m, w, e, args) for m, w, e in jobs]]
    wall = time.perf_counter() - t0
    print("workload     model                export  stops  exports  steps   TTFT p50 / p99 s   hit rate")
    for r in runs:
        print(f"{r['workload']:<12} {r['model']:<20} {r['checkpoint_export']:>6} {r['checkpoint_stops']:>6} "
              f"{r['exports']:>8} {r['steps']:>6}   {r['ttft_p50_s']:.3g} / {r['ttft_p99_s']:.3g}   "
              f"{r['prefix_hit_rate']:.4f}")
    from benchmarks._common import save

    payload = {"command": " ".join(["python benchmarks/bench_exports.py", *sys.argv[1:]]),
               "trace": Path(args.trace).name, "limit": args.limit, "long_requests": args.long_requests,
               "workers": args.workers, "total_wall_s": round(wall, 1), "runs": runs}  # fmt: skip
    print(f"saved {save('exports', payload)}")


if __name__ == "__main__":
    main()

"""Simulator speed: simulated requests per second of wall time on the Mooncake synthetic trace.

For each model, ``--compare layout=paged,padded preemption=recompute,swap,auto`` on the same trace
(3,993 requests; ``../shared/traces/mooncake_synthetic_trace.jsonl``), one configuration per
process (``--workers``). Prints the comparison table and the speed of each run and saves
``benchmarks/results/simulate_<date>_<time>.json`` (machine facts included).

    python benchmarks/bench_simulate.py                       # the whole trace, both models
    python benchmarks/bench_simulate.py --limit 500           # a documented subset
    python benchmarks/bench_simulate.py --models minimax-m1 --workers 1

Budgets: ``hybridkv plan``'s H200 figure (0.9 x 140.4 GiB less the bf16 weights of one TP rank)
less about 6 GiB for activations: MiniMax-M1 TP8 14 GiB (plan: 20.2 GiB), Qwen3-Next-80B-A3B TP2
46 GiB (plan: 51.9 GiB).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.sim.compare import expand  # noqa: E402
from hybridkv.sim.config import SimConfig  # noqa: E402
from hybridkv.sim.report import comparison_table, summarize, write_reports  # noqa: E402
from hybridkv.sim.simulator import simulate  # noqa: E402
from hybridkv.sim.trace import DEFAULT_TRACE  # noqa: E402
from hybridkv.sim.workload import from_trace  # noqa: E402

# model -> (TP, cache budget, main state dtype). The dtypes are pinned to those of the published
# 2026-11-30 figures (README, docs/simulate.md), from before issue 27 moved the preset defaults
# (MiniMax-M1 lightning bf16 now, Qwen3-Next GDN state fp32 now): the runs stay comparable.
MODELS = {"minimax-m1": (8, "14GiB", "float32"), "qwen3-next-80b-a3b": (2, "46GiB", "bfloat16")}
AXES = ["layout=paged,padded", "preemption=recompute,swap,auto"]


def _timed(cfg: SimConfig, trace: str, limit: int | None, position: int) -> tuple[dict[str, Any], float, float]:
    workload = from_trace(trace, limit)  # loaded in the worker: the trace is not pickled per task
    t0, c0 = time.perf_counter(), time.process_time()
    summary = summarize(simulate(cfg, workload, progress=True, position=position))
    return summary, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reports", default=None, help="also write the three reports per model under this folder")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(f"trace {args.trace} not found (it lives in ../shared/traces/)")
    jobs = []
    for model in args.models:
        tp, budget, state_dtype = MODELS[model]
        jobs += expand(SimConfig(model=model, tp=tp, gpu_memory=budget, state_dtype=state_dtype), AXES)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_timed, cfg, args.trace, args.limit, i) for i, cfg in enumerate(jobs)]
        results = [f.result() for f in futures]
    total_wall = time.perf_counter() - t0
    runs, by_model = [], {}
    for cfg, (summary, wall, cpu) in zip(jobs, results, strict=True):
        n = summary["totals"]["requests"]
        runs.append(
            {
                "label": summary["label"],
                "model": cfg.model,
                "layout": cfg.layout,
                "preemption": cfg.preemption,
                "requests": n,
                "steps": summary["totals"]["steps"],
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "sim_requests_per_wall_s": round(n / wall, 2),
                "sim_requests_per_cpu_s": round(n / cpu, 2),
                "steps_per_cpu_s": round(summary["totals"]["steps"] / cpu, 1),
                "totals": summary["totals"],
                "latency_s": summary["latency_s"],
            }
        )
        by_model.setdefault(cfg.model, []).append(summary)
    print(f"\n{'configuration':<60} {'requests':>8} {'steps':>7} {'wall s':>8} {'cpu s':>8} {'req/wall s':>10}")
    for r in runs:
        print(
            f"{r['label']:<60} {r['requests']:>8} {r['steps']:>7} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
            f"{r['sim_requests_per_wall_s']:>10.1f}"
        )
    tables = {}
    for model, summaries in by_model.items():
        rows = comparison_table(summaries)
        tables[model] = rows
        print(f"\n{model}")
        for row in rows:
            print("  ".join(f"{c:<28}" if i == 0 else f"{c:>20}" for i, c in enumerate(row)))
        if args.reports:
            write_reports(summaries, Path(args.reports) / model, f"bench_simulate: {model} on the Mooncake trace")
    print(f"\n{len(jobs)} runs in {total_wall:.1f} s wall with {args.workers} worker processes")
    if not args.no_save:
        from benchmarks._common import save

        payload = {
            "trace": Path(args.trace).name,
            "limit": args.limit,
            "workers": args.workers,
            "total_wall_s": round(total_wall, 1),
            "runs": runs,
            "comparison_tables": tables,
        }
        print(f"saved {save('simulate', payload)}")


if __name__ == "__main__":
    main()

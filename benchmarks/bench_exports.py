"""Checkpoints exported from inside prefill chunks (issue 39), in the simulator and the replay: hybridkv's default
policy (``branch_spaced``) with a recurrent prefill kernel that cannot export (every checkpoint
position ends a chunk) and with one that can (``--checkpoint-export 64``: no chunk ends early for a
checkpoint on that grid).

For MiniMax-M1 TP8 and Qwen3-Next-80B-A3B TP2 (``bench_simulate.py``'s budgets and state dtypes), on
the whole Mooncake synthetic trace and on a long-prompt synthetic workload: prefill chunks cut short
for a checkpoint, states exported, steps, TTFT p50 / p99 and the prefix hit rate. Saves
``benchmarks/results/exports_<date>_<time>.json`` (machine facts included).

The replay (``--replay``, on by default) runs the same scheduler, manager and layout as the simulator
(:func:`hybridkv.sim.config.build`) step by step with no clock and no cost model, as
``benchmarks/vllm_replay.py`` does: every request has arrived at step 0 (the waiting queue is topped
up to ``max_num_seqs`` from the workload in order, so token ids are built as requests enter), each
sampling row samples one token. It has no time: TTFT is counted in steps from step 0 (the step whose
forward samples the request's first token, queueing included).

    python benchmarks/bench_exports.py                    # both workloads, both models
    python benchmarks/bench_exports.py --limit 300 --long-requests 40   # a documented subset
    python benchmarks/bench_exports.py --no-sim           # the replay only
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.bench_simulate import MODELS  # noqa: E402
from hybridkv.scheduler_adapter.requests import StepOutputs  # noqa: E402
from hybridkv.sim.config import (
    SimConfig,  # noqa: E402
    build,  # noqa: E402
)
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
        "ttft_mean_s": ttft.get("mean"),
        "prefix_hit_rate": t["prefix_hit_rate"], "preemptions": t["preemptions_recompute"] + t["preemptions_swap"],
        "sim_time_s": t["sim_time_s"], "wall_s": round(wall, 1),
    }  # fmt: skip


def _replay(model: str, work: str, export: int, args: argparse.Namespace, tokens: int = 8192) -> dict[str, Any]:
    """The replay of ``work`` through the simulator's scheduler for ``model`` (see the module doc),
    ``tokens`` per step."""
    tp, budget, dtype = MODELS[model]
    cfg = SimConfig(model=model, tp=tp, gpu_memory=budget, state_dtype=dtype, checkpoint_export=export,
                    max_num_batched_tokens=tokens)
    sched = build(cfg).scheduler
    workload = _workload(work, args)
    backlog = list(reversed(workload.requests))
    prompt = {r.request_id: r.num_prompt_tokens for r in workload.requests}
    first: dict[str, int] = {}
    hits = admitted_tokens = steps = preemptions = 0
    t0 = time.perf_counter()
    while backlog or sched.has_unfinished:
        while backlog and len(sched.waiting) < cfg.max_num_seqs:
            r = backlog.pop()
            sched.add_request(r.request_id, workload.token_ids(r), r.max_new_tokens)
        p = sched.step()
        for rid in p.admitted:
            hits += sched.requests[rid].num_cached_tokens
            admitted_tokens += prompt[rid]
        preemptions += len(p.preempted)
        sampled = {x.request_id: [7] for x in p.scheduled if x.samples}
        for rid in sampled:
            first.setdefault(rid, steps + 1)
        sched.update(StepOutputs(sampled))
        steps += 1
    ttft = np.array(sorted(first.values()), dtype=np.float64)
    return {
        "model": model, "tp": tp, "gpu_memory": budget, "state_dtype": dtype, "workload": work,
        "max_num_batched_tokens": tokens, "checkpoint_export": export,
        "checkpoint_stops": sched.num_checkpoint_stops, "exports": sched.num_exports,
        "steps": steps, "finished": len(first), "ttft_p50_steps": float(np.percentile(ttft, 50)),
        "ttft_p99_steps": float(np.percentile(ttft, 99)),
        "ttft_mean_steps": round(float(ttft.mean()), 2), "prefix_hit_tokens": hits,
        "prefix_hit_rate": round(hits / admitted_tokens, 6) if admitted_tokens else 0.0,
        "preemptions": preemptions, "wall_s": round(time.perf_counter() - t0, 1),
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
    parser.add_argument("--no-sim", dest="sim", action="store_false", help="skip the simulator runs")
    parser.add_argument("--no-replay", dest="replay", action="store_false", help="skip the replay runs")
    parser.add_argument("--replay-tokens", type=int, nargs="+", default=[8192], metavar="N",
                        help="token budgets per step of the replay (default 8192, the simulator's); several: a "
                        "hit rate that moves with the budget by more than exports move it is eviction noise")
    args = parser.parse_args()
    jobs = [(m, w, e) for w in args.workloads for m in args.models for e in (0, GRID)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        sim = [pool.submit(_run, m, w, e, args) for m, w, e in jobs] if args.sim else []
        rep = [pool.submit(_replay, m, w, e, args, t) for t in args.replay_tokens for m, w, e in jobs
               if args.replay]
        runs, replays = [f.result() for f in sim], [f.result() for f in rep]
    wall = time.perf_counter() - t0
    print("workload     model                export  stops  exports  steps   TTFT p50 / p99 (mean)   hit rate")
    for r in runs:
        print(f"{r['workload']:<12} {r['model']:<20} {r['checkpoint_export']:>6} {r['checkpoint_stops']:>6} "
              f"{r['exports']:>8} {r['steps']:>6}   {r['ttft_p50_s']:.4g} / {r['ttft_p99_s']:.4g} s "
              f"(mean {r['ttft_mean_s']:.4g})   "
              f"{r['prefix_hit_rate']:.4f}")
    for r in replays:
        print(f"{r['workload']:<12} {r['model']:<20} {r['checkpoint_export']:>6} {r['checkpoint_stops']:>6} "
              f"{r['exports']:>8} {r['steps']:>6}   {r['ttft_p50_steps']:.0f} / {r['ttft_p99_steps']:.0f} steps "
              f"(mean {r['ttft_mean_steps']:.1f})  "
              f"{r['prefix_hit_rate']:.4f}  (replay, {r['max_num_batched_tokens']} tokens per step)")
    from benchmarks._common import save

    payload = {"command": " ".join(["python benchmarks/bench_exports.py", *sys.argv[1:]]),
               "trace": Path(args.trace).name, "limit": args.limit, "long_requests": args.long_requests,
               "workers": args.workers, "total_wall_s": round(wall, 1), "runs": runs, "replay": replays}  # fmt: skip
    print(f"saved {save('exports', payload)}")


if __name__ == "__main__":
    main()

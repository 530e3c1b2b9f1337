"""Simulator speed: simulated requests per second of wall time on the Mooncake synthetic trace.

For each model, ``--compare layout=paged,padded preemption=recompute,swap,auto`` on the same trace
(3,993 requests; ``../shared/traces/mooncake_synthetic_trace.jsonl``), one configuration per
process (``--workers``). Prints the comparison table and the speed of each run and saves
``benchmarks/results/simulate_<date>_<time>.json`` (machine facts included).

    python benchmarks/bench_simulate.py                       # the whole trace, both models
    python benchmarks/bench_simulate.py --limit 500           # a documented subset
    python benchmarks/bench_simulate.py --models minimax-m1 --workers 1
    # vLLM 0.33 (emulated, validated step for step) against hybridkv's defaults, prefix caching on
    python benchmarks/bench_simulate.py --engines --models minimax-m1 --budgets 16GiB 32GiB 64GiB
    # the prefix cache's host tier (issue 32): each model with and without 256 GiB of host cache
    python benchmarks/bench_simulate.py --host-tier --models minimax-m1 --workers 2

``--host-tier`` runs MiniMax-M1 TP8 at 64 GiB and Qwen3-Next-80B-A3B TP2 at 16 GiB (the issue's
budgets, the presets' state dtypes) with ``--host-cache 0`` and ``256GiB`` and saves
``simulate_host_tier_<date>_<time>.json``: TTFT, hit rates, the tier's bytes and host-link seconds,
and what makes the TTFT p99 (:func:`ttft_tail`): the slowest 1% of requests, their arrivals, the
prompt tokens any earlier request had as whole blocks (an unbounded cache's hit), what they hit,
their queueing; the simulated time of the device's first eviction (the tier's first offload: until
then the two runs are the same steps); and TTFT over the requests that arrive after it.

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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.sim.compare import expand  # noqa: E402
from hybridkv.sim.config import SimConfig  # noqa: E402
from hybridkv.sim.report import comparison_table, summarize, write_reports  # noqa: E402
from hybridkv.sim.simulator import simulate  # noqa: E402
from hybridkv.sim.trace import DEFAULT_TRACE, MOONCAKE_BLOCK_TOKENS  # noqa: E402
from hybridkv.sim.workload import Workload, from_trace  # noqa: E402

# model -> (TP, cache budget, main state dtype). The dtypes are pinned to those of the published
# 2026-11-30 figures (README, docs/simulate.md), from before issue 27 moved the preset defaults
# (MiniMax-M1 lightning bf16 now, Qwen3-Next GDN state fp32 now): the runs stay comparable.
MODELS = {"minimax-m1": (8, "14GiB", "float32"), "qwen3-next-80b-a3b": (2, "46GiB", "bfloat16")}
AXES = ["layout=paged,padded", "preemption=recompute,swap,auto"]
# --host-tier: model -> (TP, device cache budget) of issue 32's acceptance, with and without the tier
HOST_TIER_MODELS = {"minimax-m1": (8, "64GiB"), "qwen3-next-80b-a3b": (2, "16GiB")}
HOST_TIER_AXIS = "host-cache=0,256GiB"


def reusable_tokens(workload: Workload) -> dict[str, int]:
    """Per request id: its leading prompt tokens that an earlier request held as whole 512-token hash
    blocks (what a cache that kept every block forever would hit; ``bench_prefix.py --unbounded``'s
    count, request by request)."""
    seen: set[int] = set()
    out = {}
    for r in workload.requests:
        full = r.num_prompt_tokens // MOONCAKE_BLOCK_TOKENS
        k = 0
        while k < full and r.hash_ids[k] in seen:
            k += 1
        out[r.request_id] = k * MOONCAKE_BLOCK_TOKENS
        seen.update(r.hash_ids[:full])
    return out


def ttft_tail(raw: dict[str, Any], reusable: dict[str, int], after_s: float | None) -> dict[str, Any]:
    """What makes one run's TTFT p99: the finished requests at or above it (``tail``: count, arrival
    window, how many have nothing reusable, their hit and reusable tokens, queued seconds and TTFT less
    queueing, the requests that arrived before ``after_s``), and the TTFT p50 / p99 of the requests
    arriving at or after ``after_s`` (the device's first eviction; ``None``: not computed).
    ``raw``: :func:`~hybridkv.sim.simulator.simulate`'s result; ``reusable``: :func:`reusable_tokens`."""
    done = [r for r in raw["requests"] if r["status"] == "finished" and "ttft_s" in r]
    if not done:
        raise ValueError("no finished request with a first token: no TTFT tail")
    ttft = np.array([r["ttft_s"] for r in done])
    p99 = float(np.percentile(ttft, 99))
    tail = [r for r in done if r["ttft_s"] >= p99]
    queued = np.array([r["queued_s"] for r in tail])
    rest = np.array([r["ttft_s"] - r["queued_s"] for r in tail])
    out: dict[str, Any] = {
        "ttft_p99_s": round(p99, 6),
        "tail": {
            "requests": len(tail),
            "arrival_s": [round(min(r["arrival_s"] for r in tail), 3), round(max(r["arrival_s"] for r in tail), 3)],
            "with_nothing_reusable": sum(1 for r in tail if reusable[r["id"]] == 0),
            "hit_tokens": [r["cached_tokens"] for r in tail],
            "reusable_tokens": [reusable[r["id"]] for r in tail],
            "queued_s_min_median_max": [round(float(v), 3) for v in (queued.min(), np.median(queued), queued.max())],
            "ttft_less_queued_s_median_max": [round(float(np.median(rest)), 3), round(float(rest.max()), 3)],
        },
    }
    # what the engine did while the tail waited: from the first tail arrival to the last tail first token
    lo, hi = min(r["arrival_s"] for r in tail), max(r["arrival_s"] + r["ttft_s"] for r in tail)
    ser = raw["series"]
    m = (ser["t_s"] > lo) & (ser["t_s"] - ser["dt_s"] < hi)
    busy = float(ser["dt_s"][m].sum())
    out["tail"]["window"] = {
        "from_s": round(lo, 3),
        "to_s": round(hi, 3),
        "busy_s": round(busy, 3),
        "batch_full_s": round(float(ser["batch_full_s"][m].sum()), 3),
        "memory_held_s": round(float(ser["memory_held_s"][m].sum()), 3),
        "preemptions": int(ser["preempt_recompute"][m].sum() + ser["preempt_swap"][m].sum()),
        "prefill_tokens_per_s": round(float(ser["batched_tokens"][m].sum()) / busy, 1) if busy else 0.0,
        "min_free_fraction": round(float(ser["free"][m].min()) / (raw["layout"]["num_blocks"] - 1), 4)
        if m.any() else None,
    }
    if after_s is not None:
        out["tail"]["arrived_before_first_eviction"] = sum(1 for r in tail if r["arrival_s"] < after_s)
        late = np.array([r["ttft_s"] for r in done if r["arrival_s"] >= after_s])
        out["after_first_eviction"] = {
            "from_s": round(after_s, 4),
            "requests": int(late.size),
            **({"ttft_p50_s": round(float(np.percentile(late, 50)), 6),
                "ttft_p99_s": round(float(np.percentile(late, 99)), 6)} if late.size else {}),
        }  # fmt: skip
    return out


def first_offload_s(raw: dict[str, Any]) -> float | None:
    """Simulated time at the start of the first step that offloads to the host tier (the device's
    first eviction of a cached block with the tier on), ``None`` if none did."""
    s = raw["series"]
    hits = np.flatnonzero(s["tier_offload_blocks"] > 0)
    if not hits.size:
        return None
    i = int(hits[0])
    return float(s["t_s"][i] - s["dt_s"][i])


def _host_tier_pair(model: str, trace: str, limit: int | None, position: int) -> dict[str, Any]:
    """One model with and without the tier (in one worker: the tail needs both raw results)."""
    tp, budget = HOST_TIER_MODELS[model]
    workload = from_trace(trace, limit)
    reusable = reusable_tokens(workload)
    configs = expand(SimConfig(model=model, tp=tp, gpu_memory=budget), [HOST_TIER_AXIS])
    raws, cpu = {}, {}
    for i, cfg in enumerate(configs):
        c0 = time.process_time()
        raws[cfg.host_cache] = simulate(cfg, workload, progress=True, position=2 * position + i)
        cpu[cfg.host_cache] = round(time.process_time() - c0, 1)
    first = first_offload_s(raws["256GiB"])
    runs = []
    for cfg in configs:
        raw = raws[cfg.host_cache]
        summary = summarize(raw)
        t, lat = summary["totals"], summary["latency_s"]["ttft"]
        runs.append({
            "run": f"{model} TP{tp} {budget}",
            "command": f"hybridkv simulate --trace {Path(trace).name} --model {model} --tp {tp} --gpu-memory {budget} "
                       f"--compare {HOST_TIER_AXIS}",
            "label": summary["label"],
            "requests": t["requests"],
            "finished": t["finished"],
            "ttft_p50_s": lat.get("p50"),
            "ttft_p99_s": lat.get("p99"),
            "ttft_mean_s": lat.get("mean"),
            "prefix_hit_rate": t["prefix_hit_rate"],
            "host_hit_tokens": t["host_hit_tokens"],
            "host_tier_offload_bytes": t["host_tier_offload_bytes"],
            "host_tier_onload_bytes": t["host_tier_onload_bytes"],
            "host_tier_link_s": t["host_tier_link_s"],
            "swap_link_s": summary["pressure"]["swap_link_s"],
            "host_link_added_to_steps_s": summary["pressure"]["swap_stall_s"],
            "bound": summary["pressure"]["bound"],
            "sim_time_s": t["sim_time_s"],
            "steps": t["steps"],
            "cpu_s": cpu[cfg.host_cache],
            "ttft_tail": ttft_tail(raw, reusable, first),
        })  # fmt: skip
    return {"model": model, "first_eviction_s": first, "runs": runs}


def host_tier(args: argparse.Namespace) -> None:
    """``--host-tier``: each model with and without the tier, the TTFT tail explained; saved as JSON."""
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_host_tier_pair, m, args.trace, args.limit, i) for i, m in enumerate(args.models)]
        pairs = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    print()
    for pair in pairs:
        first = pair["first_eviction_s"]
        print(f"{pair['model']}: first eviction from the device at "
              + (f"{first:.1f} s" if first is not None else "never"))
        for r in pair["runs"]:
            tail = r["ttft_tail"]["tail"]
            late = r["ttft_tail"].get("after_first_eviction", {})
            print(f"  {r['label']}: hits {r['prefix_hit_rate']:.1%}, TTFT p50 {r['ttft_p50_s']:.3f} s, p99 "
                  f"{r['ttft_p99_s']:.3f} s; tier {r['host_tier_offload_bytes'] / 1e9:,.1f} GB out / "
                  f"{r['host_tier_onload_bytes'] / 1e9:,.1f} GB in, {r['host_tier_link_s']:.2f} s on the link")
            window = f"{tail['arrival_s'][0]:.1f}-{tail['arrival_s'][1]:.1f} s"
            w = tail["window"]
            print(f"    p99 tail: {tail['requests']} requests arriving {window}, "
                  f"{tail['with_nothing_reusable']} with nothing reusable, "
                  f"{tail.get('arrived_before_first_eviction', '-')} before the first eviction; queued "
                  f"{tail['queued_s_min_median_max'][1]:.2f} s median; meanwhile batch-full "
                  f"{w['batch_full_s']:.1f} of {w['busy_s']:.1f} s busy, memory-held {w['memory_held_s']:.1f} s, "
                  f"{w['prefill_tokens_per_s']:,.0f} tokens/s, {w['preemptions']} preemptions, free >= "
                  f"{w['min_free_fraction']:.0%} of the pool")
            if late.get("requests"):
                print(f"    arrivals from {late['from_s']:.1f} s ({late['requests']}): TTFT p50 "
                      f"{late['ttft_p50_s']:.3f} s, p99 {late['ttft_p99_s']:.3f} s")  # fmt: skip
    print(f"\n{2 * len(pairs)} runs in {wall:.1f} s wall with {args.workers} worker processes")
    if not args.no_save:
        _save("simulate_host_tier", args, wall, command=_command(), models=pairs)


def engines(args: argparse.Namespace) -> None:
    """``--engines``: each model at each budget with ``--engine vllm`` (vLLM 0.33's policies, checked
    step for step against its real scheduler) and ``--engine hybridkv`` (the defaults); saved as JSON."""
    jobs = [SimConfig(model=m, tp=MODELS[m][0], gpu_memory=b, engine=e)
            for m in args.models for b in args.budgets for e in ("vllm", "hybridkv")]  # fmt: skip
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_timed, cfg, args.trace, args.limit, i) for i, cfg in enumerate(jobs)]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    runs = []
    for cfg, (summary, run_wall, cpu) in zip(jobs, results, strict=True):
        t, lat = summary["totals"], summary["latency_s"]["ttft"]
        runs.append({
            "model": cfg.model, "tp": cfg.tp, "gpu_memory": cfg.gpu_memory, "engine": cfg.engine,
            "command": f"hybridkv simulate --trace {Path(args.trace).name} --model {cfg.model} --tp {cfg.tp} "
                       f"--gpu-memory {cfg.gpu_memory} --engine {cfg.engine}",
            "requests": t["requests"], "finished": t["finished"],
            "prefix_hit_rate": t["prefix_hit_rate"], "ttft_p50_s": lat.get("p50"), "ttft_p99_s": lat.get("p99"),
            "preemptions": t["preemptions_recompute"] + t["preemptions_swap"],
            "scheduled_tokens": t.get("scheduled_tokens"), "sim_time_s": t["sim_time_s"], "steps": t["steps"],
            "bound": summary["pressure"]["bound"], "wall_s": round(run_wall, 1), "cpu_s": round(cpu, 1),
        })  # fmt: skip
    print(f"\n{'run':<32}{'engine':>10}{'hits':>9}{'TTFT p50':>11}{'TTFT p99':>11}")
    for r in runs:
        print(f"{r['model'] + ' TP' + str(r['tp']) + ' ' + r['gpu_memory']:<32}{r['engine']:>10}"
              f"{r['prefix_hit_rate']:>9.1%}{r['ttft_p50_s']:>10.3f}s{r['ttft_p99_s']:>10.3f}s")
    print(f"\n{len(jobs)} runs in {wall:.1f} s wall with {args.workers} worker processes")
    if not args.no_save:
        _save("simulate_engines", args, wall, command=_command(), runs=runs)


def _command() -> str:
    return " ".join(["python benchmarks/bench_simulate.py", *sys.argv[1:]])


def _save(name: str, args: argparse.Namespace, wall: float, **fields: Any) -> None:
    """Save a mode's results as ``benchmarks/results/<name>_<date>_<time>.json`` (machine facts
    included): the trace, limit, workers and wall seconds, then ``fields``."""
    from benchmarks._common import save

    payload = {"trace": Path(args.trace).name, "limit": args.limit, "workers": args.workers,
               "total_wall_s": round(wall, 1), **fields}  # fmt: skip
    print(f"saved {save(name, payload)}")


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
    parser.add_argument("--engines", action="store_true",
                        help="each model and --budgets with --engine vllm and --engine hybridkv (prefix caching on)")
    parser.add_argument("--budgets", nargs="+", default=["16GiB", "32GiB", "64GiB"],
                        help="cache budgets per GPU of --engines (default: 16GiB 32GiB 64GiB)")
    parser.add_argument("--host-tier", action="store_true",
                        help="each model with and without a 256 GiB host tier (issue 32's budgets), the TTFT tail "
                        "explained (not with --reports)")
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(f"trace {args.trace} not found (it lives in ../shared/traces/)")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.engines:
        if args.host_tier or args.reports:
            parser.error("--engines takes neither --host-tier nor --reports")
        from hybridkv.units import parse_bytes

        for b in args.budgets:
            try:
                parse_bytes(b)
            except (TypeError, ValueError) as e:
                parser.error(f"--budgets: {e}")
        engines(args)
        return
    if args.host_tier:
        if args.reports:
            parser.error("--host-tier writes no reports: drop --reports")
        host_tier(args)
        return
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
        _save("simulate", args, total_wall, runs=runs, comparison_tables=tables)


if __name__ == "__main__":
    main()

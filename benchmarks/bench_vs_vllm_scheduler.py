"""Issue 29's table: the same workload through vLLM 0.33's real scheduler and hybridkv's, steps /
preemptions / scheduled tokens.

The workload: the first ``--requests`` (400) Mooncake synthetic-trace requests, all queued at step
0, one fake token per sampling row, 256 rows and 8,192 tokens per step, bf16 state, recompute, no
watermark, no host pool, no prefix cache (``benchmarks/vllm_replay.py``). Per run (8 and 4 GiB per
GPU, MiniMax-M1 TP8 and Qwen3-Next TP2):

- ``vllm``: vLLM 0.33.0's v1 ``Scheduler`` + ``KVCacheManager`` (skipped, and said so, without vLLM);
- ``emulated``: ``hybridkv simulate --engine vllm``'s scheduler, and whether it scheduled the same
  rows and preempted the same requests as ``vllm`` at every step;
- ``hybridkv padded`` / ``hybridkv paged``: hybridkv's default scheduler (admission ``reserved``) on
  the padded layout (vLLM's blocks) and the paged one (64-token blocks);
- ``first_chunk padded`` / ``paged``: the admission before issue 29, for reference.

``--prefix-caching``: the same runs with prefix caching on (prompts as the simulator's token ids):
vLLM in its ``align`` mode at its block size (576 tokens for Qwen3-Next, whose FlashInfer GDN
prefill exports checkpoints on a 64-token grid; 512 for MiniMax-M1) against hybridkv's default
(``reserved``, paged, ``branch_spaced`` + ``lru``) and its padded layout; prefix-hit tokens are
summed over admissions (a request readmitted after a recompute is counted again). ``emulated``:
``hybridkv simulate --engine vllm`` with prefix caching (``vllm_align``), and the first step where
it schedules differently from ``vllm``.

    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vs_vllm_scheduler.py     # about 2 minutes
    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vs_vllm_scheduler.py --prefix-caching
    python benchmarks/bench_vs_vllm_scheduler.py --requests 100 --runs qwen3-next:4 --no-save
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save  # noqa: E402
from benchmarks.vllm_replay import (  # noqa: E402
    GiB,
    engine_scheduler,
    first_difference,
    hybridkv_scheduler,
    model_spec,
    replay_hybridkv,
    replay_vllm,
    trace_requests,
    vllm_scheduler,
)
from hybridkv.planner.layout import plan  # noqa: E402

RUNS = ("qwen3-next:8", "minimax-m1:8", "minimax-m1:4", "qwen3-next:4")


def one(model: str, gib: float, requests: list, with_vllm: bool) -> dict:
    budget = int(gib * GiB)
    out: dict = {"model": model, "gib": gib}
    t0 = time.perf_counter()
    emulated = replay_hybridkv(engine_scheduler(model, budget), requests)
    out["emulated"] = emulated.totals()
    if with_vllm:
        t1 = time.perf_counter()
        sched, kv = vllm_scheduler(model, budget)
        real = replay_vllm(sched, requests)
        out["vllm"] = real.totals() | {"num_blocks": kv.num_blocks, "seconds": time.perf_counter() - t1}
        out["emulated_first_difference"] = first_difference(real, emulated)
    for admission in ("reserved", "first_chunk"):
        for kind in ("padded", "paged"):
            layout = plan(model_spec(model), budget, layout=kind)
            run = replay_hybridkv(hybridkv_scheduler(layout, admission), requests)
            name = f"{'hybridkv' if admission == 'reserved' else admission} {kind}"
            out[name] = run.totals() | {"block_size": layout.block_size, "num_blocks": layout.num_blocks}
    out["seconds"] = time.perf_counter() - t0
    return out


def one_prefix(model: str, gib: float, requests: list, with_vllm: bool) -> dict:
    """Prefix caching on: vLLM's align mode against hybridkv's default and padded layouts."""
    from hybridkv.blockmgr.prefix import PrefixCacheConfig

    budget = int(gib * GiB)
    out: dict = {"model": model, "gib": gib}
    if with_vllm:
        t1 = time.perf_counter()
        sched, kv = vllm_scheduler(model, budget, prefix_caching=True)
        real = replay_vllm(sched, requests)
        block = kv.kv_cache_groups[0].kv_cache_spec.block_size
        out["vllm"] = real.totals() | {"prefix_hit_tokens": real.prefix_hit_tokens, "block_size": block,
                                      "num_blocks": kv.num_blocks, "seconds": time.perf_counter() - t1}
    emulated = replay_hybridkv(engine_scheduler(model, budget, prefix_caching=True), requests)
    out["emulated"] = emulated.totals() | {"prefix_hit_tokens": emulated.prefix_hit_tokens}
    if with_vllm:
        out["emulated_first_difference"] = first_difference(real, emulated)
    for kind in ("padded", "paged"):
        layout = plan(model_spec(model), budget, layout=kind)
        run = replay_hybridkv(hybridkv_scheduler(layout, prefix=PrefixCacheConfig()), requests)
        out[f"hybridkv {kind}"] = run.totals() | {"prefix_hit_tokens": run.prefix_hit_tokens,
                                                  "block_size": layout.block_size}
    return out


def _cell(t: dict) -> str:
    return f"{t['steps']:,} / {t['preemptions']} / {t['scheduled_tokens'] / 1e6:.2f} M"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), help="MODEL:GIB (models: qwen3-next, minimax-m1)")
    ap.add_argument("--prefix-caching", action="store_true", help="prefix caching on (see the docstring)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    try:
        requests = trace_requests(args.requests, token_ids=args.prefix_caching)
    except FileNotFoundError as e:
        print(f"bench_vs_vllm_scheduler: {e}", file=sys.stderr)
        return 2
    try:
        import vllm

        version = vllm.__version__
    except ImportError as e:
        version = None
        print(f"vLLM is not importable here ({e}): the vllm column is left out, the emulation is not checked")
    rows = []
    cols = ["vllm", "emulated", "hybridkv padded", "hybridkv paged", "first_chunk padded", "first_chunk paged"]
    if args.prefix_caching:
        cols = ["vllm", "emulated", "hybridkv padded", "hybridkv paged"]
    print(f"{'run (steps / preemptions / scheduled tokens)':32s}" + "".join(f"{c:>26s}" for c in cols))
    for spec in args.runs:
        model, gib = spec.split(":")
        run = one_prefix if args.prefix_caching else one
        r = run(model, float(gib), requests, version is not None)
        rows.append(r)
        cells = [_cell(r[c]) if c in r else "-" for c in cols]
        print(f"{model + ' ' + gib + ' GiB':32s}" + "".join(f"{c:>26s}" for c in cells), flush=True)
        if args.prefix_caching:
            hits = ", ".join(f"{c} {r[c]['prefix_hit_tokens']:,}" for c in cols if c in r)
            print(f"  prefix-hit tokens: {hits}", flush=True)
            if "emulated_first_difference" in r:
                print(f"  emulation vs vLLM: first difference {r['emulated_first_difference']}", flush=True)
        elif version is not None:
            same = r["emulated_first_difference"]
            print(f"  emulation vs vLLM: {'identical at every step' if same is None else same}", flush=True)
    if not args.no_save:
        payload = {"vllm": version, "requests": args.requests, "prefix_caching": args.prefix_caching, "runs": rows}
        name = "vs_vllm_scheduler_issue29" + ("_prefix" if args.prefix_caching else "")
        print("saved", save(name, payload))  # named by date and time: a second run keeps the first
    return 0


if __name__ == "__main__":
    sys.exit(main())

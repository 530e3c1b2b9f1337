"""Prefix-cache hit rates on the Mooncake synthetic trace, per checkpoint x eviction policy.

Replays ``shared/traces/mooncake_synthetic_trace.jsonl`` (hash ids -> deterministic 512-token
blocks) in arrival order through the real block manager and prefix cache: each request is admitted
with its cache hit, prefilled in chunks that end where the checkpoint policy wants a checkpoint,
decoded (KV for its output tokens), and freed once ``--concurrency`` newer requests have arrived.
Everything (running requests, cached KV, checkpoints) shares one block budget.

    python benchmarks/bench_prefix.py              # both models, 3 budgets, 4 policy pairs (minutes)
    python benchmarks/bench_prefix.py --quick      # first 400 requests, one budget per model

``--quick`` is a sample for checking that the replay runs, not a result: 400 requests barely fill the
cache, so eviction (where the policies differ) hardly happens, and its ranking of the policy pairs
can be the opposite of the full run's. Quote only the full run (about 22 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from benchmarks._common import save  # noqa: E402
from hybridkv.blockmgr.errors import AllocationError  # noqa: E402
from hybridkv.blockmgr.layout import plan  # noqa: E402
from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: E402
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig  # noqa: E402
from hybridkv.blockmgr.presets import preset  # noqa: E402
from hybridkv.sim.trace import DEFAULT_TRACE, TokenMaker, load_trace  # noqa: E402

GiB = 1024**3
MODELS = {  # name -> (preset, state dtype, tp, budgets in GiB)
    "minimax-m1": ("minimax-m1", "float32", 8, (16, 32, 64)),
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", "bfloat16", 2, (16, 32, 64)),
}
PAIRS = [
    ("every_n_blocks", "lru"),
    ("every_n_blocks", "flop_aware"),
    ("branch_and_last", "lru"),
    ("branch_and_last", "flop_aware"),
]


def replay(model_key, budget_gib, checkpoint, eviction, trace, tokens, concurrency, every_n):
    name, dtype, tp, _ = MODELS[model_key]
    layout = plan(preset(name, dtype, tp), int(budget_gib * GiB), block_size=64)
    config = PrefixCacheConfig(CheckpointPolicy(checkpoint), EvictionPolicy(eviction), every_n=every_n)
    m = HybridBlockManager(layout, prefix_cache=config)
    running: deque[int] = deque()
    hit = total = skipped = 0
    ckpt_samples, kv_cached_samples = [], []
    t0 = time.perf_counter()

    def make_room() -> bool:
        if not running:
            return False
        m.free(running.popleft())
        return True

    label = f"{model_key} {budget_gib} GiB {checkpoint}+{eviction}"
    progress = tqdm(zip(trace, tokens, strict=True), total=len(trace), desc=label, unit="req", leave=False,
                    position=1, mininterval=1.0)
    for req, toks in progress:
        rid = req.index
        total += req.input_length
        try:
            m.check_fits(req.input_length + req.output_length)
        except AllocationError:
            skipped += 1
            continue
        while True:
            cached = m.match_prefix(toks)
            first = min(len(toks), cached + layout.block_size)
            if m.can_allocate(first, token_ids=toks):
                break
            if not make_room():
                break
        try:
            alloc = m.allocate(rid, first, token_ids=toks)
        except AllocationError:
            skipped += 1
            continue
        hit += alloc.num_cached_tokens
        m.checkpoint(rid)
        ok = True
        while ok and m.requests[rid].num_tokens < len(toks):
            m.release_pins()  # the forward ran this chunk's copies
            stop = m.next_checkpoint_position(rid) or len(toks)
            n = stop - m.requests[rid].num_tokens
            while not m.can_append(rid, n):
                if not make_room():
                    ok = False
                    break
            if ok:
                m.append(rid, n)
                m.checkpoint(rid)
        while ok and not m.can_append(rid, req.output_length):
            ok = make_room()
        if not ok:
            m.free(rid)
            skipped += 1
            continue
        m.release_pins()
        m.append(rid, req.output_length)
        running.append(rid)
        while len(running) > concurrency:
            m.free(running.popleft())
        u = m.usage()
        ckpt_samples.append(u.checkpoints * u.bytes_per_block)
        kv_cached_samples.append(u.kv_cached * u.bytes_per_block)
    while running:
        m.free(running.popleft())
    m.check_integrity()
    stats = m.prefix_cache.stats
    return {
        "model": model_key,
        "tp": tp,
        "state_dtype": dtype,
        "budget_gib": budget_gib,
        "checkpoint": checkpoint,
        "eviction": eviction,
        "every_n_blocks": every_n,
        "num_blocks": layout.num_blocks,
        "blocks_per_checkpoint": m.num_state_blocks,
        "requests": len(trace),
        "skipped": skipped,
        "token_hit_rate": hit / total if total else 0.0,
        "hit_tokens": hit,
        "input_tokens": total,
        "checkpoint_bytes_mean": sum(ckpt_samples) / max(len(ckpt_samples), 1),
        "checkpoint_bytes_max": max(ckpt_samples, default=0),
        "kv_cached_bytes_mean": sum(kv_cached_samples) / max(len(kv_cached_samples), 1),
        "checkpoints_made": stats.checkpoints_made,
        "checkpoints_evicted": stats.checkpoints_evicted,
        "kv_blocks_evicted": stats.kv_evicted,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--quick", action="store_true", help="400 requests, the middle budget only")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--every-n", type=int, default=8, help="every_n_blocks interval (blocks of 64 tokens)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args(argv)
    limit = 400 if args.quick and args.limit is None else args.limit
    quick_note = (
        "--quick: a sample (the first 400 requests, one budget per model), not a result. Too few requests "
        "to fill the cache, so it cannot show how the policies behave under eviction, and its ranking may be "
        "the opposite of the full run's (python benchmarks/bench_prefix.py, about 22 min on 2 cores)."
    )
    if args.quick:
        print(quick_note, flush=True)
    try:
        trace = load_trace(args.trace, limit)
    except FileNotFoundError as e:
        print(f"bench_prefix: {e}", file=sys.stderr)
        return 2
    maker = TokenMaker()
    tokens = [maker.tokens(r) for r in trace]
    rows = []
    print(
        f"{'model':20s} {'GiB':>4s} {'checkpoint':16s} {'eviction':11s} {'hit rate':>8s} "
        f"{'ckpt GiB (mean/max)':>20s} {'skipped':>7s} {'s':>6s}",
        flush=True,
    )
    runs = [
        (model_key, budget, checkpoint, eviction)
        for model_key in args.models
        for budget in (MODELS[model_key][3][1:2] if args.quick else MODELS[model_key][3])
        for checkpoint, eviction in PAIRS
    ]
    overall = tqdm(runs, desc="all runs", unit="run", position=0)
    for model_key, budget, checkpoint, eviction in overall:
        r = replay(model_key, budget, checkpoint, eviction, trace, tokens, args.concurrency, args.every_n)
        rows.append(r)
        tqdm.write(
            f"{model_key:20s} {budget:4d} {checkpoint:16s} {eviction:11s} {r['token_hit_rate']:8.1%} "
            f"{r['checkpoint_bytes_mean'] / GiB:9.2f} / {r['checkpoint_bytes_max'] / GiB:7.2f} "
            f"{r['skipped']:7d} {r['seconds']:6.1f}"
        )
    overall.close()
    gains = []
    for model_key in args.models:
        for budget in {r["budget_gib"] for r in rows if r["model"] == model_key}:
            by = {
                (r["checkpoint"], r["eviction"]): r
                for r in rows
                if r["model"] == model_key and r["budget_gib"] == budget
            }
            base, best = by[("every_n_blocks", "lru")], by[("branch_and_last", "flop_aware")]
            gains.append(
                {
                    "model": model_key,
                    "budget_gib": budget,
                    "every_n_lru": base["token_hit_rate"],
                    "branch_last_flop_aware": best["token_hit_rate"],
                    "ratio": best["token_hit_rate"] / base["token_hit_rate"] if base["token_hit_rate"] else None,
                    "points": best["token_hit_rate"] - base["token_hit_rate"],
                }
            )
    for g in gains:
        ratio = f"{g['ratio']:.2f}x" if g["ratio"] else "inf"
        print(
            f"{g['model']} {g['budget_gib']} GiB: branch_and_last+flop_aware {g['branch_last_flop_aware']:.1%} vs "
            f"every_n_blocks+lru {g['every_n_lru']:.1%} ({ratio}, {100 * g['points']:+.1f} points)"
        )
    path = save(
        "prefix",
        {
            "trace": str(args.trace),
            "limit": limit,
            "concurrency": args.concurrency,
            "block_size": 64,
            "runs": rows,
            "comparison": gains,
        },
    )
    print(f"saved {path}")
    if args.quick:
        print(quick_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())

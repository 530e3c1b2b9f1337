"""Block manager throughput: admissions, allocate+free blocks/s, batch views, id-run contiguity.

Workload of issue 3: MiniMax-M1 TP8, paged layout, 64-token blocks, 32k-token prompts, so each
request holds 112 state blocks (7 state groups x 16) + 512 KV blocks; 256 running requests.

    python benchmarks/bench_blockmgr.py            # full run, ~1 min on 2 cores
    python benchmarks/bench_blockmgr.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save, time_us  # noqa: E402
from hybridkv.blockmgr.layout import plan  # noqa: E402
from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: E402
from hybridkv.blockmgr.presets import preset  # noqa: E402

GiB = 1024**3
VLLM_BLOCKS_PER_S = 4.6e6  # vLLM 0.33 BlockPool, allocate+free, this admission pattern (issue 3)
VLLM_ADMIT_FREE_US = 269.0
TARGET_SPEEDUP = 5.0


def manager(budget_gib: float = 80) -> HybridBlockManager:
    layout = plan(preset("minimax-m1", "float32", tp_size=8), int(budget_gib * GiB), block_size=64)
    assert layout.blocks_per_state == (16,) * 7
    return HybridBlockManager(layout)


def is_run(ids: np.ndarray) -> bool:
    return bool(ids.size == 0 or np.all(np.diff(ids) == 1))


def contiguity(m: HybridBlockManager) -> dict[str, float]:
    sets = whole = 0
    for rid in m.requests:
        state = m.state_table([rid])[:, 0]
        sets += sum(is_run(s) for s in state)
        whole += is_run(state.ravel())
    n = len(m.requests)
    return {
        "state_sets_one_run_pct": 100.0 * sets / (n * m.num_state_groups),
        "requests_all_state_one_run_pct": 100.0 * whole / n,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32 * 1024)
    args = ap.parse_args(argv)
    number = 20 if args.quick else 300
    rng = random.Random(0)
    results: dict[str, object] = {"workload": {
        "model": "minimax-m1", "tp": 8, "state_dtype": "float32", "layout": "paged", "block_size": 64,
        "prompt_tokens": args.prompt, "running": args.running,
    }}

    # 1. admissions from an empty pool
    m = manager()
    per_request = m.blocks_to_admit(args.prompt)
    results["workload"]["blocks_per_request"] = per_request  # type: ignore[index]
    t0 = time.perf_counter()
    for i in range(args.running):
        m.allocate(i, args.prompt)
    fill = (time.perf_counter() - t0) / args.running * 1e6
    results["fill_admit_us_per_request"] = fill
    results["fill_admissions_per_s"] = 1e6 / fill
    results["contiguity_after_fill"] = contiguity(m)

    # 2. steady state: admit + free one more request next to `running` others
    def admit_free() -> None:
        m.allocate("x", args.prompt)
        m.free("x")

    af = time_us(admit_free, number=number)
    blocks_per_s = 2 * per_request / (af["best_us"] * 1e-6)
    results["admit_free"] = af | {
        "blocks_per_s": blocks_per_s,
        "admissions_per_s": 1e6 / af["best_us"],
        "vllm_0_33_blocks_per_s": VLLM_BLOCKS_PER_S,
        "speedup_vs_vllm": blocks_per_s / VLLM_BLOCKS_PER_S,
        "target_speedup": TARGET_SPEEDUP,
        "meets_target": blocks_per_s / VLLM_BLOCKS_PER_S >= TARGET_SPEEDUP,
    }

    # 3. batch views for the running batch
    ids = list(range(args.running))
    results["block_table_us"] = time_us(lambda: m.block_table(ids), number=number)
    results["state_table_us"] = time_us(lambda: m.state_table(ids), number=number)

    def decode_step() -> None:
        for r in ids:
            m.append(r, 1)
        m.block_table(ids)
        m.state_table(ids)

    results["decode_step_append_and_views_us"] = time_us(decode_step, repeats=5, number=max(number // 10, 5))

    # 4. churn with mixed prompt lengths: how often do state sets stay one id run?
    m = manager()
    lengths = [rng.randint(1024, 32 * 1024) for _ in range(args.running)]
    for i, n in enumerate(lengths):
        m.allocate(i, n)
    next_id, live = args.running, list(range(args.running))
    churn = 200 if args.quick else 5000
    t0 = time.perf_counter()
    for _ in range(churn):
        victim = live.pop(rng.randrange(len(live)))
        m.free(victim)
        m.allocate(next_id, rng.randint(1024, 32 * 1024))
        if rng.random() < 0.5:
            m.append(live[rng.randrange(len(live))], rng.randint(1, 512))
        live.append(next_id)
        next_id += 1
    results["churn"] = {
        "iterations": churn,
        "us_per_free_admit_append": (time.perf_counter() - t0) / churn * 1e6,
        **contiguity(m),
        "free_extents": len(m.pool.free_extents()),
    }
    m.check_integrity()

    path = save("blockmgr", results)
    af = results["admit_free"]
    print(f"{'what':44s} {'value':>14s}")
    rows = [
        ("admit+free one 624-block request (best)", f"{af['best_us']:.1f} us"),
        ("allocate+free throughput", f"{af['blocks_per_s'] / 1e6:.1f} M blocks/s"),
        ("vs vLLM 0.33 BlockPool (4.6 M blocks/s)", f"{af['speedup_vs_vllm']:.1f}x (target 5x)"),
        ("admissions/s (fill from empty)", f"{results['fill_admissions_per_s']:,.0f}"),
        ("block_table 256 x 512 (median)", f"{results['block_table_us']['median_us']:.1f} us"),
        ("state_table 7 x 256 x 16 (median)", f"{results['state_table_us']['median_us']:.1f} us"),
        ("decode step: 256 appends + both views", f"{results['decode_step_append_and_views_us']['median_us']:.1f} us"),
        ("state sets one id run, after fill", f"{results['contiguity_after_fill']['state_sets_one_run_pct']:.1f} %"),
        ("state sets one id run, after churn", f"{results['churn']['state_sets_one_run_pct']:.1f} %"),
        ("all 112 state blocks one run, after churn", f"{results['churn']['requests_all_state_one_run_pct']:.1f} %"),
    ]
    for k, v in rows:
        print(f"{k:44s} {v:>14s}")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

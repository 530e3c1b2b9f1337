"""An engine loop on the CPU: scheduler -> block copies and swaps (ops) -> forward -> update.

Qwen3-Next-80B-A3B at TP8 (fp32 ssm state) in a deliberately small pool (72 MiB), admitting on the first
chunk (not the default, which reserves a whole prompt and decode room and so hardly preempts), so requests
are preempted and swapped; 12 requests share a 256-token system prompt, so later ones hit the prefix cache. The
"forward" is a stand-in: it gathers each running request's recurrent state through the state
table, adds the number of tokens it processed, and scatters it back. Every state therefore holds
the count of tokens its request has seen, which the loop checks after swaps, prefix hits and
copies: the bytes really follow the block tables. As an engine would, it allocates the state
buffers once for ``max_num_seqs`` rows and each step's table fills the first rows (on a GPU the
kernels' run table, cached per layout and buffer shape, is then built once for the whole run).

    python examples/serve_loop.py
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.models.presets import preset
from hybridkv.ops import (
    allocate_host_pools,
    allocate_pools,
    allocate_state_buffers,
    copy_blocks,
    gather_states,
    scatter_states,
    swap_blocks,
)
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import PreemptionMode, Scheduler, SchedulerConfig, build_step_metadata
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine

MiB = 1024**2
SYSTEM_PROMPT = list(range(256))


def main() -> dict[str, int]:
    """Run the loop; returns what happened (event counts) for a caller to check."""
    layout = plan(preset("qwen3-next-80b-a3b", "float32", tp_size=8), 72 * MiB, block_size=64)
    manager = HybridBlockManager(layout, num_host_blocks=96, prefix_cache=PrefixCacheConfig())
    pools, host = allocate_pools(layout, "cpu"), allocate_host_pools(layout, 96)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=512, preemption_mode=PreemptionMode.SWAP, admission="first_chunk"
    )
    scheduler, engine = Scheduler(manager, config), SyntheticEngine(seed=0)
    bufs = allocate_state_buffers(layout, config.max_num_seqs, device="cpu")  # reused by every step
    layer = next(iter(bufs.tensors.values()))["ssm"]  # [max_num_seqs, heads, k, v] of one layer
    print(layout.describe())
    for i in range(12):
        scheduler.add_request(i, SYSTEM_PROMPT + [10_000 * (i + 1) + t for t in range(40 + 30 * i)], 24)

    seen: dict[object, float] = {}  # tokens each request's state has absorbed, by our own count
    steps = preempted = swapped = hit_tokens = 0
    progress = tqdm(total=len(scheduler.requests), desc="serve_loop", unit="req", file=sys.stderr)
    while scheduler.has_unfinished:
        step = scheduler.step()
        # the executor, in StepPlan's order: checkpoints, swap-outs, swap-ins, then this step's copies
        copy_blocks(pools, step.checkpoint_copies)
        for p in (*step.swap_out, *step.swap_in):
            swap_blocks(pools, host, p).synchronize()
        copy_blocks(pools, step.copies)
        meta = build_step_metadata(manager, step)
        # the stand-in forward: state += tokens processed, through the state tables
        gather_states(pools, meta.state_tables, None, bufs)
        for row, r in enumerate(step.scheduled):
            start = r.num_computed_tokens
            if not meta.has_initial_state[row]:  # fresh blocks hold old bytes: kernels start from zero
                for components in bufs.tensors.values():
                    components["ssm"][row] = 0
            if start == 0:
                seen[r.request_id] = 0.0  # a fresh (or recomputed) request
            elif r.request_id not in seen:  # a prefix hit: the state came from a checkpoint
                seen[r.request_id] = float(start)
                hit_tokens += start
            assert float(layer[row, 0, 0, 0]) == seen[r.request_id], f"step {steps}: {r} lost its state"
            for components in bufs.tensors.values():  # every recurrent layer
                components["ssm"][row] += r.num_scheduled_tokens
            seen[r.request_id] += r.num_scheduled_tokens
        scatter_states(pools, meta.state_tables, None, bufs)
        result = scheduler.update(engine.run(step))
        progress.update(len(result.finished))
        for rid in result.finished:
            seen.pop(rid, None)
        steps += 1
        preempted += len(step.preempted)
        swapped += len(step.swap_out)
        manager.check_integrity()
    u = manager.usage()
    progress.close()
    print(f"{steps} steps, {preempted} preemptions ({swapped} swapped out), {hit_tokens} prompt tokens from the cache")
    print(f"at the end: {u.free} free, {u.kv_cached} cached KV and {u.checkpoints} checkpoint blocks")
    return {"steps": steps, "preempted": preempted, "swapped": swapped, "prefix_hit_tokens": hit_tokens}


if __name__ == "__main__":
    main()

"""Continuous batching of a real (tiny) hybrid model through hybridkv, step by step.

The tiny model of ``tiny_hybrid.py`` (three lightning layers and one softmax-attention layer, fp64)
serves a stream of requests through the :class:`~hybridkv.scheduler_adapter.Scheduler` on a pool
small enough that requests are preempted (by recompute and by swap), with a prefix cache (requests
sharing a system prompt restore a checkpointed state), speculative decoding (2 drafts from an
imperfect drafter) and a fork. Each step prints its batch (``P`` = prefill chunk, ``D`` = decode,
``+k`` drafts), the pool's blocks by category, and what happened. At the end every logit is compared
with the request computed alone.

    python examples/continuous_batching.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_hybrid import Engine, TinyConfig, TinyHybrid, tiny_layout  # noqa: E402

from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: E402
from hybridkv.blockmgr.prefix import PrefixCacheConfig  # noqa: E402
from hybridkv.scheduler_adapter import H200, GpuSpec, PreemptionMode, Scheduler, SchedulerConfig  # noqa: E402
from hybridkv.scheduler_adapter.cost import preemption_cost  # noqa: E402

NUM_REQUESTS = 20
NUM_SHARING = 6  # requests 0-5 share the system prompt
BURST_STEP = 16
HOST_BLOCKS = 40
CROSSOVER_TOKENS = 12


def _row(r) -> str:
    kind = f"P{r.num_scheduled_tokens}" if r.is_prefill else "D1"
    return f"{r.request_id}:{kind}" + (f"+{r.num_drafts}" if r.num_drafts else "")


def main() -> dict[str, int]:
    """Run the demo; returns what happened (event counts) for a caller to check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they save
    try:
        return _demo()
    finally:
        torch.set_num_threads(threads)


def _demo() -> dict[str, int]:
    cfg = TinyConfig(lightning_head_dim=8)
    layout = tiny_layout(cfg, num_blocks=80, block_size=4)
    manager = HybridBlockManager(layout, num_host_blocks=HOST_BLOCKS, prefix_cache=PrefixCacheConfig())
    # AUTO preemption weighs recompute FLOPs against swap bytes. On an H200 this tiny model always
    # recomputes; a toy GPU, slower by the factor that puts the crossover at CROSSOVER_TOKENS tokens,
    # makes it swap the longer victims and recompute the shorter ones.
    blocks = layout.num_state_blocks_per_request + layout.num_kv_blocks(CROSSOVER_TOKENS)
    at_h200 = preemption_cost(layout, H200, blocks, CROSSOVER_TOKENS)
    toy = GpuSpec("toy", H200.flops_per_s * at_h200.recompute_s / at_h200.swap_s, H200.host_link_bytes_per_s, 1e12)
    config = SchedulerConfig(
        max_num_seqs=5,
        max_num_batched_tokens=24,
        num_speculative_tokens=2,
        preemption_mode=PreemptionMode.AUTO,
        gpu=toy,
        # admit on the first chunk (not the default, which reserves the whole prompt and decode room and so
        # hardly preempts): the burst then runs out of blocks mid-prefill and is preempted both ways
        admission="first_chunk",
    )
    scheduler = Scheduler(manager, config)
    engine = Engine(TinyHybrid(cfg), scheduler, num_host_blocks=HOST_BLOCKS)
    print(layout.describe())
    print(
        f"state per request: {layout.num_state_blocks_per_request} blocks ({layout.blocks_per_state[0]} per layer); "
        f"KV: {layout.block_size} tokens per block"
    )

    rng = random.Random(0)
    system = [rng.randrange(cfg.vocab_size) for _ in range(12)]
    stream = []  # (arrival step, id, prompt, max new tokens)
    # first a trickle of requests that share the system prompt (the later ones restore its checkpoint),
    # then a burst that outgrows the pool as it decodes (preemptions: the short victims recomputed, the
    # long ones swapped)
    for i in range(NUM_SHARING):
        prompt = system + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(2, 6))]
        stream.append((3 * i, f"r{i}", prompt, rng.randint(3, 6)))
    for i in range(NUM_SHARING, NUM_REQUESTS):
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(4, 14))]
        stream.append((BURST_STEP, f"r{i}", prompt, rng.randint(6, 16)))
    forked, start, shown, clock = False, time.perf_counter(), 0, 0
    while stream or scheduler.has_unfinished:
        while stream and stream[0][0] <= clock:
            _, rid, prompt, n = stream.pop(0)
            engine.add_request(rid, prompt, n)
        clock += 1
        if not forked and clock >= 10:
            forked = any(engine.fork(r.request_id, f"{r.request_id}/fork", 4) for r in list(scheduler.running))
        if not scheduler.has_unfinished:
            continue  # idle until the next arrival
        plan = engine.step()
        u = engine.usage
        rows = " ".join(_row(r) for r in plan.scheduled) or "-"
        print(
            f"step {plan.step:3d} | {rows:<44} | blocks: kv {u.kv_live:2d} state {u.state_live:2d} "
            f"spec {u.state_speculative:2d} cached {u.kv_cached:2d} ckpt {u.checkpoints:2d} free {u.free:2d} "
            f"host {u.host_used:2d}/{u.host_total}"
        )
        for line in engine.events.log[shown:]:
            if "finished" not in line:
                print(f"         {line.split(': ', 1)[1]}")
        shown = len(engine.events.log)
        if plan.step % 20 == 19:
            print(f"  ... {time.perf_counter() - start:.1f} s, {len(scheduler.requests)} requests in flight")
    err, rid, pos = engine.max_error()
    ev = engine.events
    print(
        f"{ev.steps} steps in {time.perf_counter() - start:.1f} s: {ev.preempted_recompute} preempted by recompute, "
        f"{ev.preempted_swap} by swap, {ev.prefix_hit_tokens} prompt tokens from the prefix cache, {ev.forks} fork(s), "
        f"{ev.accepted} of {ev.drafts} drafts accepted"
    )
    print(f"every logit vs the request computed alone: max |difference| = {err:.1e} (request {rid}, position {pos})")
    if not err <= 1e-9:
        raise SystemExit("isolation broken: a request's logits differ from its sequential reference")
    return {
        "steps": ev.steps,
        "preempted_recompute": ev.preempted_recompute,
        "preempted_swap": ev.preempted_swap,
        "prefix_hit_tokens": ev.prefix_hit_tokens,
        "forks": ev.forks,
        "drafts": ev.drafts,
        "accepted": ev.accepted,
    }


if __name__ == "__main__":
    main()

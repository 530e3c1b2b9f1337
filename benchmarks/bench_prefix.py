"""Prefix-cache hit rates, paged vs padded layout at the same memory, per checkpoint x eviction policy.

Replays a workload in arrival order through the real block manager and prefix cache: each request
is admitted with its cache hit, prefilled in chunks that end where the checkpoint policy wants a
checkpoint, decoded (KV for its output tokens), and freed once ``--concurrency`` newer requests
have arrived. Everything (running requests, cached KV, checkpoints) shares one block budget.
Every run includes the every-block row (padded layout, a state at every block: ``every_n_blocks``
with n = 1, cached KV in plain LRU order) and the padded layout with the project's policies, and
reports each paged row's ratio to the best padded row at the same memory. The every-block row is
NOT vLLM: vLLM 0.33 has no "all" mode (``config/cache.py``: ``align`` or ``none``); its ``align``
mode keeps a state at the prompt's end and at branch points, at 576-token blocks for Qwen3-Next on
an H200, and is measured against hybridkv through vLLM's real scheduler by
``benchmarks/bench_vs_vllm_scheduler.py --prefix-caching`` (issue 29). The row stays as what it is: a
state at every padded block.

Workloads (``--workloads``):

- ``trace``: the Mooncake synthetic trace as the simulator reads it (hash id -> a fixed 512-token
  block, the last cut to the input length). Replies are never part of a later prompt, and a
  partial last block shares nothing with the next turn's block at that index.
- ``trace-sessions``: the same trace with sessions reconstructed. ASSUMPTION (not in the data):
  a request that repeats an earlier prompt's whole blocks continues it; the earlier prompt's last
  partial hash block is a prefix of the next turn's block, and its reply is the next turn's tokens
  right after it (see :func:`trace_session_items`). Replies are decoded with their token ids and the
  state at the reply's last block boundary is offered to the policy (``checkpoint(final=True)``).
- ``multiturn``: synthetic conversations, each turn = previous prompt + its reply + a new message.

    python benchmarks/bench_prefix.py --workloads trace        # both models, 3 budgets, all configs
    python benchmarks/bench_prefix.py --workloads multiturn --sessions 400 --name prefix_multiturn
    python benchmarks/bench_prefix.py --quick                  # first 400 requests, one budget
    python benchmarks/bench_prefix.py --jobs 2                 # replays in 2 processes (same results)
    # the host tier's table (issue 32): both models x device 16/32/64 GiB x host 0/64/256/1024 GiB,
    # paged branch_spaced+lru (the default), whole synthetic trace, the unbounded figure, link time
    python benchmarks/bench_prefix.py --grid
    # issue 14's 24 runs (the rows of 2026-11-29), as then: demote_tail off
    python benchmarks/bench_prefix.py --workloads trace --legacy --config paged every_n_blocks lru 8 \
        --config paged every_n_blocks flop_aware 8 --config paged branch_and_last lru 8 \
        --config paged branch_and_last flop_aware 8

``--quick`` is a sample for checking that the replay runs, not a result: 400 requests barely fill the
cache, so eviction (where the policies differ) hardly happens.

``--grid`` is the host tier's budget table: the trace workload, the library's default policy
(paged ``branch_spaced`` + ``lru``), device budgets x host tier sizes (``--budgets`` and
``--host-cache`` change them), the unbounded hit rate, and per host row the bytes the tier moved on
the host link and their seconds at the GPU's host-link rate (``--gpu``, ``--calibration``: the
simulator's rates, one direction at a time, not overlapped with anything). It prints the table at
the end and saves it in the JSON (``grid``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks._common import save  # noqa: E402
from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: E402
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig  # noqa: E402
from hybridkv.errors import AllocationError  # noqa: E402
from hybridkv.models.presets import preset  # noqa: E402
from hybridkv.planner.layout import plan  # noqa: E402
from hybridkv.scheduler_adapter.cost import GpuSpec, load_gpu  # noqa: E402
from hybridkv.sim.trace import (  # noqa: E402
    DEFAULT_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    TokenMaker,
    TraceRequest,
    load_trace,
)

GiB = 1024**3
MODELS = {  # name -> (preset, state dtype, tp, budgets in GiB)
    "minimax-m1": ("minimax-m1", "float32", 8, (16, 32, 64)),
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", "bfloat16", 2, (16, 32, 64)),
}
# (layout, checkpoint policy, eviction, every_n): every_n=1 in the padded layout: a state at every block
# (a state at every block); padded with the project's policies is the other baseline
CONFIGS = [
    ("padded", "every_n_blocks", "lru", 1),  # every block, plain LRU: no demote_tail (see EVERY_BLOCK)
    ("padded", "branch_and_last", "flop_aware", 8),
    ("padded", "branch_and_last", "lru", 8),
    ("padded", "branch_last_aligned", "flop_aware", 8),
    ("padded", "branch_last_aligned", "lru", 8),
    ("paged", "branch_and_last", "flop_aware", 8),
    ("paged", "branch_last_aligned", "lru", 8),
    # branch_spaced (the default): the same positions' kinds, a minimum gap apart (from bytes); both layouts
    ("padded", "branch_spaced", "lru", 8),
    ("padded", "branch_spaced", "flop_aware", 8),
    ("paged", "branch_spaced", "lru", 8),
]
WORKLOADS = ("trace", "trace-sessions", "multiturn")
DEFAULT_WORKLOADS = ("trace", "multiturn")
# --grid: the host tier's budget table (issue 32), the default policy on the trace
GRID_BUDGETS = (16, 32, 64)
GRID_HOST_CACHE = (0, 64, 256, 1024)
GRID_CONFIG = ("paged", "branch_spaced", "lru", 8)
EVERY_BLOCK = ("padded", "every_n_blocks", "lru", 1)  # cached KV in plain LRU order (not vLLM 0.33: see above)


def config_kwargs(config: tuple, legacy: bool) -> dict:
    """Further PrefixCacheConfig fields of a CONFIGS row: the every-block row (and every row with
    ``--legacy``, the settings before ``demote_tail`` existed) keeps cached KV in plain LRU order."""
    return {"demote_tail": False} if legacy or tuple(config) == EVERY_BLOCK else {}


def parse_config(fields: list[str]) -> tuple[str, str, str, int]:
    """A ``--config LAYOUT CHECKPOINT EVICTION N`` row, checked against the known names."""
    layout, checkpoint, eviction, n = fields
    if layout not in ("paged", "padded"):
        raise ValueError(f"--config layout must be paged or padded, got {layout!r}")
    names = {c.value for c in CheckpointPolicy}
    if checkpoint not in names:
        raise ValueError(f"--config checkpoint must be one of {sorted(names)}, got {checkpoint!r}")
    if eviction not in {e.value for e in EvictionPolicy}:
        raise ValueError(f"--config eviction must be lru or flop_aware, got {eviction!r}")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"--config N (every_n_blocks interval) must be a positive integer, got {n!r}")
    return layout, checkpoint, eviction, int(n)


def label(layout: str, checkpoint: str, eviction: str, every_n: int) -> str:
    if layout == "padded" and checkpoint == "every_n_blocks" and every_n == 1:
        return "padded every block (not vLLM)"
    return f"{layout} {checkpoint}" + (f"/{every_n}" if checkpoint == "every_n_blocks" else "") + f"+{eviction}"


# ---- workloads ------------------------------------------------------------------------------------
class Item(NamedTuple):
    """One request of a replay: its input token ids and, when a later turn repeats its reply, the
    reply's token ids (``None``: the reply is never seen again; only its length matters)."""

    index: int
    input_ids: np.ndarray  # int64 (the prefix cache hashes arrays without converting)
    output_length: int
    output_ids: list[int] | None


def trace_items(trace: list[TraceRequest]) -> list[Item]:
    """The trace as the simulator reads it: hash id -> a fixed 512-token block, the last cut to the
    input length. A partial last block then shares nothing with the next turn's block at that index."""
    maker = TokenMaker()
    return [Item(r.index, maker.array(r), r.output_length, None) for r in trace]


def trace_session_items(trace: list[TraceRequest]) -> tuple[list[Item], dict[str, int]]:
    """Reconstruct conversations from a hash-id trace. ASSUMPTIONS (not in the trace's data):

    - request B continues request A (same session) when A is the latest earlier request whose whole
      512-token blocks are all B's first blocks, A ends in a partial block, B's block at that index
      has another id, and B is longer than A's input (in the Mooncake trace such a B is typically
      about A's input plus output long: median 20 tokens shorter);
    - B's block at that index then starts with A's partial block (the partial hash block is a
      prefix of the next turn's block), and A's reply is B's tokens right after A's input, as far
      as B reaches (the reply is part of the next prompt); several Bs may continue one A (all get
      its partial block; the first one fixes its reply).

    Returns the items and counts of how many requests were linked."""
    bt = MOONCAKE_BLOCK_TOKENS
    by_prefix: dict[tuple[int, ...], int] = {}  # A's whole-block ids -> A (latest)
    follow: dict[int, int] = {}  # A -> its first B
    override: dict[int, list[int]] = {}  # hash id of B's block -> [its start, A]: starts with A's partial tokens
    linked = 0
    for r in trace:
        for k in range(len(r.hash_ids) - 1, 0, -1):  # longest whole-block prefix first
            a = by_prefix.get(r.hash_ids[:k])
            if a is None:
                continue
            ra = trace[a]
            ok = len(ra.hash_ids) == k + 1 and ra.hash_ids[k] != r.hash_ids[k] and r.input_length > ra.input_length
            if ok and r.hash_ids[k] not in override:
                follow.setdefault(a, r.index)
                override[r.hash_ids[k]] = [k * bt, a]
                linked += 1
            break
        if r.input_length % bt:
            by_prefix[r.hash_ids[:-1]] = r.index
    maker = TokenMaker()

    def block(h: int) -> list[int]:
        o = override.get(h)
        if o is None:
            return maker.block(h)
        start, a = o
        ra = trace[a]
        head = tokens_of(ra)[start:]
        return head + maker.block(h)[len(head) :]

    memo: dict[int, list[int]] = {}

    def tokens_of(r: TraceRequest) -> list[int]:
        if r.index not in memo:
            out: list[int] = []
            for h in r.hash_ids:
                out.extend(block(h))
            memo[r.index] = out[: r.input_length]
        return memo[r.index]

    toks = [tokens_of(r) for r in trace]
    items = []
    rng = np.random.default_rng(0)
    for r in trace:
        b = follow.get(r.index)
        out = None
        if b is not None:  # the reply as far as B repeats it, then tokens no one repeats
            out = toks[b][r.input_length : r.input_length + r.output_length]
            out += rng.integers(0, maker.vocab_size, r.output_length - len(out)).tolist()
        items.append(Item(r.index, np.array(toks[r.index], dtype=np.int64), r.output_length, out))
    return items, {"requests": len(trace), "linked_turns": linked, "replies_reused": len(follow)}


def multiturn_items(num_sessions: int = 300, seed: int = 0) -> tuple[list[Item], dict[str, float]]:
    """Synthetic conversations: each turn's prompt is the previous turn's prompt, its reply and a new
    message; sessions start with one of 4 system prompts (2-6k tokens) and interleave (the next
    request comes from a random open session). Messages 100-4,000 tokens (log-uniform), replies
    20-800, 1-10 turns per session. Token ids are random (no two messages share content)."""
    rng = np.random.default_rng(seed)
    vocab = 32000
    systems = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(2000, 6000, 4)]

    def logu(lo: int, hi: int) -> int:
        return int(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    turns_left = {s: int(rng.integers(1, 11)) for s in range(num_sessions)}
    context = {s: list(systems[s % 4]) for s in range(num_sessions)}
    items: list[Item] = []
    pending: dict[int, int] = {}  # session -> index of its last item (its reply is decided on its next turn)
    opened, open_sessions = 0, []
    while turns_left:
        if opened < num_sessions and (not open_sessions or rng.random() < 0.3):
            open_sessions.append(opened)
            opened += 1
        s = open_sessions[int(rng.integers(len(open_sessions)))]
        msg = rng.integers(0, vocab, logu(100, 4000)).tolist()
        prev = pending.get(s)
        if prev is not None:
            reply = items[prev].output_ids
            context[s].extend(reply)  # type: ignore[arg-type]
        context[s].extend(msg)
        out_len = logu(20, 800)
        items.append(Item(len(items), np.array(context[s], dtype=np.int64), out_len,
                          rng.integers(0, vocab, out_len).tolist()))
        pending[s] = len(items) - 1
        turns_left[s] -= 1
        if not turns_left[s]:
            del turns_left[s]
            open_sessions.remove(s)
    mean_in = float(np.mean([len(i.input_ids) for i in items]))
    return items, {"sessions": num_sessions, "requests": len(items), "mean_input_tokens": mean_in}


# ---- replay ---------------------------------------------------------------------------------------
def replay(model_key, budget_gib, layout_kind, checkpoint, eviction, every_n, items, concurrency, align=(512, 2048),
           block_size=64, progress=True, host_gib=0, **policy):
    """One replay; ``policy``: further :class:`PrefixCacheConfig` fields (e.g. ``min_gap_tokens``).
    ``host_gib``: the host tier's pool in GiB per GPU (0: no tier): cached KV blocks and checkpoints
    evicted from the device are offloaded there and stay matchable (docs/blockmgr.md); the host->device
    and device->host copies it hands out are counted (blocks and bytes), not priced."""
    name, dtype, tp, _ = MODELS[model_key]
    spec = preset(name, dtype, tp)
    if layout_kind == "padded":
        layout = plan(spec, int(budget_gib * GiB), layout="padded")
    else:
        layout = plan(spec, int(budget_gib * GiB), block_size=block_size)
    num_host = int(host_gib * GiB) // layout.bytes_per_block
    config = PrefixCacheConfig(
        CheckpointPolicy(checkpoint), EvictionPolicy(eviction), every_n=every_n, align_tokens=tuple(align),
        host_tier=num_host > 0, **policy
    )
    m = HybridBlockManager(layout, num_host_blocks=num_host, prefix_cache=config)
    bs = layout.block_size
    running: deque[int] = deque()
    hit = total = skipped = 0
    moved = {"offload_blocks": 0, "onload_blocks": 0, "host_hit_tokens": 0}
    ckpt_samples, kv_cached_samples, host_samples = [], [], []
    t0 = time.perf_counter()

    def drain() -> None:
        """The tier's copies of the last calls (an executor runs them before the next forward)."""
        if num_host:
            t = m.take_tier_copies()
            moved["offload_blocks"] += len(t.offload)
            moved["onload_blocks"] += len(t.onload)

    def make_room() -> bool:
        if not running:
            return False
        m.free(running.popleft())
        return True

    desc = f"{model_key} {budget_gib} GiB {label(layout_kind, checkpoint, eviction, every_n)}"
    for item in tqdm(items, desc=desc, unit="req", leave=False, position=1, mininterval=2.0, disable=not progress):
        rid, toks = item.index, item.input_ids
        total += len(toks)
        try:
            m.check_fits(len(toks) + item.output_length)
        except AllocationError:
            skipped += 1
            continue
        while True:
            cached = m.match_prefix(toks)
            first = min(len(toks), cached + bs)
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
        drain()
        m.checkpoint(rid)
        drain()
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
                drain()
                m.checkpoint(rid)
                drain()
        while ok and not m.can_append(rid, item.output_length):
            ok = make_room()
        if not ok:
            m.free(rid)
            skipped += 1
            continue
        m.release_pins()
        if item.output_ids is None:
            m.append(rid, item.output_length)
            drain()
        else:
            # decode with the reply's ids (a later prompt repeats them); the state at the last block
            # boundary of the reply is offered to the policy (a decode-position checkpoint)
            end = len(toks) + len(item.output_ids)
            cut = max((end // bs) * bs - len(toks), 0)
            if cut:
                m.append(rid, cut, token_ids=item.output_ids[:cut])
                drain()
                m.checkpoint(rid, final=True)
                drain()
                m.release_pins()
            if len(item.output_ids) > cut:
                m.append(rid, len(item.output_ids) - cut, token_ids=item.output_ids[cut:])
                drain()
        running.append(rid)
        while len(running) > concurrency:
            m.free(running.popleft())
        cache = m.prefix_cache  # its counts (m.usage() recounts every block: too slow per request)
        ckpt_samples.append(cache.num_checkpoints * m.num_state_blocks * layout.bytes_per_block)
        kv_cached_samples.append(cache.num_cached_kv * layout.bytes_per_block)
        if num_host:
            host_samples.append(cache.tier.num_blocks * layout.bytes_per_block)
    while running:
        m.free(running.popleft())
    m.check_integrity()
    stats = m.prefix_cache.stats
    tier = m.prefix_cache.tier
    bpb = layout.bytes_per_block
    host = {}
    if tier is not None:
        ts = tier.stats
        host = {
            "host_hit_tokens": stats.hit_tokens_host,
            "offload_blocks": moved["offload_blocks"],
            "onload_blocks": moved["onload_blocks"],
            "offload_bytes": moved["offload_blocks"] * bpb,
            "onload_bytes": moved["onload_blocks"] * bpb,
            "host_kv_offloaded": ts.offloaded_kv,
            "host_checkpoints_offloaded": ts.offloaded_checkpoints,
            "host_kv_onloaded": ts.onloaded_kv,
            "host_checkpoints_onloaded": ts.onloaded_checkpoints,
            "host_kv_evicted": ts.evicted_kv,
            "host_checkpoints_evicted": ts.evicted_checkpoints,
            "host_dropped": ts.dropped,
            "host_cached_bytes_mean": sum(host_samples) / max(len(host_samples), 1),
        }
    return {
        "model": model_key,
        "tp": tp,
        "state_dtype": dtype,
        "budget_gib": budget_gib,
        "layout": layout_kind,
        "block_size": bs,
        "config": label(layout_kind, checkpoint, eviction, every_n),
        "checkpoint": checkpoint,
        "eviction": eviction,
        "every_n_blocks": every_n,
        "align_tokens": list(align),
        "num_blocks": layout.num_blocks,
        "blocks_per_checkpoint": m.num_state_blocks,
        "requests": len(items),
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
        "host_gib": host_gib,
        "num_host_blocks": num_host,
        **host,
        "seconds": time.perf_counter() - t0,
    }


def unbounded_hit_rate(trace: list[TraceRequest]) -> dict:
    """The hit rate of a cache that keeps every earlier request's full 512-token hash blocks forever
    (no checkpoint needed, no eviction): per request, its leading hash ids that an earlier request held
    as full blocks, times 512 tokens. The issue's reference figure (65.0% on the whole synthetic trace)."""
    seen: set[int] = set()
    hit = total = 0
    bt = MOONCAKE_BLOCK_TOKENS
    for r in trace:
        full = r.input_length // bt
        k = 0
        while k < full and r.hash_ids[k] in seen:
            k += 1
        hit += k * bt
        total += r.input_length
        seen.update(r.hash_ids[:full])
    return {"requests": len(trace), "hit_tokens": hit, "input_tokens": total, "token_hit_rate": hit / total}


def load_items(workload: str, trace_path: str, limit: int | None, sessions: int) -> tuple[list[Item], dict]:
    if workload == "multiturn":
        items, info = multiturn_items(sessions)
        return (items[:limit] if limit else items), info
    trace = load_trace(trace_path, limit)
    if workload == "trace":
        return trace_items(trace), {"requests": len(trace)}
    return trace_session_items(trace)


def compare(rows: list[dict]) -> list[dict]:
    """Per workload, model, budget and host tier size: the best padded row, the paged rows, and their ratios."""
    out = []
    for key in sorted({(r["workload"], r["model"], r["budget_gib"], r.get("host_gib", 0)) for r in rows}):
        sel = [r for r in rows if (r["workload"], r["model"], r["budget_gib"], r.get("host_gib", 0)) == key]
        padded = [r for r in sel if r["layout"] == "padded"]
        best = max(padded, key=lambda r: r["token_hit_rate"], default=None)
        base = best["token_hit_rate"] if best else 0.0
        out.append(
            {
                "workload": key[0],
                "model": key[1],
                "budget_gib": key[2],
                "host_gib": key[3],
                "best_padded": best["config"] if best else None,
                "best_padded_hit_rate": base,
                "rows": {r["config"]: r["token_hit_rate"] for r in sel},
                "ratio_vs_best_padded": {
                    r["config"]: (r["token_hit_rate"] / base if base else None) for r in sel if r["layout"] == "paged"
                },
            }
        )
    return out


def link_seconds(row: dict, gpu: GpuSpec) -> dict:
    """``row`` with the seconds its host tier's bytes take on ``gpu``'s host link, one direction at a
    time (``offload_link_s``: device -> host, ``onload_link_s``: host -> device, ``link_s``: both),
    as the simulator prices them; a row without a tier gets zeros."""
    rate = gpu.host_link_bytes_per_s
    out, back = row.get("offload_bytes", 0) / rate, row.get("onload_bytes", 0) / rate
    return row | {"offload_link_s": out, "onload_link_s": back, "link_s": out + back}


def grid_table(rows: list[dict], unbounded: dict) -> dict:
    """The budget table of ``rows`` (one per workload, model, device budget and host size):
    ``{workload: {model: {device GiB: {host GiB: cell}}}}`` with a cell's hit rate, the tier's bytes
    out / in and their link seconds, and ``unbounded`` per workload (its token hit rate). Keys are
    strings (JSON). Raises ``ValueError`` when two rows fill one cell (more than one policy)."""
    table: dict = {}
    for r in rows:
        cells = table.setdefault(r["workload"], {}).setdefault(r["model"], {}).setdefault(str(r["budget_gib"]), {})
        key = str(r.get("host_gib", 0))
        if key in cells:
            raise ValueError(f"two rows for {r['workload']} {r['model']} {r['budget_gib']} GiB host {key} GiB: "
                             "a grid has one policy")
        cells[key] = {
            "token_hit_rate": r["token_hit_rate"],
            "host_hit_tokens": r.get("host_hit_tokens", 0),
            "offload_bytes": r.get("offload_bytes", 0),
            "onload_bytes": r.get("onload_bytes", 0),
            "offload_link_s": r.get("offload_link_s", 0.0),
            "onload_link_s": r.get("onload_link_s", 0.0),
        }
    return {"cells": table, "unbounded": {w: u["token_hit_rate"] for w, u in unbounded.items()}}


def format_grid(grid: dict) -> str:
    """``grid_table``'s table as text: per workload and model, one line per device budget with the hit
    rate at each host size, then the tier's GB out / in and link seconds at each host size > 0."""
    lines = []
    for workload, models in grid["cells"].items():
        ub = grid["unbounded"].get(workload)
        for model, budgets in models.items():
            hosts = sorted({h for cells in budgets.values() for h in cells}, key=float)
            head = " ".join(f"{'host ' + h + ' GiB':>14s}" for h in hosts)
            lines.append(f"{workload} {model}: token hit rate" + (f" (unbounded {ub:.1%})" if ub is not None else ""))
            lines.append(f"  {'device':>8s} {head}")
            for b in sorted(budgets, key=float):
                cells = budgets[b]
                vals = " ".join(f"{cells[h]['token_hit_rate']:>14.1%}" if h in cells else f"{'-':>14s}" for h in hosts)
                lines.append(f"  {b + ' GiB':>8s} {vals}")
            tiers = [h for h in hosts if float(h) > 0]
            if tiers:
                lines.append("  host link: GB out / in (s out + in)")
                for b in sorted(budgets, key=float):
                    cells = budgets[b]
                    parts = []
                    for h in tiers:
                        c = cells.get(h)
                        parts.append("-" if c is None else
                                     f"{h} GiB {c['offload_bytes'] / 1e9:,.0f} / {c['onload_bytes'] / 1e9:,.0f} "
                                     f"({c['offload_link_s']:.1f} + {c['onload_link_s']:.1f})")
                    lines.append(f"  {b + ' GiB':>8s} " + "; ".join(parts))
    return "\n".join(lines)


# (workload, items, model, budget, layout, checkpoint, eviction, every_n, host GiB) of main()
_RUNS: list[tuple] = []


def _run(i: int, concurrency: int, align: tuple[int, ...], legacy: bool, progress: bool) -> dict:
    """Replay ``_RUNS[i]`` (in a worker process with ``--jobs``: no per-request progress bar there)."""
    workload, items, model_key, budget, layout_kind, checkpoint, eviction, every_n, host_gib = _RUNS[i]
    extra = config_kwargs((layout_kind, checkpoint, eviction, every_n), legacy)
    r = replay(model_key, budget, layout_kind, checkpoint, eviction, every_n, items, concurrency, align,
               progress=progress, host_gib=host_gib, **extra)
    r.update(extra)
    r["workload"] = workload
    return r


def _line(r: dict) -> str:
    host = f"{r['host_gib']:5d}"
    moved = (f"{r.get('onload_bytes', 0) / GiB:9.1f} / {r.get('offload_bytes', 0) / GiB:9.1f} "
             f"{r.get('link_s', 0.0):7.1f}" if r["host_gib"] else f"{'-':>29s}")
    return (f"{r['workload']:15s} {r['model']:20s} {r['budget_gib']:4d} {host} {r['config']:34s} "
            f"{r['token_hit_rate']:8.1%} {r['checkpoint_bytes_mean'] / GiB:9.2f} / "
            f"{r['checkpoint_bytes_max'] / GiB:7.2f} {moved} {r['skipped']:7d} {r['seconds']:6.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked and resolved: ``--grid`` filled in (workload, policy, budgets, host
    sizes, unbounded, name), ``workloads`` / ``host_cache`` / ``name`` defaults applied, ``gpu`` the
    :class:`GpuSpec` of ``--gpu`` / ``--calibration``. Exits with status 2 and one message on bad
    input, before any work."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--quick", action="store_true", help="400 requests, the middle budget only")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--align-tokens", type=int, nargs="+", default=[512, 2048], help="branch_last_aligned grids")
    # (branch_spaced uses PrefixCacheConfig's defaults: spaced_align_tokens, gap_fraction)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--budgets", nargs="+", type=int, default=None, help="GiB (default 16 32 64)")
    ap.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                    help=f"default {' '.join(DEFAULT_WORKLOADS)}")
    ap.add_argument("--configs", nargs="+", type=int, default=None, help="indices into CONFIGS (default all)")
    ap.add_argument("--config", nargs=4, action="append", default=None,
                    metavar=("LAYOUT", "CHECKPOINT", "EVICTION", "N"),
                    help="a row not in CONFIGS, e.g. paged every_n_blocks lru 8 (repeatable; with --configs, both)")
    ap.add_argument("--sessions", type=int, default=300, help="multiturn: number of conversations")
    ap.add_argument("--name", default=None, help="results file name prefix (default prefix; --grid: "
                    "prefix_hosttier_grid)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="replays at once, one process each (same results; per-replay seconds then share cores)")
    ap.add_argument("--legacy", action="store_true",
                    help="demote_tail off in every row (as before it existed: comparable with older runs)")
    ap.add_argument("--host-cache", nargs="+", type=int, default=None, metavar="GIB",
                    help="host tier sizes in GiB per GPU, one replay each (0: no tier; default 0; --grid: "
                    f"{' '.join(map(str, GRID_HOST_CACHE))})")
    ap.add_argument("--unbounded", action="store_true",
                    help="also report the unbounded hit rate of the trace workloads (every full hash block kept)")
    ap.add_argument("--grid", action="store_true",
                    help="the host tier's budget table: trace workload, paged branch_spaced+lru, budgets "
                    f"{' '.join(map(str, GRID_BUDGETS))} x host {' '.join(map(str, GRID_HOST_CACHE))} GiB, "
                    "unbounded, host-link time (not with --workloads, --configs, --config, --quick, --legacy)")
    ap.add_argument("--gpu", default="h200", help="GPU preset or JSON whose host link prices the tier's bytes")
    ap.add_argument("--calibration", default=None, help="a measured calibration JSON (as hybridkv simulate's)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.host_cache is not None and any(h < 0 for h in args.host_cache):
        ap.error(f"--host-cache sizes must be >= 0 GiB, got {args.host_cache}")
    if args.budgets is not None and any(b < 1 for b in args.budgets):
        ap.error(f"--budgets must be >= 1 GiB, got {args.budgets}")
    if args.grid:
        given = [flag for flag, v in (("--workloads", args.workloads), ("--configs", args.configs),
                                      ("--config", args.config), ("--quick", args.quick), ("--legacy", args.legacy))
                 if v]
        if given:
            ap.error(f"--grid fixes the workload and the policy: drop {', '.join(given)}")
        args.workloads = ["trace"]
        args.config = [[str(v) for v in GRID_CONFIG]]
        args.budgets = args.budgets or list(GRID_BUDGETS)
        args.host_cache = args.host_cache or list(GRID_HOST_CACHE)
        args.unbounded = True
        args.name = args.name or "prefix_hosttier_grid"
    args.workloads = args.workloads or list(DEFAULT_WORKLOADS)
    args.host_cache = args.host_cache or [0]
    args.name = args.name or "prefix"
    try:
        args.gpu = load_gpu(args.gpu, args.calibration)
    except ValueError as e:
        ap.error(f"--gpu / --calibration: {e}")
    try:
        args.config = [list(parse_config(c)) for c in args.config or []]
    except ValueError as e:
        ap.error(str(e))
    if args.configs is not None and any(not 0 <= i < len(CONFIGS) for i in args.configs):
        ap.error(f"--configs indices must be in 0..{len(CONFIGS) - 1}, got {args.configs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limit = 400 if args.quick and args.limit is None else args.limit
    quick_note = (
        "--quick: a sample (the first 400 requests, one budget per model), not a result. Too few requests "
        "to fill the cache, so it cannot show how the policies behave under eviction."
    )
    if args.quick:
        print(quick_note, flush=True)
    configs = [CONFIGS[i] for i in args.configs or []] if args.configs or args.config else list(CONFIGS)
    configs += [tuple(c) for c in args.config]
    rows, infos = [], {}
    runs = []
    unbounded = {}
    for workload in args.workloads:
        try:
            items, info = load_items(workload, args.trace, limit, args.sessions)
        except FileNotFoundError as e:
            print(f"bench_prefix: {e}", file=sys.stderr)
            return 2
        infos[workload] = info
        if args.unbounded and workload == "trace":
            unbounded[workload] = unbounded_hit_rate(load_trace(args.trace, limit))
            print(f"unbounded ({workload}, {unbounded[workload]['requests']} requests): "
                  f"{unbounded[workload]['token_hit_rate']:.1%}", flush=True)
        for model_key in args.models:
            budgets = args.budgets or (MODELS[model_key][3][1:2] if args.quick else MODELS[model_key][3])
            runs += [(workload, items, model_key, b, *c, h) for b in budgets for c in configs for h in args.host_cache]
    print(
        f"{'workload':15s} {'model':20s} {'GiB':>4s} {'host':>5s} {'config':34s} {'hit rate':>8s} "
        f"{'ckpt GiB (mean/max)':>20s} {'GiB in / out, link s':>29s} {'skipped':>7s} {'s':>6s}",
        flush=True,
    )
    _RUNS[:] = runs  # read by the workers (forked: the items are not copied per run)
    settings = (args.concurrency, tuple(args.align_tokens), args.legacy)
    overall = tqdm(total=len(runs), desc="all runs", unit="run", position=0)
    t0 = time.perf_counter()
    if args.jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_run, i, *settings, False) for i in range(len(runs))]
            for done in as_completed(futures):
                overall.update(1)
                overall.write(_line(link_seconds(done.result(), args.gpu)))
            rows = [link_seconds(f.result(), args.gpu) for f in futures]  # in run order, whatever finished first
    else:
        for i in range(len(runs)):
            rows.append(link_seconds(_run(i, *settings, True), args.gpu))
            overall.update(1)
            overall.write(_line(rows[-1]))
    wall = time.perf_counter() - t0
    overall.close()
    print(f"{len(rows)} replays in {wall:.1f} s wall ({sum(r['seconds'] for r in rows):.1f} s of replay, "
          f"{args.jobs} process{'es' if args.jobs > 1 else ''})", flush=True)
    table = compare(rows)
    for t in table:
        if t["best_padded"] is None:
            continue
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in t["ratio_vs_best_padded"].items() if v is not None)
        print(f"{t['workload']} {t['model']} {t['budget_gib']} GiB (host {t['host_gib']}): best padded "
              f"{t['best_padded']} {t['best_padded_hit_rate']:.1%}; paged vs it: {ratios}")
    grid = None
    if args.grid:
        grid = grid_table(rows, unbounded)
        print(f"host link: {args.gpu.name} {args.gpu.host_link_bytes_per_s / 1e9:.1f} GB/s each way")
        print(format_grid(grid), flush=True)
    path = save(
        args.name,
        {
            "workloads": infos,
            "trace": str(args.trace),
            "limit": limit,
            "legacy": args.legacy,
            "jobs": args.jobs,
            "wall_seconds": wall,
            "concurrency": args.concurrency,
            "align_tokens": args.align_tokens,
            "assumptions": {
                "trace": "hash id -> fixed 512-token block, last cut to the input length; replies never reused",
                "trace-sessions": trace_session_items.__doc__,
                "multiturn": multiturn_items.__doc__,
            },
            "host_cache_gib": args.host_cache,
            "host_link": {"gpu": args.gpu.name, "bytes_per_s": args.gpu.host_link_bytes_per_s,
                          "calibration": args.calibration},
            "command": " ".join(["python benchmarks/bench_prefix.py", *(sys.argv[1:] if argv is None else argv)]),
            "unbounded": unbounded,
            "grid": grid,
            "runs": rows,
            "comparison": table,
        },
    )
    print(f"saved {path}")
    if args.quick:
        print(quick_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())

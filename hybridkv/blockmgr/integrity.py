"""``check_integrity``: recount every reference from the records and compare with the pools."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hybridkv.blockmgr.records import BlockUse, RequestStatus, SwapDirection, SwapPlan
from hybridkv.errors import IntegrityError
from hybridkv.planner.layout import NULL_BLOCK

if TYPE_CHECKING:
    from hybridkv.blockmgr.lifecycle import ManagerCore


def _count(n: int, *id_arrays: np.ndarray) -> np.ndarray:
    counts = np.zeros(n, dtype=np.int64)
    for ids in id_arrays:
        np.add.at(counts, ids.ravel(), 1)
    return counts


def check_integrity(m: ManagerCore) -> None:
    """Raise :class:`IntegrityError` unless, on device and host alike:

    free + referenced + evictable == total; every reference count equals the references the
    records (and the prefix cache, its host tier included) hold; no block is both free and
    referenced; no state block has two owners or is also KV; the per-block use bytes agree with all of that.
    """
    problems: list[str] = []
    n = m.layout.num_blocks
    kv, state, spec, host = [], [], [], []
    for rec in m.requests.values():
        if rec.status is RequestStatus.RUNNING:
            kv.append(rec.kv_blocks)
            lent = m._lent.get(rec.request_id)
            if lent is None or lent[1] is None:  # (lent as a checkpoint: the prefix cache owns them)
                state.append(rec.state[..., m._state_mask].ravel())
            spec.append(rec.spec[..., m._state_mask].ravel())
            if rec.num_kv_blocks != (-(-rec.num_tokens // m.block_size) if m._has_kv else 0):
                problems.append(
                    f"request {rec.request_id!r}: {rec.num_kv_blocks} KV blocks for {rec.num_tokens} tokens"
                )
        else:
            host.append(rec.host_blocks)
        plan = rec.pending if isinstance(rec.pending, SwapPlan) else None  # a transfer plan holds no extra blocks
        if plan is not None and plan.direction is SwapDirection.OUT:
            host.append(plan.host_blocks)  # reserved host copies
        elif plan is not None:  # reserved device blocks: KV first, then the live state sets
            n_kv = plan.device_blocks.size - m.num_state_blocks
            kv.append(plan.device_blocks[:n_kv])
            state.append(plan.device_blocks[n_kv:])
    kv.extend(m._pin_held)  # references held by copies not yet run (their owners gave them back)
    kv.extend(m._export_kv)  # references held by pending prefix exports (a peer reads them)
    state.extend(ids for ids, key in m._held.values() if key is None)  # held states (in_place_state)
    state.extend(sets[..., m._state_mask].ravel() for held in m._exports.values() for _, sets in held)  # exports
    cache = getattr(m, "prefix_cache", None)
    cached_kv = cache.cached_kv_blocks() if cache is not None else np.empty(0, np.int32)
    checkpoints = cache.checkpoint_blocks() if cache is not None else np.empty(0, np.int32)
    kv_counts = _count(n, *kv)
    owned = _count(n, *state, *spec, checkpoints)
    expected = kv_counts + owned
    actual = m.pool.ref_counts.astype(np.int64)
    if not np.array_equal(expected, actual):
        bad = np.flatnonzero(expected != actual)[:8]
        problems.append(
            f"reference counts differ at blocks {bad.tolist()}: "
            f"expected {expected[bad].tolist()}, pool {actual[bad].tolist()}"
        )
    twice = np.flatnonzero((owned > 1) | ((owned > 0) & (kv_counts > 0)))
    if twice.size:
        problems.append(f"state blocks with more than one owner: {twice[:8].tolist()}")
    if owned[NULL_BLOCK] or kv_counts[NULL_BLOCK]:
        problems.append("the null block is referenced")
    problems += m.pool.check_free_extents()
    free = m.pool.free_mask()
    cached_mask = np.zeros(n, dtype=bool)
    cached_mask[cached_kv] = True
    if (free & (actual > 0)).any() or (free & cached_mask).any():
        problems.append("blocks both free and referenced or cached")
    pending = m.pending_free_blocks()
    pending_mask = np.zeros(n, dtype=bool)
    pending_mask[pending] = True
    if pending.size != int(pending_mask.sum()) or (pending_mask & (free | cached_mask | (actual > 0))).any():
        problems.append("pending-free blocks listed twice, free, cached or referenced")
    if (free & (m._pin_of != 0)).any():
        problems.append(f"pinned blocks in the free pool: {np.flatnonzero(free & (m._pin_of != 0))[:8].tolist()}")
    if cache is not None:
        problems += cache.check()
    if (cached_mask & (actual > 0)).any():
        problems.append("cached (evictable) KV blocks still referenced")
    referenced = actual > 0
    total = int(free.sum()) + int(referenced.sum()) + int(cached_mask.sum()) + int(pending_mask.sum()) + 1
    if total != n:
        problems.append(f"free + referenced + evictable + pending-free + null = {total}, pool has {n}")
    # the per-block use bytes agree with the recount
    use = np.full(n, BlockUse.FREE, dtype=np.int8)
    use[NULL_BLOCK] = BlockUse.NULL
    use[kv_counts > 0] = BlockUse.KV
    use[cached_kv] = BlockUse.CACHED_KV
    use[pending] = BlockUse.PENDING_FREE
    for ids, u in (
        (np.concatenate(state) if state else None, BlockUse.STATE),
        (np.concatenate(spec) if spec else None, BlockUse.SPECULATIVE),
        (checkpoints, BlockUse.CHECKPOINT),
    ):
        if ids is not None:
            use[ids] = u
    if not np.array_equal(use, m.use):
        bad = np.flatnonzero(use != m.use)[:8]
        problems.append(
            f"block use differs at {bad.tolist()}: expected {use[bad].tolist()}, recorded {m.use[bad].tolist()}"
        )
    tier = cache.tier if cache is not None else None
    host.extend(ids for _, ids in m._host_pending)  # read by swap-ins whose copies may not have run
    if tier is not None:
        host.extend(tier.host_ids())  # the host tier's cached KV blocks and checkpoints, one reference each
    if m.host_pool is not None:
        host_expected = _count(m.host_pool.num_blocks, *host)
        if not np.array_equal(host_expected, m.host_pool.ref_counts):
            problems.append("host reference counts differ from swapped requests, pending plans and the host tier")
        problems += [f"host: {p}" for p in m.host_pool.check_free_extents()]
        if host_expected.max(initial=0) > 1:
            problems.append("a host block is held twice")
    elif any(h.size for h in host):
        problems.append("swapped requests without a host pool")
    if problems:
        raise IntegrityError("; ".join(problems))

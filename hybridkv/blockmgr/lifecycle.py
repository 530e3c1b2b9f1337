"""The manager's core: the one count, pins, and a request's lifecycle (admit, grow, free, fork),
with the batch views and the books every other part of the manager works on.

:class:`ManagerCore` is the base of :class:`~hybridkv.blockmgr.manager.HybridBlockManager`; the
parts that stand on it (checkpoints, speculation, swap, transfer plans) subclass it in their own
modules, and ``manager.py`` puts them together.

Contract (DESIGN.md "Manager contract"): check-then-act pairs; every mutation is atomic (all
checks happen before the first change, so on any error nothing changed); every count is in blocks
and admission uses exactly the count allocation takes (:meth:`HybridBlockManager.blocks_to_admit`).

Ownership: the manager owns every block id it hands out. Callers get numpy views (block tables,
state tables, copy lists, swap plans) that stay valid until the next mutating call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr.books import PoolBooks
from hybridkv.blockmgr.hashing import TokenArray, as_token_array
from hybridkv.blockmgr.pool import make_pool
from hybridkv.blockmgr.prefix import PrefixCache, PrefixCacheConfig, PrefixHit
from hybridkv.blockmgr.records import (
    AdmissionPlan,
    Allocation,
    BlockCopies,
    BlockUse,
    RequestId,
    RequestRecord,
    RequestStatus,
    SwapDirection,
    TierCopies,
    TierPlan,
)
from hybridkv.blockmgr.tables import RowTables
from hybridkv.errors import (
    DuplicateRequestError,
    NoFreeBlocksError,
    RequestStateError,
    RequestTooLargeError,
)
from hybridkv.planner.layout import NULL_BLOCK, Layout
from hybridkv.units import as_count, cdiv

_EMPTY = np.empty(0, dtype=np.int32)
_NO_COPIES = BlockCopies.empty()
_NO_TIER = TierPlan(TierCopies(_EMPTY, _EMPTY, SwapDirection.OUT), TierCopies(_EMPTY, _EMPTY, SwapDirection.IN))


class ManagerCore(PoolBooks):
    """Per-request lifecycle over one :class:`BlockPool` laid out by a :class:`Layout`.

    ``num_host_blocks``: size of the host (CPU) swap pool, 0 = no swap. ``watermark``: fraction of
    usable blocks admission keeps free for running requests to grow into.
    """

    def __init__(
        self,
        layout: Layout,
        num_host_blocks: int = 0,
        watermark: float = 0.0,
        prefix_cache: PrefixCacheConfig | None = None,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark}")
        self.layout = layout
        self.block_size = layout.block_size
        self.num_state_groups = layout.num_state_groups
        self.blocks_per_state = max(layout.blocks_per_state, default=0)
        self._has_kv = layout.kv_group is not None
        # state set shape [G, bps]; groups with fewer blocks pad their row with the null block
        bps = np.array(layout.blocks_per_state, dtype=np.int64)
        self._state_mask = np.arange(self.blocks_per_state)[None, :] < bps[:, None]
        self.num_state_blocks = int(bps.sum())
        self._uniform_sets = bool(self._state_mask.all())
        self.pool = make_pool(layout.num_blocks)
        self.host_pool = make_pool(num_host_blocks, reserve_null=False) if num_host_blocks > 0 else None  # ids 0..N-1
        self.watermark_blocks = int(watermark * self.pool.num_usable)
        self.use = np.zeros(layout.num_blocks, dtype=np.int8)
        self.use[NULL_BLOCK] = BlockUse.NULL
        self.requests: dict[RequestId, RequestRecord] = {}
        self.tables = RowTables(self.num_state_groups, self.blocks_per_state)
        self._no_spec_sets = np.zeros((0, self.num_state_groups, self.blocks_per_state), dtype=np.int32)
        # pins: blocks that copies handed out (and not yet run) read or write, by epoch; a pinned
        # block given back waits in _pending_free until release_pins (tracking starts with the
        # first begin_pin_epoch; see docs/contract.md)
        self._pin_epoch = 0
        self._pin_of = np.zeros(layout.num_blocks, dtype=np.int64)  # 0 = not pinned
        self._pin_chunks: list[tuple[int, np.ndarray]] = []
        self._pending_free: list[np.ndarray] = []
        # host blocks a committed swap-in read (pin epoch, ids), given back by release_pins (host tier only)
        self._host_pending: list[tuple[int, np.ndarray]] = []
        # KV blocks whose last reference dropped while a copy not yet run reads or writes them: the
        # copy holds one reference until release_pins (a cached one would otherwise be evictable)
        self._pin_held: list[np.ndarray] = []
        # KV references held by pending prefix exports (blockmgr.transfer_host), one per block per export
        self._export_kv: list[np.ndarray] = []
        # and their checkpoint holds by node key (several exports may read one checkpoint; the prefix
        # cache's hold is one flag: the first export sets it, the last one clears it)
        self._export_checkpoints: dict[int, int] = {}
        self.prefix_cache = PrefixCache(self, prefix_cache) if prefix_cache is not None else None
        # PrefixCacheConfig.in_place_state: requests whose live sets hold the state of their last
        # block boundary, lent where they are (flat ids, and the node key when they are its
        # checkpoint); their next append takes new sets. The sets lent one boundary earlier are
        # held until the request's next append (or its free), as vLLM frees a state block then
        self._lent: dict[RequestId, tuple[np.ndarray, int | None]] = {}
        self._held: dict[RequestId, tuple[np.ndarray, int | None]] = {}
        # exports (PrefixCacheConfig.export_alignment): state sets a prefill kernel writes the state
        # at a position inside the request's chunk into, reserved with the chunk (position, sets
        # [G, bps]) until the update after its forward; with in_place_state, the checkpoints so made
        # (node keys), held until the request's next append
        self._exports: dict[RequestId, list[tuple[int, np.ndarray]]] = {}
        self._export_held: dict[RequestId, int] = {}
        if self.prefix_cache is not None and self.prefix_cache.config.in_place_state and self.host_pool is not None:
            raise ValueError("PrefixCacheConfig(in_place_state=True) does not combine with a host pool")

    # ---- counting: the one formula --------------------------------------------------------------
    def blocks_to_admit(self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None) -> int:
        """Blocks ``allocate`` takes out of :attr:`num_available_blocks` for a request holding
        ``num_tokens`` tokens: KV blocks + live state sets + speculative sets, less the KV blocks a
        prefix hit shares, plus the evictable blocks the hit pins (the cached KV blocks it revives
        and its checkpoint, read by the copy into the live sets)."""
        return self._admission(num_tokens, num_speculative, token_ids)[0]

    def _admission(
        self, num_tokens: int, num_speculative: int, token_ids: Sequence[int] | None
    ) -> tuple[int, int, PrefixHit | None]:
        """(blocks taken from the available count, new blocks to allocate, the prefix hit)."""
        num_tokens = as_count(num_tokens, "num_tokens")
        num_speculative = as_count(num_speculative, "num_speculative")
        kv = cdiv(num_tokens, self.block_size) if self._has_kv else 0
        new = kv + (1 + num_speculative) * self.num_state_blocks
        if self.prefix_cache is None or token_ids is None:
            return new, new, None
        hit = self.prefix_cache.match(token_ids, num_tokens)
        shared = hit.num_blocks if self._has_kv else 0
        taken = new - shared + self.prefix_cache.num_pinned(hit)
        # (CheckpointRules.waits_for_hit: take the hit or wait, unless nothing runs that could free blocks)
        fallback = not self.prefix_cache.rules.waits_for_hit or not self.requests
        if fallback and taken > new and taken + self.watermark_blocks > self.num_available_blocks:
            # the hit pins more than it saves and only the miss fits: admit as a miss
            miss = hit._replace(num_tokens=0, kv_blocks=_EMPTY, checkpoint_key=None, keys=[], checkpoint_ids=None,
                                host_index=_EMPTY, host_kv=_EMPTY, host_checkpoint=None)
            return new, new, miss
        return taken, new - shared, hit

    def plan_admission(
        self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None
    ) -> AdmissionPlan:
        """What ``allocate`` with these arguments would do now: the blocks it takes out of
        :attr:`num_available_blocks` and the tokens it serves from the prefix cache (0 when a hit
        that pins more than it saves is admitted as a miss). Changes nothing."""
        taken, _, hit = self._admission(num_tokens, num_speculative, token_ids)
        return AdmissionPlan(taken, hit.num_tokens if hit is not None else 0)

    def mark_computed(self, request_id: RequestId, num_computed_tokens: int) -> None:
        """The forward wrote KV (and state) for the request's first ``num_computed_tokens`` tokens:
        their full blocks may now enter the prefix cache. Blocks enter it only through this call
        (and the hit at admission), never when they are allocated, so a block whose forward never
        ran (an aborted row) can never be served as a prefix hit. A no-op without a prefix cache."""
        n = as_count(num_computed_tokens, "num_computed_tokens")
        rec = self._running(request_id)
        if n > rec.num_tokens:
            raise ValueError(f"request {request_id!r} holds {rec.num_tokens} tokens, cannot have {n} computed")
        if rec.token_ids is not None and self.prefix_cache is not None:
            self._register_computed(rec, n)

    def _register_computed(self, rec: RequestRecord, n: int) -> None:
        """:meth:`mark_computed` of ``n`` tokens on the record (a prefix cache and token ids given):
        the new full blocks enter the chain, and where a node already caches an evictable copy of a
        block the request computed again (it matched no checkpoint there), the request's copy
        replaces it (:meth:`Registration.adopt_copies`): the copy in use is the one kept, so a
        recomputed prefix's root is not left at its old place in the LRU queue, evicted first and
        orphaning the deeper blocks and checkpoints that hang on it."""
        cache, start = self.prefix_cache, len(rec.block_keys)
        assert cache is not None and rec.token_ids is not None
        if n // self.block_size <= start:
            return
        cache.register(rec.token_ids, rec.block_keys, rec.kv_blocks, n)
        old = cache.adopt_copies(rec.block_keys, rec.kv_blocks, start, n // self.block_size)
        if old.size:  # the replaced copies, unless the rules keep them queued
            self._give_back(old)

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Tokens of ``token_ids`` a request admitted now would get from the prefix cache."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(token_ids, len(token_ids) if max_tokens is None else max_tokens).num_tokens

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable (cached KV, checkpoints)."""
        if self.prefix_cache is None:
            return self.pool.num_free
        return self.pool.num_free + self.prefix_cache.num_evictable

    def check_fits(self, max_tokens: int, num_speculative: int = 0, extra_blocks: int = 0) -> None:
        """Raise :class:`RequestTooLargeError` if a request of ``max_tokens`` (and ``extra_blocks``
        held beside it at some point, e.g. a checkpoint set) can never fit (``TypeError`` /
        ``ValueError`` for counts that are not integers >= 0)."""
        needed = self.blocks_to_admit(max_tokens, num_speculative) + extra_blocks
        if needed > self.pool.num_usable - self.watermark_blocks:
            raise RequestTooLargeError(needed, self.pool.num_usable - self.watermark_blocks)

    def can_allocate(self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None) -> bool:
        need = self.blocks_to_admit(num_tokens, num_speculative, token_ids)
        return need + self.watermark_blocks <= self.num_available_blocks

    # ---- lifecycle -----------------------------------------------------------------------------
    def allocate(
        self,
        request_id: RequestId,
        num_tokens: int,
        num_speculative: int = 0,
        token_ids: Sequence[int] | None = None,
    ) -> Allocation:
        """Admit a request: KV blocks for ``num_tokens`` plus its state sets, in one pool operation.

        With a prefix cache and ``token_ids`` (the whole input, possibly longer than
        ``num_tokens``), the longest hit within ``num_tokens`` shares its KV blocks and the live sets
        are filled from its checkpoint: ``Allocation.copies`` (checkpoint -> live) must run before
        the request's first forward, which starts at ``num_cached_tokens``. Raises
        :class:`DuplicateRequestError`, :class:`RequestTooLargeError` (never fits) or
        :class:`NoFreeBlocksError` (not now); nothing changes on error.
        """
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} is already allocated: free it first")
        num_tokens, num_speculative = as_count(num_tokens, "num_tokens"), as_count(num_speculative, "num_speculative")
        self.check_fits(num_tokens, num_speculative)
        if token_ids is not None and self.prefix_cache is not None:
            token_ids = TokenArray(token_ids)  # once: the match and the record share it (and its hashes)
        taken, need, hit = self._admission(num_tokens, num_speculative, token_ids)
        if taken + self.watermark_blocks > self.num_available_blocks:
            raise NoFreeBlocksError(
                f"request {request_id!r} ({num_tokens} tokens)",
                taken + self.watermark_blocks,
                self.num_available_blocks,
                "wait for running requests to finish or preempt one",
            )
        shared = _EMPTY
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        units: set[int] = set()
        if hit is not None:
            # evict first, sparing the hit (its KV blocks and the one checkpoint it reads, on the
            # device and on the host); then take the hit's blocks out of the evictable set
            ckpt = {hit.checkpoint_key} if hit.checkpoint_key is not None else set()
            if tier is not None and hit.on_host:
                units = tier.units_of(hit.host_kv, hit.host_checkpoint)
                tier._protect = units  # the offloads of this eviction may not take them
            try:
                self._make_room(need, protect=hit.kv_blocks, protect_ckpt=ckpt)
            finally:
                if tier is not None:
                    tier._protect = set()
            shared = self.prefix_cache.take_hit(hit)  # type: ignore[union-attr]
        # state sets first: they are the contiguous part that ops gather and swap
        ids = self._take(need)
        n_live, n_state = self.num_state_blocks, (1 + num_speculative) * self.num_state_blocks
        rec = RequestRecord(request_id, num_tokens, _EMPTY, shared.size + need - n_state, _EMPTY, self._no_spec())
        self.tables.take(rec, rec.num_kv_blocks)
        n_host = hit.host_index.size if hit is not None else 0
        if n_host:  # host-resident KV of the hit: new device blocks in its place, filled host -> device
            assert hit is not None
            best = len(hit.keys)
            on_dev = np.ones(best, dtype=bool)
            on_dev[hit.host_index] = False
            rec.kv[:best][on_dev] = shared
            rec.kv[hit.host_index] = ids[n_state : n_state + n_host]
            rec.kv[best : rec.num_kv_blocks] = ids[n_state + n_host :]
        else:
            rec.kv[: shared.size] = shared
            rec.kv[shared.size : rec.num_kv_blocks] = ids[n_state:]
        rec.state[self._state_mask] = ids[:n_live]  # (a flat view only when groups are equal)
        if num_speculative:
            rec.spec = self._split_state_sets(ids[n_live:n_state], num_speculative)
        if self.pool.last_allocation_was_run:
            first = int(ids[0])  # one run (the common case): slices instead of fancy indexing
            if not shared.size and self.prefix_cache is None:
                rec.run = (first, first + need)
            self.use[first : first + n_live] = BlockUse.STATE
            self.use[first + n_live : first + n_state] = BlockUse.SPECULATIVE
            self.use[first + n_state : first + need] = BlockUse.KV
        else:
            self.use[ids[:n_live]] = BlockUse.STATE
            self.use[ids[n_live:n_state]] = BlockUse.SPECULATIVE
            self.use[ids[n_state:]] = BlockUse.KV
        self.requests[request_id] = rec
        if hit is None:
            return Allocation(0, _NO_COPIES)
        assert token_ids is not None and self.prefix_cache is not None
        rec.token_ids = token_ids
        rec.block_keys = list(hit.keys)  # the hit's blocks are cached; the rest enter via mark_computed
        rec.branch_tokens = hit.num_matched_tokens
        rec.tail_shared = hit.num_blocks > 0
        copies = _NO_COPIES
        if hit.checkpoint_ids is not None:
            ckpt_ids = hit.checkpoint_ids.copy()
            copies = self._pin(BlockCopies(ckpt_ids, ids[:n_live].copy()))
        if hit.on_host:
            assert tier is not None
            onto = ids[n_state : n_state + n_host]
            self.prefix_cache.adopt(hit.keys, token_ids.view(), hit.host_index, onto)
            host_src, dev_dst = hit.host_kv, onto
            tier.stats.onloaded_kv += n_host
            if hit.host_checkpoint is not None:  # straight into the live sets (no device checkpoint)
                host_src = np.concatenate((host_src, hit.host_checkpoint))
                dev_dst = np.concatenate((dev_dst, ids[:n_live]))
                tier.stats.onloaded_checkpoints += 1
            tier.onload(host_src, dev_dst, units)
            self._pin_device(dev_dst)
        return Allocation(hit.num_tokens, copies)

    def take_tier_copies(self) -> TierPlan:
        """The host tier's copies handed out since the last call (offloads of evicted cached blocks,
        device -> host; host hits, host -> device): the executor runs ``offload`` first of all (stage
        0), ``onload`` after the plan's swaps (stage 3b), both before the forward (docs/contract.md).
        Empty without a host tier. Callers without pin epochs run them right after the call that
        made them (``allocate``, ``append``, ``fork``, ``checkpoint``, ``swap_in``,
        ``begin_speculation``, ``reserve_export``: every call that may evict), before that call's own copies."""
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        if tier is None:
            return _NO_TIER
        return tier.take_copies()

    def num_new_kv_blocks(self, request_id: RequestId, num_new_tokens: int) -> int:
        """Blocks ``append`` takes for ``num_new_tokens`` more tokens (copy-on-write included)."""
        return self._new_blocks(self._running(request_id), as_count(num_new_tokens, "num_new_tokens"))

    def _new_blocks(self, rec: RequestRecord, num_new_tokens: int) -> int:
        """:meth:`num_new_kv_blocks` of a running request's record (the count checked)."""
        lending = self._lent or self._held or self._export_held
        lent = self._lent_extra(rec.request_id) if lending and num_new_tokens else 0
        return self._kv_new_blocks(rec, num_new_tokens) + lent

    def _kv_new_blocks(self, rec: RequestRecord, num_new_tokens: int) -> int:
        """The KV blocks (copy-on-write included) of :meth:`_new_blocks`."""
        if not self._has_kv:
            return 0
        grow = cdiv(rec.num_tokens + num_new_tokens, self.block_size) - rec.num_kv_blocks
        return max(grow, 0) + int(self._needs_cow(rec) and num_new_tokens > 0)

    def _lent_extra(self, request_id: RequestId) -> int:
        """Blocks the next append of a request takes for its lent sets: new live sets when it lent
        them, less the held sets it gives back first (``in_place_state``; may be negative)."""
        new = self.num_state_blocks if request_id in self._lent else 0
        return new - self._held_gain(request_id)

    def _held_gain(self, request_id: RequestId) -> int:
        """Blocks :meth:`_release_held` makes available now: held states no copy touches any more,
        held checkpoints no copy pins (evictable then)."""
        gain = 0
        held = self._held.get(request_id)
        if held is not None:
            ids, key = held
            if key is None:
                gain += int(np.count_nonzero(self._pin_of[ids] == 0)) if self._pin_chunks else ids.size
            elif self._unhold_frees(key):
                gain += self.num_state_blocks
        key = self._export_held.get(request_id) if self._export_held else None
        if key is not None and self._unhold_frees(key):
            gain += self.num_state_blocks
        return gain

    def can_append(self, request_id: RequestId, num_new_tokens: int) -> bool:
        return self.num_new_kv_blocks(request_id, num_new_tokens) <= self.num_available_blocks

    def append(self, request_id: RequestId, num_new_tokens: int, token_ids: Sequence[int] | None = None) -> BlockCopies:
        """Grow a request's KV by ``num_new_tokens``; state sets never grow.

        Returns the copy-on-write copies to run first (a shared, partly filled last block gets a
        private copy before it is written). ``token_ids``: tokens beyond the input given at
        admission (sampled ones), so their full blocks can be cached too. Raises
        :class:`NoFreeBlocksError`; nothing changes then.
        """
        num_new_tokens = as_count(num_new_tokens, "num_new_tokens")
        rec = self.requests.get(request_id)
        if rec is None or rec.row < 0 or rec.pending is not None:
            rec = self._running(request_id)  # raises with the reason
        if token_ids is not None and rec.token_ids is not None:
            token_ids = as_token_array(token_ids)  # checked (TypeError) before the request grows
        total = rec.num_tokens + num_new_tokens
        lent = bool(self._lent) and num_new_tokens > 0 and request_id in self._lent
        # (in_place_state: the sets lent a boundary before go back at this step, as vLLM frees them)
        held = bool(self._held or self._export_held) and num_new_tokens > 0 and (
            request_id in self._held or request_id in self._export_held)
        # decode fast path: the tokens fit the last, private block (no Python beyond a few compares)
        if num_new_tokens and total <= rec.num_kv_blocks * self.block_size and not self._needs_cow(rec) and not lent:
            if held:
                self._release_held(request_id)
            rec.num_tokens = total
            if rec.token_ids is not None:
                self._cache_tokens(rec, token_ids)
            return _NO_COPIES
        need = self._new_blocks(rec, num_new_tokens)
        if need > self.num_available_blocks:
            raise NoFreeBlocksError(
                f"append of {num_new_tokens} tokens to {request_id!r}", need, self.num_available_blocks
            )
        if held:  # (after the check: a failed append changes nothing; the count above included them)
            self._release_held(request_id)
            need = self._new_blocks(rec, num_new_tokens)  # what is left to take, the held sets given back
        copies = _NO_COPIES
        if lent:  # new live sets, the state copied over from the lent ones (held from now on)
            rec.run = None
            sets = self._take(self.num_state_blocks)
            self._mark(sets, BlockUse.STATE)
            old_sets, key = self._lent.pop(request_id)
            rec.state[self._state_mask] = sets  # (a flat view only when groups are equal)
            copies = self._pin(BlockCopies(old_sets, sets.copy()))
            self._held[request_id] = (old_sets, key)
            need = self._kv_new_blocks(rec, num_new_tokens)  # the KV blocks left to take
        if need:
            rec.run = None
            ids = self._take(need)
            self._mark(ids, BlockUse.KV)
            if self._needs_cow(rec) and num_new_tokens > 0:
                old, new = rec.kv[rec.num_kv_blocks - 1 : rec.num_kv_blocks].copy(), ids[:1]
                cow = self._pin(BlockCopies(old, new.copy()))  # pinned before the reference drops
                copies = cow if not len(copies) else copies.concat(cow)
                self._drop_kv(old)
                rec.kv[rec.num_kv_blocks - 1] = new[0]
                ids = ids[1:]
            self.tables.ensure_width(rec.num_kv_blocks + ids.size)
            rec.kv[rec.num_kv_blocks : rec.num_kv_blocks + ids.size] = ids
            rec.num_kv_blocks += ids.size
        rec.num_tokens += num_new_tokens
        if rec.token_ids is not None:
            self._cache_tokens(rec, token_ids)
        return copies

    @staticmethod
    def _cache_tokens(rec: RequestRecord, token_ids: Sequence[int] | None) -> None:
        """Remember sampled token ids; their blocks enter the prefix cache in :meth:`mark_computed`."""
        assert rec.token_ids is not None
        if token_ids is not None:
            rec.token_ids.extend(token_ids)

    def free(self, request_id: RequestId) -> None:
        """Release everything the request holds; shared KV blocks drop one reference."""
        rec = self._get(request_id)
        if rec.pending is not None:
            raise RequestStateError(f"request {request_id!r} has a pending swap plan: commit or abort it first")
        if rec.status is RequestStatus.SWAPPED:
            assert self.host_pool is not None
            self.host_pool.release(rec.host_blocks)
        else:
            lent = self._lent.pop(request_id, None) if self._lent else None
            self._release_all(rec, keep_state=lent is not None and lent[1] is not None)
            if self._exports and request_id in self._exports:
                self._drop_exports(request_id)
            # then its lent and held checkpoints: vLLM frees a request's KV blocks before its state
            # blocks, so the states are queued after them (evicted later)
            self._release_held(request_id)
            if lent is not None and lent[1] is not None:  # its live sets are a checkpoint now
                self._unhold(lent[1])
        del self.requests[request_id]

    def reclaim_lent(self, request_id: RequestId) -> bool:
        """``in_place_state``: the request keeps running in its lent live sets (a held state stops
        being held; a checkpoint leaves the cache), and gives back the sets it holds from the
        boundary before, so its next append takes no new sets: what a scheduler does rather than
        preempt a request that runs alone and cannot otherwise grow (vLLM would preempt it, and
        could so livelock). False when it lent none."""
        self._get(request_id)  # UnknownRequestError for an id it never allocated
        lent = self._lent.pop(request_id, None) if self._lent else None
        if lent is None:
            return False
        self._release_held(request_id)
        ids, key = lent
        if key is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.detach_held(key)
            self.use[ids] = BlockUse.STATE
        return True

    def _release_held(self, request_id: RequestId) -> None:
        """Give back the sets the request lent a boundary before its current one: a held state
        goes back to the pool (pending-free while a copy not yet run touches it), a checkpoint
        becomes evictable (at the back of the LRU queue); so does the checkpoint its last chunk's
        export made (vLLM frees the export's block at the request's next step)."""
        key = self._export_held.pop(request_id, None) if self._export_held else None
        if key is not None:
            self._unhold(key)
        held = self._held.pop(request_id, None) if self._held else None
        if held is None:
            return
        ids, key = held
        if key is None:
            self.pool.ref_counts[ids] = 0
            self._give_back(ids)
        else:
            self._unhold(key)

    def reserve_export(self, request_id: RequestId, position: int) -> np.ndarray | None:
        """State sets ``[G, bps]`` (the shape of :meth:`state_table`'s rows) for the prefill kernel to
        write the request's state at ``position`` into, inside the chunk just appended
        (:meth:`export_positions`, ascending). The executor's forward writes them;
        :meth:`checkpoint` with ``exported`` holding ``position`` after it makes them the checkpoint
        there, or gives them back. None when no blocks are available (exports are best effort;
        nothing changes then).

        Raises ``ValueError`` for a position that is not a block boundary inside the request's
        tokens, :class:`RequestStateError` when one is reserved at or past it in this update."""
        rec = self._running(request_id)
        position = as_count(position, "position")
        if not 0 < position < rec.num_tokens or position % self.block_size:
            raise ValueError(
                f"request {request_id!r}: an export at {position} is not a block boundary inside its "
                f"{rec.num_tokens} tokens")
        last = self._exports[request_id][-1][0] if request_id in self._exports else 0
        if position <= last:
            raise RequestStateError(
                f"request {request_id!r} has an export reserved at {last} already: reserve ascending positions")
        n = self.num_state_blocks
        if self.prefix_cache is None or rec.token_ids is None or not n or n > self.num_available_blocks:
            return None
        ids = self._take(n)
        self._mark(ids, BlockUse.STATE)
        sets = np.zeros_like(rec.state)
        sets[self._state_mask] = ids
        self._exports.setdefault(request_id, []).append((position, sets))
        return sets.copy()

    def _drop_exports(self, request_id: RequestId) -> None:
        """Give back the reserved exports the request did not turn into checkpoints."""
        for _, sets in self._exports.pop(request_id):
            self._drop_state(sets)

    def fork(self, parent_id: RequestId, child_id: RequestId) -> BlockCopies:
        """A child sharing the parent's KV (reference counts) with a private copy of its state.

        Returns the state copies ``parent set -> child set`` to run before the child's forward.
        """
        parent = self._running(parent_id)
        if child_id in self.requests:
            raise DuplicateRequestError(f"request {child_id!r} is already allocated: fork into a new id")
        if self.num_state_blocks > self.num_available_blocks:
            raise NoFreeBlocksError(f"fork of {parent_id!r}", self.num_state_blocks, self.num_available_blocks)
        ids = self._take(self.num_state_blocks)
        kv = parent.kv_blocks
        self.pool.incref(kv)
        parent.run = None  # its KV is shared now
        child = RequestRecord(child_id, parent.num_tokens, _EMPTY, kv.size, _EMPTY, self._no_spec())
        # any shared block may become a partly filled tail (now, or after a rejected draft is cut)
        parent.tail_shared = child.tail_shared = bool(kv.size)
        if parent.token_ids is not None:
            child.token_ids, child.block_keys = parent.token_ids.copy(), list(parent.block_keys)
        self.tables.take(child, kv.size)
        child.kv[: kv.size] = kv
        child.state[self._state_mask] = ids
        self.use[ids] = BlockUse.STATE
        self.requests[child_id] = child
        return self._pin(BlockCopies(parent.state[self._state_mask], ids.copy()))

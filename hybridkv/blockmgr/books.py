"""The manager's books under its lifecycle: pins (blocks of copies handed out and not run yet, and
the pending-free blocks they hold back), the one way blocks return to the pool, KV references and
their release into the prefix cache, the batch views (block and state tables) and ``usage``.

:class:`PoolBooks` is the base of :class:`~hybridkv.blockmgr.lifecycle.ManagerCore`, which sets up
the attributes used here (``pool``, ``use``, ``tables``, ``requests``, the pin arrays,
``prefix_cache``) in its ``__init__``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.records import BlockCopies, BlockUse, RequestId, RequestRecord, RequestStatus, SwapPlan, Usage
from hybridkv.errors import RequestStateError, UnknownRequestError
from hybridkv.units import as_count

_EMPTY = np.empty(0, dtype=np.int32)


class PoolBooks:
    """Pins, block returns, batch views and accounting of one manager (see the module docstring)."""

    # ---- pins: blocks of copies handed out but not run yet ------------------------------------
    def begin_pin_epoch(self) -> int:
        """Start a new pin epoch and return it; the first call turns block pins on.

        Every copy the manager hands out (``Allocation.copies``, copy-on-write, fork, checkpoint)
        pins its source and destination blocks in the current epoch: a pinned block that is given
        back (its request finished, was aborted, preempted or swapped out) is not reused, it waits
        as ``pending_free`` until :meth:`release_pins` says the copy ran. A pinned checkpoint is
        not evicted. A scheduler opens an epoch per step and per update (docs/contract.md).
        """
        self._pin_epoch += 1
        return self._pin_epoch

    @property
    def pin_epoch(self) -> int:
        return self._pin_epoch

    def release_pins(self, before: int | None = None, checkpoints_from: int = 0) -> None:
        """The executor ran every copy handed out in epochs ``< before`` (all copies when None):
        their checkpoints may be evicted again and their pending-free blocks go back to the pool.
        ``checkpoints_from``: checkpoints pinned in earlier epochs stay unevictable until a later
        call releases them (their copies ran all the same)."""
        if before is not None:
            before = as_count(before, "before")
        checkpoints_from = as_count(checkpoints_from, "checkpoints_from")
        if self.prefix_cache is not None:
            self.prefix_cache.release_pins(before, checkpoints_from)
        if self.prefix_cache is not None and self.prefix_cache.tier is not None:
            self.prefix_cache.tier.release_pins(before)  # the host tier's copies of those epochs ran
        if self._host_pending:
            done = [ids for e, ids in self._host_pending if before is None or e < before]
            self._host_pending = [(e, ids) for e, ids in self._host_pending if before is not None and e >= before]
            for ids in done:
                self.host_pool.release(ids)  # type: ignore[union-attr]
        if not self._pin_chunks:
            return
        keep = []
        for epoch, ids in self._pin_chunks:
            if before is None or epoch < before:
                self._pin_of[ids[self._pin_of[ids] == epoch]] = 0  # unless pinned again later
            else:
                keep.append((epoch, ids))
        self._pin_chunks = keep
        if self._pin_held:
            held = np.concatenate(self._pin_held)
            ready = self._pin_of[held] == 0
            self._pin_held = [held[~ready]] if not ready.all() else []
            self._drop_kv(held[ready])  # the copies' references: cached blocks become evictable now
        if self._pending_free:
            waiting = np.concatenate(self._pending_free)
            ready = self._pin_of[waiting] == 0
            self._pending_free = [waiting[~ready]] if not ready.all() else []
            self.use[waiting[ready]] = BlockUse.FREE
            self.pool.free(waiting[ready])

    def cancel_checkpoints(self, epoch: int) -> np.ndarray:
        """Drop the checkpoints taken in pin ``epoch`` whose copies were not handed to an executor yet
        (a scheduler does this rather than preempt a request, when those checkpoints are all that
        stands in the way); their blocks are free again. Returns the dropped checkpoints' block ids:
        the caller removes the copies that write them. Nothing else changes."""
        epoch = as_count(epoch, "epoch")  # checked with or without a prefix cache
        if self.prefix_cache is None:
            return _EMPTY
        ids = self.prefix_cache.cancel_checkpoints(epoch)
        if ids.size:
            self._pin_of[ids] = 0  # their copy will not run
            self.pool.ref_counts[ids] = 0
            self._give_back(ids)
        return ids

    def _pin(self, copies: BlockCopies) -> BlockCopies:
        """Pin the blocks of copies handed out (when pins are on) and return the copies."""
        if self._pin_epoch and len(copies):
            ids = np.concatenate((copies.src, copies.dst))
            self._pin_of[ids] = self._pin_epoch
            self._pin_chunks.append((self._pin_epoch, ids))
        return copies

    def _give_back(self, ids: np.ndarray) -> None:
        """The one way unreferenced blocks return to the pool: pinned ones wait in pending-free."""
        if self._pin_chunks and ids.size:
            held = self._pin_of[ids] != 0
            if held.any():
                self.use[ids[held]] = BlockUse.PENDING_FREE
                self._pending_free.append(ids[held])
                ids = ids[~held]
        self.use[ids] = BlockUse.FREE
        self.pool.free(ids)

    def _copy_epoch(self, key: int) -> int:
        """The latest pin epoch of a copy handed out and not yet run that touches the blocks of node
        ``key``'s checkpoint (0: none)."""
        if not self._pin_chunks or self.prefix_cache is None:
            return 0
        ids = self.prefix_cache.checkpoint_ids(key)
        return int(self._pin_of[ids].max()) if ids is not None and ids.size else 0

    def _note_copies(self, key: int) -> None:
        """Node ``key``'s checkpoint was made where its blocks are (no copy of its own): while a copy not
        yet run touches them (a fork's or an append's copy reading those live sets) it stays in the
        cache's books, pinned until that copy's epoch is released: never evictable nor cancelled
        under the copy."""
        epoch = self._copy_epoch(key)
        if epoch:
            assert self.prefix_cache is not None
            self.prefix_cache.note_read(key, epoch)

    def _unhold_frees(self, key: int) -> bool:
        """Whether :meth:`_unhold` of node ``key`` makes its checkpoint evictable at once (held, and
        no copy not yet run reads it: a hit's, or one that touches its blocks)."""
        cache = self.prefix_cache
        return cache is not None and cache.held_release_frees(key) and not self._copy_epoch(key)

    def _unhold(self, key: int) -> None:
        """End a hold on node ``key``'s checkpoint (:meth:`_note_copies` first)."""
        assert self.prefix_cache is not None
        self._note_copies(key)
        self.prefix_cache.release_held(key)

    def pending_free_blocks(self) -> np.ndarray:
        """Blocks given back while a pinned copy still touches them (free after ``release_pins``)."""
        return np.concatenate(self._pending_free) if self._pending_free else _EMPTY

    def _pin_device(self, ids: np.ndarray) -> None:
        """Pin device blocks a copy handed out writes (host -> device), when pins are on."""
        if self._pin_epoch and ids.size:
            self._pin_of[ids] = self._pin_epoch
            self._pin_chunks.append((self._pin_epoch, ids.copy()))

    # ---- batch views ---------------------------------------------------------------------------
    def block_table(
        self, request_ids: Sequence[RequestId], num_rows: int | None = None, width: int | None = None
    ) -> np.ndarray:
        """KV block table ``[num_rows, width]`` int32 (default ``[B, max blocks]``), padding = null block.

        Request ids must be running with no pending swap plan (else :class:`RequestStateError`).
        """
        recs = self._batch(request_ids)
        width = max((r.num_kv_blocks for r in recs), default=0) if width is None else as_count(width, "width")
        return self.tables.gather_kv([r.row for r in recs], self._num_rows(num_rows, len(recs)), width)

    def state_table(self, request_ids: Sequence[RequestId], num_rows: int | None = None) -> np.ndarray:
        """Live state sets ``[num_state_groups, num_rows, blocks_per_state]`` int32; padding rows are null."""
        recs = self._batch(request_ids)
        return self.tables.gather_state([r.row for r in recs], self._num_rows(num_rows, len(recs)))

    @staticmethod
    def _num_rows(num_rows: int | None, batch: int) -> int:
        if num_rows is None:
            return batch
        num_rows = as_count(num_rows, "num_rows")
        if num_rows < batch:
            raise ValueError(
                f"num_rows={num_rows} is smaller than the batch of {batch} requests: pass num_rows >= {batch}"
            )
        return num_rows

    def _batch(self, request_ids: Sequence[RequestId]) -> list[RequestRecord]:
        requests = self.requests
        try:
            recs = [requests[r] for r in request_ids]
        except KeyError as e:
            raise UnknownRequestError(f"unknown request {e.args[0]!r}: allocate it first") from None
        for rec in recs:
            if rec.row < 0 or rec.pending is not None:
                self._running(rec.request_id)  # raises with the reason
        return recs

    def speculative_table(self, request_id: RequestId) -> np.ndarray:
        """Speculative sets of one request, ``[K, num_state_groups, blocks_per_state]`` int32."""
        return self._running(request_id).spec

    # ---- accounting ----------------------------------------------------------------------------
    def usage(self) -> Usage:
        counts = np.bincount(self.use, minlength=len(BlockUse))
        host_total = self.host_pool.num_usable if self.host_pool else 0
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        host_cached = tier.num_blocks if tier is not None else 0
        host_used = host_total - self.host_pool.num_free - host_cached if self.host_pool else 0
        return Usage(
            self.layout.num_blocks,
            int(counts[BlockUse.FREE]),
            int(counts[BlockUse.KV]),
            int(counts[BlockUse.STATE]),
            int(counts[BlockUse.SPECULATIVE]),
            int(counts[BlockUse.CACHED_KV]),
            int(counts[BlockUse.CHECKPOINT]),
            int(counts[BlockUse.NULL]),
            host_total,
            host_used,
            self.layout.bytes_per_block,
            int(counts[BlockUse.PENDING_FREE]),
            host_cached,
        )

    # ---- internals -----------------------------------------------------------------------------
    def _get(self, request_id: RequestId) -> RequestRecord:
        rec = self.requests.get(request_id)
        if rec is None:
            raise UnknownRequestError(f"unknown request {request_id!r}: allocate it first")
        return rec

    def _running(self, request_id: RequestId) -> RequestRecord:
        rec = self._get(request_id)
        if rec.status is not RequestStatus.RUNNING or rec.pending is not None:
            kind = "swap" if isinstance(rec.pending, SwapPlan) else "transfer"
            what = f"has a pending {kind} plan" if rec.pending is not None else "is swapped out"
            raise RequestStateError(f"request {request_id!r} {what}: swap it in (or settle the plan) first")
        return rec

    def _swapped(self, request_id: RequestId) -> RequestRecord:
        rec = self._get(request_id)
        if rec.status is not RequestStatus.SWAPPED or rec.pending is not None:
            raise RequestStateError(f"request {request_id!r} is not swapped out (or has a pending plan)")
        return rec

    def _needs_cow(self, rec: RequestRecord) -> bool:
        """Whether the request's partly filled last block must be copied before it is written: it
        is shared (only fork shares a partly filled block; prefix hits share full ones), or the
        prefix cache caches it as a full block (a forked branch that kept drafts this request
        rejected registered it, and may have left): writing would change a cached node's bytes."""
        if not rec.num_kv_blocks or rec.num_tokens % self.block_size == 0:
            return False
        tail = int(rec.kv[rec.num_kv_blocks - 1])
        if rec.tail_shared and self.pool.ref_counts[tail] > 1:
            return True
        return self.prefix_cache is not None and self.prefix_cache.caches_block(tail)

    def _split_state_sets(self, ids: np.ndarray, num_sets: int) -> np.ndarray:
        sets = np.zeros((num_sets, self.num_state_groups, self.blocks_per_state), dtype=np.int32)
        sets[:, self._state_mask] = ids.reshape(num_sets, self.num_state_blocks)
        return sets

    def _no_spec(self) -> np.ndarray:
        return self._no_spec_sets  # shared and never written: spec arrays are replaced, not resized

    def _set_ids(self, sets: np.ndarray) -> np.ndarray:
        """The block ids of state sets ``[..., G, bps]`` as a flat array (a view when groups are equal)."""
        if self._uniform_sets:
            return sets.reshape(-1)
        return sets[..., self._state_mask].ravel()

    def _mark(self, ids: np.ndarray, use: BlockUse) -> None:
        kernels.put(self.use, ids, use.value)

    def _mark_sets(self, sets: np.ndarray, use: BlockUse) -> None:
        self.use[sets[..., self._state_mask]] = use

    def _make_room(
        self,
        num_blocks: int,
        protect: np.ndarray = _EMPTY,
        protect_ckpt: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        """Evict cached blocks until ``num_blocks`` are free (the caller checked availability).
        ``protect``: KV block ids that stay; ``protect_ckpt``: node keys whose checkpoints stay."""
        short = num_blocks - self.pool.num_free
        if short > 0 and self.prefix_cache is not None:
            # through _give_back like every other return to the pool; nothing evictable is pinned
            # (a pinned KV block is held by its copy, a pinned checkpoint is passed over)
            self._give_back(self.prefix_cache.evict(short, protect, protect_ckpt))

    def _take(self, num_blocks: int) -> np.ndarray:
        self._make_room(num_blocks)
        return self.pool.allocate(num_blocks)

    def _release_kv(self, ids: np.ndarray, chain: list[int] | None = None) -> np.ndarray:
        """Drop one reference; cached blocks that reach zero become evictable; returns the rest.
        ``chain``: the releasing request's chain keys (the prefix cache demotes what lies past its
        deepest checkpoint)."""
        cache = self.prefix_cache
        twins = cache.twins(ids, chain) if cache is not None and chain and cache.aligns_chunks else None
        zero = self.pool.decref(ids)
        if self._pin_chunks and zero.size:
            held = self._pin_of[zero] != 0
            if held.any():  # a copy not yet run still reads or writes them: it keeps a reference
                kept = zero[held]
                self.pool.incref(kept)
                self._pin_held.append(kept)
                zero = zero[~held]
        if cache is None:
            return zero
        if twins is not None and twins.size and zero.size:  # (pinned ones are freed as usual later)
            return cache.release(zero, chain, twins[np.isin(twins, zero)])
        return cache.release(zero, chain)

    def _drop_kv(self, ids: np.ndarray) -> None:
        self._give_back(self._release_kv(ids))

    def _drop_state(self, sets: np.ndarray) -> None:
        ids = sets[..., self._state_mask].ravel()
        self.pool.ref_counts[ids] = 0
        self._give_back(ids)

    def _release_all(self, rec: RequestRecord, keep_state: bool = False) -> None:
        """Give back a running request's blocks in one pool operation and its table row
        (``keep_state``: all but its live state sets, which the caller has handed on)."""
        if keep_state:
            owned = self._set_ids(rec.spec)
            self.pool.ref_counts[owned] = 0
            self._give_back(np.concatenate((owned, self._release_kv(rec.kv_blocks, rec.block_keys))))
            self.tables.give_back(rec)
            rec.run = None
            return
        if rec.run is not None and not (self._pin_chunks and self._pin_of[rec.run[0] : rec.run[1]].any()):
            start, end = rec.run  # one private id run: slices, no sort, no fancy indexing
            self.pool.ref_counts[start:end] = 0
            self.use[start:end] = BlockUse.FREE
            self.pool.free_run(start, end)
            self.tables.give_back(rec)
            rec.run = None
            return
        owned = np.concatenate((self._set_ids(rec.state), self._set_ids(rec.spec)))
        self.pool.ref_counts[owned] = 0
        self._give_back(np.concatenate((owned, self._release_kv(rec.kv_blocks, rec.block_keys))))
        self.tables.give_back(rec)
        rec.run = None

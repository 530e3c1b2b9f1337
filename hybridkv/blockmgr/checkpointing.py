"""Prefix-cache checkpoints of running requests: where the policy wants one, and taking it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr.lifecycle import ManagerCore
from hybridkv.blockmgr.records import BlockCopies, RequestId, RequestRecord
from hybridkv.units import as_count

_NO_COPIES = BlockCopies.empty()


class CheckpointMixin(ManagerCore):
    """Methods of :class:`~hybridkv.blockmgr.manager.HybridBlockManager`: a part that adds no state."""

    # ---- prefix-cache checkpoints --------------------------------------------------------------
    def next_checkpoint_position(
        self, request_id: RequestId, num_tokens: int | None = None
    ) -> int | None:
        """The next input position past the request's tokens (or past ``num_tokens``: an engine's
        own count of computed tokens) where the checkpoint policy wants the state saved (a
        scheduler ends a prefill chunk there), or None."""
        rec = self._running(request_id)
        done = rec.num_tokens if num_tokens is None else as_count(num_tokens, "num_tokens")
        cache = self.prefix_cache
        if cache is None or rec.token_ids is None:
            return None
        below = self._checkpoint_below(rec, done + self.block_size)
        return cache.next_checkpoint(done, len(rec.token_ids), rec.branch_tokens, below)

    def exported_checkpoint_position(self, request_id: RequestId, start: int, end: int) -> int | None:
        """The position inside the prefill chunk ``[start, end)`` of the request whose state the
        prefill kernel exports, for a policy that exports one position per chunk
        (``CheckpointRules.exports_all`` False, with ``export_alignment``), or None. A scheduler does not end the
        chunk there, and passes the position to :meth:`checkpoint` after the forward."""
        rec = self._running(request_id)
        cache = self.prefix_cache
        if cache is None or rec.token_ids is None:
            return None
        return cache.exported_checkpoint(start, end, len(rec.token_ids))

    def export_positions(self, request_id: RequestId, start: int, end: int) -> tuple[int, ...]:
        """The positions strictly inside the request's prefill chunk ``[start, end)`` whose states
        the prefill kernel writes (``PrefixCacheConfig.export_alignment``: a kernel that can), ascending:
        a scheduler does not end the chunk there, reserves sets for each (:meth:`reserve_export`) and
        passes them to :meth:`checkpoint` after the forward. Empty without a prefix cache, token ids
        or such a kernel."""
        rec = self._running(request_id)
        cache = self.prefix_cache
        if cache is None or rec.token_ids is None or cache.config.export_alignment is None:
            return ()
        below = self._checkpoint_below(rec, start + self.block_size)
        return cache.export_positions(start, end, len(rec.token_ids), rec.branch_tokens, below)

    def prefill_stop(self, request_id: RequestId, start: int, end: int) -> int:
        """Where the request's prefill chunk ``[start, end)`` ends for a checkpoint: the first
        position inside it where the policy wants one and the kernel exports none, else ``end``."""
        rec = self._running(request_id)
        cache = self.prefix_cache
        if cache is None or rec.token_ids is None:
            return end
        below = self._checkpoint_below(rec, start + self.block_size)
        return cache.prefill_stop(start, end, len(rec.token_ids), rec.branch_tokens, below)

    def checkpoint(
        self, request_id: RequestId, final: bool = False, exported: int | Sequence[int] | None = None
    ) -> BlockCopies:
        """Save the live state at the request's current position if the policy wants it there.

        Call right after the forward that brought the request to ``num_tokens`` (its live sets
        hold the state at exactly that position, and its KV is written: this is also
        :meth:`mark_computed` of ``num_tokens``). Returns the copies live -> checkpoint, to run
        before the next forward; empty when no checkpoint is due, one exists already, or no
        blocks are available (checkpoints are best effort). ``final``: the request is at the last
        block boundary of its tokens before it finishes (prompt and reply: the caller knows the
        reply's length, e.g. a replay, and calls this at that decode position): policies that keep
        the end of finished requests for the next turn take it. ``exported``: the positions (or one) inside
        the forward's chunk whose states the prefill kernel exported into the sets that
        :meth:`reserve_export` reserved (:meth:`export_positions`): they become the checkpoints there
        (no copy) or are given back; a reservation at another position, or without ``exported``,
        is given back.
        """
        rec = self._running(request_id)
        wrote: frozenset[int] = frozenset()
        if exported is not None:  # (TypeError before anything changes)
            many = isinstance(exported, Sequence)
            wrote = frozenset(as_count(p, "exported") for p in (exported if many else (exported,)))  # type: ignore[union-attr]
        cache, pos, bs = self.prefix_cache, rec.num_tokens, self.block_size
        if cache is None or rec.token_ids is None:
            return _NO_COPIES
        self._register_computed(rec, pos)  # mark_computed(request_id, pos), on the record
        reserved = self._exports.pop(request_id, ()) if self._exports else ()
        for at, sets in reserved:  # ascending: each kept export is the one below the next
            if at in wrote:  # the forward wrote the export into them
                self._keep_export(rec, at, sets)
            else:
                self._drop_state(sets)
        if pos % bs or pos // bs > len(rec.block_keys):
            return _NO_COPIES
        return self._keep_state(rec, pos, final)

    def _keep_export(self, rec: RequestRecord, pos: int, sets: np.ndarray) -> None:
        """The export :meth:`reserve_export` reserved, written by the forward: the checkpoint at
        ``pos`` if the policy keeps one there and there is none, else given back. No copy. With
        ``in_place_state`` and a policy that ``queues_on_release`` it is held until the request's
        next append (as the sets of a chunk's end state are)."""
        cache, bs = self.prefix_cache, self.block_size
        assert cache is not None and rec.token_ids is not None
        below = self._checkpoint_below(rec, pos)
        n = len(rec.token_ids)
        found = None
        if cache.wants_checkpoint(pos, n, rec.branch_tokens, False, below) and cache.retains_checkpoint(
                pos, n, rec.branch_tokens):
            found = cache.checkpoint_protect(rec.block_keys[pos // bs - 1])
        if found is None:  # not kept there, or a checkpoint is there already
            self._drop_state(sets)
            return
        key = int(rec.block_keys[pos // bs - 1])
        slot = self._node_slot(rec, found[0], pos)
        cache.add_checkpoint(slot, self._set_ids(sets).copy())
        if cache.config.in_place_state and cache.rules.queues_on_release:  # (one export per chunk: one key)
            cache.hold(key)
            self._export_held[rec.request_id] = key

    def raise_branch(self, request_id: RequestId, num_tokens: int) -> None:
        """The request's input shares its first ``num_tokens`` with tokens another request is
        scheduled to compute in this step (not in the cache until computed; vLLM caches a block when
        it schedules it): its branch point, where policies keep state, is at least there."""
        rec = self._running(request_id)
        rec.branch_tokens = max(rec.branch_tokens, as_count(num_tokens, "num_tokens"))

    def checkpoint_blocks_due(self, request_id: RequestId) -> int:
        """Blocks that :meth:`checkpoint` at the request's current position would need available
        now (its state sets, and what the eviction making room must keep), or 0 when no checkpoint
        is due there (not on a block boundary, not wanted, not computed yet, or held already). A
        scheduler that keeps checkpoints as a must (``CheckpointRules.holds_chunk_end_state``: the
        state lands in sets of its own) makes this room, preempting, before it calls :meth:`checkpoint`."""
        rec = self._running(request_id)
        cache, pos, bs = self.prefix_cache, rec.num_tokens, self.block_size
        if cache is None or rec.token_ids is None or not pos or pos % bs or pos // bs > len(rec.block_keys):
            return 0
        below = self._checkpoint_below(rec, pos)
        if not cache.wants_checkpoint(pos, len(rec.token_ids), rec.branch_tokens, False, below):
            return 0
        if rec.request_id in self._lent:  # kept where it is
            return 0
        if not cache.retains_checkpoint(pos, len(rec.token_ids), rec.branch_tokens):
            return self.num_state_blocks
        found = cache.checkpoint_protect(rec.block_keys[pos // bs - 1])
        return 0 if found is None else self.num_state_blocks + cache.num_protected(found[1])

    def _keep_state(self, rec: RequestRecord, pos: int, final: bool) -> BlockCopies:
        """The checkpoint of :meth:`checkpoint` at ``pos`` (block-aligned, registered), if the
        policy wants it and blocks are available: the pinned copies live -> checkpoint, or none."""
        cache, bs = self.prefix_cache, self.block_size
        assert cache is not None and rec.token_ids is not None
        below = self._checkpoint_below(rec, pos)
        if not cache.wants_checkpoint(pos, len(rec.token_ids), rec.branch_tokens, final, below):
            return _NO_COPIES
        in_place = self._lends(rec, pos)
        if not cache.retains_checkpoint(pos, len(rec.token_ids), rec.branch_tokens):
            return self._lend(rec, None) if in_place else self._transient_state(rec)
        key = rec.block_keys[pos // bs - 1]
        # the node must survive the eviction that makes room, so what it pins is not available
        found = cache.checkpoint_protect(key)
        if found is None:  # it has one
            return self._lend(rec, None) if in_place else _NO_COPIES
        slot, kv = found
        if in_place:  # the live sets become the checkpoint where they are: no blocks, no copy
            slot = self._node_slot(rec, slot, pos)
            cache.add_checkpoint(slot, self._set_ids(rec.state).copy())
            cache.hold(int(key))
            return self._lend(rec, int(key))
        if self.num_state_blocks > self.num_available_blocks - cache.num_protected(kv):
            return _NO_COPIES
        self._make_room(self.num_state_blocks, protect=kv)
        slot = self._node_slot(rec, slot, pos)
        ids = self._take(self.num_state_blocks)  # (the room is made: no eviction now)
        cache.add_checkpoint(slot, ids)
        # pinned: the live blocks it reads must not be reused (request finished, aborted, swapped
        # out) nor the checkpoint evicted before the executor ran the copy
        return self._pin(BlockCopies(self._set_ids(rec.state).copy(), ids.copy()))

    def free_keeping_state(self, request_id: RequestId) -> bool:
        """:meth:`free` of a running request whose live state is at a block boundary where the
        policy keeps a matchable checkpoint it has not made yet (no room was found after the
        forward): the live state sets become that checkpoint where they are, with no copy, and the
        rest is given back. Only for a policy that holds every chunk's end state
        (``CheckpointRules.holds_chunk_end_state``: it is written into sets of its own, cached in
        place, so a request preempted before its next chunk leaves it behind). Returns
        False, and frees as :meth:`free` does, when there is no such checkpoint to keep."""
        rec = self._running(request_id)
        cache, pos, bs = self.prefix_cache, rec.num_tokens, self.block_size
        keep = (
            cache is not None and cache.rules.holds_chunk_end_state and rec.token_ids is not None
            and rec.pending is None
            and self.num_state_blocks > 0 and pos > 0 and not pos % bs and pos // bs <= len(rec.block_keys)
            and cache.retains_checkpoint(pos, len(rec.token_ids), rec.branch_tokens)
        )  # fmt: skip
        found = cache.checkpoint_protect(rec.block_keys[pos // bs - 1]) if keep and cache is not None else None
        if found is None or cache is None or rec.token_ids is None:
            self.free(request_id)
            return False
        slot = self._node_slot(rec, found[0], pos)
        ids = self._set_ids(rec.state).copy()
        cache.add_checkpoint(slot, ids)
        self._note_copies(int(rec.block_keys[pos // bs - 1]))  # (a fork's copy may read the live sets)
        if self._lent:
            self._lent.pop(request_id, None)  # (a held state: the checkpoint now)
        self._release_all(rec, keep_state=True)
        if self._exports and request_id in self._exports:
            self._drop_exports(request_id)
        self._release_held(request_id)  # the sets held from the boundary before, as free() does
        del self.requests[request_id]
        return True

    def _node_slot(self, rec: RequestRecord, slot: int, pos: int) -> int:
        """``slot`` (from ``checkpoint_protect``), or, when -1 (no node: its cached twin was
        evicted), the node of the request's block ending at ``pos``, re-created with any missing
        ancestors."""
        if slot >= 0:
            return slot
        cache = self.prefix_cache
        assert cache is not None and rec.token_ids is not None
        return cache.ensure(rec.token_ids.view(), rec.block_keys, rec.kv_blocks, pos // self.block_size - 1)

    def _lends(self, rec: RequestRecord, pos: int) -> bool:
        """Whether the state at ``pos`` stays in the live sets where they are
        (``PrefixCacheConfig.in_place_state``): it is the request's position, the sets are not lent
        already, and the request has no speculative sets."""
        cache = self.prefix_cache
        return (
            cache is not None and cache.config.in_place_state and pos == rec.num_tokens
            and rec.request_id not in self._lent and not rec.spec.size
        )  # fmt: skip

    def _lend(self, rec: RequestRecord, key: int | None) -> BlockCopies:
        """Lend the live sets where they are (the checkpoint of node ``key``, or a held state when
        None): the request's next append takes new sets. Nothing to copy now."""
        self._lent[rec.request_id] = (self._set_ids(rec.state).copy(), key)
        return _NO_COPIES

    def _transient_state(self, rec: RequestRecord) -> BlockCopies:
        """A state the policy holds but does not keep matchable (``CheckpointRules.retains`` False):
        blocks of their own, written by the pinned copy live -> them and given
        back at once, so they wait in pending-free until the copy ran, then are free; nothing
        enters the cache. None when no blocks are available."""
        n = self.num_state_blocks
        if n > self.num_available_blocks:
            return _NO_COPIES
        ids = self._take(n)
        copies = self._pin(BlockCopies(self._set_ids(rec.state).copy(), ids.copy()))
        self.pool.ref_counts[ids] = 0
        self._give_back(ids)
        return copies

    def _checkpoint_below(self, rec: RequestRecord, position: int) -> int:
        """The position of the deepest checkpoint on the request's chain strictly below ``position``
        (0: none); only policies that space their checkpoints ask (the others get 0)."""
        cache = self.prefix_cache
        if cache is None or not cache.spaces_checkpoints:
            return 0
        return cache.deepest_checkpoint(rec.block_keys, (position - 1) // self.block_size)

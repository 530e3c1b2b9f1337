"""Eviction: the LRU queue of cached KV blocks and checkpoints, the two policies' victims (``lru``
and ``flop_aware``, compiled with the kernels on), and dropping what they chose."""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.prefix import kernels as prefix_kernels
from hybridkv.blockmgr.prefix.config import _EMPTY, EvictionPolicy
from hybridkv.blockmgr.prefix.placement import CheckpointPlacement
from hybridkv.blockmgr.records import BlockUse


def _norm(x: np.ndarray) -> np.ndarray:
    """``(x - min) / (max - min)`` (a new array), zeros when all are equal."""
    low = x.min()
    span = x.max() - low
    if span > 0:
        y = x - low
        y /= span
        return y
    return np.zeros_like(x)



class Eviction(CheckpointPlacement):
    """The LRU queue and the eviction policies."""

    @property
    def num_evictable(self) -> int:
        """Blocks eviction can free now (checkpoints pinned by this step's copies excluded)."""
        return self._n_evictable + (len(self._ck_ids) - len(self.pinned)) * self.host.num_state_blocks

    def evict(
        self,
        num_blocks: int,
        protect: np.ndarray = _EMPTY,
        protect_ckpt: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> np.ndarray:
        """Evict units until at least ``num_blocks`` blocks are freed; returns the freed ids.

        ``protect``: KV block ids that stay (the hit being taken); ``protect_ckpt``: node keys whose
        checkpoints stay. The caller has checked that enough is evictable.
        """
        if num_blocks <= 0:
            return np.empty(0, dtype=np.int32)
        target = max(num_blocks, int(self.config.evict_batch_fraction * self.host.pool.num_usable))
        target = max(num_blocks, min(target, self.num_evictable - self.num_protected(protect, protect_ckpt)))
        if self.config.eviction is EvictionPolicy.LRU:
            kv, ck = self._lru_victims(target, protect, protect_ckpt)
        else:
            kv, ck = self._flop_aware_victims(target, protect, protect_ckpt)
        if self.tier is not None:
            self._offload(kv, ck)
        ids = self._drop_all(kv, ck)
        kernels.put(self.host.pool.ref_counts, ids, 0)
        kernels.put(self.host.use, ids, BlockUse.FREE.value)
        return ids

    def _offload(self, kv: np.ndarray, ck_slots: np.ndarray) -> None:
        """The host tier keeps the victims (KV blocks in victim order, then checkpoints) it has room
        for: their copies device -> host are queued before the device blocks go back."""
        tier = self.tier
        assert tier is not None
        tier.begin_eviction()
        try:
            if kv.size and self._stale[kv].any():  # second copies (adopt_copies): their node has the newer
                kv = kv[~self._stale[kv]]
            if kv.size:
                slots = self._node_of[kv]
                keys = self._key[slots].tolist()
                toks = self._tok[slots]
                for i in range(kv.size):
                    tier.offload(keys[i], toks[i], kv[i : i + 1], False)
            for ck in ck_slots.tolist():
                slot = self._ck_node[ck]
                tier.offload(int(self._key[slot]), self._tok[slot], self._ck_ids[ck], True)
        finally:
            tier.end_eviction()

    def _held_checkpoints(self, protect_ckpt: set[int]) -> list[int]:
        """Slots of the checkpoints eviction may not take: protected or pinned."""
        return [int(self._ck[s]) for k in (*protect_ckpt, *self.pinned)
                if (s := self._slot.get(k)) is not None and self._ck[s] >= 0]  # fmt: skip

    def _enqueue_one(self, code: int, order: int) -> None:
        """:meth:`_enqueue` of one entry (a checkpoint made or hit), without building arrays."""
        if self._tail < self._fifo.size:
            self._fifo[self._tail] = code
            self._fifo_ord[self._tail] = order
            self._tail += 1
        else:
            self._enqueue(np.array([code], dtype=np.int64), np.array([order], dtype=np.int64))

    def _enqueue(self, blocks: np.ndarray, orders: np.ndarray) -> None:
        """Append evictable KV blocks (with their LRU orders, ascending) to the queue."""
        n = blocks.size
        if self._tail + n > self._fifo.size:
            self._repack(n, front=False)
        self._fifo[self._tail : self._tail + n] = blocks
        self._fifo_ord[self._tail : self._tail + n] = orders
        self._tail += n

    def _enqueue_front(self, codes: np.ndarray, orders: np.ndarray) -> None:
        """Put entries (orders below every queued one, ascending) at the front of the LRU queue."""
        n = codes.size
        if self._head < n:
            self._repack(n, front=True)
        self._head -= n
        self._fifo[self._head : self._head + n] = codes
        self._fifo_ord[self._head : self._head + n] = orders

    def _repack(self, n: int, front: bool) -> None:
        """Rebuild the queue from its live entries (same order), with room for ``n`` more at the back,
        or at both ends (``front``), growing it if it is still short."""
        live = self._live_queue()
        size = max(self._fifo.size, 2 * (live.size + n))
        start = (size - live.size) // 2 if front else 0  # front: >= n free before and after
        fifo, ords = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
        fifo[start : start + live.size], ords[start : start + live.size] = self._fifo[live], self._fifo_ord[live]
        self._fifo, self._fifo_ord, self._head, self._tail = fifo, ords, start, start + live.size

    def _live_queue(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """Queue positions in ``[start, end)`` (default: all) whose entries are live."""
        start = self._head if start is None else start
        end = self._tail if end is None else end
        code, order = self._fifo[start:end], self._fifo_ord[start:end]
        unit = np.where(code >= 0, code, (self._node_of.size - 1) - code)  # -1 - slot -> nb + slot
        live = self._q_live[unit]
        live &= self._q_order[unit] == order
        return live.nonzero()[0] + start

    def num_protected(self, protect: np.ndarray, protect_ckpt: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Evictable blocks that ``evict(..., protect, protect_ckpt)`` may not take."""
        if protect.size == 1:  # (a checkpoint's node: a scalar read, not a gather)
            n = int(self._kv_evictable[protect[0]])
        else:
            n = int(np.count_nonzero(self._kv_evictable[protect])) if protect.size else 0
        for key in protect_ckpt:
            s = self._slot.get(key)
            if s is not None and self._ck[s] >= 0 and key not in self.pinned:
                n += self.host.num_state_blocks
        return n

    def _lru_victims(self, target: int, protect: np.ndarray, protect_ckpt: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """Least recently used first, off the front of the LRU queue: KV blocks by their release (a
        chain's tail first) and checkpoints by their last use, in one order; protected KV blocks,
        protected and pinned checkpoints are passed over (and stay queued)."""
        held = [-1 - ck for ck in self._held_checkpoints(protect_ckpt)]  # their queue codes
        nsb, nb = self.host.num_state_blocks, self._node_of.size
        passed = self._passed  # marked for this call, cleared before returning
        any_passed = bool(protect.size or held)
        if any_passed:
            marks = np.array(protect.tolist() + held, dtype=np.int64)
            marks += nb
            passed[marks] = True
        if kernels.ENABLED:  # the same victims and queue, in one compiled scan
            out = np.empty((2, min(self._tail - self._head, target)), dtype=np.int64)  # (each victim frees >= 1)
            n_kv, n_ck, self._head = prefix_kernels.lru_victims(
                self._fifo, self._fifo_ord, self._head, self._tail, self._q_live, self._q_order, passed, nb, nsb,
                target, marks.size if any_passed else 0, out)
            if any_passed:
                passed[marks] = False
            return out[0, :n_kv], out[1, :n_ck]
        parts, held_parts, end, step, got, n_ck = [], [], self._head, target + target // 4 + 64, 0, 0
        while got < target and end < self._tail:  # live, unprotected entries from the front
            stop = min(end + step, self._tail)
            pos = self._live_queue(end, stop)
            code = self._fifo[pos]
            if any_passed:
                mask = passed[code + nb]
                if mask.any():  # passed over: they stay queued, in order
                    held_parts.append(pos[mask])
                    keep = ~mask
                    pos, code = pos[keep], code[keep]
            parts.append(code)
            parts.append(pos)
            k = int(np.count_nonzero(code < 0))  # checkpoints among them
            n_ck += k
            got += code.size + k * (nsb - 1)
            end = stop
        if any_passed:
            passed[marks] = False
        if not parts:
            return _EMPTY, _EMPTY
        code = np.concatenate(parts[::2]) if len(parts) > 2 else parts[0]
        pos = np.concatenate(parts[1::2]) if len(parts) > 2 else parts[1]
        if n_ck:  # the shortest prefix that frees target blocks
            count = int(np.where(code >= 0, 1, nsb).cumsum().searchsorted(target)) + 1
        else:  # KV blocks only: one block each
            count = target
        if pos.size:  # the queue's front up to the last victim keeps only its passed-over live entries
            last = int(pos[min(count, pos.size) - 1])
            keep = np.concatenate(held_parts) if held_parts else _EMPTY
            if keep.size:
                keep = keep[keep <= last]
            new_head = last + 1 - keep.size
            self._fifo[new_head : last + 1] = self._fifo[keep]
            self._fifo_ord[new_head : last + 1] = self._fifo_ord[keep]
            self._head = new_head
        victims = code[:count]
        if not n_ck:
            return victims, _EMPTY
        return victims[victims >= 0], -1 - victims[victims < 0]

    def _flop_aware_victims(
        self, target: int, protect: np.ndarray, protect_ckpt: set[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Lowest utility first: ``alpha * norm(log1p(FLOPs saved per byte)) + norm(recency)`` over
        all candidates (evictable KV blocks and live checkpoints, less the protected and pinned
        ones). A checkpoint saves the FLOPs of the prefix it ends, a KV block those of its own
        tokens; FLOPs per byte spans orders of magnitude, so it is compared on a log scale (the log
        is taken once, when the block or checkpoint enters the cache). Ties go to KV blocks (lowest
        id first), then to checkpoints (least recently used first)."""
        cand = np.logical_or(self._kv_evictable, self._ck_live, out=self._cand)  # by block id: one gather each
        if protect.size:
            cand[protect] = False
        held = self._held_checkpoints(protect_ckpt)
        if held:
            cand[held] = False
        if kernels.ENABLED:  # the same victims, in one compiled pass
            return prefix_kernels.flop_aware_victims(self._cand_words, self._ck_live, self._ticks, self._lfpb,
                                              float(self.config.alpha), int(target), self.host.num_state_blocks,
                                              self._cand_ids)
        ids = cand.nonzero()[0]
        if not ids.size:
            return _EMPTY, _EMPTY
        tick = self._ticks[ids]
        utility = _norm(self._lfpb[ids])  # alpha * norm(lfpb) + norm(tick), in place
        utility *= self.config.alpha
        utility += _norm(tick)
        # the victims are a prefix of the order by utility, at most ``target`` candidates long
        # (each frees >= 1 block): rank only the candidates at or below the target-th utility
        # (ties included), which is that prefix exactly
        k = min(utility.size, target)
        if k < utility.size:
            near = (utility <= np.partition(utility, k - 1)[k - 1]).nonzero()[0]
            ids, utility, tick = ids[near], utility[near], tick[near]
        # by utility, then KV blocks before checkpoints, KV blocks by id, checkpoints by tick
        # (distinct): a stable sort by utility is that order (the ids ascend) unless a checkpoint
        # ties with another candidate (KV blocks tie often: demoted tails share tick 0; the oldest
        # checkpoint at the highest FLOPs and the newest KV block at the lowest both rank 1.0)
        order = utility.argsort(kind="stable")
        is_ck = self._ck_live[ids[order]]
        u = utility[order]
        tie = u[1:] == u[:-1]
        if tie.any():
            bad = (tie & (is_ck[1:] | is_ck[:-1])).nonzero()[0]  # sorted positions i, i + 1 tie, one a checkpoint
            if bad.size:
                order = self._order_ties(order, tie, bad, ids, tick)
                is_ck = self._ck_live[ids[order]]
        ids = ids[order]
        size = np.where(is_ck, self.host.num_state_blocks, 1)  # blocks each frees
        n = int(size.cumsum().searchsorted(target)) + 1  # the shortest prefix freeing target
        ids, is_ck = ids[:n], is_ck[:n]
        return ids[~is_ck], ids[is_ck]

    def _order_ties(self, order: np.ndarray, tie: np.ndarray, bad: np.ndarray, ids: np.ndarray,
                    tick: np.ndarray) -> np.ndarray:
        """``order`` (a stable sort by utility of candidates ``ids``) with each group of equal
        utilities that holds a checkpoint (``bad``: sorted positions that tie with the next, one
        of them a checkpoint) put in the ranking's order: KV blocks by id, then checkpoints by
        tick. A few groups (the usual case: the oldest checkpoint and the newest cheapest KV block
        both at utility 1.0) are sorted group by group; many, all at once."""
        # the secondary key, in sorted order: a KV block's id (below nb), nb + a checkpoint's tick
        key = np.where(self._ck_live[ids], tick + self._node_of.size, ids)[order]
        if bad.size > 8:  # every group by the secondary key, the groups in place
            group = np.concatenate(([0], np.cumsum(~tie)))
            return order[np.lexsort((key, group))]
        order, end = order.copy(), -1
        for i in bad.tolist():
            if i <= end:  # in the group just sorted
                continue
            start, end = i, i + 1
            while start and tie[start - 1]:
                start -= 1
            while end < tie.size and tie[end]:
                end += 1
            order[start : end + 1] = order[start : end + 1][key[start : end + 1].argsort(kind="stable")]
        return order

    def _drop_all(self, kv: np.ndarray, ck_slots: np.ndarray) -> np.ndarray:
        """Drop the KV blocks ``kv`` and the checkpoints ``ck_slots``; the freed ids (KV first, in
        victim order)."""
        parts = [kv.astype(np.int32)]
        if kv.size:
            slots = self._node_of[kv]
            if (slots < 0).any():  # stale second copies on no node (adopt_copies): nothing to unmap
                self._stale[kv] = False
                slots = slots[slots >= 0]
            self._kv[slots] = 0
            self._node_of[kv] = -1
            self._n_mapped -= int(slots.size)
            self._kv_evictable[kv] = False
            self._n_evictable -= int(kv.size)
            self.stats.kv_evicted += int(kv.size)
            self._remove_nodes(slots[self._ck[slots] < 0])
        for ck in ck_slots.tolist():
            parts.append(self._drop_checkpoint(ck))
        return np.concatenate(parts)

    def _drop_checkpoint(self, ck: int, evicted: bool = True) -> np.ndarray:
        """Drop the checkpoint in slot ``ck``; its block ids (the node goes if it holds nothing now).
        ``evicted``: counted as an eviction in the stats."""
        ids = self._ck_ids.pop(ck)
        slot = self._ck_node.pop(ck)
        self._ck[slot] = -1
        self._ck_live[ck] = False
        self.stats.checkpoints_evicted += int(evicted)
        if not self._kv[slot]:  # the node holds nothing now
            key = int(self._key[slot])
            del self._slot[key]
            if self._bare:
                self._bare.pop(key, None)
            self._free_slot(slot)
        return ids

"""The block pool's extents as they were before they moved to plain sorted lists (two sorted
containers, one extent operation at a time): the oracle that ``test_pool.py`` holds the pool's id
choices to. Decisions downstream (``flop_aware`` ties between blocks, which ids a state set gets)
depend on them, so the pool must choose exactly the same ids in the same order. Reference counts
(``incref``, ``decref``, ``release``) did not change and are inherited.
"""

from __future__ import annotations

import numpy as np
from sortedcontainers import SortedDict, SortedList

from hybridkv.blockmgr.pool import BlockPool, runs

_EMPTY = np.empty(0, dtype=np.int32)


class ReferencePool(BlockPool):
    """:class:`BlockPool` with the previous extent books (by start and by length, sorted containers)."""

    def __init__(self, num_blocks: int, reserve_null: bool = True) -> None:
        super().__init__(num_blocks, reserve_null)
        del self._starts, self._ends, self._by_len  # the new books: not used here
        self._by_start: SortedDict = SortedDict()  # start -> end
        self._by_length: SortedList = SortedList()  # (length, start)
        self._num_free = 0
        self._insert(self.first_id, num_blocks)

    def free_extents(self) -> list[tuple[int, int]]:
        """The free extents ``[(start, end), ...]`` in id order, loose ids merged in first."""
        self.merge_loose()
        return list(self._by_start.items())

    def largest_free_extent(self) -> int:
        self.merge_loose()
        return self._by_length[-1][0] if self._by_length else 0

    def merge_loose(self) -> None:
        """Return the loose single ids to the extents (merging neighbours); the free set is unchanged."""
        if not self._loose:
            return
        loose = np.array(self._loose, dtype=np.int32)
        self._loose.clear()
        self._num_free -= loose.size  # free_run counts them again
        for start, end in runs(np.sort(loose)):
            self.free_run(start, end)

    # ---- extents -----------------------------------------------------------------------------
    def _insert(self, start: int, end: int) -> None:
        self._by_start[start] = end
        self._by_length.add((end - start, start))
        self._num_free += end - start

    def _remove(self, start: int, end: int) -> None:
        del self._by_start[start]
        self._by_length.remove((end - start, start))
        self._num_free -= end - start

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free ids (reference count 1 each); int32 array in allocation order.

        Raises ``ValueError`` when fewer than ``n`` are free: callers check first (check-then-act),
        so reaching this is a bug in the caller, and nothing has changed.
        """
        if n == 1 and self._loose:  # the decode fast path: the most recently freed single id
            i = self._loose.pop()
            self._num_free -= 1
            self._rc[i] = 1
            self.last_allocation_was_run = True
            one = self._one.get(i)
            if one is None:
                one = self._one[i] = self._ids[i : i + 1]
            return one
        if n <= 0:
            self.last_allocation_was_run = False
            return _EMPTY
        if n > self._num_free:
            raise ValueError(f"asked for {n} blocks, {self._num_free} free")
        i = self._by_length.bisect_left((n, -1))
        if self._loose and n > 1 and i == len(self._by_length):  # no extent holds n: merge loose ids first
            self.merge_loose()
            i = self._by_length.bisect_left((n, -1))
        if i < len(self._by_length):  # best fit: one run
            length, start = self._by_length[i]
            self._remove(start, start + length)
            if length > n:
                self._insert(start + n, start + length)
            self.ref_counts[start : start + n] = 1
            self.last_allocation_was_run = True
            return np.arange(start, start + n, dtype=np.int32)
        else:  # fragmented: largest extents first, so few runs
            parts, left = [], n
            while left:
                length, start = self._by_length.pop()  # the largest extent
                del self._by_start[start]
                self._num_free -= length
                take = min(length, left)
                if length > take:
                    self._insert(start + take, start + length)
                parts.append(np.arange(start, start + take, dtype=np.int32))
                left -= take
            out = np.concatenate(parts)
        self.ref_counts[out] = 1
        self.last_allocation_was_run = len(parts) == 1
        return out

    def free(self, ids: np.ndarray) -> None:
        """Return distinct ids whose reference count is zero to the free extents, merging neighbours."""
        if ids.size == 1:  # the decode fast path: onto the loose stack
            i = ids.item()
            if not self.first_id <= i < self.num_blocks:
                raise ValueError(f"cannot free ids outside [{self.first_id}, {self.num_blocks}): got [{i}, {i + 1})")
            if len(self._loose) < self._loose_cap:
                self._loose.append(i)
                self._num_free += 1
            else:
                self.free_run(i, i + 1)
            return
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if lo < self.first_id or hi > self.num_blocks:
            raise ValueError(f"cannot free ids outside [{self.first_id}, {self.num_blocks}): got [{lo}, {hi})")
        if hi - lo == ids.size:  # distinct ids spanning one run: no sort needed
            self.free_run(lo, hi)
            return
        for start, end in runs(np.sort(np.asarray(ids, dtype=np.int32))):
            self.free_run(start, end)

    def free_run(self, start: int, end: int) -> None:
        """Return the unreferenced ids ``[start, end)`` to the free extents, merging neighbours."""
        if end > start:
            j = self._by_start.bisect_right(start)
            if j:  # merge with the extent before
                prev_start = self._by_start.keys()[j - 1]
                prev_end = self._by_start[prev_start]
                if prev_end == start:
                    self._remove(prev_start, prev_end)
                    start = prev_start
            next_end = self._by_start.get(end)
            if next_end is not None:  # merge with the extent after
                self._remove(end, next_end)
                end = next_end
            self._insert(start, end)

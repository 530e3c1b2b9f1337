"""A block pool over one id space: free extents, reference counts, runs preferred.

Allocation works per request, not per block: :meth:`BlockPool.allocate` hands out ``n`` ids in one
call, from the smallest free extent that holds all ``n`` (best fit, so a state set comes out as one
contiguous id run and the big extents stay whole), or, when no extent is large enough, from the
largest extents first. Free ids are kept as extents ``[start, end)`` in two sorted containers
(by start, for merging on free; by length, for best fit), reference counts in a numpy array, so
admitting and freeing a request costs a handful of container operations, not one per block.

Single blocks (decode appends, copy-on-write) take a fast path: a freed single id goes onto a
bounded stack of loose free ids (counted free, kept out of the extents), and ``allocate(1)`` pops
the most recently freed one, so the decode pattern costs a list operation, not two sorted-container
updates. Loose ids never break a state set's run: when no extent holds an ``n > 1`` allocation,
they are merged back into the extents first (:meth:`BlockPool.merge_loose`), and every view of the
extents (:meth:`free_extents`, :meth:`largest_free_extent`) merges them before it answers.

Block 0 of a device pool is the null block: zero-filled, never allocated, never freed.
"""

from __future__ import annotations

import numpy as np
from sortedcontainers import SortedDict, SortedList

from hybridkv.blockmgr.layout import NULL_BLOCK

_EMPTY = np.empty(0, dtype=np.int32)
LOOSE_CAP = 4096  # most single ids kept out of the extents at once


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, as ``(start, end)`` pairs, of a sorted id array."""
    if ids.size == 0:
        return []
    if int(ids[-1]) - int(ids[0]) + 1 == ids.size:  # the common case: one run
        return [(int(ids[0]), int(ids[-1]) + 1)]
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    ends = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


class BlockPool:
    """Ids ``[first_id, num_blocks)`` with reference counts; ids below ``first_id`` are reserved.

    Ownership: the pool only counts. Whoever allocates holds one reference per id and must give
    it back with :meth:`decref`; ids whose count reaches zero are returned to the caller, which
    either :meth:`free`s them or keeps them as cached (evictable) blocks.
    """

    def __init__(self, num_blocks: int, reserve_null: bool = True) -> None:
        first = NULL_BLOCK + 1 if reserve_null else 0
        if num_blocks <= first:
            raise ValueError(f"a pool needs more than {first} block(s), got {num_blocks}")
        self.num_blocks = num_blocks
        self.first_id = first
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._rc = memoryview(self.ref_counts)  # the same counts, for scalar access without numpy overhead
        self._by_start: SortedDict = SortedDict()  # start -> end
        self._by_length: SortedList = SortedList()  # (length, start)
        self._num_free = 0
        self.last_allocation_was_run = False  # whether the last allocate() returned one id run
        self._loose: list[int] = []  # free single ids outside the extents, most recent last
        self._loose_cap = LOOSE_CAP
        self._ids = np.arange(num_blocks, dtype=np.int32)  # read-only: one-id results are views of it
        self._ids.flags.writeable = False
        self._one: dict[int, np.ndarray] = {}  # id -> its one-id view, made on first use
        self._insert(first, num_blocks)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_usable(self) -> int:
        return self.num_blocks - self.first_id

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

    # ---- reference counts --------------------------------------------------------------------
    def incref(self, ids: np.ndarray) -> None:
        """One more reference on each (distinct) id."""
        self.ref_counts[ids] += 1

    def decref(self, ids: np.ndarray) -> np.ndarray:
        """One reference less on each (distinct) id; returns the ids that reached zero."""
        if ids.size == 1:
            i = ids.item()
            count = self._rc[i] - 1
            self._rc[i] = count
            return ids if count == 0 else _EMPTY
        if ids.size == 0:
            return _EMPTY
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if hi - lo == ids.size:  # distinct ids spanning one run: slices instead of fancy indexing
            counts = self.ref_counts[lo:hi]
            counts -= 1
            return ids if not counts.any() else ids[self.ref_counts[ids] == 0]
        self.ref_counts[ids] -= 1
        return ids[self.ref_counts[ids] == 0]

    def release(self, ids: np.ndarray) -> None:
        """Drop one reference and free the ids that reached zero (no caching)."""
        if ids.size == 1:  # the decode fast path, in one call
            i = ids.item()
            count = self._rc[i] - 1
            self._rc[i] = count
            if count == 0:
                if len(self._loose) < self._loose_cap and self.first_id <= i:
                    self._loose.append(i)
                    self._num_free += 1
                else:
                    self.free(ids)
            return
        self.free(self.decref(ids))

    # ---- integrity ---------------------------------------------------------------------------
    def check_free_extents(self) -> list[str]:
        """Problems with the extents themselves (overlap, reserved ids, counts, referenced ids)."""
        problems, prev_end, total = [], self.first_id, len(self._loose)
        if self._loose:
            loose = np.array(self._loose, dtype=np.int64)
            inside = np.zeros(self.num_blocks, dtype=bool)
            for start, end in self._by_start.items():
                inside[start:end] = True
            if loose.min() < self.first_id or loose.max() >= self.num_blocks or np.unique(loose).size != loose.size:
                problems.append(f"loose free ids out of range or repeated: {sorted(self._loose)[:8]}")
            elif inside[loose].any() or self.ref_counts[loose].any():
                problems.append("loose free ids inside a free extent or referenced")
            if len(self._loose) > self._loose_cap:
                problems.append(f"{len(self._loose)} loose free ids, over the cap {self._loose_cap}")
        for start, end in self._by_start.items():
            if start < prev_end or end <= start or end > self.num_blocks:
                problems.append(f"bad free extent [{start}, {end}) after {prev_end}")
            if start == prev_end and start != self.first_id:
                problems.append(f"free extents not merged at {start}")
            if self.ref_counts[start:end].any():
                problems.append(f"free extent [{start}, {end}) holds referenced blocks")
            prev_end, total = end, total + end - start
        if total != self._num_free or len(self._by_length) != len(self._by_start):
            problems.append(f"free count {self._num_free} != extents total {total}")
        if (self.ref_counts < 0).any():
            problems.append(f"negative reference counts at {np.flatnonzero(self.ref_counts < 0)[:8].tolist()}")
        if self.first_id and self.ref_counts[: self.first_id].any():
            problems.append("the null block is referenced")
        return problems

    def free_mask(self) -> np.ndarray:
        mask = np.zeros(self.num_blocks, dtype=bool)
        for start, end in self._by_start.items():
            mask[start:end] = True
        mask[self._loose] = True
        return mask

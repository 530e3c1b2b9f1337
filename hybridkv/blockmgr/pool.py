"""A block pool over one id space: free extents, reference counts, runs preferred.

Allocation works per request, not per block: :meth:`BlockPool.allocate` hands out ``n`` ids in one
call, from the smallest free extent that holds all ``n`` (best fit, ties to the lowest start, so a
state set comes out as one contiguous id run and the big extents stay whole), or, when no extent is
large enough, from the largest extents first (ties to the highest start). Free ids are kept as
maximal extents ``[start, end)`` in plain sorted lists, by start and by ``(length, start)`` (packed
into one int), reference counts in a numpy array: admitting and freeing a request costs a few
bisects, not one operation per block, and a free of many scattered ids (an eviction) is merged in
numpy at once.

Single blocks (decode appends, copy-on-write) take a fast path: a freed single id goes onto a
bounded stack of loose free ids (counted free, kept out of the extents), and ``allocate(1)`` pops
the most recently freed one, so the decode pattern costs a list operation, not an extent update.
Loose ids never break a state set's run: when no extent holds an ``n > 1`` allocation, they are
merged back into the extents first (:meth:`BlockPool.merge_loose`), and every view of the extents
(:meth:`free_extents`, :meth:`largest_free_extent`) merges them before it answers.

Block 0 of a device pool is the null block: zero-filled, never allocated, never freed.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from hybridkv.blockmgr import kernels, pool_kernels
from hybridkv.planner.layout import NULL_BLOCK

_EMPTY = np.empty(0, dtype=np.int32)
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # reductions without the method wrappers
LOOSE_CAP = 4096  # most single ids kept out of the extents at once
_START_MASK = (1 << 32) - 1  # extents by length are keys length << 32 | start


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, as ``(start, end)`` pairs, of a sorted id array."""
    starts, ends = run_bounds(ids)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def run_bounds(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of consecutive ids of a sorted id array: their starts and ends (int64)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return ids[:0], ids[:0]
    if int(ids[-1]) - int(ids[0]) + 1 == ids.size:  # the common case: one run
        return ids[:1], ids[-1:] + 1
    ends = ((ids[1:] - ids[:-1]) != 1).nonzero()[0]  # run i ends at ids[ends[i]]
    starts = np.empty(ends.size + 1, dtype=np.int64)
    starts[0], starts[1:] = ids[0], ids[ends + 1]
    out = np.empty(ends.size + 1, dtype=np.int64)
    out[:-1], out[-1] = ids[ends] + 1, ids[-1] + 1
    return starts, out


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
        # the free extents [starts[i], ends[i]), sorted by start, disjoint and never adjacent
        # (maximal), and the same extents by (length, start) as sorted keys length << 32 | start:
        # plain lists (a pool holds tens to hundreds of extents; a bisect and a short memmove beat
        # numpy's per-call setup)
        if num_blocks > _START_MASK:
            raise ValueError(f"a pool holds at most {_START_MASK} blocks, got {num_blocks}")
        self._init_extents(first, num_blocks)
        self._num_free = num_blocks - first  # ids in the extents + loose ids
        self.last_allocation_was_run = False  # whether the last allocate() returned one id run
        self._loose: list[int] = []  # free single ids outside the extents, most recent last
        self._loose_cap = LOOSE_CAP
        self._ids = np.arange(num_blocks, dtype=np.int32)  # read-only: one-id results are views of it
        self._ids.flags.writeable = False
        self._one: dict[int, np.ndarray] = {}  # id -> its one-id view, made on first use

    def _init_extents(self, first: int, num_blocks: int) -> None:
        """One free extent ``[first, num_blocks)``."""
        self._starts: list[int] = [first]
        self._ends: list[int] = [num_blocks]
        self._by_len: list[int] = [(num_blocks - first) << 32 | first]

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
        return list(zip(self._starts, self._ends, strict=True))

    def largest_free_extent(self) -> int:
        self.merge_loose()
        return self._largest()

    def merge_loose(self) -> None:
        """Return the loose single ids to the extents (merging neighbours); the free set is unchanged."""
        if not self._loose:
            return
        loose = np.array(self._loose, dtype=np.int64)
        self._loose.clear()
        self._num_free -= loose.size  # _free_sorted counts them again
        loose.sort()
        self._free_sorted(loose)

    # ---- extents -----------------------------------------------------------------------------
    def _drop(self, start: int) -> None:
        """Remove the extent starting at ``start`` from the by-start lists."""
        j = bisect_left(self._starts, start)
        del self._starts[j], self._ends[j]

    def _keep_rest(self, start: int, length: int, taken: int) -> None:
        """The first ``taken`` ids of the extent ``[start, start + length)`` (already out of the
        by-length list) are taken: its rest stays free, in the same place by start."""
        self._starts[bisect_left(self._starts, start)] = start + taken
        insort(self._by_len, (length - taken) << 32 | (start + taken))

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
        if self._loose and n > 1 and self._largest() < n:  # no extent holds n: merge loose ids first
            self.merge_loose()
        self._num_free -= n
        return self._take(n)

    def _largest(self) -> int:
        """The length of the largest free extent (loose ids not merged)."""
        return self._by_len[-1] >> 32 if self._by_len else 0

    def _take(self, n: int) -> np.ndarray:
        """``allocate`` from the extents (which hold ``n``): best fit, or the largest first."""
        bl = self._by_len
        i = bisect_left(bl, n << 32)
        if i < len(bl):  # best fit: the shortest extent that holds n, the lowest start among equals
            k = bl.pop(i)
            length, start = k >> 32, k & _START_MASK
            if length > n:
                self._keep_rest(start, length, n)
            else:
                self._drop(start)
            self.ref_counts[start : start + n] = 1
            self.last_allocation_was_run = True
            return np.arange(start, start + n, dtype=np.int32)
        # fragmented: the largest extents first (the highest start among equals), so few runs; only
        # the last one taken may be cut, and its rest stays free
        parts, left = [], n
        while left:
            k = bl.pop()
            length, start = k >> 32, k & _START_MASK
            if length > left:
                self._keep_rest(start, length, left)
                parts.append(self._ids[start : start + left])
                break
            self._drop(start)
            parts.append(self._ids[start : start + length])
            left -= length
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
        lo, hi = int(_MIN(ids)), int(_MAX(ids)) + 1
        if lo < self.first_id or hi > self.num_blocks:
            raise ValueError(f"cannot free ids outside [{self.first_id}, {self.num_blocks}): got [{lo}, {hi})")
        if hi - lo == ids.size:  # distinct ids spanning one run: no sort needed
            self.free_run(lo, hi)
            return
        self._free_sorted(np.sort(ids))

    def free_run(self, start: int, end: int) -> None:
        """Return the unreferenced ids ``[start, end)`` to the free extents, merging neighbours."""
        if end <= start:
            return
        starts, ends, bl = self._starts, self._ends, self._by_len
        self._num_free += end - start
        j = bisect_left(starts, start)  # the first extent after the run
        if j and ends[j - 1] == start:  # merge with the extent before
            prev = starts[j - 1]
            del bl[bisect_left(bl, (start - prev) << 32 | prev)]
            if j < len(starts) and starts[j] == end:  # and the one after: the run closes a gap
                after = ends[j]
                del bl[bisect_left(bl, (after - end) << 32 | end)]
                del starts[j], ends[j]
                end = after
            ends[j - 1] = end
            insort(bl, (end - prev) << 32 | prev)
        elif j < len(starts) and starts[j] == end:  # merge with the extent after
            after = ends[j]
            del bl[bisect_left(bl, (after - end) << 32 | end)]
            starts[j] = start
            insort(bl, (after - start) << 32 | start)
        else:
            starts.insert(j, start)
            ends.insert(j, end)
            insort(bl, (end - start) << 32 | start)

    def _free_sorted(self, ids: np.ndarray) -> None:
        """Return distinct unreferenced ids (ascending) to the free extents: a few runs (an
        eviction's victims often are) one bisect each, many (scattered victims, loose ids) merged
        with the extents at once."""
        if int(np.count_nonzero(ids[1:] - ids[:-1] != 1)) < 8:  # at most 8 runs
            starts, ends = run_bounds(ids)
            for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
                self.free_run(start, end)
            return
        self._num_free += ids.size
        # the extents and the ids as unit runs, all disjoint: sorted starts and sorted ends pair up
        # (the i-th start with the i-th end); an extent ends where the next one does not start
        s = np.concatenate((np.array(self._starts, dtype=np.int64), ids))
        s.sort()
        e = np.concatenate((np.array(self._ends, dtype=np.int64), ids + 1))
        e.sort()
        breaks = (s[1:] != e[:-1]).nonzero()[0]
        first = np.empty(breaks.size + 1, dtype=np.int64)
        first[0], first[1:] = s[0], s[breaks + 1]
        last = np.empty(breaks.size + 1, dtype=np.int64)
        last[:-1], last[-1] = e[breaks], e[-1]
        self._starts, self._ends = first.tolist(), last.tolist()
        key = (last - first) << 32
        key |= first
        key.sort()
        self._by_len = key.tolist()

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
        inside = self._extent_mask()
        if self._loose:
            loose = np.array(self._loose, dtype=np.int64)
            if loose.min() < self.first_id or loose.max() >= self.num_blocks or np.unique(loose).size != loose.size:
                problems.append(f"loose free ids out of range or repeated: {sorted(self._loose)[:8]}")
            elif inside[loose].any() or self.ref_counts[loose].any():
                problems.append("loose free ids inside a free extent or referenced")
            if len(self._loose) > self._loose_cap:
                problems.append(f"{len(self._loose)} loose free ids, over the cap {self._loose_cap}")
        if len(self._starts) != len(self._ends) or self._by_len != sorted(
            (e - s) << 32 | s for s, e in zip(self._starts, self._ends, strict=True)
        ):
            problems.append("the free extents by start and by length disagree")
            return problems
        for start, end in zip(self._starts, self._ends, strict=True):
            if start < prev_end or end <= start or end > self.num_blocks:
                problems.append(f"bad free extent [{start}, {end}) after {prev_end}")
            if start == prev_end and start != self.first_id:
                problems.append(f"free extents not merged at {start}")
            if self.ref_counts[start:end].any():
                problems.append(f"free extent [{start}, {end}) holds referenced blocks")
            prev_end, total = end, total + end - start
        if total != self._num_free:
            problems.append(f"free count {self._num_free} != extents total {total}")
        if (self.ref_counts < 0).any():
            problems.append(f"negative reference counts at {np.flatnonzero(self.ref_counts < 0)[:8].tolist()}")
        if self.first_id and self.ref_counts[: self.first_id].any():
            problems.append("the null block is referenced")
        return problems

    def _extent_mask(self) -> np.ndarray:
        """Which ids lie in a free extent (loose ids not included)."""
        mask = np.zeros(self.num_blocks, dtype=bool)
        for start, end in zip(self._starts, self._ends, strict=True):
            mask[start:end] = True
        return mask

    def free_mask(self) -> np.ndarray:
        mask = self._extent_mask()
        mask[self._loose] = True
        return mask


class JitBlockPool(BlockPool):
    """:class:`BlockPool` with its free extents in numpy arrays, updated by compiled loops
    (:mod:`hybridkv.blockmgr.kernels`, numba): the same ids for the same calls, without Python's
    per-extent cost (a fragmented take, an eviction's scattered victims). The loose single ids and
    the reference counts work as in the base class. Use :func:`make_pool` to get it when numba is
    installed."""

    def _init_extents(self, first: int, num_blocks: int) -> None:
        cap = (num_blocks - first + 1) // 2 + 1  # the most disjoint, non-adjacent extents
        self._s, self._e, self._k = (np.zeros(cap, dtype=np.int64) for _ in range(3))
        self._s[0], self._e[0], self._k[0] = first, num_blocks, (num_blocks - first) << 32 | first
        self._n_ext = 1

    # the extents as the base class's lists (read-only: views and checks)
    @property
    def _starts(self) -> list[int]:  # type: ignore[override]
        return self._s[: self._n_ext].tolist()

    @property
    def _ends(self) -> list[int]:  # type: ignore[override]
        return self._e[: self._n_ext].tolist()

    @property
    def _by_len(self) -> list[int]:  # type: ignore[override]
        return self._k[: self._n_ext].tolist()

    def _largest(self) -> int:
        return int(self._k[self._n_ext - 1]) >> 32 if self._n_ext else 0

    def _take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int32)
        self._n_ext, self.last_allocation_was_run = pool_kernels.take(
            self._s, self._e, self._k, self._n_ext, n, self.ref_counts, out
        )
        return out

    def free_run(self, start: int, end: int) -> None:
        if end <= start:
            return
        self._num_free += end - start
        self._n_ext = pool_kernels.free_run(self._s, self._e, self._k, self._n_ext, start, end)

    def _free_sorted(self, ids: np.ndarray) -> None:
        self._num_free += ids.size
        self._n_ext = pool_kernels.free_sorted(self._s, self._e, self._k, self._n_ext, ids)


def make_pool(num_blocks: int, reserve_null: bool = True, jit: bool | None = None) -> BlockPool:
    """A :class:`JitBlockPool` when the compiled kernels are available (``jit=None``: when
    :data:`hybridkv.blockmgr.kernels.ENABLED`), else a :class:`BlockPool`; same ids either way."""
    use_jit = kernels.ENABLED if jit is None else jit
    return (JitBlockPool if use_jit else BlockPool)(num_blocks, reserve_null)

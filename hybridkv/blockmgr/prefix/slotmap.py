"""The prefix cache's chain key -> node slot map, in two numpy arrays probed by compiled code.

:class:`SlotMap` answers the dict operations the cache uses (``get``, ``in``, item assignment and
deletion, ``pop``, ``items``) and bulk ones on int64 arrays (:meth:`SlotMap.lookup`,
:meth:`SlotMap.put`, :meth:`SlotMap.remove`) in one compiled call each, and its arrays are what
:func:`~hybridkv.blockmgr.prefix.kernels.register_few` registers blocks into: a prefill chunk's keys,
nodes and KV mapping in one call instead of a Python step per block. The cache uses it when the
kernels are enabled (:data:`~hybridkv.blockmgr.kernels.ENABLED`) and a plain dict otherwise; both
map the same keys to the same slots.

Keys are chain keys (int64); values are slots (int64 >= 0). The load stays at most one half: the
arrays double (every key re-inserted) before an insertion would pass it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from hybridkv.blockmgr.kernels import _jit

_MIN_SIZE = 1024


# ---- the prefix cache's key -> slot map -----------------------------------------------------------
# Open addressing with linear probing in one int64 array ``tab`` of shape ``[size, 2]`` (a power of
# two of cells: the key, then its slot, -1 for an empty cell; one cache line holds both) and
# ``meta = [count, shift, most keys]`` (``shift``: 64 - log2(size); ``most keys``: the load the
# caller allows, ``SlotMap``: one half). A key's home cell is the top bits of ``key * _GOLD``
# (Fibonacci hashing); removal shifts the probe run back (no tombstones).
_GOLD = 0x9E3779B97F4A7C15


@_jit
def _km_home(key, shift):  # type: ignore[no-untyped-def]
    return np.int64((np.uint64(key) * np.uint64(_GOLD)) >> np.uint64(shift))


@_jit
def _km_index(tab, shift, key):  # type: ignore[no-untyped-def]
    """The cell holding ``key``, or ``-1 - cell`` of the empty cell that ends its probe run."""
    mask = tab.shape[0] - 1
    i = _km_home(key, shift)
    while tab[i, 1] >= 0:
        if tab[i, 0] == key:
            return i
        i = (i + 1) & mask
    return -1 - i


@_jit
def km_get(tab, meta, key):  # type: ignore[no-untyped-def]
    """The slot of ``key`` (-1: absent)."""
    i = _km_index(tab, meta[1], key)
    return tab[i, 1] if i >= 0 else -1


@_jit
def km_lookup(tab, meta, keys, out):  # type: ignore[no-untyped-def]
    """``out[j]``: the slot of ``keys[j]`` (-1: absent)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        out[j] = tab[i, 1] if i >= 0 else -1


@_jit
def _km_insert(tab, meta, found, key, val):  # type: ignore[no-untyped-def]
    """Put ``key`` (absent: ``found`` is ``_km_index``'s ``-1 - cell``) in that empty cell with ``val``."""
    cell = -1 - found
    tab[cell, 0] = key
    tab[cell, 1] = val
    meta[0] += 1


@_jit
def km_put(tab, meta, keys, vals):  # type: ignore[no-untyped-def]
    """Map each of ``keys`` to the value at the same position (replacing a present key's)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        if i < 0:
            _km_insert(tab, meta, i, keys[j], vals[j])
        else:
            tab[i, 1] = vals[j]


@_jit
def _km_remove_at(tab, shift, i):  # type: ignore[no-untyped-def]
    """Empty cell ``i``, moving back the later entries of its probe run that may live there."""
    mask = tab.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if tab[j, 1] < 0:
            break
        h = _km_home(tab[j, 0], shift)
        if (j > i and (h <= i or h > j)) or (j < i and h <= i and h > j):  # home not in (i, j]
            tab[i, 0] = tab[j, 0]
            tab[i, 1] = tab[j, 1]
            i = j
    tab[i, 1] = -1


@_jit
def km_remove(tab, meta, keys, out):  # type: ignore[no-untyped-def]
    """Remove each of ``keys``; ``out[j]``: the slot it had (-1: it was absent)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        if i < 0:
            out[j] = -1
            continue
        out[j] = tab[i, 1]
        _km_remove_at(tab, shift, i)
        meta[0] -= 1


class SlotMap:
    """Chain key -> slot, open addressing (the kernels above)."""

    __slots__ = ("tab", "meta")

    def __init__(self, capacity: int = 0) -> None:
        self._alloc(max(capacity, 1))

    def _alloc(self, capacity: int) -> None:
        size = max(_MIN_SIZE, 1 << (2 * capacity - 1).bit_length())  # >= 2 * capacity
        self.tab = np.zeros((size, 2), dtype=np.int64)  # [key, slot] per cell, slot -1: empty
        self.tab[:, 1] = -1
        self.meta = np.array([0, 64 - (size.bit_length() - 1), size // 2], dtype=np.int64)  # count, shift, most keys

    def reserve(self, n: int) -> None:
        """Room for ``n`` more keys within the load bound (the arrays double as needed)."""
        count, most = self.meta[0], self.meta[2]
        if count + n > most:
            keys, vals = self._arrays()
            self._alloc(int(count) + n)
            km_put(self.tab, self.meta, keys, vals)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        used = self.tab[:, 1] >= 0
        return self.tab[used, 0], self.tab[used, 1]

    # ---- bulk, on int64 arrays -----------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slots of ``keys`` (int64; -1: absent)."""
        out = np.empty(keys.size, dtype=np.int64)
        km_lookup(self.tab, self.meta, keys, out)
        return out

    def put(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Map ``keys[i]`` to ``slots[i]`` (int64 arrays)."""
        self.reserve(keys.size)
        km_put(self.tab, self.meta, keys, slots)

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove ``keys``; the slots they had (-1: absent)."""
        out = np.empty(keys.size, dtype=np.int64)
        km_remove(self.tab, self.meta, keys, out)
        return out

    # ---- the dict operations -------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.meta[0])

    def get(self, key: int, default: int | None = None) -> int | None:
        slot = km_get(self.tab, self.meta, key)
        return default if slot < 0 else slot

    def __contains__(self, key: int) -> bool:
        return km_get(self.tab, self.meta, key) >= 0

    def __getitem__(self, key: int) -> int:
        slot = km_get(self.tab, self.meta, key)
        if slot < 0:
            raise KeyError(key)
        return slot

    def __setitem__(self, key: int, slot: int) -> None:
        self.put(np.array([key], dtype=np.int64), np.array([slot], dtype=np.int64))

    def pop(self, key: int, *default: int | None) -> int | None:
        slot = int(self.remove(np.array([key], dtype=np.int64))[0])
        if slot >= 0:
            return slot
        if default:
            return default[0]
        raise KeyError(key)

    def __delitem__(self, key: int) -> None:
        self.pop(key)

    def update(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        self.put(np.array([k for k, _ in pairs], dtype=np.int64), np.array([s for _, s in pairs], dtype=np.int64))

    def items(self) -> Iterator[tuple[int, int]]:
        keys, vals = self._arrays()
        return zip(keys.tolist(), vals.tolist(), strict=True)

    def keys(self) -> list[int]:
        return self._arrays()[0].tolist()

    def values(self) -> list[int]:
        return self._arrays()[1].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys())

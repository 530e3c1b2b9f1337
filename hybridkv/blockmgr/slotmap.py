"""The prefix cache's chain key -> node slot map, in two numpy arrays probed by compiled code.

:class:`SlotMap` answers the dict operations the cache uses (``get``, ``in``, item assignment and
deletion, ``pop``, ``items``) and bulk ones on int64 arrays (:meth:`SlotMap.lookup`,
:meth:`SlotMap.put`, :meth:`SlotMap.remove`) in one compiled call each, and its arrays are what
:func:`~hybridkv.blockmgr.kernels.register_few` registers blocks into: a prefill chunk's keys,
nodes and KV mapping in one call instead of a Python step per block. The cache uses it when the
kernels are enabled (:data:`~hybridkv.blockmgr.kernels.ENABLED`) and a plain dict otherwise; both
map the same keys to the same slots.

Keys are chain keys (int64); values are slots (int64 >= 0). The load stays at most one half: the
arrays double (every key re-inserted) before an insertion would pass it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from hybridkv.blockmgr import kernels

_MIN_SIZE = 1024


class SlotMap:
    """Chain key -> slot, open addressing (see :mod:`hybridkv.blockmgr.kernels`)."""

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
            kernels.km_put(self.tab, self.meta, keys, vals)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        used = self.tab[:, 1] >= 0
        return self.tab[used, 0], self.tab[used, 1]

    # ---- bulk, on int64 arrays -----------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slots of ``keys`` (int64; -1: absent)."""
        out = np.empty(keys.size, dtype=np.int64)
        kernels.km_lookup(self.tab, self.meta, keys, out)
        return out

    def put(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Map ``keys[i]`` to ``slots[i]`` (int64 arrays)."""
        self.reserve(keys.size)
        kernels.km_put(self.tab, self.meta, keys, slots)

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove ``keys``; the slots they had (-1: absent)."""
        out = np.empty(keys.size, dtype=np.int64)
        kernels.km_remove(self.tab, self.meta, keys, out)
        return out

    # ---- the dict operations -------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.meta[0])

    def get(self, key: int, default: int | None = None) -> int | None:
        slot = kernels.km_get(self.tab, self.meta, key)
        return default if slot < 0 else slot

    def __contains__(self, key: int) -> bool:
        return kernels.km_get(self.tab, self.meta, key) >= 0

    def __getitem__(self, key: int) -> int:
        slot = kernels.km_get(self.tab, self.meta, key)
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

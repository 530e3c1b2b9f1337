"""Per-request rows of two growable int32 matrices, so batch views are one numpy gather.

``kv[row, :num_kv_blocks]`` is a request's KV block table and ``state[row]`` its live state sets
``[num_state_groups, blocks_per_state]``; everything else in a row is the null block (0). A record
holds numpy views of its row; when a matrix grows, every owner's views are re-bound.
"""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr.records import RequestRecord

_EMPTY = np.empty(0, dtype=np.int32)


class RowTables:
    def __init__(self, num_state_groups: int, blocks_per_state: int, rows: int = 64, width: int = 64) -> None:
        self.kv = np.zeros((rows, width), dtype=np.int32)
        self.state = np.zeros((rows, num_state_groups, blocks_per_state), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))
        self._owners: dict[int, RequestRecord] = {}

    @property
    def width(self) -> int:
        return self.kv.shape[1]

    def take(self, rec: RequestRecord, width: int) -> None:
        """Give ``rec`` a zeroed row at least ``width`` wide and bind ``rec.kv`` / ``rec.state`` to it."""
        if not self._free_rows:
            self._grow(rows=2 * self.kv.shape[0])
        self.ensure_width(width)
        rec.row = self._free_rows.pop()
        self._owners[rec.row] = rec
        self._bind(rec)

    def give_back(self, rec: RequestRecord) -> None:
        """Zero ``rec``'s row and unbind it (the record keeps empty arrays)."""
        self.kv[rec.row] = 0
        self.state[rec.row] = 0
        del self._owners[rec.row]
        self._free_rows.append(rec.row)
        rec.row = -1
        rec.kv = _EMPTY
        rec.state = np.zeros(self.state.shape[1:], dtype=np.int32)

    def ensure_width(self, width: int) -> None:
        if width > self.kv.shape[1]:
            self._grow(width=max(width, 2 * self.kv.shape[1]))

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.kv.shape
        rows, width = rows or old_rows, width or old_width
        kv = np.zeros((rows, width), dtype=np.int32)
        kv[:old_rows, :old_width] = self.kv
        state = np.zeros((rows, *self.state.shape[1:]), dtype=np.int32)
        state[:old_rows] = self.state
        self.kv, self.state = kv, state
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows
        for rec in self._owners.values():
            self._bind(rec)

    def _bind(self, rec: RequestRecord) -> None:
        rec.kv = self.kv[rec.row]
        rec.state = self.state[rec.row]

    def gather_kv(self, rows: list[int], num_rows: int, width: int) -> np.ndarray:
        """``[num_rows, width]``: the KV rows of ``rows``, then null rows (one fancy-index gather)."""
        index = np.asarray(rows, dtype=np.intp)
        if num_rows == index.size and width <= self.kv.shape[1]:
            return self.kv[index, :width]  # rows are null past each request's blocks already
        out = np.zeros((num_rows, width), dtype=np.int32)
        w = min(width, self.kv.shape[1])
        out[: index.size, :w] = self.kv[index, :w]
        return out

    def gather_state(self, rows: list[int], num_rows: int) -> np.ndarray:
        """``[num_state_groups, num_rows, blocks_per_state]``: live sets of ``rows``, then null rows."""
        g, bps = self.state.shape[1:]
        out = np.empty((g, num_rows, bps), dtype=np.int32)
        b = len(rows)
        if b:
            out[:, :b] = self.state[rows].transpose(1, 0, 2)
        out[:, b:] = 0
        return out

"""Transfer plans: a request's blocks leave for another machine (export) or arrive from one (import).

Modelled on the swap plans (``swap.py``): a plan is made, the bytes move (``hybridkv.transfer``),
then the plan is settled once, by :meth:`TransferPlan.commit` or :meth:`TransferPlan.abort`.

- ``export_request`` pins a running request: until its plan is settled the request cannot be
  appended to, batched, swapped, forked or freed (the peer may still be reading its blocks).
  Commit frees it (the peer owns it now); abort unpins it, and it runs on here.
- ``import_request`` admits a request of ``num_tokens`` tokens exactly as ``allocate`` would (KV
  blocks plus one live state set, atomically) and holds it until the bytes arrived: commit makes it
  running, abort frees every block it took, so a failed transfer or a vanished peer leaks nothing.

A state set is ordinary blocks, so one :class:`RequestBlocks` describes everything a request owns
(KV table and every live state set); source and destination ids differ, their shapes match.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.lifecycle import ManagerCore
from hybridkv.blockmgr.records import RequestId, RequestRecord
from hybridkv.errors import NoFreeBlocksError, RequestStateError

_EMPTY = np.empty(0, dtype=np.int32)


class TransferDirection(enum.Enum):
    EXPORT = "export"  # this manager's blocks are read or written by a peer, then freed here
    IMPORT = "import"  # blocks allocated here receive a peer's bytes


class RequestBlocks(NamedTuple):
    """The block ids one request owns on one side of a transfer.

    ``kv_blocks``: int32 ``[num_kv_blocks]`` in block-table order (``cdiv(num_tokens, block_size)``);
    ``state_blocks``: per state group ``g``, int32 ``[blocks_per_state[g]]``, the live set in table
    order. Speculative sets are scratch and never travel. :meth:`ids` is the order descriptors pair
    source and destination ids in: the state sets (group by group), then the KV table.
    """

    num_tokens: int
    kv_blocks: np.ndarray
    state_blocks: tuple[np.ndarray, ...]

    def ids(self) -> np.ndarray:
        return np.concatenate((*self.state_blocks, self.kv_blocks)).astype(np.int64, copy=False)

    @property
    def num_blocks(self) -> int:
        return int(self.kv_blocks.size + sum(s.size for s in self.state_blocks))

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and ints, for JSON and the engine's metadata channel."""
        return {
            "num_tokens": int(self.num_tokens),
            "kv_blocks": self.kv_blocks.tolist(),
            "state_blocks": [s.tolist() for s in self.state_blocks],
        }

    @staticmethod
    def from_wire(msg: dict[str, Any]) -> RequestBlocks:
        return RequestBlocks(
            int(msg["num_tokens"]),
            np.asarray(msg["kv_blocks"], dtype=np.int32),
            tuple(np.asarray(s, dtype=np.int32) for s in msg["state_blocks"]),
        )

    def same_shape(self, other: RequestBlocks) -> bool:
        """Whether ``other`` holds as many tokens, KV blocks and state blocks per group (ids may differ)."""
        return (
            self.num_tokens == other.num_tokens
            and self.kv_blocks.size == other.kv_blocks.size
            and [s.size for s in self.state_blocks] == [s.size for s in other.state_blocks]
        )


@dataclass(slots=True, eq=False)
class TransferPlan:
    """One request's blocks on this side of a transfer, held until :meth:`commit` or :meth:`abort`.

    While the plan is pending it sits in the request record's ``pending`` slot, so every call that
    needs the request running refuses it. ``device_blocks`` is empty: the record itself holds the
    blocks (``check_integrity`` counts a pending plan's ``device_blocks`` as reserved on top of the
    record, which is right for swap-in plans and must be nothing here). A plan is settled once.
    """

    request_id: RequestId
    direction: TransferDirection
    blocks: RequestBlocks
    _commit: Callable[[TransferPlan], None]
    _abort: Callable[[TransferPlan], None]
    settled: bool = False
    device_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)

    def __len__(self) -> int:
        return self.blocks.num_blocks

    def commit(self) -> None:
        """Export: the peer has the bytes, free the request here. Import: the bytes arrived, run it."""
        self._commit(self)

    def abort(self) -> None:
        """Export: unpin, the request runs on here. Import: free every block the plan took."""
        self._abort(self)


class TransferMixin(ManagerCore):
    """Methods of :class:`~hybridkv.blockmgr.manager.HybridBlockManager`: a part that adds no state."""

    def request_blocks(self, request_id: RequestId) -> RequestBlocks:
        """Copies of a running request's KV table and live state sets (see :class:`RequestBlocks`)."""
        return self._request_blocks(self._running(request_id))

    def _request_blocks(self, rec: RequestRecord) -> RequestBlocks:
        sets = tuple(rec.state[g, :n].copy() for g, n in enumerate(self.layout.blocks_per_state))
        return RequestBlocks(rec.num_tokens, rec.kv_blocks.copy(), sets)

    def export_request(self, request_id: RequestId) -> TransferPlan:
        """Pin a running request for a peer to read (or for this side to write out) and describe its blocks.

        Raises :class:`UnknownRequestError`, or :class:`RequestStateError` when it is swapped out or
        already has a pending plan. Settle the plan with ``commit`` (frees the request) or ``abort``.
        """
        rec = self._running(request_id)
        plan = TransferPlan(
            request_id, TransferDirection.EXPORT, self._request_blocks(rec), self._commit_export, self._abort_export
        )
        rec.pending = plan  # type: ignore[assignment]
        return plan

    def can_import(self, num_tokens: int) -> bool:
        """Whether :meth:`import_request` of ``num_tokens`` tokens fits now (same count as ``allocate``)."""
        return self.can_allocate(num_tokens)

    def import_request(self, request_id: RequestId, num_tokens: int) -> TransferPlan:
        """Allocate KV blocks for ``num_tokens`` tokens and one live state set per group for a request
        whose bytes come from a peer; the request runs only after ``commit``.

        Atomic like ``allocate`` (whose errors it raises: :class:`DuplicateRequestError`,
        :class:`RequestTooLargeError`, :class:`NoFreeBlocksError`; nothing changes on error). Abort
        gives every block back; the blocks' bytes are undefined then, as free blocks' bytes are.
        """
        self.allocate(request_id, num_tokens)
        rec = self.requests[request_id]
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        if tier is not None:  # the READ lands at once, before any queued offload could run: withdraw them
            if tier.withdraw_offloads(np.concatenate((rec.kv_blocks, self._set_ids(rec.state)))) < 0:
                need = rec.num_kv_blocks + self.num_state_blocks
                self.free(request_id)
                raise NoFreeBlocksError(
                    f"import of {request_id!r} ({num_tokens} tokens)", need, self.num_available_blocks,
                    "blocks it would get wait for the host tier's queued copies: retry after the next step")
        plan = TransferPlan(
            request_id, TransferDirection.IMPORT, self._request_blocks(rec), self._commit_import, self._abort_import
        )
        rec.pending = plan  # type: ignore[assignment]
        return plan

    # ---- settling ------------------------------------------------------------------------------
    def _settle_transfer(self, plan: TransferPlan, direction: TransferDirection) -> RequestRecord:
        rec = self.requests.get(plan.request_id)
        if plan.settled or rec is None or rec.pending is not plan or plan.direction is not direction:
            raise RequestStateError(f"transfer plan of {plan.request_id!r} is already settled or stale")
        plan.settled, rec.pending = True, None
        return rec

    def _commit_export(self, plan: TransferPlan) -> None:
        self._settle_transfer(plan, TransferDirection.EXPORT)
        self.free(plan.request_id)

    def _abort_export(self, plan: TransferPlan) -> None:
        self._settle_transfer(plan, TransferDirection.EXPORT)

    def _commit_import(self, plan: TransferPlan) -> None:
        self._settle_transfer(plan, TransferDirection.IMPORT)

    def _abort_import(self, plan: TransferPlan) -> None:
        self._settle_transfer(plan, TransferDirection.IMPORT)
        self.free(plan.request_id)

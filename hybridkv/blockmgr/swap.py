"""Swap to the host pool: plans that reserve the target blocks, then commit or abort."""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr.lifecycle import ManagerCore
from hybridkv.blockmgr.records import (
    BlockUse,
    RequestId,
    RequestRecord,
    RequestStatus,
    SwapDirection,
    SwapPlan,
)
from hybridkv.errors import HostPoolExhaustedError, NoFreeBlocksError, RequestStateError

_EMPTY = np.empty(0, dtype=np.int32)


class SwapMixin(ManagerCore):
    """Methods of :class:`~hybridkv.blockmgr.manager.HybridBlockManager`: a part that adds no state."""

    # ---- swap ----------------------------------------------------------------------------------
    def can_swap_out(self, request_id: RequestId) -> bool:
        rec = self._running(request_id)
        n = rec.num_kv_blocks + self.num_state_blocks
        return self.host_pool is not None and n <= self.host_pool.num_free

    def swap_out(self, request_id: RequestId) -> SwapPlan:
        """Reserve host blocks for the request's KV and live state; the plan lists the copies.

        Commit frees the device blocks (speculative sets included); abort frees the host blocks.
        """
        rec = self._running(request_id)
        device = np.concatenate((rec.kv_blocks, rec.state[self._state_mask]))
        if self.host_pool is None or device.size > self.host_pool.num_free:
            raise HostPoolExhaustedError(device.size, self.host_pool.num_free if self.host_pool else 0)
        host = self.host_pool.allocate(device.size)
        rec.pending = SwapPlan(request_id, SwapDirection.OUT, device, host, self._commit_out, self._abort_out)
        return rec.pending

    def can_swap_in(self, request_id: RequestId) -> bool:
        """Whether :meth:`swap_in` succeeds now: like an admission, it keeps the watermark free."""
        rec = self._swapped(request_id)
        return rec.host_blocks.size + self.watermark_blocks <= self.num_available_blocks

    def swap_in(self, request_id: RequestId) -> SwapPlan:
        """Reserve device blocks for a swapped request; commit frees its host blocks."""
        if not self.can_swap_in(request_id):  # the one formula
            n = self.requests[request_id].host_blocks.size + self.watermark_blocks
            raise NoFreeBlocksError(f"swap-in of {request_id!r} (watermark included)", n, self.num_available_blocks)
        rec = self._swapped(request_id)
        n = rec.host_blocks.size
        device = self._take(n)
        self._mark(device[: n - self.num_state_blocks], BlockUse.KV)
        self._mark(device[n - self.num_state_blocks :], BlockUse.STATE)
        rec.pending = SwapPlan(
            request_id, SwapDirection.IN, device, rec.host_blocks.copy(), self._commit_in, self._abort_in
        )
        return rec.pending

    def _settle(self, plan: SwapPlan, direction: SwapDirection) -> RequestRecord:
        rec = self.requests.get(plan.request_id)
        if plan.settled or rec is None or rec.pending is not plan or plan.direction is not direction:
            raise RequestStateError(f"swap plan of {plan.request_id!r} is already settled or stale")
        plan.settled, rec.pending = True, None
        return rec

    def _commit_out(self, plan: SwapPlan) -> None:
        rec = self._settle(plan, SwapDirection.OUT)
        self._release_all(rec)
        rec.num_kv_blocks, rec.spec = 0, self._no_spec()
        rec.host_blocks, rec.status, rec.num_drafted = plan.host_blocks, RequestStatus.SWAPPED, 0

    def _abort_out(self, plan: SwapPlan) -> None:
        self._settle(plan, SwapDirection.OUT)
        assert self.host_pool is not None
        self.host_pool.release(plan.host_blocks)

    def _commit_in(self, plan: SwapPlan) -> None:
        rec = self._settle(plan, SwapDirection.IN)
        assert self.host_pool is not None
        self.host_pool.release(rec.host_blocks)
        n_kv = plan.device_blocks.size - self.num_state_blocks
        self.tables.take(rec, n_kv)
        rec.kv[:n_kv], rec.num_kv_blocks = plan.device_blocks[:n_kv], n_kv
        rec.state[self._state_mask] = plan.device_blocks[n_kv:]
        rec.host_blocks, rec.status = _EMPTY, RequestStatus.RUNNING

    def _abort_in(self, plan: SwapPlan) -> None:
        self._settle(plan, SwapDirection.IN)
        self._give_back(self.pool.decref(plan.device_blocks))

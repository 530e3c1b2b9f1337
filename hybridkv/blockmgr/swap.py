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
    @property
    def num_available_host_blocks(self) -> int:
        """Host blocks a swap-out can take now: free, plus those the prefix cache's host tier gives
        way with (its units no queued or unreleased copy touches)."""
        if self.host_pool is None:
            return 0
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        return self.host_pool.num_free + (tier.num_evictable if tier is not None else 0)

    def can_swap_out(self, request_id: RequestId) -> bool:
        rec = self._running(request_id)
        n = rec.num_kv_blocks + self.num_state_blocks
        return self.host_pool is not None and n <= self.num_available_host_blocks

    def swap_out(self, request_id: RequestId) -> SwapPlan:
        """Reserve host blocks for the request's KV and live state; the plan lists the copies.

        A swap-out wins over the host tier: cached units are dropped from the host (least recently
        used first) until the blocks fit. Commit frees the device blocks (speculative sets
        included); abort frees the host blocks (the dropped units stay dropped).
        """
        rec = self._running(request_id)
        device = np.concatenate((rec.kv_blocks, rec.state[self._state_mask]))
        if self.host_pool is None or device.size > self.num_available_host_blocks:
            raise HostPoolExhaustedError(device.size, self.num_available_host_blocks)
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        if tier is not None and device.size > self.host_pool.num_free:
            tier.stats.given_to_swaps += tier.make_room(device.size)
        host = self.host_pool.allocate(device.size)
        if self._exports and request_id in self._exports:  # its chunk does not run: no export
            self._drop_exports(request_id)
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
        if self._pin_epoch and self.prefix_cache is not None and self.prefix_cache.tier is not None:
            # the swap-in's copies (host -> device) may not have run: an offload of the host tier
            # (its copies run first in a plan) may not take these host blocks until release_pins
            self._host_pending.append((self._pin_epoch, rec.host_blocks))
        else:
            self.host_pool.release(rec.host_blocks)
        n_kv = plan.device_blocks.size - self.num_state_blocks
        self.tables.take(rec, n_kv)
        rec.kv[:n_kv], rec.num_kv_blocks = plan.device_blocks[:n_kv], n_kv
        rec.state[self._state_mask] = plan.device_blocks[n_kv:]
        rec.host_blocks, rec.status = _EMPTY, RequestStatus.RUNNING

    def _abort_in(self, plan: SwapPlan) -> None:
        self._settle(plan, SwapDirection.IN)
        self._give_back(self.pool.decref(plan.device_blocks))

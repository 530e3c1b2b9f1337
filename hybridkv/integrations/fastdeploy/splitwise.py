"""FastDeploy splitwise (prefill / decode instances) over the facade: a request's KV blocks and state
sets travel through :mod:`hybridkv.transfer` in FastDeploy's direction, a prefill-side WRITE.

FastDeploy's decode instance preallocates first (``preallocate_resource_in_d``) and tells the prefill
instance where to write; the prefill instance writes when its prefill is done; the decode instance
then takes the request in (``add_prefilled_request``). The facade maps these steps onto the
manager's transfer plans (``hybridkv.blockmgr.transfer_plans``) and the hand-off flows of
:mod:`hybridkv.transfer.handoff`:

- decode role: the first ``allocate_gpu_blocks`` of a request (from ``preallocate_resource_in_d``)
  is an **import plan** (its KV blocks and live state sets, held until the bytes arrived);
  :meth:`SplitwiseMixin.transfer_accept` is the message for the prefill side, and
  :meth:`SplitwiseMixin.transfer_received` waits for the WRITE's notification and commits (the
  request may run) or, on failure, aborts (every block back) and raises;
- prefill role: :meth:`SplitwiseMixin.transfer_send`, after the request's last prefill chunk,
  exports the request and WRITEs its KV blocks and state sets into the accepted blocks, then frees
  it (FastDeploy's later ``_free_blocks`` of it finds nothing left); on failure the export is
  aborted and the request stays here, so FastDeploy's own clean-up frees it.

A request released before its transfer settled (finished, aborted, ``pre_recycle_resource``) has
its plan aborted first (:meth:`SplitwiseMixin._drop_transfer`), so nothing leaks either way.
"""

from __future__ import annotations

from typing import Any

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestId
from hybridkv.blockmgr.transfer_plans import TransferPlan
from hybridkv.errors import RequestStateError
from hybridkv.transfer.descriptors import PoolRegions
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.handoff import finish_import, offer_message, push_request


class SplitwiseMixin:
    """The transfer steps of :class:`~hybridkv.integrations.fastdeploy.facade.FastDeployBlockManager`.

    Ownership: ``_transfers`` holds the pending import plan of each decode-role request between its
    preallocation and :meth:`transfer_received`; the manager holds the blocks."""

    manager: HybridBlockManager
    _transfers: dict[RequestId, TransferPlan]

    def _role(self) -> str:  # provided by the facade (the bound engine's splitwise_role)
        raise NotImplementedError

    def _require(self, call: str) -> None:  # provided by the facade
        raise NotImplementedError

    def transfer_accept(self, request: Any, pool: PoolRegions) -> bytes:
        """Decode role, right after ``preallocate_resource_in_d``: the message that tells the prefill
        instance which blocks (KV table and state sets) of ``pool`` to write. FastDeploy carries it
        in ``request.disaggregate_info`` next to ``block_tables``."""
        self._require("transfer_accept")
        plan = self._plan_of(request, "transfer_accept")
        return offer_message(plan, pool)

    def transfer_received(self, request: Any, engine: TransferEngine, peer: str, timeout_s: float) -> None:
        """Decode role, before ``add_prefilled_request``: wait for the prefill side's WRITE, then commit
        (the request runs here now). On a timeout or an engine error the import is aborted (every
        block it took goes back, the request no longer exists here) and the error raised; FastDeploy's
        ``pre_recycle_resource`` of it then finds nothing to free."""
        self._require("transfer_received")
        plan = self._plan_of(request, "transfer_received")
        try:
            finish_import(engine, peer, plan, timeout_s)
        finally:
            if plan.settled:
                self._transfers.pop(request.request_id, None)

    def transfer_send(self, request: Any, engine: TransferEngine, peer: str, accept: bytes, timeout_s: float) -> None:
        """Prefill role, after the request's last prefill chunk ran: WRITE its KV blocks and live state
        sets (the state after the prompt) into the blocks ``accept`` names, then free it here. On
        failure the export is aborted and the error raised: the request still holds its blocks and
        FastDeploy's ``_free_blocks`` frees them as for any finished request."""
        self._require("transfer_send")
        if self._role() != "prefill":
            raise RequestStateError(f"transfer_send is the prefill role's step; this engine is {self._role()!r}")
        rid = request.request_id
        rec = self.manager.requests.get(rid)
        if rec is None:
            raise RequestStateError(f"transfer_send: {rid!r} holds no blocks here (freed already, or never allocated)")
        done = getattr(request, "num_computed_tokens", None)
        need = getattr(request, "need_prefill_tokens", None)
        if done is None or need is None or done < need:
            raise RequestStateError(
                f"transfer_send: {rid!r} has computed {done} of its {need} prompt tokens; send after the last chunk"
            )
        plan = self.manager.export_request(rid)
        push_request(self.manager, engine, peer, plan, accept, timeout_s)

    def _plan_of(self, request: Any, what: str) -> TransferPlan:
        if self._role() != "decode":
            raise RequestStateError(f"{what} is the decode role's step; this engine is {self._role()!r}")
        plan = self._transfers.get(request.request_id)
        if plan is None or plan.settled:
            raise RequestStateError(
                f"{what}: {request.request_id!r} has no pending import (preallocate_resource_in_d makes it; "
                "a received or failed transfer ends it)"
            )
        return plan

    def _drop_transfer(self, rid: RequestId) -> bool:
        """Abort ``rid``'s pending import (its blocks go back). True if there was one."""
        plan = self._transfers.pop(rid, None)
        if plan is None or plan.settled:
            return False
        plan.abort()
        return True

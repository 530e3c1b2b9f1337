"""A request from one instance to another: the manager's transfer plans driven over an engine.

Two directions, as engines do prefill/decode disaggregation:

- **decode-side READ** (vLLM's NixlConnector): the prefill side ``offer_request`` (export plan +
  offer message), the decode side ``pull_request`` (import plan, READ, commit; abort on failure),
  the prefill side ``finish_export`` (waits for the READ's notification, then frees the request).
- **prefill-side WRITE** (FastDeploy's splitwise cache messager, Mooncake): the decode side
  ``reserve_request`` (import plan + accept message), the prefill side ``push_request`` (WRITE with
  notification, then frees the request), the decode side ``finish_import`` (waits, then commits).

Messages are JSON bytes the serving engine carries on its own control channel. Every failure aborts
the plan it concerns, so neither manager leaks a block when a transfer fails or a peer disappears,
except when the engine reports a transfer it could not cancel (``TransferError.in_flight``): then the
destination's plan stays pending (its blocks must not be reused) and the error is raised.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridkv.blockmgr.records import RequestId
from hybridkv.blockmgr.transfer_plans import RequestBlocks, TransferPlan
from hybridkv.transfer.descriptors import DescriptorPairs, PoolRegions, pair_descriptors
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import TransferError

if TYPE_CHECKING:
    from hybridkv.blockmgr.manager import HybridBlockManager


def notification_for(request_id: RequestId) -> bytes:
    """The message a finished transfer of ``request_id`` carries."""
    return f"hybridkv:done:{request_id}".encode()


class BlocksMessage(NamedTuple):
    """One side's blocks of a request and where its pool lives: an offer (source) or an accept (destination)."""

    request_id: RequestId
    blocks: RequestBlocks
    pool: dict[str, Any]  # PoolRegions.to_wire()

    def to_bytes(self) -> bytes:
        return json.dumps({"request_id": self.request_id, "blocks": self.blocks.to_wire(), "pool": self.pool}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> BlocksMessage:
        msg = json.loads(data)
        return BlocksMessage(msg["request_id"], RequestBlocks.from_wire(msg["blocks"]), msg["pool"])


def _settle_failed(plan: TransferPlan, error: TransferError) -> None:
    if not error.in_flight and not plan.settled:
        plan.abort()


# ---- decode-side READ ----------------------------------------------------------------------------
def offer_request(manager: HybridBlockManager, pool: PoolRegions, request_id: RequestId) -> tuple[TransferPlan, bytes]:
    """Prefill side: pin the request (export plan) and describe it for the decode side."""
    plan = manager.export_request(request_id)
    return plan, offer_message(plan, pool)


def offer_message(plan: TransferPlan, pool: PoolRegions) -> bytes:
    """The offer of an export (or the accept of an import) plan: its blocks and this side's pool."""
    return BlocksMessage(plan.request_id, plan.blocks, pool.to_wire()).to_bytes()


def pull_request(
    manager: HybridBlockManager, engine: TransferEngine, peer: str, offer: bytes, timeout_s: float
) -> TransferPlan:
    """Decode side: import the offered request, READ its bytes, commit (it runs here now).

    Raises :class:`TransferError` (the import was aborted, unless ``in_flight``) or the manager's
    allocation errors (nothing was reserved then; tell the prefill side to retry or abort its plan).
    """
    msg = BlocksMessage.from_bytes(offer)
    remote = PoolRegions.from_wire(manager.layout, msg.pool)
    plan = manager.import_request(msg.request_id, msg.blocks.num_tokens)
    try:
        pairs = pair_descriptors(remote, msg.blocks, engine.pool, plan.blocks)
        engine.read(peer, pairs, remote, notification_for(msg.request_id), timeout_s)
    except TransferError as e:
        _settle_failed(plan, e)
        raise
    plan.commit()
    return plan


def finish_export(engine: TransferEngine, peer: str, plan: TransferPlan, timeout_s: float) -> None:
    """Prefill side: wait for the peer's notification, then free the request (commit).

    On :class:`TransferTimeoutError` the plan is aborted (the request runs on here) and the error raised.
    """
    try:
        engine.wait_notification(peer, notification_for(plan.request_id), timeout_s)
    except TransferError as e:
        _settle_failed(plan, e)
        raise
    plan.commit()


# ---- prefill-side WRITE --------------------------------------------------------------------------
def reserve_request(
    manager: HybridBlockManager, pool: PoolRegions, request_id: RequestId, num_tokens: int
) -> tuple[TransferPlan, bytes]:
    """Decode side: allocate the request's blocks (import plan) and tell the prefill side where they are."""
    plan = manager.import_request(request_id, num_tokens)
    return plan, offer_message(plan, pool)


def push_pairs(
    manager: HybridBlockManager, engine: TransferEngine, plan: TransferPlan, accept: bytes
) -> tuple[DescriptorPairs, PoolRegions]:
    """Prefill side: the descriptor pairs from this pool into the accepted blocks, and the peer's pool."""
    msg = BlocksMessage.from_bytes(accept)
    if msg.request_id != plan.request_id:
        raise TransferError(f"accept for {msg.request_id!r} does not match the export of {plan.request_id!r}")
    remote = PoolRegions.from_wire(manager.layout, msg.pool)
    return pair_descriptors(engine.pool, plan.blocks, remote, msg.blocks), remote


def push_request(
    manager: HybridBlockManager, engine: TransferEngine, peer: str, plan: TransferPlan, accept: bytes, timeout_s: float
) -> None:
    """Prefill side: WRITE the exported request into the accepted blocks with the notification, then
    free it here (commit). On :class:`TransferError` the export is aborted (the request runs on here)."""
    try:
        pairs, remote = push_pairs(manager, engine, plan, accept)
        engine.write(peer, pairs, remote, notification_for(plan.request_id), timeout_s)
    except TransferError as e:
        _settle_failed(plan, e)
        raise
    plan.commit()


def finish_import(engine: TransferEngine, peer: str, plan: TransferPlan, timeout_s: float) -> None:
    """Decode side: wait for the WRITE's notification, then run the request (commit); abort on timeout.

    A timeout means the writer failed or vanished; drop the connection (``engine.disconnect``) before
    the freed blocks are reused if the writer might still be alive.
    """
    try:
        engine.wait_notification(peer, notification_for(plan.request_id), timeout_s)
    except TransferError as e:
        _settle_failed(plan, e)
        raise
    plan.commit()

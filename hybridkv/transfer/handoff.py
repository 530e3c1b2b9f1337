"""A request from one instance to another: the manager's transfer plans driven over an engine.

Two directions, as engines do prefill/decode disaggregation:

- **decode-side READ** (vLLM's NixlConnector): the prefill side ``offer_request`` (export plan +
  offer message), the decode side ``pull_request`` (import plan, READ, commit; abort on failure),
  the prefill side ``finish_export`` (waits for the READ's notification, then frees the request).
- **prefill-side WRITE** (FastDeploy's splitwise cache messager, Mooncake): the decode side
  ``reserve_request`` (import plan + accept message), the prefill side ``push_request`` (WRITE with
  notification, then frees the request), the decode side ``finish_import`` (waits, then commits).

Messages are JSON bytes the serving engine carries on its own control channel, so request ids are
``str`` or ``int`` (numpy integers travel as ``int``; anything else raises ``TypeError`` before any
change: a tuple would come back as a list). A message from the peer is checked completely (its
layout, its pool's regions and planes, the block ids) before anything is reserved for it, and any
exception after a plan was made aborts that plan, so neither manager leaks a block when a transfer
fails, a peer disappears or a message is malformed, except when the engine reports a transfer it
could not cancel (``TransferError.in_flight``): then the destination's plan stays pending (its
blocks must not be reused) and the error is raised.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.records import RequestId
from hybridkv.blockmgr.transfer_plans import RequestBlocks, TransferPlan
from hybridkv.planner.layout import Layout
from hybridkv.transfer.descriptors import DescriptorPairs, PoolRegions, check_request_blocks, pair_descriptors
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import TransferError

if TYPE_CHECKING:
    from hybridkv.blockmgr.manager import HybridBlockManager

_INT32_MAX = np.iinfo(np.int32).max


# ---- arguments -----------------------------------------------------------------------------------
def wire_request_id(request_id: object) -> str | int:
    """``request_id`` as it travels in a message: a ``str``, or an ``int`` (numpy integers become
    ``int``). Raises ``TypeError`` for anything else (tuples, floats, bools, None...), which JSON
    would not bring back as the same hashable id."""
    if isinstance(request_id, str):
        return request_id
    if isinstance(request_id, int | np.integer) and not isinstance(request_id, bool | np.bool_):
        return int(request_id)
    raise TypeError(
        f"request id {request_id!r} ({type(request_id).__name__}) cannot travel in a hand-off message: "
        "use a str or an int (numpy integers are converted to int)"
    )


def check_engine(engine: object) -> TransferEngine:
    """``engine`` if it is a :class:`TransferEngine`, else ``TypeError``."""
    if not isinstance(engine, TransferEngine):
        raise TypeError(f"expected a TransferEngine, got {type(engine).__name__}")
    return engine


def check_peer(peer: object) -> str:
    """``peer`` if it is a peer name (a non-empty ``str``), else ``TypeError``."""
    if not isinstance(peer, str) or not peer:
        raise TypeError(f"a peer is the non-empty str name connect() returned, got {peer!r}")
    return peer


def check_timeout(timeout_s: object) -> float:
    """``timeout_s`` as a float ``>= 0``: ``TypeError`` for non-numbers (bools too), ``ValueError``
    for negative or NaN values."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float | np.integer | np.floating):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r} ({type(timeout_s).__name__})")
    t = float(timeout_s)
    if math.isnan(t) or t < 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
    return t


def _check_manager(manager: object) -> HybridBlockManager:
    from hybridkv.blockmgr.manager import HybridBlockManager

    if not isinstance(manager, HybridBlockManager):
        raise TypeError(f"expected a HybridBlockManager, got {type(manager).__name__}")
    return manager


def _check_plan(plan: object, what: str) -> TransferPlan:
    if not isinstance(plan, TransferPlan):
        raise TypeError(f"{what} must be a TransferPlan, got {type(plan).__name__}")
    if plan.settled:
        raise TransferError(f"the transfer plan of {plan.request_id!r} is already settled: make a new one")
    return plan


def notification_for(request_id: RequestId) -> bytes:
    """The message a finished transfer of ``request_id`` carries. The id is JSON-encoded, so the
    ``int`` 5 and the ``str`` "5" (two requests) never share a notification."""
    return b"hybridkv:done:" + json.dumps(wire_request_id(request_id)).encode()


# ---- messages ------------------------------------------------------------------------------------
def _wire_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TransferError(f"malformed message: {what} must be a list of integers")
    if value and (min(value) < 0 or max(value) > _INT32_MAX):
        raise TransferError(f"malformed message: {what} must lie in [0, {_INT32_MAX}]")
    return value


class BlocksMessage(NamedTuple):
    """One side's blocks of a request and where its pool lives: an offer (source) or an accept (destination)."""

    request_id: RequestId
    blocks: RequestBlocks
    pool: dict[str, Any]  # PoolRegions.to_wire()

    def to_bytes(self) -> bytes:
        """The message as JSON bytes (``TypeError`` for a request id that cannot travel)."""
        return json.dumps(
            {"request_id": wire_request_id(self.request_id), "blocks": self.blocks.to_wire(), "pool": self.pool}
        ).encode()

    @staticmethod
    def from_bytes(data: bytes) -> BlocksMessage:
        """Parse a message; raises :class:`TransferError` when it is not one (bad JSON, a missing or
        mistyped field). The blocks are checked against a layout by :func:`parse_offer`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"a hand-off message is bytes, got {type(data).__name__}")
        try:
            msg = json.loads(bytes(data))
        except (UnicodeDecodeError, ValueError) as e:
            raise TransferError(f"malformed message: not JSON ({e})") from None
        if not isinstance(msg, dict) or not {"request_id", "blocks", "pool"} <= msg.keys():
            raise TransferError("malformed message: expected an object with request_id, blocks and pool")
        rid = msg["request_id"]
        if isinstance(rid, bool) or not isinstance(rid, str | int):
            raise TransferError(f"malformed message: request_id must be a str or an int, got {rid!r}")
        blocks, pool = msg["blocks"], msg["pool"]
        if not isinstance(blocks, dict) or not {"num_tokens", "kv_blocks", "state_blocks"} <= blocks.keys():
            raise TransferError("malformed message: blocks must have num_tokens, kv_blocks and state_blocks")
        n = blocks["num_tokens"]
        if type(n) is not int or n < 0:
            raise TransferError(f"malformed message: num_tokens must be an integer >= 0, got {n!r}")
        _wire_ids(blocks["kv_blocks"], "kv_blocks")
        if not isinstance(blocks["state_blocks"], list):
            raise TransferError("malformed message: state_blocks must be a list of lists of integers")
        for i, ids in enumerate(blocks["state_blocks"]):
            _wire_ids(ids, f"state_blocks[{i}]")
        if not isinstance(pool, dict):
            raise TransferError("malformed message: pool must be an object")
        return BlocksMessage(rid, RequestBlocks.from_wire(blocks), pool)


def parse_offer(layout: Layout, data: bytes) -> tuple[BlocksMessage, PoolRegions]:
    """An offer (or accept) read and checked against ``layout`` before anything is reserved for it:
    the message, the peer's pool (layout signature, regions, planes) and its blocks (shape, ids inside
    the peer's pool, no id twice). Raises :class:`TransferError` naming what is wrong."""
    if not isinstance(layout, Layout):
        raise TypeError(f"parse_offer checks against a Layout, got {type(layout).__name__}")
    msg = BlocksMessage.from_bytes(data)
    remote = PoolRegions.from_wire(layout, msg.pool)
    check_request_blocks(remote, msg.blocks, "the peer's blocks", distinct=True)
    return msg, remote


def _settle_failed(plan: TransferPlan, error: BaseException) -> None:
    """Abort ``plan`` after ``error``, unless the engine could not cancel the transfer (in flight)."""
    if isinstance(error, TransferError) and error.in_flight:
        return
    if not plan.settled:
        plan.abort()


# ---- decode-side READ ----------------------------------------------------------------------------
def offer_request(manager: HybridBlockManager, pool: PoolRegions, request_id: RequestId) -> tuple[TransferPlan, bytes]:
    """Prefill side: pin the request (export plan) and describe it for the decode side.

    Raises ``TypeError`` for a request id that cannot travel (nothing pinned) and the manager's
    errors of ``export_request``; if the offer cannot be built the export is aborted."""
    _check_manager(manager)
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"pool must be PoolRegions, got {type(pool).__name__}")
    wire_request_id(request_id)
    plan = manager.export_request(request_id)
    try:
        return plan, offer_message(plan, pool)
    except Exception:
        plan.abort()
        raise


def offer_message(plan: TransferPlan, pool: PoolRegions) -> bytes:
    """The offer of an export (or the accept of an import) plan: its blocks and this side's pool."""
    if not isinstance(plan, TransferPlan):
        raise TypeError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"pool must be PoolRegions, got {type(pool).__name__}")
    return BlocksMessage(plan.request_id, plan.blocks, pool.to_wire()).to_bytes()


def read_offered(
    engine: TransferEngine,
    peer: str,
    remote: PoolRegions,
    offered: RequestBlocks,
    plan: TransferPlan,
    timeout_s: float,
) -> None:
    """Decode side: READ the offered blocks from ``peer``'s pool ``remote`` into the import ``plan``'s
    blocks, with the notification. On any exception the plan is aborted (unless the engine reports
    the transfer in flight) and the exception raised; the plan is not committed here."""
    try:
        pairs = pair_descriptors(remote, offered, engine.pool, plan.blocks)
        engine.read(peer, pairs, remote, notification_for(plan.request_id), timeout_s)
    except Exception as e:
        _settle_failed(plan, e)
        raise


def pull_request(
    manager: HybridBlockManager, engine: TransferEngine, peer: str, offer: bytes, timeout_s: float
) -> TransferPlan:
    """Decode side: import the offered request, READ its bytes, commit (it runs here now).

    The offer is checked (:func:`parse_offer`) before anything is reserved. Raises
    :class:`TransferError` (a malformed or incompatible offer: nothing reserved; a failed READ: the
    import was aborted, unless ``in_flight``), any other exception of the engine (the import was
    aborted), or the manager's allocation errors (nothing was reserved then; tell the prefill side to
    retry or abort its plan).
    """
    _check_manager(manager)
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    msg, remote = parse_offer(manager.layout, offer)
    plan = manager.import_request(msg.request_id, msg.blocks.num_tokens)
    read_offered(engine, peer, remote, msg.blocks, plan, timeout_s)
    plan.commit()
    return plan


def finish_export(engine: TransferEngine, peer: str, plan: TransferPlan, timeout_s: float) -> None:
    """Prefill side: wait for the peer's notification, then free the request (commit).

    On :class:`TransferTimeoutError` (or any other exception of the engine) the plan is aborted (the
    request runs on here) and the error raised.
    """
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    _check_plan(plan, "plan")
    try:
        engine.wait_notification(peer, notification_for(plan.request_id), timeout_s)
    except Exception as e:
        _settle_failed(plan, e)
        raise
    plan.commit()


# ---- prefill-side WRITE --------------------------------------------------------------------------
def reserve_request(
    manager: HybridBlockManager, pool: PoolRegions, request_id: RequestId, num_tokens: int
) -> tuple[TransferPlan, bytes]:
    """Decode side: allocate the request's blocks (import plan) and tell the prefill side where they are.

    Raises ``TypeError`` for a request id that cannot travel (nothing reserved) and the manager's
    errors of ``import_request``; if the accept cannot be built the import is aborted."""
    _check_manager(manager)
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"pool must be PoolRegions, got {type(pool).__name__}")
    wire_request_id(request_id)
    plan = manager.import_request(request_id, num_tokens)
    try:
        return plan, offer_message(plan, pool)
    except Exception:
        plan.abort()
        raise


def push_pairs(
    manager: HybridBlockManager, engine: TransferEngine, plan: TransferPlan, accept: bytes
) -> tuple[DescriptorPairs, PoolRegions]:
    """Prefill side: the descriptor pairs from this pool into the accepted blocks, and the peer's pool
    (the accept is checked like an offer, :func:`parse_offer`)."""
    msg, remote = parse_offer(manager.layout, accept)
    want = wire_request_id(plan.request_id)
    if type(msg.request_id) is not type(want) or msg.request_id != want:
        raise TransferError(f"accept for {msg.request_id!r} does not match the export of {plan.request_id!r}")
    return pair_descriptors(engine.pool, plan.blocks, remote, msg.blocks), remote


def push_request(
    manager: HybridBlockManager, engine: TransferEngine, peer: str, plan: TransferPlan, accept: bytes, timeout_s: float
) -> None:
    """Prefill side: WRITE the exported request into the accepted blocks with the notification, then
    free it here (commit). On any exception (a :class:`TransferError`, a malformed accept) the export
    is aborted (the request runs on here), unless the engine reports the WRITE in flight."""
    _check_manager(manager)
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    _check_plan(plan, "plan")
    try:
        pairs, remote = push_pairs(manager, engine, plan, accept)
        engine.write(peer, pairs, remote, notification_for(plan.request_id), timeout_s)
    except Exception as e:
        _settle_failed(plan, e)
        raise
    plan.commit()


def finish_import(engine: TransferEngine, peer: str, plan: TransferPlan, timeout_s: float) -> None:
    """Decode side: wait for the WRITE's notification, then run the request (commit); abort on timeout
    (or any other exception of the engine).

    A timeout means the writer failed or vanished; drop the connection (``engine.disconnect``) before
    the freed blocks are reused if the writer might still be alive.
    """
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    _check_plan(plan, "plan")
    try:
        engine.wait_notification(peer, notification_for(plan.request_id), timeout_s)
    except Exception as e:
        _settle_failed(plan, e)
        raise
    plan.commit()

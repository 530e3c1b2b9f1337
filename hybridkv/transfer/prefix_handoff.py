"""A cached prefix from a peer's device pool and host tier into a request here (decode-side READ).

The source instance keeps a prefix its prefix cache holds, some or all of it offloaded to its host
tier (``PrefixCacheConfig(host_tier=True)``). A request that lands on another instance pulls it:

1. source: :func:`offer_prefix` holds the prefix (``blockmgr.transfer_host.export_prefix``) and
   describes it: per block, its id and its pool (device or host), and both pools' regions;
2. here: :func:`pull_prefix` checks the offer, imports a request of the prefix's tokens
   (``import_request``: KV blocks and one live state set, atomically), READs the device-resident
   part from the peer's device pool and the host-resident part straight from the peer's host pool
   (DRAM; nothing is brought back to the peer's device first), with the notification on the last
   READ, and commits: the request runs here from ``num_tokens`` on;
3. source: :func:`finish_prefix_export` waits for the notification and drops the holds.

The checkpoint's bytes land in the request's live state set: what a local hit's copy (checkpoint ->
live) would have given it. Failures settle every plan as :mod:`.handoff` does: a malformed or
incompatible offer reserves nothing; a failed READ aborts the import (unless the engine reports it
in flight); a timeout on the source drops the holds. The source engine must register its host pool
too (``host_pool=`` of the loopback, NIXL and Mooncake engines).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.records import RequestId
from hybridkv.blockmgr.transfer_host import PrefixExport, export_prefix
from hybridkv.blockmgr.transfer_plans import RequestBlocks, TransferPlan
from hybridkv.planner.layout import Layout
from hybridkv.transfer.descriptors import (
    PoolRegions,
    TieredPairs,
    _check_ids,
    _check_shape,
    check_compatible,
    layout_signature,
    pair_tiered_descriptors,
)
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.handoff import (
    BlocksMessage,
    _check_manager,
    _settle_failed,
    check_engine,
    check_peer,
    check_timeout,
    notification_for,
    wire_request_id,
)

if TYPE_CHECKING:
    from hybridkv.blockmgr.manager import HybridBlockManager


class PrefixOffer(NamedTuple):
    """A prefix offer, read and checked: the request it is for, the prefix's source blocks, which of
    them are host ids (bool ``[blocks.num_blocks]``, :meth:`RequestBlocks.ids` order), and the
    peer's device and host pools (the host pool None when no block is on the host)."""

    request_id: RequestId
    blocks: RequestBlocks
    on_host: np.ndarray
    device_pool: PoolRegions
    host_pool: PoolRegions | None


def offer_prefix(
    manager: HybridBlockManager,
    device_pool: PoolRegions,
    host_pool: PoolRegions | None,
    request_id: RequestId,
    token_ids: Sequence[int] | np.ndarray,
    max_tokens: int | None = None,
) -> tuple[PrefixExport, bytes]:
    """Source side: hold the cached prefix of ``token_ids`` for the peer's request ``request_id``
    and describe it (JSON bytes). ``host_pool``: this instance's host pool regions (block-major,
    ``PoolRegions.block_major`` / ``regions_of_pools`` of an ``ops`` host pool); needed when part of
    the prefix is on the host.

    Raises ``TypeError`` (arguments; an id that cannot travel), :class:`TransferError` when the
    regions are not this manager's pools (another layout or number of blocks; nothing held), the
    errors of ``export_prefix`` (nothing held then), or :class:`TransferError` when part of the
    prefix is on the host and no ``host_pool`` is given (the export is aborted)."""
    _check_manager(manager)
    for name, pool in (("device_pool", device_pool), ("host_pool", host_pool)):
        if pool is not None and not isinstance(pool, PoolRegions):
            raise TypeError(f"{name} must be PoolRegions, got {type(pool).__name__}")
    if device_pool is None:
        raise TypeError("device_pool must be PoolRegions, got None")
    wire_request_id(request_id)
    _check_own_pools(manager, device_pool, host_pool)
    plan = export_prefix(manager, token_ids, max_tokens)
    try:
        if plan.num_host_blocks and host_pool is None:
            raise TransferError(
                f"{plan.num_host_blocks} blocks of the prefix are in the host tier: pass the host pool's regions"
            )
        message = {
            "request_id": wire_request_id(request_id),
            "blocks": plan.blocks.to_wire(),
            "on_host": plan.on_host().tolist(),
            "pool": device_pool.to_wire(),
            "host_pool": host_pool.to_wire() if host_pool is not None and plan.num_host_blocks else None,
        }
        return plan, json.dumps(message).encode()
    except Exception:
        plan.abort()
        raise


def _check_own_pools(manager: HybridBlockManager, device: PoolRegions, host: PoolRegions | None) -> None:
    """The regions an offer names must be this manager's pools: its layout, its device pool's
    blocks (with the null block) and its host pool's (without); :class:`TransferError` otherwise."""
    check_compatible(manager.layout, layout_signature(device.layout))
    if device.num_blocks != manager.layout.num_blocks or not device.null_block:
        raise TransferError(
            f"device_pool has {device.num_blocks} blocks (null block: {device.null_block}), the manager's device "
            f"pool {manager.layout.num_blocks} with the null block: pass that pool's regions"
        )
    if host is None:
        return
    check_compatible(manager.layout, layout_signature(host.layout))
    n_host = manager.host_pool.num_blocks if manager.host_pool is not None else 0
    if host.num_blocks != n_host or host.null_block:
        raise TransferError(
            f"host_pool has {host.num_blocks} blocks (null block: {host.null_block}), the manager's host pool "
            f"{n_host} without one: pass PoolRegions.block_major (or regions_of_pools) of that pool"
        )


def parse_prefix_offer(layout: Layout, data: bytes) -> PrefixOffer:
    """A prefix offer read and checked against ``layout`` before anything is reserved for it: the
    message, both pools (layout signatures, regions, planes) and the blocks (shape; each id inside
    the pool it names, no id twice within one pool). Raises :class:`TransferError`."""
    if not isinstance(layout, Layout):
        raise TypeError(f"parse_prefix_offer checks against a Layout, got {type(layout).__name__}")
    base = BlocksMessage.from_bytes(data)  # request id, blocks and the device pool, checked
    msg: dict[str, Any] = json.loads(bytes(data))
    on_host = msg.get("on_host")
    n = base.blocks.num_blocks
    if not isinstance(on_host, list) or len(on_host) != n or not all(type(v) is bool for v in on_host):
        raise TransferError(f"malformed prefix offer: on_host must be a list of {n} booleans")
    mask = np.array(on_host, dtype=bool)
    device = PoolRegions.from_wire(layout, base.pool)
    host_msg = msg.get("host_pool")
    if mask.any() and host_msg is None:
        raise TransferError("malformed prefix offer: blocks on the host but no host_pool")
    host = PoolRegions.from_wire(layout, host_msg) if host_msg is not None else None
    _check_shape(device, base.blocks, "the peer's blocks")
    ids = base.blocks.ids()
    _check_ids(device, ids[~mask], "the peer's blocks (device pool)", True)
    if host is not None:
        _check_ids(host, ids[mask], "the peer's blocks (host pool)", True)
    return PrefixOffer(base.request_id, base.blocks, mask, device, host)


def prefix_pairs(offer: PrefixOffer, dst_pool: PoolRegions, dst_blocks: RequestBlocks) -> TieredPairs:
    """The pairs of an offered prefix into ``dst_blocks`` of ``dst_pool``: from the peer's device
    pool and from its host pool."""
    host = offer.host_pool if offer.host_pool is not None else offer.device_pool
    return pair_tiered_descriptors(offer.device_pool, host, offer.blocks, offer.on_host, dst_pool, dst_blocks)


def pull_prefix(
    manager: HybridBlockManager, engine: TransferEngine, peer: str, offer: bytes, timeout_s: float
) -> TransferPlan:
    """Here (the pulling instance): import a request of the offered prefix's tokens, READ the
    device-resident part and then the host-resident part (the notification rides on the last READ),
    commit. The request runs here with ``num_tokens`` computed tokens: append the rest of its input.

    Raises :class:`TransferError` (a malformed or incompatible offer: nothing reserved; a failed
    READ: the import was aborted, unless ``in_flight``), any other exception of the engine (the
    import was aborted), or the manager's allocation errors (nothing reserved; the source should
    abort its export or retry)."""
    _check_manager(manager)
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    parsed = parse_prefix_offer(manager.layout, offer)
    plan = manager.import_request(parsed.request_id, parsed.blocks.num_tokens)
    try:
        pairs = prefix_pairs(parsed, engine.pool, plan.blocks)
        parts = [(p, r) for p, r in ((pairs.device, parsed.device_pool), (pairs.host, parsed.host_pool)) if len(p)]
        note = notification_for(parsed.request_id)
        for i, (part, remote) in enumerate(parts):
            assert remote is not None
            engine.read(peer, part, remote, note if i == len(parts) - 1 else b"", timeout_s)
    except Exception as e:
        _settle_failed(plan, e)
        raise
    plan.commit()
    return plan


def finish_prefix_export(
    engine: TransferEngine, peer: str, plan: PrefixExport, request_id: RequestId, timeout_s: float
) -> None:
    """Source side: wait for the peer's notification for ``request_id``, then drop the holds
    (commit). On a timeout (or any other exception of the engine) the export is aborted (the holds
    dropped just the same) and the error raised: the peer's READ failed or it is gone."""
    check_engine(engine)
    check_peer(peer)
    timeout_s = check_timeout(timeout_s)
    if not isinstance(plan, PrefixExport):
        raise TypeError(f"plan must be a PrefixExport, got {type(plan).__name__}")
    if plan.settled:
        raise TransferError("this prefix export is already settled: export the prefix again")
    try:
        engine.wait_notification(peer, notification_for(request_id), timeout_s)
    except Exception as e:
        if isinstance(e, TransferError) and e.in_flight:
            raise
        plan.abort()
        raise
    plan.commit()

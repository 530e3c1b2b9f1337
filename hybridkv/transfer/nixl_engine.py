"""NIXL adapter: a :class:`~hybridkv.transfer.engine.TransferEngine` over one NIXL agent.

Optional extra ``[transfer]``: ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (a plain
``pip install nixl`` pulls CUDA torch). NIXL is imported when an engine is made, so this module
imports without it. On a machine without RDMA set ``UCX_TLS=tcp UCX_NET_DEVICES=lo`` (loopback) or
the interface to use, before the agent starts.

How the NIXL calls map: the pool's regions are registered once (``register_memory``) before the
agent's metadata is taken, so the peer's ``add_remote_agent`` knows them; a transfer prepares both
descriptor lists (``prep_xfer_dlist``: local with ``NIXL_INIT_AGENT``, remote with the peer's name),
makes one prepped transfer over all indices with the notification, posts it and polls
``check_xfer_state`` until ``DONE`` (or ``ERR``, or the deadline); handles are released in every case.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hybridkv.transfer.descriptors import Descriptors, PoolRegions
from hybridkv.transfer.engine import Exchange, OneSidedEngine, importable
from hybridkv.transfer.errors import TransferError, TransferTimeoutError, TransferUnavailableError

_LOCAL = "NIXL_INIT_AGENT"


def nixl_available() -> bool:
    """Whether ``nixl`` imports here (tests skip without it)."""
    return importable("nixl._api")


def _kind(pool: PoolRegions) -> str:
    kinds = {r.kind.value for r in pool.regions}
    if len(kinds) != 1:
        raise TransferError(f"a pool's regions must all be one memory kind for NIXL, got {sorted(kinds)}")
    return kinds.pop()


def _regs(pool: PoolRegions) -> list[tuple[int, int, int, str]]:
    """``register_memory``'s list: ``(address, length, device_id, name)`` per region (DRAM regions
    carry device id 0, as NIXL's host segments do)."""
    return [(r.address, r.length, r.device_id, "") for r in pool.regions]


class NixlEngine(OneSidedEngine):
    """One NIXL agent named ``name`` with ``pool`` registered. ``backends``: NIXL backends (UCX).

    ``poll_interval_s``: sleep between state polls (0 spins; the notification and transfer polls
    both honour it). ``host_pool``: the instance's host pool (``PoolRegions.block_major``, DRAM),
    registered as well (its own ``register_memory`` call with its own memory type, as NIXL takes
    one type per registration), so a peer can READ the prefix blocks its host tier holds; this
    side's own transfers move into and out of ``pool``. Raises :class:`TransferUnavailableError`
    when nixl is not installed.
    """

    def __init__(
        self,
        name: str,
        pool: PoolRegions,
        backends: tuple[str, ...] = ("UCX",),
        poll_interval_s: float = 2e-4,
        host_pool: PoolRegions | None = None,
    ) -> None:
        if host_pool is not None and not isinstance(host_pool, PoolRegions):
            raise TypeError(f"host_pool must be PoolRegions or None, got {type(host_pool).__name__}")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise TransferUnavailableError(
                f"NIXL is not installed ({e}): pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy"
            ) from e
        self.name = name
        self.pool = pool
        self.poll_interval_s = poll_interval_s
        self._mem = _kind(pool)
        self.agent: Any = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self.host_pool = host_pool
        self._registrations: list[Any] = [self.agent.register_memory(_regs(pool), self._mem)]
        if host_pool is not None:  # before the metadata is taken: the peer learns both pools' memory
            self._registrations.append(self.agent.register_memory(_regs(host_pool), _kind(host_pool)))
        self._peers: set[str] = set()
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False

    # ---- peers ---------------------------------------------------------------------------------
    def connect(self, exchange: Exchange) -> str:
        peer = self.agent.add_remote_agent(exchange(self.agent.get_agent_metadata()))
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers.add(peer)
        return peer

    def disconnect(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            try:
                self.disconnect(peer)
            except Exception:  # noqa: BLE001 - a peer that vanished cannot be told; keep closing
                pass
        for registration in self._registrations:
            self.agent.deregister_memory(registration)

    # ---- transfers -----------------------------------------------------------------------------
    def _transfer(
        self,
        op: str,
        peer: str,
        local: Descriptors,
        remote_descs: Descriptors,
        remote: PoolRegions,
        notification: bytes,
        timeout_s: float,
    ) -> None:
        if not len(local):  # nothing to move (a KV-only request of 0 tokens): only the message
            if notification:
                self.agent.send_notif(peer, notification)
            return
        deadline = time.monotonic() + timeout_s
        handles: list[Any] = []
        xfer = None
        state = "ERR"
        try:
            local_h = self.agent.prep_xfer_dlist(_LOCAL, local.addresses(self.pool), self._mem)
            handles.append(local_h)
            remote_h = self.agent.prep_xfer_dlist(peer, remote_descs.addresses(remote), _kind(remote))
            handles.append(remote_h)
            index = np.arange(len(local), dtype=np.int32)
            xfer = self.agent.make_prepped_xfer(op, local_h, index, remote_h, index, notification)
            state = self.agent.transfer(xfer)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"{op} of {len(local)} descriptors ({local.num_bytes} bytes) with {peer!r} did not finish "
                        f"in {timeout_s} s: is the peer alive? raise timeout_s for slow links"
                    )
                if self.poll_interval_s:
                    time.sleep(self.poll_interval_s)
                state = self.agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(
                    f"{op} of {len(local)} descriptors with {peer!r} failed (NIXL state {state}): the peer may be "
                    "gone or its registration changed; abort the plans and reconnect"
                )
        except TransferError as e:
            e.in_flight = not self._release(xfer, handles)
            xfer = None
            raise
        except Exception as e:  # NIXL raises its own errors for bad descriptors or peers
            cancelled = self._release(xfer, handles)
            raise TransferError(f"{op} with {peer!r} failed: {e}", in_flight=not cancelled) from e
        self._release(xfer, handles)

    def _release(self, xfer: Any, handles: list[Any]) -> bool:
        """Release the transfer (NIXL cancels it if active) and the lists; False if it could not cancel."""
        cancelled = True
        if xfer is not None:
            try:
                self.agent.release_xfer_handle(xfer)
            except Exception:  # noqa: BLE001 - an active transfer NIXL cannot cancel
                cancelled = False
        for h in handles:
            try:
                self.agent.release_dlist_handle(h)
            except Exception:  # noqa: BLE001 - still used by the uncancelled transfer
                cancelled = False
        handles.clear()
        return cancelled

    # ---- notifications -------------------------------------------------------------------------
    def take_notification(self, peer: str, notification: bytes) -> bool:
        for name, msgs in self.agent.get_new_notifs().items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            self._notifs.setdefault(key, []).extend(msgs)
        got = self._notifs.get(peer, [])
        if notification in got:
            got.remove(notification)
            return True
        return False

    def wait_notification(self, peer: str, notification: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.take_notification(peer, notification):
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"no notification {notification!r} from {peer!r} in {timeout_s} s: the peer's transfer failed "
                    "or the peer is gone; abort the plan"
                )
            if self.poll_interval_s:
                time.sleep(self.poll_interval_s)

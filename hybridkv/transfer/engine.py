"""The interface every transfer engine adapter implements (NIXL first, Mooncake Transfer Engine second).

An engine is one side: it registers its pool's regions once, learns peers through a metadata
exchange the serving engine provides (``exchange(local_metadata) -> peer_metadata``: a pipe, a
ZMQ socket, an etcd key...), and moves :class:`~hybridkv.transfer.descriptors.DescriptorPairs`
one-sided, with a notification the other side can wait for.

Contract (what raises, what is left behind):

- ``read`` / ``write`` return once every byte moved, or raise :class:`TransferError` (the engine
  reported a failure; a dead peer) or :class:`TransferTimeoutError` (``timeout_s`` passed). Either
  way the engine released the transfer's handles; ``error.in_flight`` is True only when the engine
  could not cancel a transfer that may still write: then the destination's blocks must not be
  reused (do not abort the import plan; drop the connection first).
- ``wait_notification`` returns when the peer's message arrived, or raises
  :class:`TransferTimeoutError`; ``take_notification`` polls once. The message is consumed.
- ``close`` releases everything (registrations, peers); an engine is a context manager.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Container

import numpy as np

from hybridkv.transfer.descriptors import DescriptorPairs, Descriptors, PoolRegions
from hybridkv.transfer.errors import TransferError


def importable(module: str) -> bool:
    """Whether an engine's Python module imports here (adapters import theirs lazily; tests skip without)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


Exchange = Callable[[bytes], bytes]
"""Sends this side's metadata to the peer and returns the peer's (both sides call it once)."""


class TransferEngine(abc.ABC):
    """One side of a transfer: ``pool`` (this side's registered regions), peers by name."""

    pool: PoolRegions
    name: str

    @abc.abstractmethod
    def connect(self, exchange: Exchange) -> str:
        """Swap metadata with a peer through ``exchange``; returns the peer's name."""

    @abc.abstractmethod
    def read(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        """Pull ``pairs.src`` (the peer's pool ``remote``) into ``pairs.dst`` (this pool); the peer
        receives ``notification`` once the bytes are here (empty: none)."""

    @abc.abstractmethod
    def write(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        """Push ``pairs.src`` (this pool) into ``pairs.dst`` (the peer's pool ``remote``); the peer
        receives ``notification`` once the bytes are there (empty: none)."""

    @abc.abstractmethod
    def take_notification(self, peer: str, notification: bytes) -> bool:
        """Non-blocking: whether ``peer`` sent exactly ``notification`` (consumed if so). For serving
        loops that poll once per step instead of waiting."""

    @abc.abstractmethod
    def wait_notification(self, peer: str, notification: bytes, timeout_s: float) -> None:
        """Block until ``peer`` sent exactly ``notification``."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget ``peer`` (its metadata, connections); later transfers to it fail."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister the pool and drop every peer; idempotent."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OneSidedEngine(TransferEngine):
    """An engine whose ``read`` and ``write`` are one ``_transfer(op, ...)`` with this side's and the
    peer's descriptors in the order the engine's call takes them (NIXL, Mooncake). The peer and the
    pairs are checked here, once for every such engine."""

    _peers: Container[str]

    def read(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._checked("READ", peer, pairs.dst, pairs.src, remote, notification, timeout_s)

    def write(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._checked("WRITE", peer, pairs.src, pairs.dst, remote, notification, timeout_s)

    def _checked(
        self,
        op: str,
        peer: str,
        local: Descriptors,
        remote_descs: Descriptors,
        remote: PoolRegions,
        notification: bytes,
        timeout_s: float,
    ) -> None:
        if peer not in self._peers:
            raise TransferError(f"{op} to unknown peer {peer!r}: connect() to it first")
        if len(local) != len(remote_descs) or not np.array_equal(local.length, remote_descs.length):
            raise TransferError(f"{op}: local and remote descriptors differ in count or lengths")
        self._transfer(op, peer, local, remote_descs, remote, notification, timeout_s)

    @abc.abstractmethod
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
        """Move ``local`` <-> ``remote_descs`` (``op``: "READ" pulls, "WRITE" pushes), checked pairs."""

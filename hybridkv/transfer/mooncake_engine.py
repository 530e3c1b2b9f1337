"""Mooncake Transfer Engine adapter: the same :class:`~hybridkv.transfer.engine.TransferEngine` contract.

Install (no GPU): ``apt-get install --no-install-recommends libibverbs1`` (never ``ibverbs-providers``)
and ``pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1``; the CUDA wheel needs
CUDA to import. The engine runs in ``P2PHANDSHAKE`` mode (no metadata server): a peer is named by its
``host:rpc_port`` session, which the metadata exchange carries; remote addresses travel in the offer
(Mooncake takes raw ``(local, remote, length)`` triples).

How the calls map: regions are registered with ``batch_register_memory``; a transfer posts the
descriptors in batches of at most ``max_batch`` (Mooncake's TCP transport rejects a batch of 4,096 by
default: its per-peer queue holds 2,048) with ``batch_transfer_async_read/write``, waits for each with
``get_batch_transfer_status`` (0 done, negative failed), and carries the notification on a last
``batch_transfer_sync`` of the final descriptor (idempotent: the same bytes again), the only call
that takes one. Mooncake's waits cannot be cancelled, so they run on a worker thread and the caller
waits at most ``timeout_s``; a timeout then reports ``in_flight=True``.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

from hybridkv.transfer.descriptors import Descriptors, MemoryKind, PoolRegions
from hybridkv.transfer.engine import Exchange, OneSidedEngine, importable
from hybridkv.transfer.errors import TransferError, TransferTimeoutError, TransferUnavailableError

DEFAULT_MAX_BATCH = 1024


def mooncake_available() -> bool:
    """Whether Mooncake's engine imports here (tests skip without it)."""
    return importable("mooncake.engine")


def _as_str(notification: bytes) -> str:
    return notification.decode("latin-1")


class MooncakeEngine(OneSidedEngine):
    """One Mooncake engine on ``hostname`` (its RPC port is picked by Mooncake) with ``pool`` registered.

    ``protocol``: ``"tcp"`` (or ``"rdma"`` with ``device_name``). ``host_pool``: the instance's host
    pool (DRAM), registered as well so a peer can READ the prefix blocks its host tier holds; Mooncake
    takes no memory kind (``batch_register_memory`` registers with its wildcard location, and the
    engine finds whether an address is host or GPU memory itself: ``TransferEngine::registerLocalMemory``
    in kvcache-ai/Mooncake). Raises :class:`TransferUnavailableError` when Mooncake is not installed,
    :class:`TransferError` when it does not start.
    """

    def __init__(
        self,
        name: str,
        pool: PoolRegions,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch: int = DEFAULT_MAX_BATCH,
        host_pool: PoolRegions | None = None,
    ) -> None:
        if host_pool is not None and not isinstance(host_pool, PoolRegions):
            raise TypeError(f"host_pool must be PoolRegions or None, got {type(host_pool).__name__}")
        try:
            from mooncake.engine import TransferEngine as _Engine
            from mooncake.engine import TransferNotify, TransferOpcode
        except ImportError as e:
            raise TransferUnavailableError(
                f"Mooncake Transfer Engine is not installed ({e}): pip install --no-deps "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1 "
                "(and apt-get install --no-install-recommends libibverbs1)"
            ) from e
        pools = (pool,) if host_pool is None else (pool, host_pool)
        if any(r.kind is not MemoryKind.DRAM for p in pools for r in p.regions) and protocol == "tcp":
            raise TransferError("Mooncake over TCP moves host memory here: register DRAM pools (or use rdma)")
        self.name, self.pool, self.max_batch, self.host_pool = name, pool, max_batch, host_pool
        self._notify_cls, self._opcode = TransferNotify, TransferOpcode
        self.engine: Any = _Engine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake engine did not start on {hostname!r} over {protocol} (code {rc})")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        regions = [r for p in pools for r in p.regions]
        addresses, lengths = [r.address for r in regions], [r.length for r in regions]
        if self.engine.batch_register_memory(addresses, lengths) != 0:
            raise TransferError(f"Mooncake could not register the pool's {len(addresses)} regions")
        self._registered = addresses
        self._peers: dict[str, str] = {}  # peer name -> its session "host:port"
        self._notifs: list[tuple[str, str]] = []
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mooncake-{name}")
        self._closed = False

    # ---- peers ---------------------------------------------------------------------------------
    def connect(self, exchange: Exchange) -> str:
        peer = json.loads(exchange(json.dumps({"name": self.name, "session": self.session}).encode()))
        self._peers[peer["name"]] = peer["session"]
        return peer["name"]

    def disconnect(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        self._worker.shutdown(wait=False, cancel_futures=True)
        for address in self._registered:
            self.engine.unregister_memory(address)

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
        session = self._peers[peer]  # a known peer: OneSidedEngine checked
        if not len(local):
            raise TransferError(f"{op} of no bytes: Mooncake carries a notification only with a transfer")
        mine = local.addresses(self.pool)[:, 0].tolist()
        theirs = remote_descs.addresses(remote)[:, 0].tolist()
        lengths = local.length.tolist()
        job = self._worker.submit(self._run, op, session, mine, theirs, lengths, notification)
        try:
            job.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TransferTimeoutError(
                f"{op} of {len(local)} descriptors ({local.num_bytes} bytes) with {peer!r} did not finish in "
                f"{timeout_s} s: is the peer alive? Mooncake cannot cancel it",
                in_flight=True,
            ) from None

    def _run(self, op: str, session: str, mine: list, theirs: list, lengths: list, notification: bytes) -> None:
        post = self.engine.batch_transfer_async_read if op == "READ" else self.engine.batch_transfer_async_write
        last = len(lengths) - 1 if notification else len(lengths)
        for start in range(0, last, self.max_batch):
            end = min(start + self.max_batch, last)
            batch = post(session, mine[start:end], theirs[start:end], lengths[start:end])
            if not batch or self.engine.get_batch_transfer_status([batch]) != 0:
                raise TransferError(
                    f"{op} of descriptors {start}..{end - 1} with {session} failed: the peer may be gone; "
                    "abort the plans and reconnect"
                )
        if notification:
            opcode = self._opcode.Read if op == "READ" else self._opcode.Write
            note = self._notify_cls(self.name, _as_str(notification))
            rc = self.engine.batch_transfer_sync(session, mine[last:], theirs[last:], lengths[last:], opcode, note)
            if rc != 0:
                raise TransferError(f"{op} with {session} failed at its last descriptor (code {rc})")

    # ---- notifications -------------------------------------------------------------------------
    def take_notification(self, peer: str, notification: bytes) -> bool:
        self._notifs.extend((n.name, n.msg) for n in self.engine.get_notifies())
        key = (peer, _as_str(notification))
        if key in self._notifs:
            self._notifs.remove(key)
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
            time.sleep(2e-4)

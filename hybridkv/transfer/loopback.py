"""The reference transfer: copy a request's bytes by descriptors between buffers of one process.

The engines (NIXL, Mooncake) move the same descriptors between machines; this copy is what they
must equal byte for byte, and what tests and the simulator use without a network. Buffers are
1-D uint8 numpy arrays, one per registered region, in ``PoolRegions.regions`` order.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np

from hybridkv.blockmgr.layout import Layout
from hybridkv.transfer.descriptors import DescriptorPairs, Descriptors, MemoryKind, PoolRegions
from hybridkv.transfer.engine import Exchange, TransferEngine
from hybridkv.transfer.errors import TransferError, TransferTimeoutError


def pool_array(layout: Layout, num_blocks: int | None = None, fill: int = 0) -> np.ndarray:
    """A host pool as numpy: uint8 ``[group_size, num_segments, num_blocks, segment_bytes]``, the
    ``ops`` device-pool layout. The caller owns it and must keep it alive while it is registered."""
    n = layout.num_blocks if num_blocks is None else num_blocks
    return np.full((layout.group_size, layout.num_segments, n, layout.segment_bytes), fill, dtype=np.uint8)


def regions_of_array(layout: Layout, pool: np.ndarray) -> PoolRegions:
    """:class:`PoolRegions` of a :func:`pool_array` (one region: the array's memory)."""
    if not pool.flags.c_contiguous or pool.dtype != np.uint8 or pool.ndim != 4:
        raise ValueError("expected a C-contiguous uint8 [group_size, num_segments, num_blocks, segment_bytes] array")
    return PoolRegions.contiguous(layout, pool.ctypes.data, pool.shape[2], 0, MemoryKind.DRAM)


def regions_of_pools(pools: Any) -> PoolRegions:
    """:class:`PoolRegions` of an ``hybridkv.ops.BlockPools`` (torch or paddle; host or device memory).

    Device (slot-major) pools only: one region over the backing tensor.
    """
    pools.require_slot_major("regions_of_pools")
    t = pools.torch_data
    kind = MemoryKind.VRAM if t.device.type == "cuda" else MemoryKind.DRAM
    return PoolRegions.contiguous(pools.layout, t.data_ptr(), pools.num_blocks, t.device.index or 0, kind)


def copy_pairs(src: list[np.ndarray], dst: list[np.ndarray], pairs: DescriptorPairs) -> None:
    """Copy ``src`` region bytes to ``dst`` region bytes, descriptor pair by pair (``[N]`` of each)."""
    s, d = pairs
    for sr, so, n, dr, do in zip(
        s.region.tolist(), s.offset.tolist(), s.length.tolist(), d.region.tolist(), d.offset.tolist(), strict=True
    ):
        dst[dr][do : do + n] = src[sr][so : so + n]


def gather_bytes(buffers: list[np.ndarray], descs: Descriptors) -> bytes:
    """The bytes ``descs`` name, concatenated in descriptor order."""
    return b"".join(
        buffers[r][o : o + n].tobytes()
        for r, o, n in zip(descs.region.tolist(), descs.offset.tolist(), descs.length.tolist(), strict=True)
    )


def sha256(buffers: list[np.ndarray], descs: Descriptors) -> str:
    """SHA-256 (hex) of :func:`gather_bytes`; equal on both sides after a correct transfer."""
    h = hashlib.sha256()
    for r, o, n in zip(descs.region.tolist(), descs.offset.tolist(), descs.length.tolist(), strict=True):
        h.update(buffers[r][o : o + n].data)
    return h.hexdigest()


def covered_mask(pool: PoolRegions, descs: Descriptors) -> list[np.ndarray]:
    """Per region, a bool mask of the bytes ``descs`` name (to check every other byte is untouched)."""
    masks = [np.zeros(r.length, dtype=bool) for r in pool.regions]
    for r, o, n in zip(descs.region.tolist(), descs.offset.tolist(), descs.length.tolist(), strict=True):
        masks[r][o : o + n] = True
    return masks


def _check_bounds(pool: PoolRegions, descs: Descriptors, side: str) -> None:
    lengths = np.array([r.length for r in pool.regions], dtype=np.int64)
    if len(descs) and ((descs.offset < 0).any() or (descs.offset + descs.length > lengths[descs.region]).any()):
        raise TransferError(f"{side} descriptors run past their regions: the pool layout or block ids are wrong")
    if any(r.kind is not MemoryKind.DRAM for r in pool.regions):
        raise TransferError(f"{side}: the loopback engine copies host (DRAM) memory of this process only")


class LoopbackHub:
    """Engines of one process that can reach each other, and their undelivered notifications."""

    def __init__(self) -> None:
        self.engines: dict[str, LoopbackEngine] = {}
        self.notifications: dict[str, list[tuple[str, bytes]]] = {}  # receiver -> [(sender, message)]


class LoopbackEngine(TransferEngine):
    """A :class:`TransferEngine` between pools of one process (``memmove`` by address): the hand-off
    logic runs unchanged in tests and in the simulator without a network. DRAM pools only; every
    descriptor is bounds-checked against its region before a byte moves."""

    def __init__(self, name: str, pool: PoolRegions, hub: LoopbackHub) -> None:
        if name in hub.engines:
            raise TransferError(f"an engine named {name!r} is already on this hub: use a new name")
        self.name, self.pool, self.hub = name, pool, hub
        self._peers: set[str] = set()
        hub.engines[name] = self
        hub.notifications[name] = []

    def connect(self, exchange: Exchange) -> str:
        peer = exchange(self.name.encode()).decode()
        if peer not in self.hub.engines:
            raise TransferError(f"no engine {peer!r} on this hub")
        self._peers.add(peer)
        return peer

    def _move(self, peer: str, src: tuple[PoolRegions, Descriptors], dst: tuple[PoolRegions, Descriptors]) -> None:
        if peer not in self._peers or peer not in self.hub.engines:
            raise TransferError(f"peer {peer!r} is not connected (or closed): connect() to it first")
        _check_bounds(*src, "source")
        _check_bounds(*dst, "destination")
        if not np.array_equal(src[1].length, dst[1].length):
            raise TransferError("source and destination descriptors differ in lengths")
        s, d = src[1].addresses(src[0]), dst[1].addresses(dst[0])
        for (sa, n, _), (da, _, _) in zip(s.tolist(), d.tolist(), strict=True):
            ctypes.memmove(da, sa, n)

    def read(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._move(peer, (remote, pairs.src), (self.pool, pairs.dst))
        if notification:
            self.hub.notifications[peer].append((self.name, notification))

    def write(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._move(peer, (self.pool, pairs.src), (remote, pairs.dst))
        if notification:
            self.hub.notifications[peer].append((self.name, notification))

    def take_notification(self, peer: str, notification: bytes) -> bool:
        box = self.hub.notifications.get(self.name, [])
        if (peer, notification) in box:
            box.remove((peer, notification))
            return True
        return False

    def wait_notification(self, peer: str, notification: bytes, timeout_s: float) -> None:
        if not self.take_notification(peer, notification):  # one process: nothing arrives while we wait
            raise TransferTimeoutError(f"no notification {notification!r} from {peer!r}")

    def disconnect(self, peer: str) -> None:
        self._peers.discard(peer)

    def close(self) -> None:
        self._peers.clear()
        if self.hub.engines.get(self.name) is self:
            del self.hub.engines[self.name]


def connect_pair(a: LoopbackEngine, b: LoopbackEngine) -> None:
    """Connect two engines of one hub both ways."""
    a.connect(lambda _: b.name.encode())
    b.connect(lambda _: a.name.encode())

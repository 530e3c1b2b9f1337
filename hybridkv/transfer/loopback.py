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

from hybridkv.planner.layout import Layout
from hybridkv.transfer.descriptors import DescriptorPairs, Descriptors, MemoryKind, PoolRegions
from hybridkv.transfer.engine import Exchange, TransferEngine
from hybridkv.transfer.errors import TransferError, TransferTimeoutError


def pool_array(layout: Layout, num_blocks: int | None = None, fill: int = 0) -> np.ndarray:
    """A host pool as numpy: uint8 ``[group_size, num_segments, num_blocks, segment_bytes]``, the
    ``ops`` device-pool layout. :func:`regions_of_array` regions hold a reference to it, so an engine
    that registered them keeps it alive."""
    n = layout.num_blocks if num_blocks is None else num_blocks
    return np.full((layout.group_size, layout.num_segments, n, layout.segment_bytes), fill, dtype=np.uint8)


def regions_of_array(layout: Layout, pool: np.ndarray) -> PoolRegions:
    """:class:`PoolRegions` of a :func:`pool_array` (one region: the array's memory, which the regions
    keep alive: ``owner`` is the array)."""
    if not isinstance(pool, np.ndarray):
        raise TypeError(f"regions_of_array takes a numpy array, got {type(pool).__name__}")
    if not pool.flags.c_contiguous or pool.dtype != np.uint8 or pool.ndim != 4:
        raise ValueError("expected a C-contiguous uint8 [group_size, num_segments, num_blocks, segment_bytes] array")
    if pool.shape[:2] != (layout.group_size, layout.num_segments) or pool.shape[3] != layout.segment_bytes:
        raise ValueError(
            f"array of shape {list(pool.shape)} does not match the layout's [group_size, num_segments, num_blocks, "
            f"segment_bytes] = {[layout.group_size, layout.num_segments, 'n', layout.segment_bytes]}"
        )
    return PoolRegions.contiguous(layout, pool.ctypes.data, pool.shape[2], 0, MemoryKind.DRAM, owner=pool)


def host_pool_array(layout: Layout, num_blocks: int, fill: int = 0) -> np.ndarray:
    """A host pool as numpy: uint8 ``[num_blocks, group_size, num_segments, segment_bytes]``, the
    block-major layout of ``ops.allocate_host_pools`` (ids ``0..num_blocks-1``, no null block)."""
    return np.full((num_blocks, layout.group_size, layout.num_segments, layout.segment_bytes), fill, dtype=np.uint8)


def regions_of_host_array(layout: Layout, pool: np.ndarray) -> PoolRegions:
    """:class:`PoolRegions` of a :func:`host_pool_array` (one DRAM region, block-major; ``owner``
    is the array)."""
    if not isinstance(pool, np.ndarray):
        raise TypeError(f"regions_of_host_array takes a numpy array, got {type(pool).__name__}")
    if not pool.flags.c_contiguous or pool.dtype != np.uint8 or pool.ndim != 4:
        raise ValueError("expected a C-contiguous uint8 [num_blocks, group_size, num_segments, segment_bytes] array")
    if pool.shape[1:] != (layout.group_size, layout.num_segments, layout.segment_bytes):
        raise ValueError(
            f"array of shape {list(pool.shape)} does not match the layout's [num_blocks, group_size, num_segments, "
            f"segment_bytes] = {['n', layout.group_size, layout.num_segments, layout.segment_bytes]}"
        )
    return PoolRegions.block_major(layout, pool.ctypes.data, pool.shape[0], 0, MemoryKind.DRAM, owner=pool)


def regions_of_pools(pools: Any) -> PoolRegions:
    """:class:`PoolRegions` of an ``hybridkv.ops.BlockPools`` (torch or paddle; host or device memory).

    One region over the backing tensor: a device pool (``allocate_pools``, slot-major; VRAM on a
    GPU) or a host pool (``allocate_host_pools``, block-major, pinned or not: DRAM, device id 0, as
    NIXL's ``DRAM_SEG`` and Mooncake's ``cpu`` locations name host memory). The regions keep
    ``pools`` alive (``owner``).
    """
    t = pools.torch_data
    kind = MemoryKind.VRAM if t.device.type == "cuda" else MemoryKind.DRAM
    if pools.block_major:
        return PoolRegions.block_major(pools.layout, t.data_ptr(), pools.num_blocks, 0, MemoryKind.DRAM, owner=pools)
    return PoolRegions.contiguous(pools.layout, t.data_ptr(), pools.num_blocks, t.device.index or 0, kind, owner=pools)


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


def _check_registered(registered: tuple[PoolRegions, ...], pool: PoolRegions, descs: Descriptors, side: str) -> None:
    """Every byte ``descs`` name (addressed through ``pool``, which came from a message) must lie in a
    region the owning engine registered: a wrong address in an offer is refused, never copied."""
    if not len(descs):
        return
    a = descs.addresses(pool)
    start, end = a[:, 0], a[:, 0] + a[:, 1]
    inside = np.zeros(len(descs), dtype=bool)
    for r in (r for p in registered for r in p.regions):
        inside |= (start >= np.uint64(r.address)) & (end <= np.uint64(r.address + r.length))
    if not inside.all():
        raise TransferError(
            f"{side} descriptors name memory the peer did not register: the peer's pool message is wrong or stale"
        )


class LoopbackEngine(TransferEngine):
    """A :class:`TransferEngine` between pools of one process (``memmove`` by address): the hand-off
    logic runs unchanged in tests and in the simulator without a network. DRAM pools only; every
    descriptor is bounds-checked against its region, and a peer's descriptors against the regions
    that peer registered, before a byte moves.

    The engine holds ``pool`` (and so its ``owner``, the memory) while it is registered; the peers
    it reaches are held by the hub until they close. ``host_pool``: the instance's host pool,
    registered too, so a peer can READ the blocks its prefix cache's host tier holds (this side's
    own transfers still move into and out of ``pool``).
    """

    def __init__(self, name: str, pool: PoolRegions, hub: LoopbackHub, host_pool: PoolRegions | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"an engine name must be a non-empty str, got {name!r}")
        if not isinstance(pool, PoolRegions):
            raise TypeError(f"pool must be PoolRegions, got {type(pool).__name__}")
        if host_pool is not None and not isinstance(host_pool, PoolRegions):
            raise TypeError(f"host_pool must be PoolRegions or None, got {type(host_pool).__name__}")
        if not isinstance(hub, LoopbackHub):
            raise TypeError(f"hub must be a LoopbackHub, got {type(hub).__name__}")
        if name in hub.engines:
            raise TransferError(f"an engine named {name!r} is already on this hub: use a new name")
        self.name, self.pool, self.hub, self.host_pool = name, pool, hub, host_pool
        self._peers: set[str] = set()
        hub.engines[name] = self
        hub.notifications[name] = []

    @property
    def registered(self) -> tuple[PoolRegions, ...]:
        """The pools whose memory peers may read or write: the pool, and the host pool if given."""
        return (self.pool,) if self.host_pool is None else (self.pool, self.host_pool)

    def connect(self, exchange: Exchange) -> str:
        if not callable(exchange):
            raise TypeError(f"exchange must be a callable(bytes) -> bytes, got {type(exchange).__name__}")
        peer = exchange(self.name.encode()).decode()
        if peer not in self.hub.engines:
            raise TransferError(f"no engine {peer!r} on this hub")
        self._peers.add(peer)
        return peer

    @staticmethod
    def _check_args(peer: object, pairs: object, remote: object, notification: object, timeout_s: object) -> None:
        if not isinstance(peer, str):
            raise TypeError(f"peer must be a str, got {type(peer).__name__}")
        if not isinstance(pairs, DescriptorPairs):
            raise TypeError(f"pairs must be DescriptorPairs, got {type(pairs).__name__}")
        if not isinstance(remote, PoolRegions):
            raise TypeError(f"remote must be PoolRegions, got {type(remote).__name__}")
        if not isinstance(notification, bytes):
            raise TypeError(f"notification must be bytes, got {type(notification).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise TypeError(f"timeout_s must be a number, got {timeout_s!r}")

    def _move(
        self, peer: str, src: tuple[PoolRegions, Descriptors], dst: tuple[PoolRegions, Descriptors], op: str
    ) -> None:
        if peer not in self._peers or peer not in self.hub.engines:
            raise TransferError(f"peer {peer!r} is not connected (or closed): connect() to it first")
        _check_bounds(*src, "source")
        _check_bounds(*dst, "destination")
        remote, side = (src, "source") if op == "READ" else (dst, "destination")
        _check_registered(self.hub.engines[peer].registered, *remote, side)
        if not np.array_equal(src[1].length, dst[1].length):
            raise TransferError("source and destination descriptors differ in lengths")
        s, d = src[1].addresses(src[0]), dst[1].addresses(dst[0])
        for (sa, n, _), (da, _, _) in zip(s.tolist(), d.tolist(), strict=True):
            ctypes.memmove(da, sa, n)

    def read(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._check_args(peer, pairs, remote, notification, timeout_s)
        self._move(peer, (remote, pairs.src), (self.pool, pairs.dst), "READ")
        if notification:
            self.hub.notifications[peer].append((self.name, notification))

    def write(
        self, peer: str, pairs: DescriptorPairs, remote: PoolRegions, notification: bytes, timeout_s: float
    ) -> None:
        self._check_args(peer, pairs, remote, notification, timeout_s)
        self._move(peer, (self.pool, pairs.src), (remote, pairs.dst), "WRITE")
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

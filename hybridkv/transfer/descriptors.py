"""Descriptors of a request's bytes: from a layout, the pool's base addresses and the request's block ids.

A pool (``hybridkv.ops.allocate_pools``) is laid out ``[group_size, num_segments, num_blocks,
segment_bytes]``: every (layer slot, segment) pair is a **plane** of ``num_blocks`` pieces of
``segment_bytes``, and block ``b`` of plane ``(slot, seg)`` starts ``b * segment_bytes`` into it. A
request's bytes are, in every plane that holds one of its layers, its KV blocks (whole pieces, in KV
slots) and its live state sets (state slots, cut to the layer's real state bytes: a state's last
block may be partly unused, and in a plane where it is unused it is left out).

Source and destination ids differ, so descriptors come in pairs (:class:`DescriptorPairs`), piece
by piece in the same order, then coalesced: two neighbouring pieces merge when they are adjacent in
memory on *both* sides, so a request that is one id run on both machines is one descriptor per
plane (or fewer, when planes sit back to back in one region). Lengths match pair by pair.

Framework-free: base addresses come from the caller (``regions_from_pools`` for ``ops`` pools).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.layout import Layout
from hybridkv.blockmgr.spec import RecurrentLayerSpec
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.transfer.errors import TransferError


class MemoryKind(enum.Enum):
    DRAM = "DRAM"  # host memory
    VRAM = "VRAM"  # device (GPU) memory


class Region(NamedTuple):
    """One registered memory range: ``length`` bytes at ``address`` on ``device_id``."""

    address: int
    length: int
    device_id: int = 0
    kind: MemoryKind = MemoryKind.DRAM


def layout_signature(layout: Layout) -> dict[str, Any]:
    """What two sides must agree on to exchange blocks (everything but the number of blocks)."""
    layers = []
    for group in layout.groups:
        for layer_id in group.layer_ids:
            layer = layout.model.layers[layer_id] if layer_id is not None else None
            layers.append(layer.state_bytes if isinstance(layer, RecurrentLayerSpec) else layer_id is not None)
    return {
        "model": layout.model.name,
        "tp_size": layout.model.tp_size,
        "block_size": layout.block_size,
        "group_size": layout.group_size,
        "num_segments": layout.num_segments,
        "segment_bytes": layout.segment_bytes,
        "groups": [[g.kind.value, g.blocks_per_state, len(g.layer_ids)] for g in layout.groups],
        "layers": layers,
    }


@dataclass(frozen=True, eq=False)
class PoolRegions:
    """Where one side's pool lives: its registered regions and, per plane, where block 0 starts.

    ``plane_region[slot, seg]`` indexes ``regions``; ``plane_offset[slot, seg]`` is the byte offset of
    block 0 of that plane inside it. Built by :meth:`contiguous` (one ``ops`` pool tensor),
    :meth:`per_slot` (one ``[num_segments, num_blocks, segment_bytes]`` tensor per layer slot) or
    :meth:`per_plane` (one ``[num_blocks, segment_bytes]`` tensor per slot and segment, as engines
    that keep separate K and V caches per layer have).
    """

    layout: Layout
    num_blocks: int
    regions: tuple[Region, ...]
    plane_region: np.ndarray  # int64 [group_size, num_segments]
    plane_offset: np.ndarray  # int64 [group_size, num_segments]

    @staticmethod
    def contiguous(
        layout: Layout, address: int, num_blocks: int | None = None, device_id: int = 0, kind: MemoryKind | str = "DRAM"
    ) -> PoolRegions:
        n = layout.num_blocks if num_blocks is None else num_blocks
        slot, seg = np.meshgrid(np.arange(layout.group_size), np.arange(layout.num_segments), indexing="ij")
        offset = (slot * layout.num_segments + seg) * n * layout.segment_bytes
        region = Region(
            address, layout.group_size * layout.num_segments * n * layout.segment_bytes, device_id, MemoryKind(kind)
        )
        return PoolRegions(layout, n, (region,), np.zeros_like(offset, dtype=np.int64), offset.astype(np.int64))

    @staticmethod
    def per_slot(
        layout: Layout,
        addresses: list[int],
        num_blocks: int | None = None,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
    ) -> PoolRegions:
        n = layout.num_blocks if num_blocks is None else num_blocks
        if len(addresses) != layout.group_size:
            raise TransferError(
                f"per_slot needs one address per layer slot ({layout.group_size}), got {len(addresses)}"
            )
        size = layout.num_segments * n * layout.segment_bytes
        regions = tuple(Region(a, size, device_id, MemoryKind(kind)) for a in addresses)
        slot, seg = np.meshgrid(np.arange(layout.group_size), np.arange(layout.num_segments), indexing="ij")
        return PoolRegions(layout, n, regions, slot.astype(np.int64), (seg * n * layout.segment_bytes).astype(np.int64))

    @staticmethod
    def per_plane(
        layout: Layout,
        addresses: list[list[int]],
        num_blocks: int | None = None,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
    ) -> PoolRegions:
        n = layout.num_blocks if num_blocks is None else num_blocks
        grid = np.asarray(addresses, dtype=np.int64)
        if grid.shape != (layout.group_size, layout.num_segments):
            raise TransferError(
                f"per_plane needs [group_size, num_segments] = {[layout.group_size, layout.num_segments]} "
                f"addresses, got shape {list(grid.shape)}"
            )
        regions = tuple(Region(int(a), n * layout.segment_bytes, device_id, MemoryKind(kind)) for a in grid.ravel())
        index = np.arange(grid.size, dtype=np.int64).reshape(grid.shape)
        return PoolRegions(layout, n, regions, index, np.zeros_like(index))

    # ---- the wire ------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """Plain data a peer needs to address this pool (with :func:`layout_signature` to check)."""
        return {
            "signature": layout_signature(self.layout),
            "num_blocks": self.num_blocks,
            "regions": [[r.address, r.length, r.device_id, r.kind.value] for r in self.regions],
            "plane_region": self.plane_region.tolist(),
            "plane_offset": self.plane_offset.tolist(),
        }

    @staticmethod
    def from_wire(layout: Layout, msg: dict[str, Any]) -> PoolRegions:
        """The peer's pool, checked against ``layout`` (raises :class:`TransferError` on a mismatch)."""
        check_compatible(layout, msg["signature"])
        regions = tuple(Region(int(a), int(n), int(d), MemoryKind(k)) for a, n, d, k in msg["regions"])
        return PoolRegions(
            layout,
            int(msg["num_blocks"]),
            regions,
            np.asarray(msg["plane_region"], dtype=np.int64),
            np.asarray(msg["plane_offset"], dtype=np.int64),
        )


def check_compatible(layout: Layout, peer_signature: dict[str, Any]) -> None:
    """Raise :class:`TransferError` unless the peer's layout moves blocks of the same shape as ``layout``."""
    mine = layout_signature(layout)
    diff = [k for k in mine if mine[k] != peer_signature.get(k)]
    if diff:
        details = ", ".join(f"{k}: here {mine[k]!r}, peer {peer_signature.get(k)!r}" for k in diff)
        raise TransferError(
            f"the peer's pool layout differs ({details}): both sides need the same model, TP size, block size "
            "and layout kind (only the number of blocks may differ)"
        )


class Descriptors(NamedTuple):
    """int64 arrays ``[N]`` of one side: ``region`` (index into ``PoolRegions.regions``), byte
    ``offset`` inside it, ``length`` in bytes."""

    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:  # type: ignore[override]
        return int(self.length.size)

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum())

    def addresses(self, pool: PoolRegions) -> np.ndarray:
        """uint64 ``[N, 3]`` of ``(address, length, device_id)``: what NIXL's ``prep_xfer_dlist`` takes."""
        base = np.array([r.address for r in pool.regions], dtype=np.uint64)
        dev = np.array([r.device_id for r in pool.regions], dtype=np.uint64)
        out = np.empty((len(self), 3), dtype=np.uint64)
        out[:, 0] = base[self.region] + self.offset.astype(np.uint64)
        out[:, 1] = self.length
        out[:, 2] = dev[self.region]
        return out


class DescriptorPairs(NamedTuple):
    """``src[i]`` moves to ``dst[i]``; ``src.length == dst.length`` element-wise."""

    src: Descriptors
    dst: Descriptors

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.src)

    @property
    def num_bytes(self) -> int:
        return self.src.num_bytes

    def reversed(self) -> DescriptorPairs:
        return DescriptorPairs(self.dst, self.src)


class _Pieces(NamedTuple):
    plane: np.ndarray  # [P] flat plane index slot * num_segments + seg
    index: np.ndarray  # [P] index into RequestBlocks.ids()
    length: np.ndarray  # [P] bytes used in that block of that plane


def _pieces(layout: Layout, num_kv_blocks: int) -> _Pieces:
    """Every (plane, block, bytes) piece of a request with ``num_kv_blocks`` KV blocks, in transfer order:
    plane by plane; within a plane the state sets (group by group, table order), then the KV table."""
    seg_b, blk_b, nseg = layout.segment_bytes, layout.block_bytes, layout.num_segments
    planes, index, length = [], [], []
    state_start = np.cumsum((0, *layout.blocks_per_state))
    kv_start = int(state_start[-1])
    state_groups = layout.state_groups
    for slot in range(layout.group_size):
        for seg in range(nseg):
            p = slot * nseg + seg
            for g, group in enumerate(state_groups):
                layer_id = group.layer_ids[slot]
                if layer_id is None:
                    continue
                layer = layout.model.layers[layer_id]
                assert isinstance(layer, RecurrentLayerSpec)
                cols = np.arange(group.blocks_per_state, dtype=np.int64)
                used = np.clip(layer.state_bytes - cols * blk_b - seg * seg_b, 0, seg_b)
                keep = used > 0
                planes.append(np.full(int(keep.sum()), p, dtype=np.int64))
                index.append(state_start[g] + cols[keep])
                length.append(used[keep])
            kv = layout.kv_group
            if kv is not None and kv.layer_ids[slot] is not None and num_kv_blocks:
                planes.append(np.full(num_kv_blocks, p, dtype=np.int64))
                index.append(kv_start + np.arange(num_kv_blocks, dtype=np.int64))
                length.append(np.full(num_kv_blocks, seg_b, dtype=np.int64))
    return _Pieces(_cat(planes), _cat(index), _cat(length))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _locate(pool: PoolRegions, pieces: _Pieces, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    region = pool.plane_region.ravel()[pieces.plane]
    offset = pool.plane_offset.ravel()[pieces.plane] + ids[pieces.index] * pool.layout.segment_bytes
    return region, offset


def _check_blocks(pool: PoolRegions, blocks: RequestBlocks, side: str) -> None:
    layout = pool.layout
    if blocks.kv_blocks.size != layout.num_kv_blocks(blocks.num_tokens):
        raise TransferError(
            f"{side}: {blocks.kv_blocks.size} KV blocks for {blocks.num_tokens} tokens, the layout needs "
            f"{layout.num_kv_blocks(blocks.num_tokens)}"
        )
    if [s.size for s in blocks.state_blocks] != list(layout.blocks_per_state):
        raise TransferError(
            f"{side}: state sets of {[s.size for s in blocks.state_blocks]} blocks, the layout has "
            f"{list(layout.blocks_per_state)}"
        )
    ids = blocks.ids()
    if ids.size and (ids.min() < 1 or ids.max() >= pool.num_blocks):
        raise TransferError(f"{side}: block ids must lie in [1, {pool.num_blocks}), got {ids.min()}..{ids.max()}")


def request_descriptors(pool: PoolRegions, blocks: RequestBlocks) -> Descriptors:
    """One side's descriptors of a request, coalesced on that side alone (for counting, hashing, registering)."""
    _check_blocks(pool, blocks, "request")
    pieces = _pieces(pool.layout, blocks.kv_blocks.size)
    region, offset = _locate(pool, pieces, blocks.ids())
    keep = _coalesce_starts([(region, offset)], pieces.length)
    return _merged(region, offset, pieces.length, keep)


def pair_descriptors(
    src_pool: PoolRegions, src_blocks: RequestBlocks, dst_pool: PoolRegions, dst_blocks: RequestBlocks
) -> DescriptorPairs:
    """Paired, coalesced descriptors moving a request's bytes from ``src_pool`` to ``dst_pool``.

    Raises :class:`TransferError` when the layouts differ (beyond the number of blocks) or the two
    block lists do not have the same shape (tokens, KV blocks, state blocks per group).
    """
    check_compatible(src_pool.layout, layout_signature(dst_pool.layout))
    _check_blocks(src_pool, src_blocks, "source")
    _check_blocks(dst_pool, dst_blocks, "destination")
    if not src_blocks.same_shape(dst_blocks):
        raise TransferError(
            f"source ({src_blocks.num_tokens} tokens, {src_blocks.kv_blocks.size} KV blocks) and destination "
            f"({dst_blocks.num_tokens} tokens, {dst_blocks.kv_blocks.size} KV blocks) differ: import the request "
            "with the source's token count"
        )
    pieces = _pieces(src_pool.layout, src_blocks.kv_blocks.size)
    s_region, s_offset = _locate(src_pool, pieces, src_blocks.ids())
    d_region, d_offset = _locate(dst_pool, pieces, dst_blocks.ids())
    starts = _coalesce_starts([(s_region, s_offset), (d_region, d_offset)], pieces.length)
    return DescriptorPairs(
        _merged(s_region, s_offset, pieces.length, starts), _merged(d_region, d_offset, pieces.length, starts)
    )


def _coalesce_starts(sides: list[tuple[np.ndarray, np.ndarray]], length: np.ndarray) -> np.ndarray:
    """Indices of pieces that start a descriptor: piece i+1 joins piece i when it follows it in memory on every side."""
    if not length.size:
        return np.zeros(0, dtype=np.int64)
    joins = np.ones(length.size - 1, dtype=bool)
    for region, offset in sides:
        joins &= (region[1:] == region[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    return np.concatenate(([0], np.flatnonzero(~joins) + 1))


def _merged(region: np.ndarray, offset: np.ndarray, length: np.ndarray, starts: np.ndarray) -> Descriptors:
    if not starts.size:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty, empty)
    return Descriptors(region[starts], offset[starts], np.add.reduceat(length, starts))

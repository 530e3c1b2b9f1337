"""Descriptors of a request's bytes: from a layout, the pool's base addresses and the request's block ids.

A pool (``hybridkv.ops.allocate_pools``) is laid out ``[group_size, num_segments, num_blocks,
segment_bytes]``: every (layer slot, segment) pair is a **plane** of ``num_blocks`` pieces of
``segment_bytes``, and block ``b`` of plane ``(slot, seg)`` starts ``b * block_stride`` into it
(``block_stride = segment_bytes`` there; a host pool, ``ops.allocate_host_pools``, is block-major,
``[num_blocks, group_size, num_segments, segment_bytes]``, so its planes interleave and its stride is
one host block, :meth:`PoolRegions.block_major`). A
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

from typing import NamedTuple

import numpy as np

from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.models.spec import RecurrentLayerSpec
from hybridkv.planner.layout import Layout
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.regions import (  # re-exported: the names this module always offered
    MemoryKind,
    PoolRegions,
    Region,
    check_compatible,
    layout_signature,
)

__all__ = [
    "DescriptorPairs", "Descriptors", "MemoryKind", "PoolRegions", "Region", "TieredPairs", "check_compatible",
    "check_request_blocks", "layout_signature", "pair_descriptors", "pair_tiered_descriptors", "request_descriptors",
]


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
    offset = pool.plane_offset.ravel()[pieces.plane] + ids[pieces.index] * pool.block_stride
    return region, offset


def check_request_blocks(
    pool: PoolRegions, blocks: RequestBlocks, side: str = "request", distinct: bool = False
) -> None:
    """Raise :class:`TransferError` unless ``blocks`` is a well-formed request of ``pool``'s layout:
    as many KV blocks as its token count needs, one set of ``blocks_per_state`` blocks per state
    group, every id a block of the pool other than the null block (from id 0 in a pool without
    one, a host pool; ``distinct``: and no id twice, as a manager hands them out; offers from a peer
    are checked so)."""
    _check_shape(pool, blocks, side)
    ids = blocks.ids()
    _check_ids(pool, ids, side, distinct)


def _check_shape(pool: PoolRegions, blocks: RequestBlocks, side: str) -> None:
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"{side}: expected PoolRegions, got {type(pool).__name__}")
    if not isinstance(blocks, RequestBlocks):
        raise TypeError(f"{side}: expected RequestBlocks, got {type(blocks).__name__}")
    layout = pool.layout
    arrays = (blocks.kv_blocks, *blocks.state_blocks)
    if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu" for a in arrays):
        raise TransferError(f"{side}: block ids must be 1-D integer arrays")
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


def _check_ids(pool: PoolRegions, ids: np.ndarray, side: str, distinct: bool) -> None:
    lo = pool.first_block
    if ids.size and (ids.min() < lo or ids.max() >= pool.num_blocks):
        raise TransferError(f"{side}: block ids must lie in [{lo}, {pool.num_blocks}), got {ids.min()}..{ids.max()}")
    if distinct and np.unique(ids).size != ids.size:
        raise TransferError(f"{side}: a block id appears twice in the request: {ids.tolist()}")


def request_descriptors(pool: PoolRegions, blocks: RequestBlocks) -> Descriptors:
    """One side's descriptors of a request, coalesced on that side alone (for counting, hashing, registering)."""
    if not isinstance(pool, PoolRegions):
        raise TypeError(f"request_descriptors takes PoolRegions, got {type(pool).__name__}")
    check_request_blocks(pool, blocks, "request")
    pieces = _pieces(pool.layout, blocks.kv_blocks.size)
    region, offset = _locate(pool, pieces, blocks.ids())
    keep = _coalesce_starts([(region, offset)], pieces.length)
    return _merged(region, offset, pieces.length, keep)


def _check_same_shape(src_blocks: RequestBlocks, dst_blocks: RequestBlocks, what: str) -> None:
    """``TransferError`` unless both sides hold the same tokens in the same number of KV blocks."""
    if not src_blocks.same_shape(dst_blocks):
        raise TransferError(
            f"source ({src_blocks.num_tokens} tokens, {src_blocks.kv_blocks.size} KV blocks) and destination "
            f"({dst_blocks.num_tokens} tokens, {dst_blocks.kv_blocks.size} KV blocks) differ: import the {what} "
            "with the source's token count"
        )


def pair_descriptors(
    src_pool: PoolRegions, src_blocks: RequestBlocks, dst_pool: PoolRegions, dst_blocks: RequestBlocks
) -> DescriptorPairs:
    """Paired, coalesced descriptors moving a request's bytes from ``src_pool`` to ``dst_pool``.

    Raises :class:`TransferError` when the layouts differ (beyond the number of blocks) or the two
    block lists do not have the same shape (tokens, KV blocks, state blocks per group).
    """
    for pool in (src_pool, dst_pool):
        if not isinstance(pool, PoolRegions):
            raise TypeError(f"pair_descriptors takes PoolRegions, got {type(pool).__name__}")
    check_compatible(src_pool.layout, layout_signature(dst_pool.layout))
    check_request_blocks(src_pool, src_blocks, "source")
    check_request_blocks(dst_pool, dst_blocks, "destination")
    _check_same_shape(src_blocks, dst_blocks, "request")
    pieces = _pieces(src_pool.layout, src_blocks.kv_blocks.size)
    s_region, s_offset = _locate(src_pool, pieces, src_blocks.ids())
    d_region, d_offset = _locate(dst_pool, pieces, dst_blocks.ids())
    starts = _coalesce_starts([(s_region, s_offset), (d_region, d_offset)], pieces.length)
    return DescriptorPairs(
        _merged(s_region, s_offset, pieces.length, starts), _merged(d_region, d_offset, pieces.length, starts)
    )


class TieredPairs(NamedTuple):
    """The pairs of a request whose source blocks lie in two pools: ``device`` reads the source's
    device pool, ``host`` its host pool; both write the destination's one pool."""

    device: DescriptorPairs
    host: DescriptorPairs

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.device) + len(self.host)

    @property
    def num_bytes(self) -> int:
        return self.device.num_bytes + self.host.num_bytes


def pair_tiered_descriptors(
    src_device: PoolRegions,
    src_host: PoolRegions,
    src_blocks: RequestBlocks,
    src_on_host: np.ndarray,
    dst_pool: PoolRegions,
    dst_blocks: RequestBlocks,
) -> TieredPairs:
    """:func:`pair_descriptors` for a source whose blocks lie partly in its host pool (a cached
    prefix some of which the prefix cache's host tier holds): ``src_on_host`` (bool ``[N]``, in
    :meth:`RequestBlocks.ids` order) says which ids are host block ids. The pieces are the same as
    for one pool and in the same order; each part is coalesced on its own (a block-major host pool
    interleaves its planes, so a host-side piece joins its neighbour only within one block).

    Raises :class:`TransferError` when a layout differs from the destination's, the shapes differ,
    or an id is not a block of the pool it names (``TypeError`` for arguments of the wrong type)."""
    for pool in (src_device, src_host, dst_pool):
        if not isinstance(pool, PoolRegions):
            raise TypeError(f"pair_tiered_descriptors takes PoolRegions, got {type(pool).__name__}")
    for src in (src_device, src_host):
        check_compatible(src.layout, layout_signature(dst_pool.layout))
    _check_shape(src_device, src_blocks, "source")
    check_request_blocks(dst_pool, dst_blocks, "destination")
    ids = src_blocks.ids()
    on_host = np.asarray(src_on_host)
    if on_host.dtype != np.bool_ or on_host.shape != ids.shape:
        raise TransferError(f"src_on_host must be a bool array of shape {list(ids.shape)}, got {on_host.dtype} "
                            f"of shape {list(on_host.shape)}")
    _check_ids(src_device, ids[~on_host], "source (device pool)", False)
    _check_ids(src_host, ids[on_host], "source (host pool)", False)
    _check_same_shape(src_blocks, dst_blocks, "prefix")
    pieces = _pieces(src_device.layout, src_blocks.kv_blocks.size)
    d_region, d_offset = _locate(dst_pool, pieces, dst_blocks.ids())
    from_host = on_host[pieces.index]
    parts = []
    for src, take in ((src_device, ~from_host), (src_host, from_host)):
        sub = _Pieces(pieces.plane[take], pieces.index[take], pieces.length[take])
        s_region, s_offset = _locate(src, sub, ids)
        dr, do = d_region[take], d_offset[take]
        starts = _coalesce_starts([(s_region, s_offset), (dr, do)], sub.length)
        parts.append(DescriptorPairs(_merged(s_region, s_offset, sub.length, starts),
                                     _merged(dr, do, sub.length, starts)))
    return TieredPairs(*parts)


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

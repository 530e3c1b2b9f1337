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

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.models.spec import RecurrentLayerSpec
from hybridkv.planner.layout import Layout
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


def _plain(value: Any) -> Any:
    """A spec as plain JSON data: every field of every (nested) dataclass, enums by value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"type": type(value).__name__}
        out.update({f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _layer_signature(layout: Layout, layer_id: int | None) -> dict[str, Any] | None:
    """What one layer slot holds, down to every tensor's dtype and shape (None: a padding slot): the
    layer's whole spec (an attention layer's KV heads, head sizes, KV and scale dtypes; a recurrent
    layer's mixer and each state component's name, shape and dtype)."""
    if layer_id is None:
        return None
    return {"layer": layer_id, **_plain(layout.model.layers[layer_id])}


def layout_signature(layout: Layout) -> dict[str, Any]:
    """What two sides must agree on to exchange blocks (everything but the number of blocks).

    Plain JSON data: the model name and TP size, the layout kind, block size and byte geometry
    (segments, KV scale segments), the group structure, and per group and layer slot the whole spec
    of the layer it holds: an attention layer's KV heads, head sizes, KV dtype and scale dtype, a
    recurrent layer's mixer and every state component's name, shape and dtype. Two layouts of one model with
    a different KV dtype (``with_kv_dtype``) or state dtype therefore differ, even where their byte
    sizes happen to agree (bf16 and fp16, int8 and fp8).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout_signature takes a Layout, got {type(layout).__name__}")
    return {
        "model": layout.model.name,
        "tp_size": layout.model.tp_size,
        "layout_kind": layout.kind.value,
        "block_size": layout.block_size,
        "group_size": layout.group_size,
        "num_segments": layout.num_segments,
        "segment_bytes": layout.segment_bytes,
        "scale_segment_bytes": layout.scale_segment_bytes,
        "groups": [[g.kind.value, g.blocks_per_state, len(g.layer_ids)] for g in layout.groups],
        "layers": [[_layer_signature(layout, layer_id) for layer_id in g.layer_ids] for g in layout.groups],
    }


def _differences(path: str, mine: Any, peer: Any, out: list[str]) -> None:
    """Append ``path: here X, peer Y`` for every leaf where the two signatures differ."""
    if isinstance(mine, dict) and isinstance(peer, dict):
        for key in [*mine, *(k for k in peer if k not in mine)]:
            if key not in peer:
                out.append(f"{path}{key}: here {mine[key]!r}, peer has none")
            elif key not in mine:
                out.append(f"{path}{key}: here none, peer {peer[key]!r}")
            else:
                _differences(f"{path}{key}.", mine[key], peer[key], out)
    elif isinstance(mine, list) and isinstance(peer, list) and len(mine) == len(peer):
        stem = path[:-1] if path.endswith(".") else path
        for i, (a, b) in enumerate(zip(mine, peer, strict=True)):
            _differences(f"{stem}[{i}].", a, b, out)
    elif mine != peer:
        out.append(f"{path[:-1] if path.endswith('.') else path}: here {mine!r}, peer {peer!r}")


def _count(value: Any, what: str, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy integers too) ``>= minimum``; :class:`TransferError` otherwise
    (this checks what arrives from a peer, so a bad value is a malformed message)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TransferError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise TransferError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def _memory_kind(kind: MemoryKind | str) -> MemoryKind:
    try:
        return MemoryKind(kind)
    except ValueError:
        raise TransferError(f"unknown memory kind {kind!r}: use one of {[k.value for k in MemoryKind]}") from None


@dataclass(frozen=True, eq=False)
class PoolRegions:
    """Where one side's pool lives: its registered regions and, per plane, where block 0 starts.

    ``plane_region[slot, seg]`` indexes ``regions``; ``plane_offset[slot, seg]`` is the byte offset of
    block 0 of that plane inside it. Built by :meth:`contiguous` (one ``ops`` pool tensor),
    :meth:`per_slot` (one ``[num_segments, num_blocks, segment_bytes]`` tensor per layer slot) or
    :meth:`per_plane` (one ``[num_blocks, segment_bytes]`` tensor per slot and segment, as engines
    that keep separate K and V caches per layer have).

    ``owner``: the object that owns the memory (a numpy array, an ``ops`` pool, a list of tensors).
    The regions hold a reference to it, so an engine that registered them keeps the memory alive
    until it drops them (``close``); ``regions_of_array`` and ``regions_of_pools`` set it. Regions
    built from bare addresses (``owner=None``) rely on the caller to keep the memory alive.

    ``block_stride``: bytes from block ``b`` to block ``b + 1`` of a plane (None: ``segment_bytes``,
    the device pools' planes; a block-major host pool's is one host block). ``null_block``: block 0
    is the null block, never moved (device pools); host pools have none (ids ``0..num_blocks-1``).

    Construction checks that every plane of ``num_blocks`` blocks lies inside its region (a peer's
    regions arrive through :meth:`from_wire`, which checks the message too), so descriptors built
    from these regions never point outside them.
    """

    layout: Layout
    num_blocks: int
    regions: tuple[Region, ...]
    plane_region: np.ndarray  # int64 [group_size, num_segments]
    plane_offset: np.ndarray  # int64 [group_size, num_segments]
    owner: Any = field(default=None, repr=False, compare=False)
    block_stride: int | None = None
    null_block: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise TypeError(f"PoolRegions needs a Layout, got {type(self.layout).__name__}")
        n = _count(self.num_blocks, "num_blocks", 1)
        object.__setattr__(self, "num_blocks", n)
        regions = tuple(self.regions)
        if not regions:
            raise TransferError("a pool needs at least one region")
        for i, r in enumerate(regions):
            if not isinstance(r, Region):
                raise TypeError(f"region {i} must be a Region, got {type(r).__name__}")
            _count(r.address, f"region {i} address")
            _count(r.length, f"region {i} length")
            _count(r.device_id, f"region {i} device_id")
            if not isinstance(r.kind, MemoryKind):
                raise TypeError(f"region {i} kind must be a MemoryKind, got {r.kind!r}")
        object.__setattr__(self, "regions", regions)
        shape = (self.layout.group_size, self.layout.num_segments)
        planes = []
        for name in ("plane_region", "plane_offset"):
            a = np.asarray(getattr(self, name))
            if a.shape != shape or a.dtype.kind not in "iu":
                raise TransferError(
                    f"{name} must be integers of shape [group_size, num_segments] = {list(shape)}, "
                    f"got {a.dtype} of shape {list(a.shape)}"
                )
            planes.append(a.astype(np.int64))
            object.__setattr__(self, name, planes[-1])
        region, offset = planes
        seg_b = self.layout.segment_bytes
        stride = seg_b if self.block_stride is None else _count(self.block_stride, "block_stride", 1)
        if stride < seg_b:
            raise TransferError(f"block_stride {stride} is shorter than a segment ({seg_b} bytes): blocks overlap")
        object.__setattr__(self, "block_stride", stride)
        if not isinstance(self.null_block, bool):
            raise TransferError(f"null_block must be a bool, got {self.null_block!r}")
        if ((region < 0) | (region >= len(regions))).any():
            raise TransferError(
                f"plane_region names regions {sorted(set(region.ravel().tolist()))}, the pool has "
                f"{len(regions)} (0..{len(regions) - 1})"
            )
        lengths = np.array([r.length for r in regions], dtype=np.int64)
        extent = (n - 1) * stride + seg_b
        if (offset < 0).any() or (offset + extent > lengths[region]).any():
            raise TransferError(
                f"a plane of {n} blocks of {seg_b} bytes ({stride} bytes apart) does not fit in its region at its "
                "offset: the pool's num_blocks, offsets or region lengths are wrong"
            )

    @property
    def first_block(self) -> int:
        """The lowest id a request's blocks may have: 1 with a null block, else 0."""
        return 1 if self.null_block else 0

    @staticmethod
    def contiguous(
        layout: Layout,
        address: int,
        num_blocks: int | None = None,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
        owner: Any = None,
    ) -> PoolRegions:
        """One ``[group_size, num_segments, num_blocks, segment_bytes]`` buffer at ``address``."""
        n = layout.num_blocks if num_blocks is None else _count(num_blocks, "num_blocks", 1)
        slot, seg = np.meshgrid(np.arange(layout.group_size), np.arange(layout.num_segments), indexing="ij")
        offset = (slot * layout.num_segments + seg) * n * layout.segment_bytes
        region = Region(
            _count(address, "address"),
            layout.group_size * layout.num_segments * n * layout.segment_bytes,
            _count(device_id, "device_id"),
            _memory_kind(kind),
        )
        return PoolRegions(layout, n, (region,), np.zeros_like(offset, dtype=np.int64), offset.astype(np.int64), owner)

    @staticmethod
    def per_slot(
        layout: Layout,
        addresses: list[int],
        num_blocks: int | None = None,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
        owner: Any = None,
    ) -> PoolRegions:
        """One ``[num_segments, num_blocks, segment_bytes]`` buffer per layer slot."""
        n = layout.num_blocks if num_blocks is None else _count(num_blocks, "num_blocks", 1)
        if len(addresses) != layout.group_size:
            raise TransferError(
                f"per_slot needs one address per layer slot ({layout.group_size}), got {len(addresses)}"
            )
        size = layout.num_segments * n * layout.segment_bytes
        dev, mem = _count(device_id, "device_id"), _memory_kind(kind)
        regions = tuple(Region(_count(a, "address"), size, dev, mem) for a in addresses)
        slot, seg = np.meshgrid(np.arange(layout.group_size), np.arange(layout.num_segments), indexing="ij")
        return PoolRegions(
            layout, n, regions, slot.astype(np.int64), (seg * n * layout.segment_bytes).astype(np.int64), owner
        )

    @staticmethod
    def per_plane(
        layout: Layout,
        addresses: list[list[int]],
        num_blocks: int | None = None,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
        owner: Any = None,
    ) -> PoolRegions:
        """One ``[num_blocks, segment_bytes]`` buffer per layer slot and segment."""
        n = layout.num_blocks if num_blocks is None else _count(num_blocks, "num_blocks", 1)
        grid = np.asarray(addresses, dtype=np.int64)
        if grid.shape != (layout.group_size, layout.num_segments):
            raise TransferError(
                f"per_plane needs [group_size, num_segments] = {[layout.group_size, layout.num_segments]} "
                f"addresses, got shape {list(grid.shape)}"
            )
        dev, mem = _count(device_id, "device_id"), _memory_kind(kind)
        regions = tuple(Region(_count(a, "address"), n * layout.segment_bytes, dev, mem) for a in grid.ravel().tolist())
        index = np.arange(grid.size, dtype=np.int64).reshape(grid.shape)
        return PoolRegions(layout, n, regions, index, np.zeros_like(index), owner)

    @staticmethod
    def block_major(
        layout: Layout,
        address: int,
        num_blocks: int,
        device_id: int = 0,
        kind: MemoryKind | str = "DRAM",
        owner: Any = None,
    ) -> PoolRegions:
        """One block-major ``[num_blocks, group_size, num_segments, segment_bytes]`` buffer at
        ``address``: the manager's host pool as ``ops.allocate_host_pools`` lays it out (ids
        ``0..num_blocks-1``, no null block). Plane ``(slot, seg)`` of block ``b`` starts
        ``b * group_size * num_segments * segment_bytes + (slot * num_segments + seg) * segment_bytes``.
        KV scale segments (``block_wise_fp8``) are not in host pools, so not here either."""
        n = _count(num_blocks, "num_blocks", 1)
        seg_b, nseg = layout.segment_bytes, layout.num_segments
        stride = layout.group_size * nseg * seg_b
        slot, seg = np.meshgrid(np.arange(layout.group_size), np.arange(nseg), indexing="ij")
        region = Region(_count(address, "address"), n * stride, _count(device_id, "device_id"), _memory_kind(kind))
        offset = ((slot * nseg + seg) * seg_b).astype(np.int64)
        return PoolRegions(layout, n, (region,), np.zeros_like(offset), offset, owner, stride, False)

    # ---- the wire ------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """Plain data a peer needs to address this pool (with :func:`layout_signature` to check)."""
        return {
            "signature": layout_signature(self.layout),
            "num_blocks": self.num_blocks,
            "regions": [[r.address, r.length, r.device_id, r.kind.value] for r in self.regions],
            "plane_region": self.plane_region.tolist(),
            "plane_offset": self.plane_offset.tolist(),
            "block_stride": self.block_stride,
            "null_block": self.null_block,
        }

    @staticmethod
    def from_wire(layout: Layout, msg: dict[str, Any]) -> PoolRegions:
        """The peer's pool, checked against ``layout`` and for consistency: raises :class:`TransferError`
        on a layout mismatch or a malformed message (a missing key, a plane naming a region that is not
        there, a plane running past its region), before anything uses it. ``block_stride`` and
        ``null_block`` may be absent (a device pool's: ``segment_bytes``, True)."""
        if not isinstance(msg, dict):
            raise TransferError(f"a pool message must be a mapping, got {type(msg).__name__}")
        missing = [k for k in ("signature", "num_blocks", "regions", "plane_region", "plane_offset") if k not in msg]
        if missing:
            raise TransferError(f"malformed pool message: missing {missing}")
        check_compatible(layout, msg["signature"])
        if not isinstance(msg["regions"], list):
            raise TransferError("malformed pool message: regions must be a list")
        regions = []
        for i, r in enumerate(msg["regions"]):
            if not isinstance(r, list) or len(r) != 4:
                raise TransferError(f"malformed pool message: region {i} must be [address, length, device_id, kind]")
            a, n, d, k = r
            regions.append(
                Region(
                    _count(a, f"region {i} address"),
                    _count(n, f"region {i} length"),
                    _count(d, f"region {i} device_id"),
                    _memory_kind(k),
                )
            )
        planes = []
        for name in ("plane_region", "plane_offset"):
            try:
                a = np.asarray(msg[name])
            except (TypeError, ValueError) as e:
                raise TransferError(f"malformed pool message: {name}: {e}") from None
            if a.dtype.kind not in "iu":
                raise TransferError(f"malformed pool message: {name} must be integers, got {a.dtype}")
            planes.append(a.astype(np.int64))
        stride = msg.get("block_stride")
        stride = None if stride is None else _count(stride, "block_stride", 1)
        null_block = msg.get("null_block", True)
        if not isinstance(null_block, bool):
            raise TransferError(f"malformed pool message: null_block must be true or false, got {null_block!r}")
        return PoolRegions(layout, _count(msg["num_blocks"], "num_blocks", 1), tuple(regions), *planes, None,
                           stride, null_block)


def check_compatible(layout: Layout, peer_signature: dict[str, Any]) -> None:
    """Raise :class:`TransferError` unless the peer's layout moves blocks of the same shape and
    element types as ``layout``; the message names every difference (``layers[g][s].dtype`` is
    group ``g``, layer slot ``s``)."""
    if not isinstance(peer_signature, dict):
        raise TransferError(
            f"the peer's layout signature is not a mapping (got {type(peer_signature).__name__}): "
            "the peer runs another version or sent a malformed message"
        )
    diff: list[str] = []
    _differences("", layout_signature(layout), peer_signature, diff)
    if diff:
        shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise TransferError(
            f"the peer's pool layout differs ({shown}): both sides need the same model, TP size, block size, "
            "layout kind and KV / state dtypes (only the number of blocks may differ)"
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

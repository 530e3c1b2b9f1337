"""A pool's memory as a transfer engine sees it: the regions it registers, where each plane of a
layout lies in them (:class:`PoolRegions`), and the layout signature two peers compare before they
move blocks (:func:`layout_signature`, :func:`check_compatible`).

Framework-free: base addresses come from the caller (``regions_from_pools`` for ``ops`` pools).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

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

"""The reference transfer: copy a request's bytes by descriptors between buffers of one process.

The engines (NIXL, Mooncake) move the same descriptors between machines; this copy is what they
must equal byte for byte, and what tests and the simulator use without a network. Buffers are
1-D uint8 numpy arrays, one per registered region, in ``PoolRegions.regions`` order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from hybridkv.blockmgr.layout import Layout
from hybridkv.transfer.descriptors import DescriptorPairs, Descriptors, MemoryKind, PoolRegions


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

"""Batched swaps: one device gather/scatter through a block-major staging buffer plus one DMA copy per
run of consecutive host ids, issued on a side stream with pinned host memory on CUDA.

Device blocks of a request are scattered over the pool, and a copy per block and slot would be
bound by API calls (thousands of ~100 KiB copies). Instead the pairs are sorted by host id, the
device blocks of a chunk are gathered into a contiguous ``[n, group_size, num_segments, segment_bytes]``
staging tensor by one indexing kernel (device bandwidth, ~100x the host link), and each run of
consecutive host blocks moves in one copy. Staging is bounded by ``max_staging_bytes`` per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hybridkv.ops import _ids
from hybridkv.ops._framework import WORD_NAMES, widest_word
from hybridkv.ops.pools import BlockPools

if TYPE_CHECKING:
    import torch

MAX_STAGING_BYTES = 256 * 1024**2
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def host_runs(host_ids: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of ``host_ids`` (sorted) whose ids are consecutive."""
    if host_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(host_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [host_ids.size]))
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def side_stream(device: torch.device) -> torch.cuda.Stream:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _block_major_words(pools: BlockPools) -> torch.Tensor:
    """Device pool as ``[num_blocks, group_size, num_segments, segment_words]`` (a permuted view)."""
    import torch

    data = pools.torch_data
    word = widest_word(data.data_ptr(), data.shape[-1])
    return data.view(getattr(torch, WORD_NAMES[word])).permute(2, 0, 1, 3)


def swap_runs(
    device_pools: BlockPools,
    host_pools: BlockPools,
    device_ids: np.ndarray,
    host_ids: np.ndarray,
    out: bool,
    non_blocking: bool,
    max_staging_bytes: int = MAX_STAGING_BYTES,
) -> int:
    """Move every pair ``device_ids[i] <-> host_ids[i]``; returns the number of host copies issued."""
    import torch

    order = np.argsort(host_ids, kind="stable")
    dev_sorted, host_sorted = device_ids[order], host_ids[order]
    device = device_pools.device
    dev_view = _block_major_words(device_pools)
    host = host_pools.torch_data  # [num_host_blocks, group_size, num_segments, segment_bytes]
    chunk = max(1, max_staging_bytes // device_pools.layout.bytes_per_block)
    num_copies = 0
    for a in range(0, dev_sorted.size, chunk):
        d, h = dev_sorted[a : a + chunk], host_sorted[a : a + chunk]
        index = _ids.to_device([d], device, torch.int64)[0]  # pinned and non-blocking on CUDA
        if out:
            staging = dev_view[index].view(torch.uint8)  # [n, group_size, num_segments, segment_bytes]
        else:
            staging = torch.empty((d.size, *host.shape[1:]), dtype=torch.uint8, device=device)
        for s, e in host_runs(h):
            first = int(h[s])
            if out:
                host[first : first + e - s].copy_(staging[s:e], non_blocking=non_blocking)
            else:
                staging[s:e].copy_(host[first : first + e - s], non_blocking=non_blocking)
            num_copies += 1
        if not out:
            dev_view[index] = staging.view(dev_view.dtype)
    return num_copies

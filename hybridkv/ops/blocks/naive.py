"""Reference copy_blocks: ``pool[:, :, dst[i]] = pool[:, :, src[i]]`` over every slot and segment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.ops.pools import BlockPools

if TYPE_CHECKING:
    import torch


def copy_blocks_naive(pools: BlockPools, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer slot (int64 ids on the pool's device)."""
    data = pools.torch_data  # [group_size, num_segments, num_blocks, segment_bytes]
    data[:, :, dst] = data[:, :, src]

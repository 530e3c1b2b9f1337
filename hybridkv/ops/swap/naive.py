"""Reference swap: one synchronous copy per block pair, every layer slot and segment."""

from __future__ import annotations

import numpy as np

from hybridkv.ops.pools import BlockPools


def swap_blocks_naive(
    device_pools: BlockPools, host_pools: BlockPools, device_blocks: np.ndarray, host_blocks: np.ndarray, out: bool
) -> None:
    """``out``: ``host[h] = device[:, :, d]`` for each pair (host pools are block-major); else the reverse."""
    dev, host = device_pools.torch_data, host_pools.torch_data
    for d, h in zip(device_blocks.tolist(), host_blocks.tolist(), strict=True):
        if out:
            host[h].copy_(dev[:, :, d])
        else:
            dev[:, :, d].copy_(host[h])

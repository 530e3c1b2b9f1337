"""Tensor ops over the block pool (DESIGN.md "Ops"): pools, state gather/scatter, block copies, swaps.

Each op has a plain reference (``naive.py``) and a Triton kernel (``kernel.py``); ``backend="auto"``
runs the kernel on CUDA tensors and the reference elsewhere. Paddle tensors go through the same
functions as DLPack views. See ``docs/ops.md``.
"""

from hybridkv.ops._framework import Backend, DeviceMismatchError, Framework
from hybridkv.ops.blocks import copy_blocks
from hybridkv.ops.pools import (
    BlockPools,
    StateBuffers,
    allocate_host_pools,
    allocate_pools,
    allocate_state_buffers,
    kv_cache_views,
    read_state,
)
from hybridkv.ops.states import gather_states, scatter_states
from hybridkv.ops.swap import CompletedSwap, SwapDirection, swap_blocks

__all__ = [
    "Backend",
    "BlockPools",
    "CompletedSwap",
    "DeviceMismatchError",
    "Framework",
    "StateBuffers",
    "SwapDirection",
    "allocate_host_pools",
    "allocate_pools",
    "allocate_state_buffers",
    "copy_blocks",
    "gather_states",
    "kv_cache_views",
    "read_state",
    "scatter_states",
    "swap_blocks",
]

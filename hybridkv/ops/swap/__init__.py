"""swap_blocks: move blocks between the device pool and a host pool with the same block bytes."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from hybridkv.ops._framework import Backend, Framework
from hybridkv.ops.blocks import block_ids, check_pairs
from hybridkv.ops.pools import BlockPools
from hybridkv.ops.swap.runs import MAX_STAGING_BYTES
from hybridkv.planner.layout import NULL_BLOCK

if TYPE_CHECKING:
    import torch


class SwapDirection(enum.Enum):
    OUT = "out"  # device -> host
    IN = "in"  # host -> device


class CompletedSwap:
    """Returned where the copy already finished (CPU pools): ``synchronize``/``wait``/``query`` are no-ops."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


def swap_blocks(
    device_pools: BlockPools,
    host_pools: BlockPools,
    device_blocks: Any,
    host_blocks: Any = None,
    direction: SwapDirection | str | None = None,
    backend: Backend | str = "auto",
    max_staging_bytes: int = MAX_STAGING_BYTES,
) -> torch.cuda.Event | CompletedSwap:
    """Copy ``device_blocks[i]`` <-> ``host_blocks[i]`` in every layer slot; ``direction`` ``"out"``
    (device -> host) or ``"in"`` (host -> device).

    ``device_blocks`` may instead be a plan with ``device_blocks`` and ``host_blocks`` attributes
    (the block manager's ``SwapPlan``); then the direction may be passed fourth or come from the plan's
    ``direction``. The device blocks go through a block-major staging tensor (at most
    ``max_staging_bytes`` at a time) so that each run of consecutive host ids is one copy. On CUDA
    everything runs non-blocking on a side stream, after the current stream's pending work; the
    returned ``torch.cuda.Event`` marks the end: wait on it (``event.wait()`` orders the current
    stream, ``event.synchronize()`` the host) before touching the blocks. Elsewhere the copy is
    synchronous and a :class:`CompletedSwap` is returned. Raises ``ValueError`` on ids out of range,
    repeated destinations, the null block as a device destination, or a bad direction.

    Paddle pools (device and host both Paddle) move with Paddle alone: one gather or index put of the
    device rows and one copy per run of consecutive host ids, synchronous on every device for now
    (a :class:`CompletedSwap` is returned), no torch.
    """
    if hasattr(device_blocks, "device_blocks") and hasattr(device_blocks, "host_blocks"):
        plan = device_blocks
        if isinstance(host_blocks, str | SwapDirection) and direction is None:
            direction = host_blocks
        direction = direction if direction is not None else getattr(plan, "direction", None)
        device_blocks, host_blocks = plan.device_blocks, plan.host_blocks
    if host_blocks is None:
        raise ValueError("swap_blocks needs host_blocks (or a plan with device_blocks and host_blocks)")
    way = _direction(direction)
    dev = block_ids(device_blocks, "device_blocks")
    host = block_ids(host_blocks, "host_blocks")
    device_pools.require_slot_major("swap_blocks (device side)")
    if not host_pools.block_major:
        raise ValueError("swap_blocks: host_pools must come from allocate_host_pools (block-major)")
    if tuple(device_pools.data.shape[:2]) != tuple(host_pools.data.shape[1:3]) or (
        device_pools.layout.block_bytes != host_pools.layout.block_bytes
    ):
        raise ValueError("device and host pools differ in block bytes or layer slots: plan them from one layout")
    if way is SwapDirection.OUT:
        check_pairs(dev, host, device_pools.num_blocks, host_pools.num_blocks, "swap_blocks out")
    else:
        check_pairs(host, dev, host_pools.num_blocks, device_pools.num_blocks, "swap_blocks in")
        if (dev == NULL_BLOCK).any():
            raise ValueError("swap_blocks in: the null block (0) cannot be a destination; it stays zero-filled")
    out = way is SwapDirection.OUT
    if device_pools.framework is Framework.PADDLE and host_pools.framework is Framework.PADDLE:
        from hybridkv.ops import _paddle

        _paddle.swap_blocks(device_pools, host_pools, dev, host, out)
        return CompletedSwap()
    import torch

    from hybridkv.ops.swap.naive import swap_blocks_naive
    from hybridkv.ops.swap.runs import side_stream, swap_runs

    if Backend(backend) is Backend.NAIVE:
        swap_blocks_naive(device_pools, host_pools, dev, host, out)
        return CompletedSwap()
    if device_pools.device.type != "cuda":
        swap_runs(device_pools, host_pools, dev, host, out, False, max_staging_bytes)
        return CompletedSwap()
    stream = side_stream(device_pools.device)
    stream.wait_stream(torch.cuda.current_stream(device_pools.device))
    with torch.cuda.stream(stream):
        swap_runs(device_pools, host_pools, dev, host, out, host_pools.torch_data.is_pinned(), max_staging_bytes)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _direction(direction: Any) -> SwapDirection:
    value = getattr(direction, "value", direction)
    if isinstance(value, str) and value.lower() in ("out", "in"):
        return SwapDirection(value.lower())
    raise ValueError(f"swap direction must be 'out' (device -> host) or 'in' (host -> device), got {direction!r}")

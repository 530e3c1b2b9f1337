"""copy_blocks: whole blocks (every layer slot, every segment) for checkpoints, copy-on-write and fork."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.ops import _ids
from hybridkv.ops._framework import (
    Backend,
    Framework,
    as_words,
    device_guard,
    interpreter_on,
    is_paddle_tensor,
    paddle_compat,
    paddle_device,
    require_device,
    resolve_backend,
    tile_words,
    to_torch,
    word_and_align,
)
from hybridkv.ops.blocks.naive import copy_blocks_naive
from hybridkv.ops.pools import BlockPools
from hybridkv.planner.layout import NULL_BLOCK


def block_ids(ids: Any, what: str) -> np.ndarray:
    """Block ids (list, numpy, torch or paddle) as a 1-D int64 numpy array on the host."""
    if isinstance(ids, list | tuple | range | np.ndarray | int | np.integer):
        arr = np.asarray(ids, dtype=np.int64)
    elif is_paddle_tensor(ids):
        arr = np.asarray(ids.numpy(), dtype=np.int64)
    else:
        arr = to_torch(ids).detach().cpu().numpy().astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D list of block ids, got shape {arr.shape}")
    return arr


def check_pairs(src: np.ndarray, dst: np.ndarray, num_src: int, num_dst: int, what: str) -> None:
    """Equal lengths, ids in range, destinations unique and never the null block. Raises ``ValueError``."""
    if src.shape != dst.shape:
        raise ValueError(f"{what}: {src.size} source blocks but {dst.size} destination blocks")
    for ids, n, side in ((src, num_src, "source"), (dst, num_dst, "destination")):
        bad = ids[(ids < 0) | (ids >= n)]
        if bad.size:
            raise ValueError(f"{what}: {side} block {int(bad[0])} is outside the pool's 0..{n - 1}")
    uniq, counts = np.unique(dst, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what}: destination block {int(uniq[counts > 1][0])} appears twice")


def copy_blocks(
    pools: BlockPools,
    src_blocks: Any,
    dst_blocks: Any = None,
    backend: Backend | str = "auto",
    validate: bool | None = None,
) -> None:
    """Copy block ``src_blocks[i]`` onto ``dst_blocks[i]`` in every layer slot and segment, in one launch.

    Ids: 1-D int lists/arrays/tensors of equal length, or the block manager's ``BlockCopies``
    (``src``/``dst`` attributes) as ``src_blocks``. A source may repeat (fork one to many).
    ``validate`` (default: when every id comes from the host, i.e. lists, numpy or CPU tensors) raises
    ``ValueError`` when ids are out of range, a destination is the null block or repeats, or a block is
    both a source and a destination (the copies would race). Host ids are checked before they move and
    then reach the device in one copy; ids passed as tensors on the pools' device are trusted unless
    ``validate=True`` (which synchronises). Raises :class:`~hybridkv.ops._framework.DeviceMismatchError`
    for id tensors on another device. Paddle pools run with Paddle alone (``hybridkv.ops._paddle``),
    except a Triton call under the CPU interpreter, which goes through a torch view.
    """
    pools.require_slot_major("copy_blocks")
    if dst_blocks is None and hasattr(src_blocks, "src") and hasattr(src_blocks, "dst"):
        src_blocks, dst_blocks = src_blocks.src, src_blocks.dst
    if dst_blocks is None:
        raise ValueError("copy_blocks needs dst_blocks (or a BlockCopies with src and dst)")
    src, dst = _ids.by_origin(src_blocks), _ids.by_origin(dst_blocks)
    if src.ndim != 1 or dst.ndim != 1:
        raise ValueError(
            f"copy_blocks: src_blocks and dst_blocks must be 1-D lists of block ids, got shapes "
            f"{tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.shape != dst.shape:
        raise ValueError(f"copy_blocks: {src.shape[0]} source blocks but {dst.shape[0]} destination blocks")
    device = pools.device
    for ids, what in ((src, "src_blocks"), (dst, "dst_blocks")):
        if not _ids.from_host(ids):
            require_device(device, paddle_device(ids) if is_paddle_tensor(ids) else ids.device, f"copy_blocks {what}")
    if validate or (validate is None and _ids.from_host(src) and _ids.from_host(dst)):
        _check_copy(_ids.host_copy(src), _ids.host_copy(dst), pools.num_blocks)
    if src.shape[0] == 0:
        return
    choice = resolve_backend(backend, device)
    if pools.framework is Framework.PADDLE and not (choice is Backend.TRITON and interpreter_on()):
        _copy_blocks_paddle(pools, src, dst, choice)
        return
    import torch

    host = [ids for ids in (src, dst) if _ids.from_host(ids)]
    moved = iter(_ids.to_device(host, device, torch.int64) if host else ())  # one staging copy for both
    src_t, dst_t = (
        next(moved) if _ids.from_host(ids) else _ids.on_device(ids, device, torch.int64, f"copy_blocks {what}")
        for ids, what in ((src, "src_blocks"), (dst, "dst_blocks"))
    )
    if choice is Backend.NAIVE:
        copy_blocks_naive(pools, src_t, dst_t)
        return
    _launch(pools, pools.torch_data.view(-1), src_t, dst_t, device)


def _launch(pools: BlockPools, flat_bytes: Any, src: Any, dst: Any, device: Any) -> None:
    """The Triton kernel over ``flat_bytes`` (the pool, 1-D uint8, torch or Paddle)."""
    from hybridkv.ops.blocks import kernel

    layout = pools.layout
    word, align = word_and_align(flat_bytes.data_ptr(), layout.segment_bytes)
    with device_guard(device):
        kernel.launch(
            as_words(flat_bytes, word),
            src,
            dst,
            layout.group_size * layout.num_segments,
            pools.num_blocks,
            layout.segment_bytes // word,
            tile_words(word, align),
            align,
        )


def _copy_blocks_paddle(pools: BlockPools, src: Any, dst: Any, choice: Backend) -> None:
    """Paddle pools, no torch: ids to the pool's place (host ids in one copy), then the Paddle
    reference or the kernel under Paddle's compat guard (CUDA)."""
    from hybridkv.ops import _paddle

    device = pools.device
    host = [ids for ids in (src, dst) if _ids.from_host(ids)]
    moved = iter(_paddle.to_place(host, device) if host else ())
    src_p, dst_p = (
        next(moved) if _ids.from_host(ids) else _paddle.on_place(ids, device, "int64", f"copy_blocks {what}")
        for ids, what in ((src, "src_blocks"), (dst, "dst_blocks"))
    )
    if choice is Backend.NAIVE:
        _paddle.copy_blocks(pools, src_p, dst_p)
        return
    with paddle_compat():
        _launch(pools, pools.data.reshape([-1]), src_p, dst_p, device)


def _check_copy(src: np.ndarray, dst: np.ndarray, num_blocks: int) -> None:
    check_pairs(src, dst, num_blocks, num_blocks, "copy_blocks")
    if (dst == NULL_BLOCK).any():
        raise ValueError("copy_blocks: the null block (0) cannot be a destination; it stays zero-filled")
    both = np.intersect1d(src, dst)
    if both.size:
        raise ValueError(
            f"copy_blocks: block {int(both[0])} is both a source and a destination; copy in two calls instead"
        )

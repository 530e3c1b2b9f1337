"""State bytes over per-segment allocations (FastDeploy's ``caches``): the Triton path.

The reference twin, one index move per segment, is
:func:`hybridkv.integrations.fastdeploy.state.gather_state_bytes` / ``scatter_state_bytes``, which
dispatch here for ``backend="triton"`` (CUDA, or Triton's interpreter on torch CPU tensors). Tensors
may be torch or Paddle: Paddle tensors are launched inside Paddle's torch-compat guard, as FastDeploy
launches its own kernels, and nothing imports torch then.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from hybridkv.ops._framework import device_guard, interpreter_on, is_paddle_tensor, paddle_compat, paddle_device
from hybridkv.planner.layout import Layout


@lru_cache(maxsize=256)
def pieces(block_bytes: int, segment_bytes: int, num_segments: int, nbytes: int) -> np.ndarray:
    """int64 ``[P, 4]``: ``(column, segment, start, length)`` of every (block of the set, segment) run of
    a state's first ``nbytes`` bytes; block ``column`` of the set holds bytes ``[column * block_bytes,
    (column + 1) * block_bytes)``, segment by segment."""
    out = []
    for column in range(-(-nbytes // block_bytes)):
        for seg in range(num_segments):
            start = column * block_bytes + seg * segment_bytes
            if start < nbytes:
                out.append((column, seg, start, min(segment_bytes, nbytes - start)))
    arr = np.array(out, dtype=np.int64).reshape(-1, 4)
    arr.flags.writeable = False
    return arr


def _like(arr: np.ndarray, like: Any) -> Any:
    """``arr`` as a tensor of ``like``'s framework on ``like``'s device (one host -> device copy)."""
    if is_paddle_tensor(like):
        import paddle

        return paddle.to_tensor(np.array(arr), place=like.place)
    import torch

    return torch.from_numpy(np.array(arr)).to(like.device)  # a copy: the cached pieces are read-only


_POINTERS: dict[tuple, Any] = {}
_PIECES: dict[tuple, Any] = {}


def pointer_row(segments: Sequence[Any]) -> Any:
    """int64 ``[num_segments]`` device tensor of the segments' base addresses, built once per set of
    allocations (cached by the addresses themselves, so it is right for whatever holds them)."""
    addresses = tuple(int(t.data_ptr()) for t in segments)
    # (the framework and device too: a row is a tensor of the segments' own kind and place)
    key = (type(segments[0]).__module__, str(_device(segments[0])), addresses)
    row = _POINTERS.get(key)
    if row is None:
        row = _POINTERS[key] = _like(np.array(addresses, dtype=np.int64), segments[0])
    return row


def _device(t: Any) -> Any:
    return paddle_device(t) if is_paddle_tensor(t) else t.device


def run(scatter: bool, segments: Sequence[Any], layout: Layout, table: Any, buf: Any) -> None:
    """Move ``buf`` uint8 ``[B, nbytes]`` <-> the state sets ``table`` int ``[B, >= columns]`` of one
    layer slot whose segment allocations are ``segments`` (uint8 ``[num_blocks, segment_bytes]``
    each), in one launch. ``table`` may be host numpy (copied once) or a device tensor (used as given:
    the caller checked it). Needs CUDA tensors or, for torch CPU tensors, ``TRITON_INTERPRET=1``."""
    from hybridkv.ops.segments import kernel

    first = segments[0]
    device = _device(first)
    if device.type != "cuda" and not (interpreter_on() and not is_paddle_tensor(first)):
        raise RuntimeError("the segment kernel runs on CUDA tensors, or on torch CPU tensors with TRITON_INTERPRET=1")
    nbytes = int(buf.shape[1])
    key = (layout.block_bytes, layout.segment_bytes, layout.num_segments, nbytes, str(device), is_paddle_tensor(first))
    table_t = _like(np.asarray(table, dtype=np.int64), first) if isinstance(table, np.ndarray) else table
    piece_t = _PIECES.get(key)
    if piece_t is None:
        piece_t = _PIECES[key] = _like(pieces(*key[:4]), first)
    args = (scatter, pointer_row(segments), table_t, buf, piece_t, layout.segment_bytes, layout.segment_bytes)
    if is_paddle_tensor(first):
        with paddle_compat(), device_guard(device):
            kernel.launch(*args)
    else:
        with device_guard(device):
            kernel.launch(*args)

"""Block ids from the caller to the pools' device: checked by where they come from, moved in one copy.

Ids given on the host (lists, ranges, numpy arrays, CPU torch or paddle tensors) are checked on the
host, where checking is free, *before* anything moves; then all of a call's host ids travel in one
staging buffer and one host->device copy (page-locked and non-blocking on CUDA). Ids given as a
tensor on the pools' device are the caller's promise: they are used as they are and checked only
when asked (``validate=True``, which synchronises). Ids on any other device raise
:class:`~hybridkv.ops._framework.DeviceMismatchError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hybridkv.ops._framework import is_paddle_tensor, require_device, to_torch

if TYPE_CHECKING:
    import torch

Ids = Any  # host ids (numpy) or the caller's device tensor (torch or Paddle)


def by_origin(ids: Any) -> Ids:
    """Host-provided ids as a numpy array (a view where the input allows), device tensors unchanged.
    A CPU Paddle tensor comes to the host through numpy, a GPU one stays as given (no torch)."""
    if isinstance(ids, np.ndarray):
        return ids
    if isinstance(ids, list | tuple | range | int | np.integer):
        return np.asarray(ids, dtype=np.int64)
    if is_paddle_tensor(ids):
        return ids if ids.place.is_gpu_place() else np.asarray(ids.numpy())
    t = to_torch(ids)
    return t.detach().numpy() if t.device.type == "cpu" else t


def from_host(ids: Ids) -> bool:
    return isinstance(ids, np.ndarray)


def host_copy(ids: Ids) -> np.ndarray:
    """The ids as int64 numpy on the host (for a device tensor: a synchronising copy)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    if is_paddle_tensor(ids):
        return np.asarray(ids.numpy()).astype(np.int64)
    return ids.detach().cpu().numpy().astype(np.int64)


def to_device(arrays: list[np.ndarray], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """``arrays`` as contiguous ``dtype`` tensors on ``device`` (same shapes), in one staging buffer.

    On CUDA the buffer is page-locked and the copy non-blocking on the current stream (torch's
    caching host allocator keeps the buffer alive until the copy is done). The caller checks ranges
    first: values are cast to ``dtype`` as they are.
    """
    import torch

    sizes = [a.size for a in arrays]
    pinned = device.type == "cuda"
    staging = torch.empty(sum(sizes), dtype=dtype, pin_memory=pinned)
    flat = staging.numpy()
    pos = 0
    for a, n in zip(arrays, sizes, strict=True):
        flat[pos : pos + n] = a.ravel()
        pos += n
    moved = staging.to(device, non_blocking=True) if pinned else staging
    out, pos = [], 0
    for a, n in zip(arrays, sizes, strict=True):
        out.append(moved[pos : pos + n].view(a.shape))
        pos += n
    return out


def on_device(ids: torch.Tensor, device: torch.device, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A caller's device tensor as contiguous ``dtype`` on ``device``; raises if it is on another device."""
    require_device(device, ids.device, what)
    return ids if ids.dtype == dtype and ids.is_contiguous() else ids.to(dtype).contiguous()

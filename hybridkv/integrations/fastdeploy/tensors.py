"""The few tensor moves the FastDeploy worker pieces make, in the framework of the tensors given.

A FastDeploy worker has Paddle and no torch; the tests also run the same pieces on torch CPU
tensors. Each helper imports only the framework of its argument, so nothing here pulls torch into
a Paddle process. Index ids come from the host (numpy, checked by the callers) and are moved once to
the tensor's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def is_paddle(t: Any) -> bool:
    return type(t).__module__.startswith("paddle")


def index(like: Any, ids: np.ndarray) -> Any:
    """``ids`` (numpy) as an int64 tensor of ``like``'s framework on ``like``'s device."""
    arr = np.ascontiguousarray(ids, dtype=np.int64)
    if is_paddle(like):
        import paddle

        return paddle.to_tensor(arr, place=like.place)
    import torch

    return torch.from_numpy(arr).to(like.device)


def to_like(x: Any, like: Any) -> Any:
    """``x`` (numpy, torch or Paddle) as a tensor of ``like``'s framework on ``like``'s device."""
    if is_paddle(like):
        import paddle

        if is_paddle(x):
            return x if x.place._equals(like.place) else x._copy_to(like.place, True)
        return paddle.to_tensor(np.ascontiguousarray(to_numpy(x)), place=like.place)
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(like.device)
    return torch.from_numpy(np.ascontiguousarray(to_numpy(x))).to(like.device)


def to_host(t: Any) -> Any:
    """``t`` on the CPU, same framework (a copy if it lives elsewhere)."""
    return t.cpu()


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if is_paddle(x):
        return np.asarray(x.numpy())
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def stack(tensors: Sequence[Any], axis: int) -> Any:
    if is_paddle(tensors[0]):
        import paddle

        return paddle.stack(list(tensors), axis=axis)
    import torch

    return torch.stack(list(tensors), dim=axis)


def concat(tensors: Sequence[Any], axis: int) -> Any:
    if len(tensors) == 1:
        return tensors[0]
    if is_paddle(tensors[0]):
        import paddle

        return paddle.concat(list(tensors), axis=axis)
    import torch

    return torch.cat(list(tensors), dim=axis)


def reshape(t: Any, shape: Sequence[int]) -> Any:
    return t.reshape(list(shape)) if is_paddle(t) else t.reshape(tuple(shape))


def view_dtype(t: Any, name: str) -> Any:
    """``t`` (contiguous) seen as dtype ``name`` (same memory)."""
    if is_paddle(t):
        import paddle

        return t.view(getattr(paddle, name))
    import torch

    return t.view(getattr(torch, name))


def zeros(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """A new zero tensor of ``like``'s framework and device."""
    if is_paddle(like):
        import paddle

        return paddle.zeros(list(shape), dtype=dtype, device=like.place)
    import torch

    return torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=like.device)

"""Framework plumbing shared by the ops: torch/paddle conversion, dtypes, backend choice.

Every op computes on torch tensors. A paddle tensor is turned into a torch tensor over the same
memory with DLPack (zero-copy), so a kernel launched on the torch view writes into the paddle
tensor. paddle and triton are imported lazily: ``hybridkv.ops`` imports without them.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
from typing import Any

import numpy as np
import torch

from hybridkv.models.spec import DType

_TORCH_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.INT64: torch.int64,  # token ids and positions some caches keep (Qwen4-exp)
}


class Framework(enum.Enum):
    TORCH = "torch"
    PADDLE = "paddle"


class Backend(enum.Enum):
    AUTO = "auto"
    NAIVE = "naive"
    TRITON = "triton"


def torch_dtype(dtype: DType) -> torch.dtype:
    return _TORCH_DTYPES[DType.parse(dtype)]


def is_paddle_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("paddle") and hasattr(x, "place")


def to_torch(x: Any) -> torch.Tensor:
    """A torch tensor over the memory of ``x`` (paddle: a DLPack view; numpy: a view; lists: a new tensor)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if is_paddle_tensor(x):
        return torch.from_dlpack(x)
    if isinstance(x, list | tuple | range):
        return torch.as_tensor(list(x))
    raise TypeError(f"expected a torch tensor, a paddle tensor or a numpy array, got {type(x).__name__}")


def from_torch(t: torch.Tensor, framework: Framework) -> Any:
    """``t`` as a tensor of ``framework`` over the same memory (paddle: a DLPack view)."""
    if framework is Framework.TORCH:
        return t
    import paddle

    return paddle.utils.dlpack.from_dlpack(t)


class DeviceMismatchError(ValueError):
    """Pools, state buffers or ids of one op call live on different devices."""


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with an index: ``"cuda"`` without one means torch's current CUDA device, for torch
    *and* paddle allocations alike (paddle's own current place is not consulted)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def require_device(expected: torch.device, actual: torch.device, what: str) -> None:
    """Raise :class:`DeviceMismatchError` unless ``what`` is on the pools' device ``expected``."""
    if actual != expected:
        raise DeviceMismatchError(
            f"{what}: on {actual}, but the pools are on {expected}; put it on {expected} "
            "(ids may also come from the host: a list, numpy array or CPU tensor is copied there)"
        )


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a Triton launch (Triton launches on the current device and stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def paddle_place_for(device: torch.device) -> Any:
    import paddle

    device = resolve_device(device)
    if device.type == "cuda":
        return paddle.CUDAPlace(0 if device.index is None else device.index)
    return paddle.CPUPlace()


def paddle_zeros(shape: list[int], device: torch.device) -> Any:
    """A zero uint8 paddle tensor allocated directly on ``device``'s place (paddle >= 3.0 takes ``device=``)."""
    import paddle

    place = paddle_place_for(device)
    try:
        return paddle.zeros(shape, dtype="uint8", device=place)
    except TypeError:  # older paddle: allocate on the current place, then move
        return paddle.zeros(shape, dtype="uint8").to(place)


def resolve_backend(backend: Backend | str, device: torch.device) -> Backend:
    """``auto``: Triton on CUDA tensors (when installed), the reference elsewhere.

    ``triton`` off CUDA needs TRITON_INTERPRET=1 (raises ``RuntimeError`` otherwise)."""
    choice = Backend(backend) if isinstance(backend, str) else backend
    if choice is Backend.AUTO:
        has_triton = importlib.util.find_spec("triton") is not None
        return Backend.TRITON if device.type == "cuda" and has_triton else Backend.NAIVE
    if choice is Backend.TRITON and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' on a {device.type} tensor needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before starting Python, or use backend='auto'"
        )
    return choice


def widest_word(*values: int) -> int:
    """Largest word size in bytes (8, 4, 2 or 1) dividing every value (offsets, sizes, addresses)."""
    for word in (8, 4, 2):
        if all(v % word == 0 for v in values):
            return word
    return 1


VECTOR_BYTES = 16  # widest load/store of one thread
TILE_BYTES = 8192  # most bytes one program moves
NUM_WARPS = 4
MAX_GRID_YZ = 65_535  # CUDA's limit on grid axes 1 and 2 (axis 0 allows 2**31 - 1)


def word_and_align(*values: int) -> tuple[int, int]:
    """``(word, align)``: the widest word (8, 4, 2 or 1 bytes) dividing every value (offsets, sizes,
    addresses), and how many such words (1 or 2) every value is a multiple of, up to 16 bytes.

    The five outcomes, by the largest power of two up to 16 dividing all values, are (1, 1), (2, 1),
    (4, 1), (8, 1) and (8, 2): these are the kernel variants ``ptx_check`` compiles."""
    align_bytes = next(a for a in (16, 8, 4, 2, 1) if all(v % a == 0 for v in values))
    word = min(align_bytes, 8)
    return word, align_bytes // word


def tile_words(word: int, align: int) -> int:
    """Words one program moves: 8 KiB, or fewer when narrow unaligned words would give each thread more
    than 8 separate accesses (each a 64-bit address in registers: 64 byte loads per thread spill)."""
    return min(TILE_BYTES // word, 32 * NUM_WARPS * align * 8)


WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def as_words(flat_bytes: torch.Tensor, word: int) -> torch.Tensor:
    """A 1-D uint8 tensor viewed as ``word``-byte integers (same memory; sizes must divide)."""
    return flat_bytes.view(WORD_DTYPES[word])

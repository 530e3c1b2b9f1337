"""Framework plumbing shared by the ops: torch/paddle conversion, dtypes, devices, backend choice.

No tensor framework is imported here at import time: torch, paddle and triton are imported by the
function that needs them, so ``hybridkv.ops`` imports with Paddle and no torch (a FastDeploy
deployment) as well as with torch and no Paddle. Torch tensors go through the torch paths as they
always did; Paddle tensors go through :mod:`hybridkv.ops._paddle` (references in Paddle, Triton
kernels launched on the Paddle tensors under Paddle's torch-compat guard, as FastDeploy launches its
own), except under Triton's CPU interpreter, which only takes torch tensors: there a Paddle tensor is
seen through a zero-copy DLPack torch view.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridkv.models.spec import DType

if TYPE_CHECKING:
    import torch

# token ids and positions some caches keep (Qwen4-exp) are int64
_DTYPE_NAMES = {DType.FLOAT32: "float32", DType.BFLOAT16: "bfloat16", DType.FLOAT16: "float16", DType.INT64: "int64"}


class Framework(enum.Enum):
    TORCH = "torch"
    PADDLE = "paddle"


class Backend(enum.Enum):
    AUTO = "auto"
    NAIVE = "naive"
    TRITON = "triton"


def dtype_name(dtype: DType | str) -> str:
    """The framework-neutral name of a state / KV dtype (``"float32"``, ``"bfloat16"``, ...)."""
    return _DTYPE_NAMES[DType.parse(dtype)]


def torch_dtype(dtype: DType | str) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(dtype))


def paddle_dtype(dtype: DType | str) -> Any:
    import paddle

    return getattr(paddle, dtype_name(dtype))


def is_paddle_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("paddle") and hasattr(x, "place")


def interpreter_on() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): it takes torch tensors only."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class DeviceId:
    """Where a Paddle tensor lives, in torch's words (``type`` ``"cpu"`` or ``"cuda"``, ``index``),
    without importing torch. Compares equal to a ``torch.device`` naming the same device."""

    type: str
    index: int | None = None

    def __eq__(self, other: object) -> bool:
        kind, index = getattr(other, "type", None), getattr(other, "index", None)
        return kind is not None and (kind, index) == (self.type, self.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def paddle_device(t: Any) -> DeviceId:
    """The :class:`DeviceId` of a Paddle tensor's place (``cpu``, ``cuda:N``; pinned host is ``cpu``)."""
    place = t.place
    if place.is_gpu_place():
        return DeviceId("cuda", place.gpu_device_id())
    return DeviceId("cpu")


@contextlib.contextmanager
def paddle_compat() -> Any:
    """Paddle's torch-compat guard around a Triton launch on Paddle tensors: inside it, Triton's own
    ``import torch`` (device, stream, tensor checks) is served by Paddle, which is what FastDeploy's
    ``enable_compat_on_triton_kernel`` does for its kernels. Paddle >= 3.3 has ``use_compat_guard``."""
    import paddle

    guard = getattr(paddle, "use_compat_guard", None)
    if guard is None:
        raise RuntimeError(
            f"launching Triton kernels on Paddle tensors needs paddle.use_compat_guard (Paddle >= 3.3), "
            f"this is Paddle {paddle.__version__}"
        )
    with guard(enable=True, silent=True):
        yield


def to_torch(x: Any) -> torch.Tensor:
    """A torch tensor over the memory of ``x`` (paddle: a DLPack view; numpy: a view; lists: a new tensor).
    Imports torch: the torch paths and the interpreter only."""
    import torch

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
    *and* paddle allocations alike (paddle's own current place is not consulted). Torch allocations
    only; Paddle allocations use :func:`resolve_paddle_device`."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def resolve_paddle_device(device: Any) -> DeviceId:
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"gpu:N"``, a ``torch.device`` or a
    :class:`DeviceId`) as a :class:`DeviceId` with an index; ``"cuda"`` without one is Paddle's
    current device. Imports no torch."""
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind is None:
        name, _, num = str(device).partition(":")
        kind, index = ("cuda" if name in ("cuda", "gpu") else name), (int(num) if num else None)
    if kind == "cuda" and index is None:
        import paddle

        index = paddle.device.get_device().partition(":")[2]
        index = int(index) if index else 0
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N] (gpu:N), got {device!r}")
    return DeviceId(kind, index if kind == "cuda" else None)


def require_device(expected: Any, actual: Any, what: str) -> None:
    """Raise :class:`DeviceMismatchError` unless ``what`` is on the pools' device ``expected``."""
    if actual != expected:
        raise DeviceMismatchError(
            f"{what}: on {actual}, but the pools are on {expected}; put it on {expected} "
            "(ids may also come from the host: a list, numpy array or CPU tensor is copied there)"
        )


def device_guard(device: Any) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a Triton launch (Triton launches on the current device and stream).
    A :class:`DeviceId` (Paddle tensors) is made current with Paddle's ``set_device`` for the launch."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if isinstance(device, DeviceId):
        return _paddle_device_guard(device)
    import torch

    return torch.cuda.device(device)


@contextlib.contextmanager
def _paddle_device_guard(device: DeviceId) -> Any:
    import paddle

    before = paddle.device.get_device()
    paddle.device.set_device(f"gpu:{device.index or 0}")
    try:
        yield
    finally:
        paddle.device.set_device(before)


def paddle_place_for(device: Any) -> Any:
    import paddle

    device = resolve_paddle_device(device)
    if device.type == "cuda":
        return paddle.CUDAPlace(0 if device.index is None else device.index)
    return paddle.CPUPlace()


def paddle_zeros(shape: list[int], device: Any) -> Any:
    """A zero uint8 paddle tensor allocated directly on ``device``'s place (paddle >= 3.0 takes ``device=``)."""
    import paddle

    place = paddle_place_for(device)
    try:
        return paddle.zeros(shape, dtype="uint8", device=place)
    except TypeError:  # older paddle: allocate on the current place, then move
        return paddle.zeros(shape, dtype="uint8").to(place)


def resolve_backend(backend: Backend | str, device: Any) -> Backend:
    """``auto``: Triton on CUDA tensors (when installed), the reference elsewhere.

    ``triton`` off CUDA needs TRITON_INTERPRET=1 (raises ``RuntimeError`` otherwise)."""
    choice = Backend(backend) if isinstance(backend, str) else backend
    if choice is Backend.AUTO:
        has_triton = importlib.util.find_spec("triton") is not None
        return Backend.TRITON if device.type == "cuda" and has_triton else Backend.NAIVE
    if choice is Backend.TRITON and device.type != "cuda" and not interpreter_on():
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


WORD_NAMES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def __getattr__(name: str) -> Any:
    if name == "WORD_DTYPES":  # torch dtypes by word size, for torch callers (imports torch)
        import torch

        return {w: getattr(torch, n) for w, n in WORD_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_words(flat_bytes: Any, word: int) -> Any:
    """A 1-D uint8 tensor (torch or Paddle) viewed as ``word``-byte integers (same memory; sizes must divide)."""
    if is_paddle_tensor(flat_bytes):
        import paddle

        return flat_bytes.view(getattr(paddle, WORD_NAMES[word]))
    import torch

    return flat_bytes.view(getattr(torch, WORD_NAMES[word]))

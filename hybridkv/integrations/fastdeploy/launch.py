"""Launching :mod:`.kernels` from the layer API: framework glue, the pointer row, the tile sizes.

Tensors may be Paddle (a FastDeploy worker: launched inside Paddle's torch-compat guard, as FastDeploy
launches its own Triton kernels, with no torch imported) or torch. Off CUDA the kernels run only in
Triton's interpreter (``TRITON_INTERPRET=1``), which takes torch tensors: there Paddle tensors are seen
through zero-copy DLPack torch views, so the kernels write the Paddle memory itself. The step's fields
(``cu_seqlens_q``, ``seq_lens_decoder``, ``state_block_tables``) are used where they are: a device
tensor is never read on the host (numpy fields, as tests pass them, are copied to the device once).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import numpy as np

from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.worker import StateLayerSlot
from hybridkv.models.spec import RecurrentLayerSpec
from hybridkv.ops._framework import device_guard, interpreter_on, is_paddle_tensor, paddle_compat, paddle_device
from hybridkv.planner.layout import Layout

MAX_STATE_TILE = 2048  # state elements per program (as hybridkv.ops.lightning's decode kernel)
MAX_CONV_CHANNELS = 256
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def use_kernel(slot: StateLayerSlot, backend: str) -> bool:
    """``backend``: ``"auto"`` (the kernel on CUDA when Triton is installed, the reference elsewhere),
    ``"triton"`` (the kernel: needs CUDA, or ``TRITON_INTERPRET=1`` and torch for CPU tensors) or
    ``"naive"`` (the reference). Raises ``ValueError`` for another name, ``RuntimeError`` for
    ``"triton"`` on CPU tensors without the interpreter."""
    if backend not in ("auto", "naive", "triton"):
        raise ValueError(f"backend must be 'auto', 'naive' or 'triton', got {backend!r}")
    on_gpu = _device(slot.segments[0]).type == "cuda"
    if backend == "auto":
        return on_gpu and importlib.util.find_spec("triton") is not None
    if backend == "triton" and not on_gpu and not interpreter_on():
        raise RuntimeError("backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1")
    return backend == "triton"


def _device(t: Any) -> Any:
    return paddle_device(t) if is_paddle_tensor(t) else t.device


def _contiguous(t: Any) -> Any:
    return t.contiguous()


def _strides(t: Any) -> list[int]:
    """Element strides of a contiguous tensor."""
    shape = [int(d) for d in t.shape]
    return [int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape))]


def _field(x: Any, like: Any, what: str) -> Any:
    """A step field as a contiguous tensor on ``like``'s device (numpy: copied there once)."""
    if x is None:
        raise ValueError(f"forward_meta.{what} is not set (patches W2 / W3 set it)")
    if isinstance(x, np.ndarray | list | tuple):
        return tensors_.to_like(np.ascontiguousarray(np.asarray(x, dtype=np.int64)), like)
    return _contiguous(x)


_DECAYS: dict[tuple, Any] = {}


def decay_row(slopes: Any, like: Any) -> Any:
    """``exp(-slopes)`` ``[H]`` float32 on ``like``'s device, built once per set of slopes (computed in
    float64 on the host, like the reference)."""
    key = (tuple(float(s) for s in np.asarray(slopes, dtype=np.float64).reshape(-1)), str(_device(like)))
    row = _DECAYS.get(key)
    if row is None:
        row = _DECAYS[key] = tensors_.to_like(np.exp(-np.array(key[0])).astype(np.float32), like)
    return row


def state_args(forward_meta: Any, slot: StateLayerSlot, layout: Layout, spec: RecurrentLayerSpec, name: str):
    """``(ptrs, table, cu, dec, component_base, block_elems, segment_elems, DT)`` of component ``name``
    of the layer's state, in elements of its dtype. Raises ``ValueError`` if the layout's sizes are not
    whole elements (the kernels address elements)."""
    import triton.language as tl

    from hybridkv.ops.segments import pointer_row

    first = slot.segments[0]
    comp = spec.component(name)
    dtype = comp.dtype.value
    size = _ITEMSIZE.get(dtype)
    base = spec.component_offsets()[name]
    if size is None or any(v % size for v in (base, layout.block_bytes, layout.segment_bytes)):
        raise ValueError(
            f"the layer kernels address {dtype} states at element boundaries: component {name!r} at byte "
            f"{base}, blocks of {layout.block_bytes}, segments of {layout.segment_bytes} bytes"
        )
    tables = forward_meta.state_block_tables
    table = _field(tables[slot.group] if tables is not None else None, first, "state_block_tables")
    cu = _field(forward_meta.cu_seqlens_q, first, "cu_seqlens_q")
    dec = _field(forward_meta.seq_lens_decoder, first, "seq_lens_decoder")
    if int(cu.shape[0]) != int(dec.shape[0]) + 1 or int(table.shape[0]) < int(dec.shape[0]):
        raise ValueError(f"cu_seqlens_q needs one entry per batch slot plus one and the state tables a row per slot: "
                         f"{list(cu.shape)}, {list(dec.shape)}, {list(table.shape)}")  # fmt: skip
    dt = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}[dtype]
    return pointer_row(slot.segments), table, cu, dec, base // size, layout.block_bytes // size, \
        layout.segment_bytes // size, dt  # fmt: skip


def launch(kernel: Any, grid: tuple[int, ...], tensors: list[Any], scalars: list[Any], **constexprs: Any) -> None:
    """``kernel[grid](*tensors, *scalars, **constexprs)`` on the tensors' device: Paddle CUDA tensors
    inside Paddle's compat guard; Paddle CPU tensors (interpreter) as DLPack torch views."""
    device = _device(tensors[0])
    paddle_args = [is_paddle_tensor(t) for t in tensors]
    if any(paddle_args) and device.type != "cuda":
        from hybridkv.ops._framework import to_torch

        # each tensor on its own: the pointer row may be a torch tensor beside Paddle caches
        tensors = [to_torch(t) if p else t for t, p in zip(tensors, paddle_args, strict=True)]
        guard: Any = contextlib.nullcontext()
    else:
        guard = paddle_compat() if any(paddle_args) else contextlib.nullcontext()
    with guard, device_guard(device):
        kernel[grid](*tensors, *scalars, **constexprs)


def state_tiles(dk: int, dv: int) -> tuple[int, int]:
    """(BK, BV): all of ``d_k`` (a power of two) by as many value columns as the tile allows."""
    import triton

    bk = triton.next_power_of_2(dk)
    return bk, min(triton.next_power_of_2(dv), max(1, MAX_STATE_TILE // bk))


def output_like(v: Any, shape: tuple[int, ...]) -> Any:
    """A zero tensor ``shape`` of ``v``'s framework, device and dtype (the layer's output)."""
    return tensors_.zeros(v, shape, str(v.dtype).rpartition(".")[2])


# ---- the three layer kernels: shapes were checked by the layer API -----------------------------------
def lightning(q: Any, k: Any, v: Any, slopes: Any, forward_meta: Any, slot: StateLayerSlot, layout: Layout,
              spec: RecurrentLayerSpec) -> Any:  # fmt: skip
    """:func:`.layers.lightning_attention` on the kernel: one launch, ``[num_tokens, H, d_v]`` out."""
    from hybridkv.integrations.fastdeploy.kernels import lightning_kernel

    comp = spec.components[0]
    heads, dk, dv = comp.shape
    ptrs, table, cu, dec, base, block_elems, seg_elems, dt = state_args(forward_meta, slot, layout, spec, comp.name)
    q, k, v = (_contiguous(x) for x in (q, k, v))
    out = output_like(v, tuple(int(d) for d in v.shape))
    bk, bv = state_tiles(dk, dv)
    grid = (int(dec.shape[0]), heads, -(-dv // bv))
    sq, sv = _strides(q), _strides(v)
    launch(lightning_kernel, grid, [ptrs, table, cu, dec, q, k, v, out, decay_row(slopes, ptrs)],
           [_strides(table)[0], sq[0], sq[1], sv[0], sv[1], sv[0], sv[1], base, block_elems, seg_elems],
           DK=dk, DV=dv, BK=bk, BV=bv, DT=dt, F64=False)  # fmt: skip
    return out


def conv(x: Any, weight: Any, forward_meta: Any, slot: StateLayerSlot, layout: Layout,
         spec: RecurrentLayerSpec) -> Any:  # fmt: skip
    """:func:`.layers.gdn_conv` on the kernel: one launch, ``[num_tokens, conv_dim]`` out."""
    import triton

    from hybridkv.integrations.fastdeploy.kernels import conv_kernel

    dim, taps = spec.component("conv").shape
    ptrs, table, cu, dec, base, block_elems, seg_elems, dt = state_args(forward_meta, slot, layout, spec, "conv")
    weight = tensors_.to_like(weight, x) if isinstance(weight, np.ndarray) else weight
    x, weight = _contiguous(x), _contiguous(weight)
    out = output_like(x, tuple(int(d) for d in x.shape))
    bc = min(triton.next_power_of_2(dim), MAX_CONV_CHANNELS)
    grid = (int(dec.shape[0]), -(-dim // bc))
    launch(conv_kernel, grid, [ptrs, table, cu, dec, x, weight, out],
           [_strides(table)[0], dim, dim, base, block_elems, seg_elems],
           DIM=dim, TAPS=taps, BT=triton.next_power_of_2(taps), BC=bc, DT=dt, F64=False)  # fmt: skip
    return out


def gated_delta(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, forward_meta: Any, slot: StateLayerSlot,
                layout: Layout, spec: RecurrentLayerSpec) -> Any:  # fmt: skip
    """:func:`.layers.gated_delta_rule` on the kernel: one launch, ``[num_tokens, Hv, d_v]`` out."""
    from hybridkv.integrations.fastdeploy.kernels import gated_delta_kernel

    hv, dk, dv = spec.component("ssm").shape
    ptrs, table, cu, dec, base, block_elems, seg_elems, dt = state_args(forward_meta, slot, layout, spec, "ssm")
    q, k, v, g, beta = (_contiguous(a) for a in (q, k, v, g, beta))
    out = output_like(v, tuple(int(d) for d in v.shape))
    bk, bv = state_tiles(dk, dv)
    grid = (int(dec.shape[0]), hv, -(-dv // bv))
    sq, sv = _strides(q), _strides(v)
    launch(gated_delta_kernel, grid, [ptrs, table, cu, dec, q, k, v, g, beta, out],
           [_strides(table)[0], sq[0], sq[1], sv[0], sv[1], hv, sv[0], sv[1], float(scale), base, block_elems,
            seg_elems],
           REP=hv // int(q.shape[1]), DK=dk, DV=dv, BK=bk, BV=bv, DT=dt, F64=False)  # fmt: skip
    return out

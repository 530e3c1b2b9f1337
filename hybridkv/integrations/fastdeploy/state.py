"""A recurrent layer's state bytes in FastDeploy's cache allocations: the reference path (index
moves in the caches' own framework: Paddle, with no torch, or torch) over per-segment base pointers.

State byte ``o`` of block ``j`` of a state set lies in segment ``(o - j * block_bytes) //
segment_bytes`` of that block's row, in the layer slot's allocations (:class:`StateLayerSlot`).
Every function checks its arguments (real block ids of the layout, widths, dtypes) before it reads
or writes anything. Split from :mod:`hybridkv.integrations.fastdeploy.worker`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.worker import StateLayerSlot, check_block_ids
from hybridkv.planner.layout import Layout
from hybridkv.units import as_count


def _state_spans(layout: Layout, nbytes: int) -> list[tuple[int, int, int, int]]:
    """``(j, segment, start, length)`` pieces of a state's first ``nbytes`` flat bytes: block ``j`` of
    the set holds bytes ``[j*block_bytes, (j+1)*block_bytes)``, segment by segment."""
    spans, seg = [], layout.segment_bytes
    for j in range(-(-nbytes // layout.block_bytes)):
        for k in range(layout.num_segments):
            start = j * layout.block_bytes + k * seg
            if start < nbytes:
                spans.append((j, k, start, min(seg, nbytes - start)))
    return spans


def _state_rows(slot: StateLayerSlot, layout: Layout, tables: Any, nbytes: int, what: str) -> np.ndarray:
    """Checked state sets ``tables`` ``[B, >= ceil(nbytes / block_bytes)]`` as numpy int64: real block
    ids of ``layout`` (no padding: a -1 row would address the last block), wide enough for ``nbytes``,
    which may not exceed the slot's state set (``blocks_per_state[group] * block_bytes``)."""
    if not isinstance(slot, StateLayerSlot):
        raise TypeError(f"{what} needs a StateLayerSlot (FastDeployCaches.layer_slots), got {type(slot).__name__}")
    if not isinstance(layout, Layout):
        raise TypeError(f"{what} needs a Layout, got {type(layout).__name__}")
    nbytes = as_count(nbytes, f"{what} nbytes")
    capacity = layout.blocks_per_state[slot.group] * layout.block_bytes
    if nbytes > capacity:
        raise ValueError(f"{what}: {nbytes} bytes exceed the state set of group {slot.group} ({capacity} bytes)")
    rows = check_block_ids(layout, tables, f"{what} tables")
    if rows.ndim != 2:
        raise ValueError(f"{what}: tables must be [batch, blocks], got shape {list(rows.shape)}")
    need = -(-nbytes // layout.block_bytes)
    if rows.shape[1] < need:
        raise ValueError(f"{what}: {nbytes} bytes span {need} blocks, the tables have {rows.shape[1]} columns")
    return np.ascontiguousarray(rows)


def _use_kernel(slot: StateLayerSlot, backend: str) -> bool:
    """``backend``: ``"naive"`` (index moves), ``"triton"`` (:mod:`hybridkv.ops.segments`, one launch
    over the segments' pointer table) or ``"auto"`` (Triton on CUDA when installed)."""
    if backend not in ("auto", "naive", "triton"):
        raise ValueError(f"backend must be 'auto', 'naive' or 'triton', got {backend!r}")
    if backend != "auto":
        return backend == "triton"
    import importlib.util

    first = slot.segments[0]
    on_gpu = first.place.is_gpu_place() if tensors_.is_paddle(first) else first.device.type == "cuda"
    return on_gpu and importlib.util.find_spec("triton") is not None


def gather_state_bytes(slot: StateLayerSlot, layout: Layout, tables: Any, nbytes: int, backend: str = "auto") -> Any:
    """The first ``nbytes`` of each row's state: uint8 ``[B, nbytes]`` (a new tensor of the segments'
    framework and device) from state sets ``tables`` int ``[B, >= ceil(nbytes / block_bytes)]`` (rows
    of ``state_block_tables[group]``). Reference path over per-segment base pointers: byte ``o`` of
    segment ``k`` of block ``b`` is at ``segments[k] + b * segment_bytes + o``; one index move per
    segment for the whole blocks, one per (last block, segment) for the rest. The tables are checked
    on the host first (real block ids only, see :func:`check_block_ids`). ``backend``: see
    :func:`_use_kernel` (the kernel path gives the same bytes)."""
    rows = _state_rows(slot, layout, tables, nbytes, "gather_state_bytes")
    segs, batch = slot.segments, rows.shape[0]
    if _use_kernel(slot, backend):
        from hybridkv.ops import segments as segment_ops

        out = tensors_.zeros(segs[0], (batch, nbytes), "uint8")
        segment_ops.run(False, segs, layout, rows, out)
        return out
    full = nbytes // layout.block_bytes  # whole blocks: one index move per segment
    pieces = []
    if full:
        idx = tensors_.index(segs[0], rows[:, :full].reshape(-1))
        whole = tensors_.stack([tensors_.reshape(seg[idx], (batch, full, layout.segment_bytes)) for seg in segs], 2)
        pieces.append(tensors_.reshape(whole, (batch, full * layout.block_bytes)))
    for j, k, _start, length in _state_spans(layout, nbytes):
        if j >= full:  # the last block's used part
            pieces.append(segs[k][tensors_.index(segs[k], rows[:, j])][:, :length])
    return tensors_.concat(pieces, axis=1)


def scatter_state_bytes(slot: StateLayerSlot, layout: Layout, tables: Any, data: Any, backend: str = "auto") -> None:
    """Write ``data`` uint8 ``[B, nbytes]`` (numpy, or a tensor of any framework) into the state sets
    ``tables``, in place, in the segments' framework. Checks the tables (as
    :func:`gather_state_bytes`) and ``data``'s dtype and shape before writing."""
    dtype = str(getattr(data, "dtype", np.asarray(data).dtype)).rpartition(".")[2]
    shape = tuple(int(d) for d in getattr(data, "shape", np.shape(data)))
    if dtype != "uint8" or len(shape) != 2:
        raise TypeError(f"scatter_state_bytes: data must be uint8 [batch, nbytes], got {dtype} {list(shape)}")
    rows = _state_rows(slot, layout, tables, shape[1], "scatter_state_bytes")
    if rows.shape[0] != shape[0]:
        raise ValueError(f"scatter_state_bytes: {rows.shape[0]} table rows for {shape[0]} data rows")
    segs = slot.segments
    data = tensors_.to_like(data, segs[0])
    if _use_kernel(slot, backend):
        from hybridkv.ops import segments as segment_ops

        segment_ops.run(True, segs, layout, rows, data.contiguous())
        return
    full = shape[1] // layout.block_bytes  # whole blocks: one index move per segment
    if full:
        idx = tensors_.index(segs[0], rows[:, :full].reshape(-1))
        head = tensors_.reshape(data[:, : full * layout.block_bytes], (shape[0], full, layout.num_segments, -1))
        for k, seg in enumerate(segs):
            seg[idx] = tensors_.reshape(head[:, :, k], (-1, layout.segment_bytes))
    for j, k, start, length in _state_spans(layout, shape[1]):
        if j >= full:  # the last block's used part; its unused tail is left as it is
            segs[k][tensors_.index(segs[k], rows[:, j]), :length] = data[:, start : start + length]


def _state_set(slot: StateLayerSlot, layout: Layout, blocks: Sequence[int], what: str) -> np.ndarray:
    """``blocks`` as one checked state set ``[1, blocks_per_state[group]]`` (distinct real block ids)."""
    if not isinstance(slot, StateLayerSlot):
        raise TypeError(f"{what} needs a StateLayerSlot (FastDeployCaches.layer_slots), got {type(slot).__name__}")
    if not isinstance(layout, Layout):
        raise TypeError(f"{what} needs a Layout, got {type(layout).__name__}")
    ids = check_block_ids(layout, blocks, f"{what} blocks", distinct=True)
    want = layout.blocks_per_state[slot.group]
    if ids.ndim != 1 or ids.size != want:
        raise ValueError(f"{what}: state group {slot.group} needs {want} block ids, got shape {list(ids.shape)}")
    return ids[None]


def read_state_bytes(slot: StateLayerSlot, layout: Layout, blocks: Sequence[int], nbytes: int) -> np.ndarray:
    """One state's ``nbytes`` flat bytes from its state set ``blocks`` (numpy copy). ``blocks`` must be
    the ``blocks_per_state[group]`` distinct block ids of one state set."""
    rows = _state_set(slot, layout, blocks, "read_state_bytes")
    return tensors_.to_numpy(gather_state_bytes(slot, layout, rows, nbytes)[0])


def write_state_bytes(slot: StateLayerSlot, layout: Layout, blocks: Sequence[int], data: np.ndarray) -> None:
    """One state's flat bytes (uint8, 1-D) into its state set ``blocks``, in place; checked as
    :func:`read_state_bytes` before anything is written."""
    rows = _state_set(slot, layout, blocks, "write_state_bytes")
    arr = np.asarray(data)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"write_state_bytes: data must be uint8 bytes of one state, got {arr.dtype} {list(arr.shape)}")
    scatter_state_bytes(slot, layout, rows, arr[None])

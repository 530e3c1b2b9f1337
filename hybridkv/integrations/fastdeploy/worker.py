"""FastDeploy drop-in, worker side: the cache tensors and the persistent state tables of a batch.

FastDeploy's cache manager lives in the engine process and its model runner in the worker process.
What crosses between them is the task list (``Request`` for prefill, ``ScheduledDecodeTask``,
``ScheduledPreemptTask``). The engine facade adds three fields to the prefill and decode tasks
(:data:`~hybridkv.integrations.fastdeploy.facade.HYBRID_TASK_FIELDS`); here they land in buffers
indexed by the batch slot ``request.idx``:

- :class:`FastDeployCaches`: every tensor FastDeploy sees in ``caches`` is its own allocation
  starting at offset 0 (FastDeploy shares caches with the cache-transfer process by name through
  ``set_data_ipc``, a CUDA IPC handle of the allocation, so a view at an offset would map the wrong
  memory there). A layer slot is ``num_segments`` segments ``[num_blocks, segment_bytes]`` uint8
  (K, V, then the side segments of per-token side tensors, ``Layout.side_segments``; each its own
  allocation, or, when K and V take several segments each, K's in one allocation, V's in the next
  and the side run in a third) plus, for ``block_wise_fp8``, two scale allocations. Recurrent state lives in the
  same K/V allocations, addressed per segment base pointer (:mod:`.state`).
- :func:`kv_cache_list`: the one function that builds FastDeploy's ``caches``:
  ``caches[2*l]`` / ``[2*l+1]`` (``[4*l .. 4*l+3]`` with scales) for attention layer ``l``.
- :class:`StateTables`: ``state_block_tables`` int32 ``[num_state_groups, max_num_seqs,
  blocks_per_state]``, allocated once and updated in place from the tasks, like FastDeploy's
  ``share_inputs["block_tables"]``; rows without a live request are -1, FastDeploy's padding.
- the host tier's pool and copies (W6) are in :mod:`.host_tier`.

Every public entry point checks its arguments before it writes anything: batch slots must be
integers in ``[0, max_num_seqs)`` (:class:`BatchSlotError` otherwise; a negative slot would index
another slot's row), block ids integers naming a real block of the layout, ``1 .. num_blocks - 1``
(:class:`BlockIdError` for the null block 0, the padding -1, ids past the pool or a repeated id;
``TypeError`` for bools, floats, strings).

torch and paddle are imported lazily, each only for tensors of its own (a Paddle worker needs no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybridkv.errors import HybridKVError
from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.models.spec import AttentionLayerSpec, DType
from hybridkv.planner.layout import NULL_BLOCK, Layout
from hybridkv.units import as_count, is_integer

if TYPE_CHECKING:
    pass

PAD_BLOCK = -1
"""FastDeploy pads ``block_tables`` rows with -1; state tables use the same value."""

FRAMEWORKS = ("paddle", "torch")


class BatchSlotError(HybridKVError, IndexError):
    """A batch slot (``request.idx``) outside ``[0, max_num_seqs)``."""


class BlockIdError(HybridKVError, ValueError):
    """A block id that names no real block of the layout (the null block, the padding -1, past the
    pool) or that repeats where each id must be distinct; nothing was written."""


def _check_framework(framework: object) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    return str(framework)


def _host_array(values: Any, what: str) -> np.ndarray:
    """``values`` (a numpy / torch / paddle array, or nested sequences of integers) as a numpy int64
    array, refusing anything that is not integers. No range check (see :func:`check_block_ids`)."""
    if isinstance(values, np.ndarray):
        arr = values
    elif hasattr(values, "numpy") and hasattr(values, "shape"):  # a torch or paddle tensor
        arr = values.detach().cpu().numpy() if hasattr(values, "detach") else values.numpy()
    else:
        if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
            raise TypeError(f"{what} must be a sequence of block ids, got {values!r} ({type(values).__name__})")
        _check_ints(values, what)
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            raise BlockIdError(f"{what}: a block id is too large for any pool") from None
        except ValueError as e:  # ragged nesting
            raise TypeError(f"{what}: not a rectangular table of block ids ({e})") from None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integer block ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_ints(values: Any, what: str) -> None:
    for v in values:
        if is_integer(v):
            continue
        if isinstance(v, str | bytes) or not hasattr(v, "__len__"):
            raise TypeError(f"{what}: block id {v!r} ({type(v).__name__}) is not an integer")
        _check_ints(v, what)


def check_block_ids(layout: Layout, values: Any, what: str, distinct: bool = False) -> np.ndarray:
    """``values`` as numpy int64 after checking that every id is an integer (``TypeError``) naming a
    real block of ``layout``: ``NULL_BLOCK < id < num_blocks`` (:class:`BlockIdError`; 0 is the null
    block, -1 the padding). ``distinct``: no id may repeat either. Raises before anything is written."""
    arr = _host_array(values, what)
    bad = (arr <= NULL_BLOCK) | (arr >= layout.num_blocks)
    if bad.any():
        shown = sorted(set(arr[bad].tolist()))[:5]
        raise BlockIdError(
            f"{what}: {shown} are not block ids of the layout (real blocks are {NULL_BLOCK + 1}.."
            f"{layout.num_blocks - 1}; {NULL_BLOCK} is the null block, {PAD_BLOCK} the padding)"
        )
    if distinct and np.unique(arr).size != arr.size:
        values_, counts = np.unique(arr, return_counts=True)
        raise BlockIdError(f"{what}: block ids {values_[counts > 1][:5].tolist()} appear more than once")
    return arr


def _framework_of(t: Any) -> str:
    return "paddle" if type(t).__module__.startswith("paddle") else "torch"


def _dtype(framework: str, dtype: DType | str) -> Any:
    name = dtype.value if isinstance(dtype, DType) else dtype
    if framework == "paddle":
        import paddle

        return getattr(paddle, name)
    import torch

    return getattr(torch, name)


def _zeros(framework: str, shape: Sequence[int], dtype: str, device: str) -> Any:
    """A new zero tensor, allocated directly on ``device`` ("cpu", "gpu:N" or "cuda:N")."""
    if framework == "paddle":
        import paddle

        on_gpu = device.startswith(("gpu", "cuda"))
        place = paddle.CUDAPlace(int(device.partition(":")[2] or 0)) if on_gpu else paddle.CPUPlace()
        try:
            return paddle.zeros(list(shape), dtype=dtype, device=place)
        except TypeError:  # paddle < 3: allocate on the current place
            return paddle.zeros(list(shape), dtype=dtype)
    import torch

    return torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=device.replace("gpu", "cuda"))


def _view(t: Any, dtype: str, shape: Sequence[int]) -> Any:
    """``t`` (uint8, offset 0) seen as ``dtype`` of ``shape``: same memory, same start."""
    v = t if dtype == "uint8" else t.view(_dtype(_framework_of(t), dtype))
    return v.reshape(list(shape)) if _framework_of(t) == "paddle" else v.view(*shape)


def allocation_start(t: Any) -> int:
    """Address of the start of the allocation ``t`` lives in (torch storage / paddle holder)."""
    if _framework_of(t) == "paddle":
        return t.data_ptr() - t._offset()
    return t.untyped_storage().data_ptr()


def is_own_allocation(t: Any) -> bool:
    """``t`` starts at its allocation's start and spans all of it (what ``set_data_ipc`` needs)."""
    if _framework_of(t) == "paddle":
        nbytes = int(np.prod(t.shape)) * t.element_size()
        return t._offset() == 0 and t._holder_size() == nbytes
    return t.data_ptr() == t.untyped_storage().data_ptr() and t.untyped_storage().nbytes() == t.nbytes


@dataclass(frozen=True, eq=False)
class FastDeployCaches:
    """The cache tensors of one worker: one allocation per (layer slot, segment), plus scales.

    ``segments[s][k]``: uint8 ``[num_blocks, segment_bytes]``, segment ``k`` of layer slot ``s`` (all
    ``layout.num_segments``: K's, V's, then the side segments).
    ``scales[s]``: ``(k_scale, v_scale)`` float32 ``[num_blocks, kv_heads, block_size]`` when the KV
    cache is ``block_wise_fp8``, else None. ``caches`` is FastDeploy's list, built once by
    :func:`kv_cache_list`. The object owns the memory; keep it alive as long as the runner runs.
    """

    layout: Layout
    num_layers: int
    framework: str
    device: str
    segments: tuple[tuple[Any, ...], ...]
    scales: tuple[tuple[Any, Any] | None, ...]
    caches: list[Any] = field(default_factory=list)

    @property
    def stride(self) -> int:
        """Entries of ``caches`` per model layer: 4 with ``block_wise_fp8`` scales, else 2."""
        return 4 if any(s is not None for s in self.scales) else 2

    @cached_property
    def layer_slots(self) -> dict[int, StateLayerSlot]:
        """Model layer id -> :class:`StateLayerSlot` of every recurrent layer (built once)."""
        return state_layer_slots(self)

    def to_tensor(self, arr: np.ndarray) -> Any:
        """A new tensor of the caches' framework and device holding ``arr``."""
        if self.framework == "paddle":
            import paddle

            return paddle.to_tensor(np.ascontiguousarray(arr), place=self.segments[0][0].place)
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    def names(self, rank: int = 0, device_id: int = 0) -> list[str | None]:
        """The names FastDeploy shares ``caches`` under (``key_caches_{l}_rank{r}.device{d}`` ...), None
        where ``caches`` has no tensor."""
        kinds = ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales")[: self.stride]
        out: list[str | None] = []
        for i, t in enumerate(self.caches):
            kind = kinds[i % self.stride]
            out.append(None if t is None else f"{kind}_{i // self.stride}_rank{rank}.device{device_id}")
        return out


def allocate_caches(
    layout: Layout, num_layers: int | None = None, framework: str = "paddle", device: str = "cpu"
) -> FastDeployCaches:
    """Allocate a worker's caches for ``layout``: ``num_segments`` uint8 ``[num_blocks, segment_bytes]``
    tensors per layer slot, side segments included (each its own allocation, zero-filled; K's, V's
    and the side segments as three allocations when K and V take several segments), scale tensors for
    ``block_wise_fp8`` attention, and FastDeploy's ``caches`` list over them. ``num_layers`` defaults
    to the model's decoder layer count (FastDeploy's ``num_hidden_layers``; ``layout.num_decoder_layers``)
    and may not be lower; ``framework`` ``"paddle"`` or ``"torch"``."""
    if not isinstance(layout, Layout):
        raise TypeError(f"allocate_caches needs a Layout, got {type(layout).__name__}")
    framework = _check_framework(framework)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'gpu:0', got {device!r}")
    n = layout.num_decoder_layers if num_layers is None else as_count(num_layers, "num_layers")
    if n < layout.num_decoder_layers:
        raise ValueError(f"num_layers {n} is below the model's {layout.num_decoder_layers} layers")
    kv, attn, seg = layout.kv_group, _attention_spec(layout), (layout.num_blocks, layout.segment_bytes)
    runs = (layout.key_segments, layout.value_segments) if attn is not None else (1,)
    # the side run (per-token side tensors after V: indexer keys, positions) in one allocation of its own
    side = (layout.side_segments,) if attn is not None and layout.side_segments else ()
    segments, scales = [], []
    for slot in range(layout.num_layer_slots):
        if max(runs) > 1:  # K's segments in one allocation, V's in the next: each caches entry starts one
            segs = tuple(s for k in (*runs, *side) for s in _zeros(framework, (k, *seg), "uint8", device).unbind(0))
        else:
            segs = tuple(_zeros(framework, seg, "uint8", device) for _ in range(layout.num_segments))
        assert len(segs) == layout.num_segments  # every segment the layout has (state bytes span them all)
        segments.append(segs)
        has_attn = kv is not None and kv.layer_ids[slot] is not None
        if has_attn and attn is not None and attn.kv_scale_dtype is not None:
            shape = (layout.num_blocks, attn.num_kv_heads, layout.block_size)
            dt = attn.kv_scale_dtype.value
            scales.append((_zeros(framework, shape, dt, device), _zeros(framework, shape, dt, device)))
        else:
            scales.append(None)
    out = FastDeployCaches(layout, n, framework, device, tuple(segments), tuple(scales))
    out.caches.extend(kv_cache_list(out))
    return out


def _attention_spec(layout: Layout) -> AttentionLayerSpec | None:
    kv = layout.kv_group
    if kv is None:
        return None
    layer_id = next(i for i in kv.layer_ids if i is not None)
    spec = layout.model.layers[layer_id]
    assert isinstance(spec, AttentionLayerSpec)
    return spec


def kv_cache_list(caches: FastDeployCaches) -> list[Any]:
    """FastDeploy's ``caches`` over ``caches.segments``, by decoder layer (``layout.decoder_layer_id``):
    for the attention of decoder layer ``l``, ``stride*l`` is K ``[num_blocks, kv_heads, block_size,
    head_dim]`` (uint8 for int8 / fp8 KV), ``stride*l+1`` V, with ``block_wise_fp8`` ``+2`` / ``+3`` the
    K / V scales ``[num_blocks, kv_heads, block_size]``; K, V of different widths (MLA): see ops.pools
    ``kv_view_shape``. Each starts its own allocation; None where no KV (docs/fastdeploy.md)."""
    layout, stride = caches.layout, caches.stride
    out: list[Any] = [None] * (stride * caches.num_layers)
    kv = layout.kv_group
    if kv is None:
        return out
    for slot, layer_id in enumerate(kv.layer_ids):
        if layer_id is None:
            continue
        spec = layout.model.layers[layer_id]
        assert isinstance(spec, AttentionLayerSpec)
        at = stride * layout.decoder_layer_id(layer_id)
        for v, (first, n, width) in enumerate(layout.kv_segment_runs(spec)):
            t, seg = caches.segments[slot][first], layout.segment_bytes
            if n == 1:
                shape = (layout.num_blocks, spec.num_kv_heads, layout.block_size, width)
                out[at + v] = _view(t, "uint8" if spec.dtype.itemsize == 1 else spec.dtype.value, shape)
            else:  # t starts the allocation that holds the run's n segments (allocate_caches)
                from hybridkv.ops.pools import segment_kv_view

                run = t.as_strided([n, layout.num_blocks, seg], [layout.num_blocks * seg, seg, 1])
                out[at + v] = segment_kv_view(run, spec, layout.block_size)
        if stride == 4 and caches.scales[slot] is not None:
            out[at + 2], out[at + 3] = caches.scales[slot]  # type: ignore[misc]
    return out


# ---- recurrent state through the same allocations ---------------------------------------------------
class StateLayerSlot(NamedTuple):
    """Where a recurrent layer's state lives: its state group (row of ``state_block_tables``), its
    layer slot, and that slot's segment allocations (uint8 ``[num_blocks, segment_bytes]`` each, the
    memory ``caches`` shows attention as K and V)."""

    layer_id: int
    group: int
    slot: int
    segments: tuple[Any, ...]


def state_layer_slots(caches: FastDeployCaches) -> dict[int, StateLayerSlot]:
    """Model layer id -> :class:`StateLayerSlot` for every recurrent layer."""
    out = {}
    for g, group in enumerate(caches.layout.state_groups):
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is not None:
                out[layer_id] = StateLayerSlot(layer_id, g, slot, caches.segments[slot])
    return out


def copy_blocks(caches: FastDeployCaches, copies: Sequence[Sequence[int]]) -> None:
    """Run ``[[src...], [dst...]]`` block copies (a task's ``state_copies`` / ``checkpoint_copies``)
    in every allocation of ``caches``: each block's row of every segment (and scale) tensor.
    Reference path, one index move per tensor in the caches' framework (Paddle: no torch); sources
    are read before any destination is written.
    Checked first: two lists of equal length, real block ids of the layout, no destination twice."""
    if not isinstance(caches, FastDeployCaches):
        raise TypeError(f"copy_blocks needs FastDeployCaches, got {type(caches).__name__}")
    if isinstance(copies, str | bytes) or not hasattr(copies, "__len__") or len(copies) != 2:
        raise TypeError(f"copy_blocks: copies must be [[src...], [dst...]], got {copies!r}")
    src = check_block_ids(caches.layout, copies[0], "copy_blocks src")
    dst = check_block_ids(caches.layout, copies[1], "copy_blocks dst", distinct=True)
    if src.ndim != 1 or dst.ndim != 1 or src.size != dst.size:
        raise ValueError(
            f"copy_blocks: src and dst must be two lists of equal length, got shapes {list(src.shape)} and "
            f"{list(dst.shape)}"
        )
    if not src.size:
        return
    for tensors in (*caches.segments, *(s for s in caches.scales if s is not None)):
        for t in tensors:
            t[tensors_.index(t, dst)] = t[tensors_.index(t, src)]  # in the caches' own framework


# ---- state tables in persistent buffers ---------------------------------------------------------------
def _task_kind(task: Any) -> str:
    kind = getattr(task, "task_type", None)
    return str(getattr(kind, "name", kind)).upper()


class StateTables:
    """``state_block_tables`` int32 ``[num_state_groups, max_num_seqs, blocks_per_state]`` of a worker,
    allocated once, row ``i`` = the request in batch slot ``i`` (``request.idx``), updated in place.

    :meth:`apply` takes the tasks of a step as FastDeploy's runner does in ``insert_tasks_v1``:
    prefill and decode tasks carrying ``state_block_tables`` set their row (a swap-in is a decode
    task with the new sets); preempted and ``SWAP_OUT`` tasks, and :meth:`release` for a slot the
    runner marks stopped, set it to -1. A group with fewer
    ``blocks_per_state`` than the widest has its row tail -1 as well. The tensor object and its
    memory never change, so CUDA graphs may capture it.

    Every write is checked first (slots, block ids: see the module docstring); :meth:`apply` checks
    all the tasks of a step before it writes any row.
    """

    def __init__(self, layout: Layout, max_num_seqs: int, framework: str = "paddle", device: str = "cpu") -> None:
        if not isinstance(layout, Layout):
            raise TypeError(f"StateTables needs a Layout, got {type(layout).__name__}")
        max_num_seqs = as_count(max_num_seqs, "max_num_seqs", minimum=1)
        framework = _check_framework(framework)
        if not isinstance(device, str):
            raise TypeError(f"device must be a string such as 'cpu' or 'gpu:0', got {device!r}")
        self.layout = layout
        self.max_num_seqs = max_num_seqs
        self.blocks_per_state = layout.blocks_per_state
        width = max(self.blocks_per_state, default=0)
        shape = (layout.num_state_groups, max_num_seqs, width)
        self.framework = framework
        self.state_block_tables = _zeros(framework, shape, "int32", device)
        self.state_block_tables[...] = PAD_BLOCK
        self.request_ids: list[Any] = [None] * max_num_seqs

    def apply(self, tasks: Iterable[Any]) -> None:
        """Update the rows the tasks of one step name (same tensor, same memory), in task order.
        Every task is checked (slot, block ids) before any row is written: a bad task leaves all
        rows as they were. Tasks of other kinds are passed over."""
        writes: list[tuple[int, np.ndarray | None, Any]] = []
        for task in tasks:
            kind = _task_kind(task)
            if kind in ("PREEMPTED", "SWAP_OUT"):
                writes.append((self._slot(getattr(task, "idx", None), f"{kind} task"), None, None))
            elif kind in ("PREFILL", "DECODE"):
                tables = getattr(task, "state_block_tables", None)
                if tables is not None:
                    what = f"{kind} task of {getattr(task, 'request_id', None)!r}"
                    idx = self._slot(getattr(task, "idx", None), what)
                    writes.append((idx, self._row(tables, what), task.request_id))
        for idx, row, request_id in writes:
            if row is None:
                self.release(idx)
            else:
                self._write(idx, row)
                self.request_ids[idx] = request_id

    def set_row(self, idx: int, tables: Sequence[Sequence[int]], request_id: Any = None) -> None:
        """Slot ``idx`` holds ``request_id`` with state sets ``tables`` (one list of
        ``blocks_per_state[g]`` ids per state group, as ``task_fields`` sends them). Raises before
        writing: ``TypeError`` (a slot or id that is not an integer), :class:`BatchSlotError` (a slot
        outside ``[0, max_num_seqs)``), :class:`BlockIdError` (an id that is no real block of the
        layout, or repeats in the row), ``ValueError`` (wrong group or id counts)."""
        idx = self._slot(idx, "set_row")
        row = self._row(tables, "set_row")
        self._write(idx, row)
        self.request_ids[idx] = request_id

    def release(self, idx: int) -> None:
        """Slot ``idx`` holds no request: its row becomes -1 (kernels writing state in place skip it).
        The slot is checked like :meth:`set_row`'s."""
        idx = self._slot(idx, "release")
        self._write(idx, np.full(self.state_block_tables.shape[::2], PAD_BLOCK, dtype=np.int32))
        self.request_ids[idx] = None

    def _slot(self, idx: Any, what: str) -> int:
        """``idx`` as a checked batch slot in ``[0, max_num_seqs)``."""
        if not is_integer(idx):
            raise TypeError(f"{what}: batch slot must be an integer (request.idx), got {idx!r} ({type(idx).__name__})")
        if not 0 <= idx < self.max_num_seqs:
            raise BatchSlotError(
                f"{what}: batch slot {int(idx)} is outside [0, {self.max_num_seqs}) (max_num_seqs); "
                "a negative slot would overwrite another slot's row"
            )
        return int(idx)

    def _row(self, tables: Any, what: str) -> np.ndarray:
        """One slot's row int32 ``[num_state_groups, width]`` from per-group id lists, checked."""
        groups = self.layout.num_state_groups
        if isinstance(tables, str | bytes) or not hasattr(tables, "__len__"):
            raise TypeError(f"{what}: state_block_tables must be one list of block ids per state group, got {tables!r}")
        if len(tables) != groups:
            raise ValueError(f"{what}: state_block_tables has {len(tables)} groups, the layout {groups}")
        row = np.full(self.state_block_tables.shape[::2], PAD_BLOCK, dtype=np.int32)
        for g, ids in enumerate(tables):
            arr = check_block_ids(self.layout, ids, f"{what}: state group {g}")
            if arr.ndim != 1 or arr.size != self.blocks_per_state[g]:
                raise ValueError(
                    f"{what}: state group {g} needs {self.blocks_per_state[g]} block ids, got shape {list(arr.shape)}"
                )
            row[g, : arr.size] = arr
        used = row[row != PAD_BLOCK]
        if np.unique(used).size != used.size:
            values, counts = np.unique(used, return_counts=True)
            raise BlockIdError(f"{what}: block ids {values[counts > 1][:5].tolist()} appear more than once in the row")
        return row

    def _write(self, idx: int, row: np.ndarray) -> None:
        buf = self.state_block_tables
        if self.framework == "paddle":
            buf[:, idx, :] = row  # paddle's set_value: in place, as FastDeploy fills block_tables
        else:
            import torch

            buf[:, idx, :] = torch.from_numpy(row)

    def numpy(self) -> np.ndarray:
        """A host copy of ``state_block_tables`` (int32 ``[num_state_groups, max_num_seqs, width]``)."""
        return np.asarray(
            self.state_block_tables.cpu().numpy() if self.framework == "torch" else self.state_block_tables.numpy()
        )


def attach_worker(forward_meta: Any, caches: FastDeployCaches, tables: StateTables) -> Any:
    """Set ``caches``, ``state_block_tables``, ``state_layer_slots``, ``hybridkv_layout`` on ``forward_meta`` (after
    ``initialize_forward_meta``), and ``state_request_ids`` (the tables' per-slot request ids: the
    rounding seeds of int8 / fp8 states). Always the same objects: nothing is allocated per step.
    ``has_initial_state`` of a row is ``seq_lens_decoder[idx] > 0``, read by the kernel itself.
    ``TypeError`` for other objects, ``ValueError`` if the two were built for different layouts."""
    if not isinstance(caches, FastDeployCaches) or not isinstance(tables, StateTables):
        raise TypeError(
            "attach_worker needs FastDeployCaches and StateTables, "
            f"got {type(caches).__name__}, {type(tables).__name__}"
        )
    if caches.layout is not tables.layout and caches.layout != tables.layout:
        raise ValueError("attach_worker: the caches and the state tables were built for different layouts")
    forward_meta.caches = caches.caches
    forward_meta.state_block_tables = tables.state_block_tables
    forward_meta.state_layer_slots = caches.layer_slots
    forward_meta.hybridkv_layout = caches.layout  # what layers.lightning_attention addresses the states by
    forward_meta.state_request_ids = tables.request_ids  # the same list, updated in place by the tables
    return forward_meta

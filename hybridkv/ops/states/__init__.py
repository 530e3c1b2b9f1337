"""gather_states / scatter_states: state sets in the block pool <-> batched contiguous state tensors."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

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
    word_and_align,
)
from hybridkv.ops.addressing import (
    RUN_DST_BASE,
    RUN_DST_ROW_STRIDE,
    RUN_LENGTH,
    RUN_SRC_BASE,
    BufferRegion,
    state_runs,
)
from hybridkv.ops.pools import BlockPools, StateBuffers
from hybridkv.ops.states.naive import (
    computed_states_naive,
    computed_view,
    gather_states_naive,
    scatter_states_naive,
)
from hybridkv.planner.layout import NULL_BLOCK, Layout


def gather_states(
    pools: BlockPools,
    state_table: Any,
    group: int | None,
    out: StateBuffers,
    backend: Backend | str = "auto",
    validate: bool | None = None,
) -> StateBuffers:
    """Copy the state sets of ``state_table`` into ``out``, every layer of ``group`` (None: all groups) at once.

    ``state_table``: int32 ``[num_state_groups, B, >= blocks_per_state]`` (or ``[B, >= blocks_per_state]``
    for one ``group``), numpy, torch or paddle. ``out``: :class:`StateBuffers` of batch ``>= B`` holding
    ``group`` (from :func:`~hybridkv.ops.pools.allocate_state_buffers`); rows ``0..B-1`` of each
    component tensor ``[batch_size, *shape]`` are overwritten, later rows stay as they were (so one
    set of buffers serves every step of an engine). Null-block entries read as zeros. Buffers
    allocated with a ``compute_dtype`` receive int8 / fp8 / float16 components dequantized into it.
    One Triton launch on CUDA (or with
    ``backend="triton"``), the reference otherwise (torch for torch pools, Paddle for Paddle pools:
    no torch on that path). ``validate`` (default: when the table is on
    the host: numpy, lists or CPU tensors) checks block ids before they move; a table that is already a
    tensor on the pools' device is trusted unless ``validate=True`` (which synchronises). Raises
    ``ValueError`` on shapes or ids that do not fit, :class:`~hybridkv.ops._framework.DeviceMismatchError`
    when the buffers or a device table are not on the pools' device. Returns ``out``.
    """
    _run(False, pools, state_table, group, out, backend, validate)
    return out


def scatter_states(
    pools: BlockPools,
    state_table: Any,
    group: int | None,
    src: StateBuffers,
    backend: Backend | str = "auto",
    validate: bool | None = None,
    seeds: Any = None,
) -> None:
    """Write ``src``'s states into the state sets of ``state_table`` (the inverse of :func:`gather_states`).

    Only the bytes of each state are written (the unused tail of a last block and all other blocks
    stay as they were); null-block entries are skipped, so padding rows write nothing. A block id may
    appear only once among the written state sets (checked when ``validate``). Raises ``ValueError``.

    Buffers allocated with a ``compute_dtype`` hold int8 / fp8 / float16 components as values: they
    are quantized here (per scale group, scales written beside the values), rounded to nearest, or
    stochastically with ``seeds`` (int64 ``[>= B]``, one per table row, e.g. from
    :func:`~hybridkv.ops.states.quant.rounding_seeds` of (request, position)): the same seeds write
    the same bytes.
    """
    _run(True, pools, state_table, group, src, backend, validate, seeds)


class _Selection(NamedTuple):
    """What one (buffers, group, table rank) call moves; computed once and cached on the buffers."""

    groups: tuple[int, ...]
    table_group: dict[int, int]  # state group -> its row in the (3-D) state table
    widths: list[int]  # blocks_per_state of each selected group
    regions: tuple[BufferRegion, ...]  # moved as bytes
    offsets: tuple[int, ...]  # every region's state offset, size and buffer offset (for the alignment)
    computed: tuple[BufferRegion, ...] = ()  # quantized or float16 components held in a compute dtype


def _select(pools: BlockPools, buffers: StateBuffers, group: int | None, table_dim: int) -> _Selection:
    key = ("selection", group, table_dim)
    cached = buffers.cache.get(key)
    if cached is not None and buffers.layout is pools.layout:
        return cached
    layout = pools.layout
    if buffers.layout is not layout and buffers.layout != layout:
        raise ValueError("state buffers were allocated for a different layout than the pools")
    if group is not None and not 0 <= group < layout.num_state_groups:
        raise ValueError(f"state group {group} does not exist: the layout has {layout.num_state_groups}")
    groups = tuple(range(layout.num_state_groups)) if group is None else (group,)
    missing = [g for g in groups if g not in buffers.groups]
    if missing:
        raise ValueError(f"state buffers hold state groups {list(buffers.groups)}, not {missing}")
    if table_dim == 2 and group is not None:
        table_group = {group: 0}
    elif table_dim == 3:
        table_group = {g: g for g in groups}
    else:
        raise ValueError(
            f"state table has {table_dim} dimensions: expected [num_state_groups={layout.num_state_groups}, B, "
            "blocks_per_state], or [B, blocks_per_state] with an int group"
        )
    widths = [layout.blocks_per_state[g] for g in groups]
    regions = tuple(r for r in buffers.regions if r.group in groups and r.compute is None)
    computed = tuple(r for r in buffers.regions if r.group in groups and r.compute is not None)
    offsets = tuple(v for r in regions for v in (r.state_offset, r.nbytes, r.buffer_offset))
    selection = _Selection(groups, table_group, widths, regions, offsets, computed)
    buffers.cache[key] = selection
    return selection


def _run(
    scatter: bool,
    pools: BlockPools,
    state_table: Any,
    group: int | None,
    buffers: StateBuffers,
    backend: Backend | str,
    validate: bool | None,
    seeds: Any = None,
) -> None:
    pools.require_slot_major("gather_states/scatter_states")
    device = pools.device
    require_device(device, buffers.device, "state buffers")
    table = _ids.by_origin(state_table)  # host ids as numpy, a device tensor as given
    sel = _select(pools, buffers, group, table.ndim)
    num_state_groups = pools.layout.num_state_groups
    if table.ndim == 2:
        table = table[None]
    elif table.shape[0] != num_state_groups:
        raise ValueError(f"state table has {table.shape[0]} group rows, the layout {num_state_groups} state groups")
    if table.shape[1] > buffers.batch_size or table.shape[2] < max(sel.widths):
        raise ValueError(
            f"state table has shape {tuple(table.shape)}: expected a batch of at most {buffers.batch_size} "
            "(the buffers') "
            f"and at least {max(sel.widths)} block ids per row (blocks_per_state)"
        )
    host = _ids.from_host(table)
    if not host:
        require_device(device, paddle_device(table) if is_paddle_tensor(table) else table.device, "state table")
    if validate or (validate is None and host):
        _validate_ids(_ids.host_copy(table), sel.table_group, sel.widths, pools.num_blocks, scatter)
    choice = resolve_backend(backend, device)
    if pools.framework is Framework.PADDLE and not (choice is Backend.TRITON and interpreter_on()):
        _run_paddle(scatter, pools, table, sel, buffers, choice)
        if not sel.computed:
            return
        # computed components of Paddle pools: the torch reference / kernel on DLPack views (needs torch)
    import torch

    if host:
        table_t = _ids.to_device([table], device, torch.int32)[0]
    else:
        table_t = _ids.on_device(table, device, torch.int32, "state table")
    seeds_t = None if seeds is None else _ids.to_device([np.asarray(seeds, dtype=np.int64)], device, torch.int64)[0]
    if seeds_t is not None and seeds_t.shape[0] < table.shape[1]:
        raise ValueError(f"seeds has {seeds_t.shape[0]} entries, the state table {table.shape[1]} rows")
    paddle_done = pools.framework is Framework.PADDLE and not (choice is Backend.TRITON and interpreter_on())
    if choice is Backend.NAIVE:
        run = scatter_states_naive if scatter else gather_states_naive
        if not paddle_done:
            run(pools, table_t.to(torch.int64), sel.table_group, buffers, list(sel.regions))
        if sel.computed:
            computed_states_naive(
                scatter, pools, table_t.to(torch.int64), sel.table_group, buffers, list(sel.computed), seeds_t
            )
        return
    if not paddle_done:
        _launch(scatter, pools, pools.torch_data.view(-1), buffers.torch_data, table_t, sel, device)
    if sel.computed:
        _launch_computed(scatter, pools, table_t.contiguous(), sel, buffers, seeds_t, device)


def _launch_computed(
    scatter: bool, pools: BlockPools, table: Any, sel: _Selection, buffers: StateBuffers, seeds: Any, device: Any
) -> None:
    """The Triton kernel of :mod:`.kernel_quant`, one launch per computed region."""
    from hybridkv.models.dtypes import DType
    from hybridkv.ops.states import kernel_quant, quant

    layout = pools.layout
    seg, stride = layout.segment_bytes, pools.num_blocks * layout.segment_bytes
    kinds = {DType.INT8: kernel_quant.KIND_INT8, DType.FLOAT8_E4M3: kernel_quant.KIND_E4M3}
    for r in sel.computed:
        c = layout.model.layers[r.layer_id].component(r.name)  # type: ignore[union-attr]
        if (seg | r.state_offset | c.value_bytes) % 4:
            raise ValueError(f"component {r.name!r}: quantized values and scales need 4-byte aligned offsets")
        with device_guard(device):
            kernel_quant.launch(
                scatter, pools.torch_data.view(-1), computed_view(buffers, r, c.shape), table, seeds,
                kind=kinds.get(c.dtype, kernel_quant.KIND_F16), qmax=c.dtype.quant_max if c.dtype.quantized else 1.0,
                table_group=sel.table_group[r.group], block_bytes=layout.block_bytes, segment_bytes=seg,
                segment_stride=stride, slot_base=r.slot * layout.num_segments * stride, state_offset=r.state_offset,
                value_bytes=c.value_bytes, numel=c.numel, group=c.scale_group or c.shape[-1],
                salt=quant.region_salt(r.layer_id, r.state_offset),
            )  # fmt: skip


def _launch(
    scatter: bool, pools: BlockPools, pool_bytes: Any, buf_bytes: Any, table: Any, sel: _Selection, device: Any
) -> None:
    """The Triton kernel over 1-D uint8 ``pool_bytes`` / ``buf_bytes`` (torch, or Paddle inside the
    compat guard) and the int32 device ``table``."""
    from hybridkv.ops.states import kernel

    word, align = word_and_align(pool_bytes.data_ptr(), buf_bytes.data_ptr(), pools.layout.segment_bytes, *sel.offsets)
    block = tile_words(word, align)
    runs = run_table(pools, sel.regions, sel.table_group, word, align, block, paddle=is_paddle_tensor(pool_bytes))
    with device_guard(device):
        kernel.launch(
            scatter, as_words(pool_bytes, word), as_words(buf_bytes, word), table, runs,
            pools.layout.segment_bytes // word, block, align,
        )  # fmt: skip


def _run_paddle(scatter: bool, pools: BlockPools, table: Any, sel: _Selection, buffers: StateBuffers, choice: Backend):
    """Paddle pools, no torch: the Paddle reference (addresses from the host table), or the kernel
    under Paddle's compat guard on CUDA."""
    from hybridkv.ops import _paddle

    if choice is Backend.NAIVE:
        run = _paddle.scatter_states if scatter else _paddle.gather_states
        run(pools, _paddle.host_ids(table), sel.table_group, buffers, list(sel.regions))
        return
    device = pools.device
    if _ids.from_host(table):
        (table_p,) = _paddle.to_place([np.ascontiguousarray(table)], device, "int32")
    else:
        table_p = _paddle.on_place(table, device, "int32", "state table").contiguous()
    with paddle_compat():
        _launch(scatter, pools, pools.data.reshape([-1]), buffers.data, table_p, sel, device)


def _validate_ids(
    table: np.ndarray, table_group: dict[int, int], widths: list[int], num_blocks: int, scatter: bool
) -> None:
    used = [table[t, :, :w].ravel() for t, w in zip(table_group.values(), widths, strict=True)]
    ids = np.concatenate(used)
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise ValueError(f"state table holds block id {int(bad[0])}, outside the pool's 0..{num_blocks - 1}")
    if scatter:
        written = ids[ids != NULL_BLOCK]
        uniq, counts = np.unique(written, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"scatter_states would write block {int(uniq[counts > 1][0])} twice: every state set of "
                "the table must own its blocks"
            )


RUN_TABLE_CACHE_SIZE = 64
_RUN_TABLES: OrderedDict[tuple, tuple[Layout, Any]] = OrderedDict()


def run_table(
    pools: BlockPools,
    regions: tuple[BufferRegion, ...],
    table_group: dict[int, int],
    word: int,
    align: int,
    block: int,
    paddle: bool = False,
) -> Any:
    """The run table (int64 ``[num_runs, NUM_RUN_FIELDS]`` on the pools' device, in the pools'
    framework: a Paddle tensor with ``paddle``, else torch) for these regions.

    Cached per layout, pool size, regions (the buffers' shape: batch size and groups), word, tile and
    device, not per buffers object: new buffers of the same shape reuse it, and so does every step of
    an engine. At most ``RUN_TABLE_CACHE_SIZE`` tables are kept (least recently used goes first).
    """
    layout = pools.layout
    key = (id(layout), pools.num_blocks, regions, tuple(table_group.items()), word, block, paddle, pools.device)
    hit = _RUN_TABLES.get(key)
    if hit is not None and hit[0] is layout:  # the entry holds the layout, so its id cannot be reused
        _RUN_TABLES.move_to_end(key)
        return hit[1]
    host = state_runs(layout, pools.num_blocks, list(regions), table_group, word, block * word)
    if (host[:, [RUN_SRC_BASE, RUN_LENGTH, RUN_DST_BASE, RUN_DST_ROW_STRIDE]] % align).any():
        raise AssertionError(f"runs are not aligned to {align} words of {word} bytes")
    if paddle:
        from hybridkv.ops import _paddle

        runs = _paddle.to_place([host], pools.device)[0]
    else:
        import torch

        runs = _ids.to_device([host], pools.device, torch.int64)[0]
    _RUN_TABLES[key] = (layout, runs)
    while len(_RUN_TABLES) > RUN_TABLE_CACHE_SIZE:
        _RUN_TABLES.popitem(last=False)
    return runs

"""gather_states / scatter_states: state sets in the block pool <-> batched contiguous state tensors."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from hybridkv.blockmgr.layout import NULL_BLOCK
from hybridkv.ops._framework import Backend, as_words, resolve_backend, to_torch, widest_word
from hybridkv.ops.addressing import (
    RUN_DST_BASE,
    RUN_DST_ROW_STRIDE,
    RUN_LENGTH,
    RUN_SRC_BASE,
    BufferRegion,
    state_runs,
)
from hybridkv.ops.pools import BlockPools, StateBuffers
from hybridkv.ops.states.naive import gather_states_naive, scatter_states_naive

TILE_BYTES = 8192  # bytes one program moves
VECTOR_BYTES = 16  # widest load/store of one thread


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
    for one ``group``), numpy, torch or paddle. ``out``: :class:`StateBuffers` of batch ``B`` holding
    ``group`` (from :func:`~hybridkv.ops.pools.allocate_state_buffers`); each component tensor
    ``[B, *shape]`` is overwritten. Null-block entries read as zeros. One Triton launch on CUDA (or with
    ``backend="triton"``), the torch reference otherwise. ``validate`` (default: when the table is on
    the host) checks block ids. Raises ``ValueError`` on shapes or ids that do not fit. Returns ``out``.
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
) -> None:
    """Write ``src``'s states into the state sets of ``state_table`` (the inverse of :func:`gather_states`).

    Only the bytes of each state are written (the unused tail of a last block and all other blocks
    stay as they were); null-block entries are skipped, so padding rows write nothing. A block id may
    appear only once among the written state sets (checked when ``validate``). Raises ``ValueError``.
    """
    _run(True, pools, state_table, group, src, backend, validate)


class _Selection(NamedTuple):
    """What one (buffers, group, table rank) call moves; computed once and cached on the buffers."""

    groups: tuple[int, ...]
    table_group: dict[int, int]  # state group -> its row in the (3-D) state table
    widths: list[int]  # blocks_per_state of each selected group
    regions: list[BufferRegion]


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
    selection = _Selection(groups, table_group, widths, [r for r in buffers.regions if r.group in groups])
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
) -> None:
    pools.require_slot_major("gather_states/scatter_states")
    table = to_torch(state_table)
    sel = _select(pools, buffers, group, table.dim())
    num_state_groups = pools.layout.num_state_groups
    if table.dim() == 2:
        table = table.unsqueeze(0)
    elif table.shape[0] != num_state_groups:
        raise ValueError(f"state table has {table.shape[0]} group rows, the layout {num_state_groups} state groups")
    if table.shape[1] != buffers.batch_size or table.shape[2] < max(sel.widths):
        raise ValueError(
            f"state table has shape {tuple(table.shape)}: expected batch {buffers.batch_size} (the buffers') "
            f"and at least {max(sel.widths)} block ids per row (blocks_per_state)"
        )
    if validate or (validate is None and table.device.type == "cpu"):
        _validate_ids(table, sel.table_group, sel.widths, pools.num_blocks, scatter)
    if table.device != pools.device or table.dtype != torch.int32 or not table.is_contiguous():
        table = table.to(device=pools.device, dtype=torch.int32).contiguous()
    if resolve_backend(backend, pools.device) is Backend.NAIVE:
        run = scatter_states_naive if scatter else gather_states_naive
        run(pools, table.to(torch.int64), sel.table_group, buffers, sel.regions)
        return
    from hybridkv.ops.states import kernel

    word, align, runs = _runs(pools, buffers, sel.regions, sel.table_group)
    pool_words = as_words(pools.torch_data.view(-1), word)
    buf_words = as_words(buffers.torch_data, word)
    segment_words, block = pools.layout.segment_bytes // word, TILE_BYTES // word
    kernel.launch(scatter, pool_words, buf_words, table, runs, segment_words, block, align)


def _validate_ids(
    table: torch.Tensor, table_group: dict[int, int], widths: list[int], num_blocks: int, scatter: bool
) -> None:
    used = [table[t, :, :w].cpu().numpy().ravel() for t, w in zip(table_group.values(), widths, strict=True)]
    ids = np.concatenate(used).astype(np.int64)
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


def _runs(
    pools: BlockPools, buffers: StateBuffers, regions: list[BufferRegion], table_group: dict[int, int]
) -> tuple[int, int, torch.Tensor]:
    """Widest word, the alignment hint (words) and the run table on the device, cached on the buffers."""
    pool_ptr = pools.torch_data.data_ptr()
    key = ("runs", pool_ptr, pools.num_blocks, pools.device, tuple(table_group.items()))
    cached = buffers.cache.get(key)
    if cached is None:
        offsets = [v for r in regions for v in (r.state_offset, r.nbytes, r.buffer_offset)]
        buf_ptr = buffers.torch_data.data_ptr()
        word = widest_word(pool_ptr, buf_ptr, pools.layout.segment_bytes, *offsets)
        host = state_runs(pools.layout, pools.num_blocks, regions, table_group, word, TILE_BYTES)
        fields = host[:, [RUN_SRC_BASE, RUN_LENGTH, RUN_DST_BASE, RUN_DST_ROW_STRIDE]].ravel()
        bases = np.array([pool_ptr // word, buf_ptr // word, pools.layout.segment_bytes // word], dtype=np.int64)
        words = np.concatenate([fields, bases])
        align = next(a for a in (16, 8, 4, 2, 1) if a * word <= VECTOR_BYTES and not (words % a).any())
        cached = (word, align, torch.from_numpy(host).to(pools.device))
        buffers.cache[key] = cached
    return cached

"""Triton kernels of gather_states / scatter_states: every layer of every selected group in one launch.

The host splits each (layer, component) into runs that are contiguous in the pool (never crossing a
segment boundary, at most ``BLOCK`` words; see :func:`hybridkv.ops.addressing.state_runs`). Program
``(i_run, i_b)`` moves run ``i_run`` of batch row ``i_b``: one block id from the state table, then a
contiguous masked copy in the widest word alignment allows. Null-block entries read zeros (gather)
and are never written (scatter). All address arithmetic is int64. The batch (grid axis 1) is
launched in chunks of at most 65,535 rows, CUDA's limit on that axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from hybridkv.ops import _framework

if TYPE_CHECKING:
    import torch
from hybridkv.ops.addressing import (
    NUM_RUN_FIELDS,
    RUN_COLUMN,
    RUN_DST_BASE,
    RUN_DST_ROW_STRIDE,
    RUN_LENGTH,
    RUN_SRC_BASE,
    RUN_TABLE_GROUP,
)


@triton.jit
def _run_addresses(
    runs_ptr,
    table_ptr,
    stride_table_g,
    stride_table_b,
    segment_words,
    row_start,
    NUM_FIELDS: tl.constexpr,
    F_SRC: tl.constexpr,
    F_GROUP: tl.constexpr,
    F_COLUMN: tl.constexpr,
    F_LENGTH: tl.constexpr,
    F_DST: tl.constexpr,
    F_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    i_run = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64) + row_start
    p_run = runs_ptr + i_run * NUM_FIELDS
    src_base = tl.load(p_run + F_SRC)
    group = tl.load(p_run + F_GROUP)
    column = tl.load(p_run + F_COLUMN)
    length = tl.load(p_run + F_LENGTH)
    dst_base = tl.load(p_run + F_DST)
    row_stride = tl.load(p_run + F_ROW)
    b_block = tl.load(table_ptr + group * stride_table_g + i_b * stride_table_b + column).to(tl.int64)
    o_w = tl.arange(0, BLOCK).to(tl.int64)
    # ALIGN (words) divides every run field and segment_words: the hints let loads and stores vectorise
    n_live = tl.multiple_of(tl.where(b_block != 0, length, 0), ALIGN)  # nothing of the null block moves
    n_all = tl.multiple_of(length, ALIGN)
    o_pool = tl.multiple_of(src_base + b_block * segment_words, ALIGN) + o_w
    o_buf = tl.multiple_of(dst_base + i_b * row_stride, ALIGN) + o_w
    return o_pool, o_buf, o_w < n_live, o_w < n_all


@triton.jit
def _states_kernel(
    pool_ptr,
    buf_ptr,
    table_ptr,
    runs_ptr,
    stride_table_g,
    stride_table_b,
    segment_words,
    row_start,
    NUM_FIELDS: tl.constexpr,
    F_SRC: tl.constexpr,
    F_GROUP: tl.constexpr,
    F_COLUMN: tl.constexpr,
    F_LENGTH: tl.constexpr,
    F_DST: tl.constexpr,
    F_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """Gather (pool -> buffer) or, with ``SCATTER``, scatter (buffer -> pool) one run for one row."""
    o_pool, o_buf, m_live, m_all = _run_addresses(
        runs_ptr, table_ptr, stride_table_g, stride_table_b, segment_words, row_start,
        NUM_FIELDS, F_SRC, F_GROUP, F_COLUMN, F_LENGTH, F_DST, F_ROW, BLOCK, ALIGN,
    )  # fmt: skip
    if SCATTER:
        b_x = tl.load(buf_ptr + o_buf, mask=m_live, other=0)
        tl.store(pool_ptr + o_pool, b_x, mask=m_live)  # the null block is never written
    else:
        b_x = tl.load(pool_ptr + o_pool, mask=m_live, other=0)  # null block: explicit zeros
        tl.store(buf_ptr + o_buf, b_x, mask=m_all)


def launch(
    scatter: bool,
    pool_words: torch.Tensor,
    buf_words: torch.Tensor,
    table: torch.Tensor,
    runs: torch.Tensor,
    segment_words: int,
    block: int,
    align: int,
) -> None:
    """One launch over ``runs`` (int64 ``[num_runs, NUM_RUN_FIELDS]``) x batch rows of ``table``.

    ``pool_words``/``buf_words``: 1-D word views of the pool and the state buffers; ``table``: int32
    ``[num_table_groups, B, W]`` contiguous (torch or Paddle) on the pool's device (the current
    device). ``align``: a
    power of two (words) dividing every run offset, length and row stride, ``segment_words`` and both
    base addresses. ``block``: the tile the runs were cut to (:func:`~hybridkv.ops._framework.tile_words`).
    """
    num_rows = table.shape[1]
    if runs.shape[0] == 0 or num_rows == 0:
        return
    table_stride0, table_stride1 = int(table.shape[1]) * int(table.shape[2]), int(table.shape[2])  # contiguous
    limit = _framework.MAX_GRID_YZ
    for row_start in range(0, num_rows, limit):
        grid = (runs.shape[0], min(limit, num_rows - row_start))
        _states_kernel[grid](
            pool_words, buf_words, table, runs, table_stride0, table_stride1, segment_words, row_start,
            NUM_FIELDS=NUM_RUN_FIELDS, F_SRC=RUN_SRC_BASE, F_GROUP=RUN_TABLE_GROUP, F_COLUMN=RUN_COLUMN,
            F_LENGTH=RUN_LENGTH, F_DST=RUN_DST_BASE, F_ROW=RUN_DST_ROW_STRIDE, BLOCK=block,
            ALIGN=align, SCATTER=scatter, num_warps=_framework.NUM_WARPS,
        )  # fmt: skip

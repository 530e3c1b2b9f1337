"""Triton kernel: state bytes <-> FastDeploy's per-segment allocations, through a pointer table.

FastDeploy shares every ``caches`` entry by CUDA IPC handle of its allocation, so a layer slot's
segments are separate allocations with unrelated base addresses; the pool-wide kernels of
:mod:`hybridkv.ops.states` (one base pointer) cannot address them. Here the base addresses of a
slot's segments are one int64 device row (``ptrs``, built once per set of allocations), and a program
turns its segment's entry into a pointer.

Program ``(i_b, i_p, i_t)`` moves tile ``i_t`` of piece ``i_p`` of batch row ``i_b``. A piece is one
(block of the set, segment) run of the state: table column ``column``, segment ``seg``, state bytes
``[start, start + length)``, which live at ``ptrs[seg] + table[i_b, column] * segment_bytes``
(a piece always starts a segment). ``buf`` row ``i_b`` holds the state's first ``nbytes`` bytes.
One launch moves every row of one layer; there is no loop over requests and no host sync.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from hybridkv.ops import _framework

NUM_PIECE_FIELDS = 4  # column, segment, start, length
TILE_BYTES = 1024


@triton.jit
def _segments_kernel(
    ptrs,
    table_ptr,
    buf_ptr,
    pieces_ptr,
    table_stride,
    nbytes,
    segment_bytes,
    SCATTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1).to(tl.int64)
    i_t = tl.program_id(2).to(tl.int64)
    column = tl.load(pieces_ptr + i_p * 4)
    seg = tl.load(pieces_ptr + i_p * 4 + 1)
    start = tl.load(pieces_ptr + i_p * 4 + 2)
    length = tl.load(pieces_ptr + i_p * 4 + 3)
    block = tl.load(table_ptr + i_b * table_stride + column).to(tl.int64)
    p_base = tl.load(ptrs + seg).to(tl.pointer_type(tl.uint8))
    o_t = i_t * BLOCK + tl.arange(0, BLOCK)
    m_t = o_t < length
    p_pool = p_base + block * segment_bytes + o_t
    p_buf = buf_ptr + i_b * nbytes + start + o_t
    if SCATTER:
        tl.store(p_pool, tl.load(p_buf, mask=m_t), mask=m_t)
    else:
        tl.store(p_buf, tl.load(p_pool, mask=m_t), mask=m_t)


def launch(scatter: bool, ptrs: Any, table: Any, buf: Any, pieces: Any, segment_bytes: int, max_piece: int) -> None:
    """``ptrs``: int64 ``[num_segments]`` base addresses of one layer slot's segments; ``table``: int
    ``[B, W]`` contiguous block ids; ``buf``: uint8 ``[B, nbytes]`` contiguous; ``pieces``: int64
    ``[P, 4]`` (:func:`hybridkv.ops.segments.pieces`). All on the segments' device (torch, or Paddle
    inside its compat guard)."""
    rows, num_pieces = int(table.shape[0]), int(pieces.shape[0])
    if rows == 0 or num_pieces == 0:
        return
    nbytes, stride = int(buf.shape[1]), int(table.shape[1])
    tiles = triton.cdiv(max_piece, TILE_BYTES)
    limit = _framework.MAX_GRID_YZ
    assert num_pieces <= limit and tiles <= limit, "a state of more than 65,535 pieces or tiles"
    _segments_kernel[(rows, num_pieces, tiles)](
        ptrs, table, buf, pieces, stride, nbytes, segment_bytes, SCATTER=scatter, BLOCK=TILE_BYTES,
        num_warps=_framework.NUM_WARPS,
    )  # fmt: skip

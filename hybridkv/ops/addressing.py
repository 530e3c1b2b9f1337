"""Where a state's bytes live: the layout's addressing rule, as tensors (reference) and as runs (kernels).

A state set is ``blocks_per_state`` block ids; the state's flat byte ``o`` lives in block
``table[o // block_bytes]``, at ``within = o % block_bytes``, in segment ``within // segment_bytes``
at offset ``within % segment_bytes``. In a layer slot tensor ``[num_segments, num_blocks,
segment_bytes]`` that byte is at ``seg * num_blocks * segment_bytes + block * segment_bytes + off``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybridkv.planner.layout import NULL_BLOCK, Layout

if TYPE_CHECKING:
    import torch


def state_byte_addresses(
    layout: Layout, num_blocks: int, table_rows: torch.Tensor, state_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte address in a layer slot tensor of every state byte, and whether its block is the null block.

    ``table_rows``: int ``[B, >= blocks_per_state]`` block ids (torch). Returns int64 ``[B, state_bytes]``
    addresses and bool ``[B, state_bytes]`` null flags (:func:`state_byte_addresses_host`: the same in numpy).
    """
    import torch

    o = torch.arange(state_bytes, dtype=torch.int64, device=table_rows.device)
    block = table_rows.to(torch.int64)[:, o // layout.block_bytes]
    within = o % layout.block_bytes
    seg, off = within // layout.segment_bytes, within % layout.segment_bytes
    address = seg * num_blocks * layout.segment_bytes + block * layout.segment_bytes + off
    return address, block == NULL_BLOCK


def state_byte_addresses_host(
    layout: Layout, num_blocks: int, table_rows: Any, state_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`state_byte_addresses` on the host: ``table_rows`` int ``[B, >= blocks_per_state]``
    (numpy) -> int64 ``[B, state_bytes]`` addresses and bool ``[B, state_bytes]`` null flags."""
    o = np.arange(state_bytes, dtype=np.int64)
    block = np.asarray(table_rows, dtype=np.int64)[:, o // layout.block_bytes]
    within = o % layout.block_bytes
    seg, off = within // layout.segment_bytes, within % layout.segment_bytes
    address = seg * num_blocks * layout.segment_bytes + block * layout.segment_bytes + off
    return address, block == NULL_BLOCK


class BufferRegion(NamedTuple):
    """One component of one state layer inside a :class:`~hybridkv.ops.pools.StateBuffers` backing buffer."""

    group: int  # state group (0-based)
    slot: int  # layer slot
    layer_id: int  # model layer id
    name: str  # component name
    state_offset: int  # byte offset of the component inside the layer's flat state
    nbytes: int  # bytes of one request's component
    buffer_offset: int  # byte offset of row 0 in the backing buffer; row b at + b * row_stride
    # buffers allocated with a compute dtype: the dtype name this region holds dequantized values in
    # (an int8 / fp8 / float16 component), and its bytes per row; None / 0: the stored bytes as they are
    compute: str | None = None
    row_bytes: int = 0

    @property
    def row_stride(self) -> int:
        """Bytes between rows in the backing buffer (``nbytes`` unless the region holds computed values)."""
        return self.row_bytes or self.nbytes


# Columns of a run table (int64, in words): one contiguous piece of pool memory <-> one buffer piece.
RUN_SRC_BASE, RUN_TABLE_GROUP, RUN_COLUMN, RUN_LENGTH, RUN_DST_BASE, RUN_DST_ROW_STRIDE = range(6)
NUM_RUN_FIELDS = 6


def state_runs(
    layout: Layout,
    num_blocks: int,
    regions: list[BufferRegion],
    table_group: dict[int, int],
    word: int,
    tile_bytes: int,
) -> np.ndarray:
    """Split every region into runs that never cross a segment boundary and hold at most ``tile_bytes``.

    Returns int64 ``[num_runs, NUM_RUN_FIELDS]`` in units of ``word`` bytes: the pool address of a run
    is ``src_base + table[table_group, b, column] * segment_words`` (``src_base`` holds slot, segment
    and offset), its buffer address ``dst_base + b * dst_row_stride``. ``table_group`` maps a state
    group to its row in the state table. Every offset and size must be a multiple of ``word``.
    """
    seg_b, blk_b = layout.segment_bytes, layout.block_bytes
    slot_bytes = layout.num_segments * num_blocks * seg_b
    rows: list[np.ndarray] = []
    for r in regions:
        start, end = r.state_offset, r.state_offset + r.nbytes
        o = start
        while o < end:  # one (column, segment) piece per iteration
            column, within = divmod(o, blk_b)
            seg, off = divmod(within, seg_b)
            piece = min(end, o + seg_b - off) - o
            tiles = np.arange(0, piece, tile_bytes, dtype=np.int64)
            out = np.empty((len(tiles), NUM_RUN_FIELDS), dtype=np.int64)
            out[:, RUN_SRC_BASE] = r.slot * slot_bytes + seg * num_blocks * seg_b + off + tiles
            out[:, RUN_TABLE_GROUP] = table_group[r.group]
            out[:, RUN_COLUMN] = column
            out[:, RUN_LENGTH] = np.minimum(tile_bytes, piece - tiles)
            out[:, RUN_DST_BASE] = r.buffer_offset + (o - start) + tiles
            out[:, RUN_DST_ROW_STRIDE] = r.nbytes
            rows.append(out)
            o += piece
    runs = np.concatenate(rows) if rows else np.zeros((0, NUM_RUN_FIELDS), dtype=np.int64)
    bytes_fields = [RUN_SRC_BASE, RUN_LENGTH, RUN_DST_BASE, RUN_DST_ROW_STRIDE]
    if (runs[:, bytes_fields] % word).any():
        raise AssertionError(f"runs are not aligned to {word}-byte words")
    runs[:, bytes_fields] //= word
    return runs

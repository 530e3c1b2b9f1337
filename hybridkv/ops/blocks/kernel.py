"""Triton kernel of copy_blocks: every (pair, slot x segment, tile) in one launch.

Program ``(i_pair, i_ss, i_t)`` copies tile ``i_t`` of segment ``i_ss`` (slot-major) of block
``src[i_pair]`` to block ``dst[i_pair]``: a contiguous masked copy of at most ``BLOCK`` words.
``ALIGN`` (words) divides ``segment_words`` and the pool's base address, so every segment start is
a multiple of it: the same hint the state kernels give, which lets accesses vectorise to 16 bytes
whatever ``segment_words % 16`` is. Grid axes 1 and 2 are chunked to CUDA's 65,535 limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from hybridkv.ops import _framework

if TYPE_CHECKING:
    import torch


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,
    src_ptr,
    dst_ptr,
    num_blocks,
    segment_words,
    ss_start,
    t_start,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    i_pair = tl.program_id(0).to(tl.int64)
    i_ss = tl.program_id(1).to(tl.int64) + ss_start
    i_t = tl.program_id(2).to(tl.int64) + t_start
    b_src = tl.load(src_ptr + i_pair).to(tl.int64)
    b_dst = tl.load(dst_ptr + i_pair).to(tl.int64)
    n_seg = tl.multiple_of(segment_words.to(tl.int64), ALIGN)
    o_tile = tl.multiple_of(i_t * BLOCK, BLOCK)
    o_w = tl.arange(0, BLOCK).to(tl.int64)
    # the mask compares the bare arange with a length that is a multiple of ALIGN, as the state
    # kernels do: that is the form Triton's alignment analysis turns into 16-byte accesses
    m_w = o_w < tl.multiple_of(n_seg - o_tile, ALIGN)
    o_seg = i_ss * num_blocks * n_seg
    o_src = tl.multiple_of(o_seg + b_src * n_seg + o_tile, ALIGN) + o_w
    o_dst = tl.multiple_of(o_seg + b_dst * n_seg + o_tile, ALIGN) + o_w
    b_x = tl.load(pool_ptr + o_src, mask=m_w)
    tl.store(pool_ptr + o_dst, b_x, mask=m_w)


def launch(
    pool_words: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slot_segments: int,
    num_blocks: int,
    segment_words: int,
    block: int,
    align: int,
) -> None:
    """``pool_words``: 1-D word view of ``[group_size * num_segments, num_blocks, segment_words]``;
    ``src``/``dst``: contiguous int64 ``[num_pairs]`` on the pool's device (the current device).
    ``align``: a power of two (words) dividing ``segment_words`` and the pool's address."""
    if src.numel() == 0:
        return
    limit = _framework.MAX_GRID_YZ
    num_tiles = triton.cdiv(segment_words, block)
    for ss in range(0, num_slot_segments, limit):
        for t in range(0, num_tiles, limit):
            grid = (src.numel(), min(limit, num_slot_segments - ss), min(limit, num_tiles - t))
            _copy_blocks_kernel[grid](
                pool_words, src, dst, num_blocks, segment_words, ss, t,
                BLOCK=block, ALIGN=align, num_warps=_framework.NUM_WARPS,
            )  # fmt: skip

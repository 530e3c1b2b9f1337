"""Triton kernel of copy_blocks: every (pair, slot x segment, tile) in one launch.

Program ``(i_pair, i_ss, i_t)`` copies tile ``i_t`` of segment ``i_ss`` (slot-major) of block
``src[i_pair]`` to block ``dst[i_pair]``: a contiguous masked copy of at most ``BLOCK`` words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,
    src_ptr,
    dst_ptr,
    num_blocks,
    segment_words,
    BLOCK: tl.constexpr,
):
    i_pair = tl.program_id(0).to(tl.int64)
    i_ss = tl.program_id(1).to(tl.int64)
    i_t = tl.program_id(2).to(tl.int64)
    b_src = tl.load(src_ptr + i_pair).to(tl.int64)
    b_dst = tl.load(dst_ptr + i_pair).to(tl.int64)
    o_w = i_t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_w = o_w < segment_words
    o_seg = i_ss * num_blocks * segment_words
    b_x = tl.load(pool_ptr + o_seg + b_src * segment_words + o_w, mask=m_w)
    tl.store(pool_ptr + o_seg + b_dst * segment_words + o_w, b_x, mask=m_w)


def launch(
    pool_words: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slot_segments: int,
    num_blocks: int,
    segment_words: int,
    block: int,
) -> None:
    """``pool_words``: 1-D word view of ``[group_size * num_segments, num_blocks, segment_words]``;
    ``src``/``dst``: int64 ``[num_pairs]`` on the pool's device."""
    if src.numel() == 0:
        return
    grid = (src.numel(), num_slot_segments, triton.cdiv(segment_words, block))
    _copy_blocks_kernel[grid](pool_words, src, dst, num_blocks, segment_words, BLOCK=block, num_warps=4)

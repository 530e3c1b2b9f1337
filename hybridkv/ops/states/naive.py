"""Reference gather/scatter of states: the layout's addressing rule as plain torch indexing.

A state set is ``blocks_per_state`` block ids; in layer slot ``s`` block ``j`` of the set holds the
state's bytes ``[j * block_bytes, (j + 1) * block_bytes)``, split over the slot's segments
(``slot[seg, block]`` holds ``segment_bytes`` of them). So one layer's states for a batch are
``slot[:, table]`` (``[num_segments, B, blocks_per_state, segment_bytes]``) read block by block,
null blocks as zeros, and cut to ``state_bytes``. Components sit back to back in those bytes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from hybridkv.ops._framework import WORD_NAMES, torch_dtype
from hybridkv.ops.addressing import BufferRegion
from hybridkv.ops.pools import BlockPools, StateBuffers
from hybridkv.planner.layout import NULL_BLOCK

if TYPE_CHECKING:
    import torch


def _layers(regions: list[BufferRegion]) -> dict[tuple[int, int], list[BufferRegion]]:
    layers: dict[tuple[int, int], list[BufferRegion]] = defaultdict(list)
    for r in regions:
        layers[(r.group, r.slot)].append(r)
    return layers


def _layer(pools: BlockPools, table: torch.Tensor, table_group: dict[int, int], g: int, slot: int):
    """(slot tensor ``[S, N, seg / w]`` of ``w``-byte words, ids ``[B, blocks_per_state]`` int64,
    state bytes) of one layer; moving words instead of bytes is several times faster on the CPU."""
    layout = pools.layout
    spec = layout.state_layer(g, slot)[1]
    bps = layout.state_groups[g].blocks_per_state
    import torch

    ids = table[table_group[g], :, :bps].to(torch.int64)
    word = next(w for w in (8, 4, 2, 1) if layout.segment_bytes % w == 0)
    return pools.torch_data[slot].view(getattr(torch, WORD_NAMES[word])), ids, spec.state_bytes


def gather_states_naive(
    pools: BlockPools,
    table: torch.Tensor,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """``buffers[region][b] = state bytes of table row b`` for every region and table row (rows of the
    buffers beyond the table's stay as they were); null blocks read zeros."""
    import torch

    for (g, slot), components in _layers(regions).items():
        data, ids, state_bytes = _layer(pools, table, table_group, g, slot)
        blocks = data[:, ids]  # [S, B, bps, seg words]
        null = ids == NULL_BLOCK
        if null.any():
            blocks.masked_fill_(null[None, :, :, None], 0)
        state = blocks.permute(1, 2, 0, 3).contiguous().view(ids.shape[0], -1).view(torch.uint8)[:, :state_bytes]
        for r in components:
            buffers.region_bytes(r)[: ids.shape[0]].copy_(state[:, r.state_offset : r.state_offset + r.nbytes])


def scatter_states_naive(
    pools: BlockPools,
    table: torch.Tensor,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """The inverse of :func:`gather_states_naive`: only the state's bytes are written (not the unused
    tail of its last block), and nothing lands in the null block."""
    import torch

    seg = pools.layout.segment_bytes
    for (g, slot), components in _layers(regions).items():
        words, ids, state_bytes = _layer(pools, table, table_group, g, slot)
        data = words.view(torch.uint8)
        num_segments, bps = data.shape[0], ids.shape[1]
        state = torch.zeros(ids.shape[0], bps * num_segments * seg, dtype=torch.uint8, device=data.device)
        for r in components:
            state[:, r.state_offset : r.state_offset + r.nbytes] = buffers.region_bytes(r)[: ids.shape[0]]
        blocks = state.view(ids.shape[0], bps, num_segments, seg)
        keep = ids != NULL_BLOCK
        full, tail = divmod(state_bytes, num_segments * seg)
        if full:  # blocks the state fills completely, moved as words
            rows = keep[:, :full]
            whole = blocks[:, :full].reshape(ids.shape[0], full, num_segments * seg).view(words.dtype)
            picked = whole[rows].view(-1, num_segments, words.shape[2])  # [kept blocks, S, seg words]
            words[:, ids[:, :full][rows]] = picked.permute(1, 0, 2)
        if tail:  # the last block: only its first ``tail`` bytes, segment by segment
            rows = keep[:, full]
            for k in range(num_segments):
                n = min(seg, max(0, tail - k * seg))
                if n:
                    data[k, ids[rows, full], :n] = blocks[rows, full, k, :n]


def computed_view(buffers: StateBuffers, region: BufferRegion, shape: tuple[int, ...]) -> torch.Tensor:
    """A computed region's ``[batch_size, *shape]`` tensor in torch, cut from the backing buffer's torch
    view (for Paddle buffers a DLPack view of the whole buffer: a view of a Paddle slice may lose its offset)."""
    if buffers.framework.value == "torch":
        return buffers.layer(region.group, region.slot)[region.name]
    raw = buffers.torch_data[region.buffer_offset : region.buffer_offset + buffers.batch_size * region.row_stride]
    return raw.view(torch_dtype(region.compute)).view(buffers.batch_size, *shape)


def computed_states_naive(
    scatter: bool,
    pools: BlockPools,
    table: torch.Tensor,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
    seeds: torch.Tensor | None,
) -> None:
    """Gather (dequantize) or scatter (quantize; ``seeds`` int64 ``[>= B]``: stochastic rounding,
    None: nearest) the computed regions (int8 / fp8 / float16 components held in a compute dtype):
    the stored bytes move by the layout's byte addresses, and :mod:`.quant` turns them into values."""
    import torch

    from hybridkv.ops.addressing import state_byte_addresses
    from hybridkv.ops.states import quant

    layout = pools.layout
    for (g, slot), components in _layers(regions).items():
        layer_id, spec = layout.state_layer(g, slot)
        ids = table[table_group[g], :, : layout.state_groups[g].blocks_per_state].to(torch.int64)
        rows = ids.shape[0]
        address, null = state_byte_addresses(layout, pools.num_blocks, ids, spec.state_bytes)
        flat = pools.torch_data[slot].reshape(-1)
        for r in components:
            c = spec.component(r.name)
            cut = slice(r.state_offset, r.state_offset + r.nbytes)
            out = computed_view(buffers, r, c.shape)[:rows]
            group = c.scale_group or c.shape[-1]
            if not scatter:
                raw = flat[address[:, cut]].masked_fill(null[:, cut], 0)
                out.copy_(quant.decode(raw, c.dtype, c.numel, group).view(out.shape))
                continue
            u = (
                0.5
                if seeds is None
                else quant.uniforms(seeds[:rows], quant.region_salt(layer_id, r.state_offset), c.numel)
            )
            raw = quant.encode(out.reshape(rows, -1), c.dtype, group, u)
            keep = ~null[:, cut]
            flat[address[:, cut][keep]] = raw[keep]

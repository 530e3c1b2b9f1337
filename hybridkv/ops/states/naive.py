"""Reference gather/scatter of states: the layout's addressing rule as plain torch indexing.

For state group ``g``, layer slot ``s`` and batch row ``b``, state byte ``o`` is
``slot[s].flat[address(table[g, b], o)]`` (zero where the block is the null block); components sit
back to back in the state's flat bytes.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hybridkv.ops.addressing import BufferRegion, state_byte_addresses
from hybridkv.ops.pools import BlockPools, StateBuffers


def _layers(regions: list[BufferRegion]) -> dict[tuple[int, int], list[BufferRegion]]:
    layers: dict[tuple[int, int], list[BufferRegion]] = defaultdict(list)
    for r in regions:
        layers[(r.group, r.slot)].append(r)
    return layers


def _addresses(pools: BlockPools, table: torch.Tensor, table_group: dict[int, int], g: int, slot: int):
    spec = pools.layout.state_layer(g, slot)[1]
    return state_byte_addresses(pools.layout, pools.num_blocks, table[table_group[g]], spec.state_bytes)


def gather_states_naive(
    pools: BlockPools,
    table: torch.Tensor,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """``buffers[region][b] = state bytes of table row b`` for every region; null blocks read zeros."""
    for (g, slot), components in _layers(regions).items():
        address, null = _addresses(pools, table, table_group, g, slot)
        state = pools.torch_data[slot].reshape(-1)[address].masked_fill(null, 0)  # [B, state_bytes]
        for r in components:
            buffers.region_bytes(r).copy_(state[:, r.state_offset : r.state_offset + r.nbytes])


def scatter_states_naive(
    pools: BlockPools,
    table: torch.Tensor,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """The inverse of :func:`gather_states_naive`; bytes that fall in the null block are dropped."""
    for (g, slot), components in _layers(regions).items():
        address, null = _addresses(pools, table, table_group, g, slot)
        state = torch.cat([buffers.region_bytes(r) for r in components], dim=1)  # [B, state_bytes]
        keep = ~null
        pools.torch_data[slot].reshape(-1)[address[keep]] = state[keep]

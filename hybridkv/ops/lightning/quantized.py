"""Lightning layers whose state component is quantized (int8 / float8_e4m3fn values then float32
scales, :mod:`hybridkv.ops.states.quant`): the reference reads and writes, and the Triton geometry.

The reference is the composition the kernels must equal: the set's bytes by the layout's addressing
rule -> :func:`~hybridkv.ops.states.quant.decode` (float32) -> the float32 recurrence ->
:func:`~hybridkv.ops.states.quant.encode` with the same salt (``region_salt(layer_id, component
offset)``) and seeds as :func:`~hybridkv.ops.states.scatter_states`, so a decode written here has the
bytes a gather (dequantize) -> recurrence -> scatter (quantize) of the same state would write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hybridkv.ops.addressing import state_byte_addresses
from hybridkv.ops.states import quant

if TYPE_CHECKING:
    from hybridkv.ops.lightning import LightningLayer
    from hybridkv.ops.pools import BlockPools


def _addresses(pools: BlockPools, layer: LightningLayer, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    address, null = state_byte_addresses(pools.layout, pools.num_blocks, rows, layer.state_bytes)
    nbytes = layer.stored_bytes or layer.num_heads * layer.dk * layer.dv * layer.dtype.itemsize
    cut = slice(layer.component_offset, layer.component_offset + nbytes)
    return address[:, cut], null[:, cut]


def read_states(pools: BlockPools, layer: LightningLayer, rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, H, d_k, d_v]``: the dequantized states of the sets in ``rows`` (null blocks read zeros)."""
    address, null = _addresses(pools, layer, rows.to(pools.torch_data.device, torch.int64))
    raw = pools.torch_data[layer.slot].reshape(-1)[address].masked_fill(null, 0)
    numel = layer.num_heads * layer.dk * layer.dv
    values = quant.decode(raw, layer.stored, numel, layer.scale_group)
    return values.view(rows.shape[0], layer.num_heads, layer.dk, layer.dv)


def write_states(
    pools: BlockPools, layer: LightningLayer, rows: torch.Tensor, states: torch.Tensor, seeds: Any = None
) -> None:
    """Quantize ``states`` ``[B, H, d_k, d_v]`` (per scale group; ``seeds`` int64 ``[B]``: stochastic
    rounding, None: nearest) into the sets in ``rows``; null-block bytes are skipped."""
    address, null = _addresses(pools, layer, rows.to(pools.torch_data.device, torch.int64))
    b = rows.shape[0]
    flat = states.to(torch.float32).reshape(b, -1)
    u: torch.Tensor | float = 0.5
    if seeds is not None:
        u = quant.uniforms(torch.as_tensor(seeds, dtype=torch.int64)[:b].to(flat.device), layer.salt, flat.shape[1])
    raw = quant.encode(flat, layer.stored, layer.scale_group, u)
    keep = ~null
    pools.torch_data[layer.slot].view(-1)[address[keep]] = raw[keep]


def copy_sets(pools: BlockPools, layer: LightningLayer, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the component's stored bytes (a quantized one's values and scales as they are) from the sets
    ``src`` to ``dst`` (int ``[B, >= blocks_per_state]`` each; null blocks read zeros and are not written)."""
    a_src, null_src = _addresses(pools, layer, src.to(pools.torch_data.device, torch.int64))
    a_dst, null_dst = _addresses(pools, layer, dst.to(pools.torch_data.device, torch.int64))
    flat = pools.torch_data[layer.slot].view(-1)
    raw = flat[a_src].masked_fill(null_src, 0)
    flat[a_dst[~null_dst]] = raw[~null_dst]


def geometry(pools: BlockPools, layer: LightningLayer) -> dict[str, Any]:
    """The byte geometry and format of ``layer`` as :mod:`.kernel_quant`'s launches take it. Raises
    ``ValueError`` unless the scales are 4-byte aligned in every block."""
    lay = pools.layout
    value_bytes = layer.num_heads * layer.dk * layer.dv
    if (lay.segment_bytes | lay.block_bytes | layer.component_offset | value_bytes) % 4:
        raise ValueError("a quantized lightning state needs 4-byte aligned segments, offsets and value bytes")
    stride = pools.num_blocks * lay.segment_bytes
    return dict(
        block_bytes=lay.block_bytes,
        segment_bytes=lay.segment_bytes,
        segment_stride=stride,
        slot_base=layer.slot * lay.num_segments * stride,
        state_offset=layer.component_offset,
        value_bytes=value_bytes,
        salt=layer.salt,
        kind=layer.stored.value,
        qmax=layer.stored.quant_max,
        row=layer.scale_group == layer.dv,
    )

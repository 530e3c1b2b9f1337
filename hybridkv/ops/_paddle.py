"""The ops on Paddle tensors with Paddle alone: no torch is imported on these paths.

A FastDeploy worker has ``paddlepaddle-gpu`` and Triton, not torch. The public ops
(:func:`~hybridkv.ops.copy_blocks`, :func:`~hybridkv.ops.gather_states`,
:func:`~hybridkv.ops.scatter_states`, :func:`~hybridkv.ops.swap_blocks`,
:func:`~hybridkv.ops.read_state`) send Paddle pools here:

- the references compute with Paddle indexing (``flat[address]`` reads and index puts), on the
  host or the device, from addresses computed on the host by the layout's rule
  (:func:`~hybridkv.ops.addressing.state_byte_addresses_host`);
- the Triton kernels are the same ``@triton.jit`` functions as for torch, launched on Paddle word
  views inside :func:`~hybridkv.ops._framework.paddle_compat` (Paddle's torch-compat guard, which
  serves Triton's own ``import torch``), the way FastDeploy launches its kernels.

Triton's CPU interpreter takes torch tensors only, so a Paddle call with ``backend="triton"`` off
CUDA does not come here: the op sees the Paddle memory through a DLPack torch view (torch lane).
Ids are checked on the host by the callers before anything moves, as for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hybridkv.ops._framework import DeviceId, paddle_device, paddle_dtype, paddle_place_for, require_device
from hybridkv.ops.addressing import BufferRegion, state_byte_addresses_host

if TYPE_CHECKING:
    from hybridkv.models.spec import StateLayerSpec
    from hybridkv.ops.pools import BlockPools, StateBuffers


def to_place(arrays: list[np.ndarray], device: DeviceId, dtype: str = "int64") -> list[Any]:
    """``arrays`` as contiguous Paddle ``dtype`` tensors on ``device``, in one host -> device copy
    (one staging array). The caller checks ranges first."""
    import paddle

    sizes = [a.size for a in arrays]
    staging = np.empty(sum(sizes), dtype=dtype)
    pos = 0
    for a, n in zip(arrays, sizes, strict=True):
        staging[pos : pos + n] = a.ravel()
        pos += n
    moved = paddle.to_tensor(staging, place=paddle_place_for(device))
    out, pos = [], 0
    for a, n in zip(arrays, sizes, strict=True):
        out.append(moved[pos : pos + n].reshape(list(a.shape)))
        pos += n
    return out


def on_place(ids: Any, device: DeviceId, dtype: str, what: str) -> Any:
    """A caller's Paddle device tensor as ``dtype`` on ``device``; raises if it is elsewhere."""
    require_device(device, paddle_device(ids), what)
    return ids if str(ids.dtype).endswith(dtype) else ids.astype(dtype)


def host_ids(ids: Any) -> np.ndarray:
    """Ids (numpy, or a Paddle tensor: a copy, which synchronises for a device tensor) as int64 numpy."""
    return ids.astype(np.int64, copy=False) if isinstance(ids, np.ndarray) else np.asarray(ids.numpy(), np.int64)


# ---- references --------------------------------------------------------------------------------------
def copy_blocks(pools: BlockPools, src: Any, dst: Any) -> None:
    """``pool[:, :, dst[i]] = pool[:, :, src[i]]`` for every slot and segment (int64 Paddle ids on the
    pool's place). Sources are read before any destination is written."""
    data = pools.data  # [group_size, num_segments, num_blocks, segment_bytes]
    data[:, :, dst] = data[:, :, src]


def _layer_rows(pools: BlockPools, table: np.ndarray, table_group: dict[int, int], g: int, slot: int, rows: int):
    layout = pools.layout
    spec = layout.state_layer(g, slot)[1]
    bps = layout.state_groups[g].blocks_per_state
    ids = table[table_group[g], :rows, :bps]
    address, null = state_byte_addresses_host(layout, pools.num_blocks, ids, spec.state_bytes)
    return address, null


def _layers(regions: list[BufferRegion]) -> dict[tuple[int, int], list[BufferRegion]]:
    out: dict[tuple[int, int], list[BufferRegion]] = {}
    for r in regions:
        out.setdefault((r.group, r.slot), []).append(r)
    return out


def gather_states(
    pools: BlockPools,
    table: np.ndarray,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """``buffers[region][b] = state bytes of table row b`` (``table``: int ``[groups, B, >= bps]``
    numpy); rows of the buffers beyond ``B`` stay as they were; null blocks read zeros."""
    rows = table.shape[1]
    device = pools.device
    for (g, slot), components in _layers(regions).items():
        address, null = _layer_rows(pools, table, table_group, g, slot, rows)
        flat = pools.data[slot].reshape([-1])
        for r in components:
            cut = np.s_[:, r.state_offset : r.state_offset + r.nbytes]
            (idx,) = to_place([address[cut]], device)
            got = flat[idx.reshape([-1])]
            zeros = np.flatnonzero(null[cut])
            if zeros.size:
                (at,) = to_place([zeros], device)
                got[at] = 0
            buffers.data[r.buffer_offset : r.buffer_offset + rows * r.nbytes] = got


def scatter_states(
    pools: BlockPools,
    table: np.ndarray,
    table_group: dict[int, int],
    buffers: StateBuffers,
    regions: list[BufferRegion],
) -> None:
    """The inverse of :func:`gather_states`: only the state's bytes are written (not the unused tail
    of its last block), nothing lands in the null block."""
    rows = table.shape[1]
    device = pools.device
    for (g, slot), components in _layers(regions).items():
        address, null = _layer_rows(pools, table, table_group, g, slot, rows)
        flat = pools.data[slot].reshape([-1])
        for r in components:
            cut = np.s_[:, r.state_offset : r.state_offset + r.nbytes]
            keep = np.flatnonzero(~null[cut])
            if not keep.size:
                continue
            src = buffers.data[r.buffer_offset : r.buffer_offset + rows * r.nbytes]
            dst_idx, src_idx = to_place([address[cut].ravel()[keep], keep], device)
            flat[dst_idx] = src[src_idx]


def swap_blocks(
    device_pools: BlockPools, host_pools: BlockPools, device_blocks: np.ndarray, host_blocks: np.ndarray, out: bool
) -> int:
    """``out``: ``host[h] = device[:, :, d]`` for each pair (host pools are block-major); else the
    reverse. Pairs sorted by host id; the device rows move in one gather / one index put and each run
    of consecutive host ids in one copy. Synchronous. Returns the number of host copies."""
    from hybridkv.ops.swap.runs import host_runs

    order = np.argsort(host_blocks, kind="stable")
    dev, hst = device_blocks[order], host_blocks[order]
    if not dev.size:
        return 0
    (idx,) = to_place([dev], device_pools.device)
    block_major = device_pools.data.transpose([2, 0, 1, 3])  # [num_blocks, slots, segments, segment_bytes]
    host = host_pools.data
    runs = host_runs(hst)
    if out:
        rows = block_major[idx]._copy_to(host.place, True) if device_pools.device.type == "cuda" else block_major[idx]
        for a, b in runs:
            first = int(hst[a])
            host[first : first + b - a] = rows[a:b]
    else:
        import paddle

        parts = [host[int(hst[a]) : int(hst[a]) + b - a] for a, b in runs]
        rows = paddle.concat(parts) if len(parts) > 1 else parts[0]
        if device_pools.device.type == "cuda":
            rows = rows._copy_to(paddle_place_for(device_pools.device), True)
        device_pools.data[:, :, idx] = rows.transpose([1, 2, 0, 3])
    return len(runs)


def read_state(pools: BlockPools, group: int, slot: int, spec: StateLayerSpec, blocks: Any) -> dict[str, Any]:
    """One state's components as new Paddle tensors (null blocks read zeros)."""
    row = host_ids(np.asarray(blocks) if not hasattr(blocks, "place") else blocks).reshape(1, -1)
    if row.shape[1] < pools.layout.blocks_per_state[group]:
        raise ValueError(
            f"a state of group {group} spans {pools.layout.blocks_per_state[group]} block ids, got {row.shape[1]}"
        )
    address, null = state_byte_addresses_host(pools.layout, pools.num_blocks, row, spec.state_bytes)
    address = np.where(null, 0, address)[0]  # placeholders, zeroed below
    (idx,) = to_place([address], pools.device)
    flat = pools.data[slot].reshape([-1])[idx]
    if null.any():
        (at,) = to_place([np.flatnonzero(null[0])], pools.device)
        flat[at] = 0
    offsets = spec.component_offsets()
    out = {}
    for c in spec.components:
        # a tensor of its own before the typed view: Paddle 3.3 reads a typed view of a slice at a byte
        # offset from the wrong bytes
        own = flat[offsets[c.name] : offsets[c.name] + c.nbytes].clone()
        out[c.name] = own.view(paddle_dtype(c.dtype)).reshape(list(c.shape))
    return out


# ---- Triton on Paddle tensors (CUDA) ----------------------------------------------------------------
def words(flat_bytes: Any, word: int) -> Any:
    """A Paddle uint8 tensor, flattened, seen as ``word``-byte integers (same memory)."""
    from hybridkv.ops._framework import as_words

    return as_words(flat_bytes.reshape([-1]), word)

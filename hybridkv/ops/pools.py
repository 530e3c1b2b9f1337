"""Device and host block pools of a :class:`~hybridkv.planner.layout.Layout`, and batched state buffers.

One backing uint8 tensor ``[group_size, num_segments, num_blocks, segment_bytes]`` holds every layer
slot, so each op is one launch over one base pointer; ``pools.slot(i)`` is layer slot ``i``'s
``[num_segments, num_blocks, segment_bytes]`` view. Block 0 is the null block: zero-filled, never
written by the ops. The caller owns the pools (they live as long as the returned object is referenced).

Host pools are **block-major**, ``[num_host_blocks, group_size, num_segments, segment_bytes]``: a host
block is one contiguous ``bytes_per_block`` chunk, so a run of consecutive host ids moves in one
DMA copy whatever the number of slots (no kernel ever reads the host pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.models.spec import AttentionLayerSpec, DType
from hybridkv.ops._framework import (
    DeviceId,
    Framework,
    from_torch,
    is_paddle_tensor,
    paddle_device,
    paddle_dtype,
    paddle_zeros,
    resolve_device,
    resolve_paddle_device,
    to_torch,
    torch_dtype,
)
from hybridkv.ops.addressing import BufferRegion, state_byte_addresses
from hybridkv.planner.layout import NULL_BLOCK, Layout

if TYPE_CHECKING:
    import torch

NAN_FILL = 0xFF  # all-ones bytes read as NaN in float32, bfloat16 and float16
BUFFER_ALIGN_BYTES = 256


def _fill_byte(fill: int | float | str | None) -> int | None:
    if fill is None:
        return None
    if isinstance(fill, str) and fill.lower() == "nan" or isinstance(fill, float) and math.isnan(fill):
        return NAN_FILL
    if isinstance(fill, int) and 0 <= fill <= 255:
        return fill
    raise ValueError(f"fill must be None, 'nan' or a byte value 0..255, got {fill!r}")


@dataclass(frozen=True, eq=False)
class BlockPools:
    """All layer slots of one pool. ``data``: uint8 ``[group_size, num_segments, num_blocks, segment_bytes]``
    (host pools, ``block_major``: ``[num_blocks, group_size, num_segments, segment_bytes]``) in
    ``framework``; ``torch_data`` is the same memory as a torch tensor (a DLPack view for paddle,
    made on first use: it imports torch, which a Paddle deployment need not have)."""

    layout: Layout
    data: Any
    framework: Framework
    block_major: bool = False
    # block_wise_fp8 KV scales: uint8 [group_size, 2 (K, V), num_blocks, scale_segment_bytes], else None
    scales: Any = None
    cache: dict = field(default_factory=dict, repr=False)  # unused by the ops (run tables: ops.states)

    @property
    def torch_data(self) -> torch.Tensor:
        return _torch_alias(self.data, self.framework, self.cache)

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0 if self.block_major else 2])

    def require_slot_major(self, op: str) -> None:
        """Raise ``ValueError`` for a host (block-major) pool passed to a device op."""
        if self.block_major:
            raise ValueError(f"{op} works on device pools from allocate_pools, not on a host pool")

    @property
    def device(self) -> torch.device | DeviceId:
        """``torch.device`` of a torch pool; :class:`~hybridkv.ops._framework.DeviceId` of a Paddle
        pool (equal to the ``torch.device`` of the same device)."""
        return paddle_device(self.data) if self.framework is Framework.PADDLE else self.data.device

    def slot(self, i: int) -> Any:
        """Layer slot ``i``: ``[num_segments, num_blocks, segment_bytes]`` uint8, a view of ``data``."""
        return self.data[:, i].transpose(0, 1) if self.block_major else self.data[i]

    def slots(self) -> list[Any]:
        return [self.slot(i) for i in range(self.layout.group_size)]


def _torch_alias(data: Any, framework: Framework, cache: dict) -> torch.Tensor:
    """``data`` as torch: itself, or (Paddle) a DLPack view made once and kept in ``cache``."""
    if framework is Framework.TORCH:
        return data
    alias = cache.get("torch_data")
    if alias is None:
        alias = cache["torch_data"] = to_torch(data)
    return alias


def _paddle_uint8(shape: list[int], device: DeviceId, pin: bool) -> Any:
    """A zero uint8 Paddle tensor on ``device`` (``pin``: page-locked host memory)."""
    if pin:
        import paddle

        return paddle.zeros(shape, dtype="uint8").pin_memory()
    return paddle_zeros(shape, device)


def _new_pools(
    layout: Layout, num_blocks: int, device: Any, framework: Framework, fill: Any, pin: bool, host: bool
) -> BlockPools:
    shape = [layout.group_size, layout.num_segments, num_blocks, layout.segment_bytes]
    if host:
        shape = [num_blocks, layout.group_size, layout.num_segments, layout.segment_bytes]
    byte = _fill_byte(fill)
    scales = None
    if framework is Framework.PADDLE:  # allocated by Paddle; no torch involved
        data = _paddle_uint8(shape, device, pin)
        if byte is not None:
            data.fill_(byte)
            if not host:
                data[:, :, NULL_BLOCK] = 0
        if layout.scale_segment_bytes and not host:
            scales = paddle_zeros([layout.group_size, 2, num_blocks, layout.scale_segment_bytes], device)
        return BlockPools(layout, data, framework, block_major=host, scales=scales)
    import torch

    data = torch.zeros(shape, dtype=torch.uint8, device=device, pin_memory=pin)
    if byte is not None:
        data.fill_(byte)
        if not host:
            data[:, :, NULL_BLOCK].zero_()
    if layout.scale_segment_bytes and not host:
        shape = [layout.group_size, 2, num_blocks, layout.scale_segment_bytes]
        scales = torch.zeros(shape, dtype=torch.uint8, device=device)
    return BlockPools(layout, data, framework, block_major=host, scales=scales)


def _pool_device(device: Any, framework: Framework) -> Any:
    return resolve_paddle_device(device) if framework is Framework.PADDLE else resolve_device(device)


def allocate_pools(
    layout: Layout,
    device: str | Any = "cuda",
    framework: Framework | str = "torch",
    fill: int | float | str | None = None,
    num_blocks: int | None = None,
) -> BlockPools:
    """Allocate ``layout.num_blocks`` (or ``num_blocks``) blocks of every layer slot on ``device``.

    ``framework="paddle"`` allocates with paddle (the torch view is a DLPack alias). ``fill``: None
    for zeros, ``"nan"`` (bytes 0xFF) or a byte value, for tests that must see stray reads; block 0
    is zeroed either way. Raises ``ValueError`` on a bad ``fill``.
    """
    n = layout.num_blocks if num_blocks is None else num_blocks
    if n < 2:
        raise ValueError(f"a pool needs the null block and one more, got num_blocks={n}")
    fw = Framework(framework)
    return _new_pools(layout, n, _pool_device(device, fw), fw, fill, pin=False, host=False)


def allocate_host_pools(
    layout: Layout,
    num_host_blocks: int,
    framework: Framework | str = "torch",
    fill: int | float | str | None = None,
    pin_memory: bool | None = None,
) -> BlockPools:
    """Host pool with the layout's block bytes and ``num_host_blocks`` blocks (ids 0..num_host_blocks-1),
    block-major: ``data`` is ``[num_host_blocks, group_size, num_segments, segment_bytes]`` uint8.

    ``HybridBlockManager(num_host_blocks=N)`` hands out host ids 0..N-1: allocate ``N`` here. Pinned
    (page-locked) by default when CUDA is available, so swaps can run asynchronously; the memory is
    allocated by the framework named (Paddle: ``pin_memory()``, no torch).
    """
    if num_host_blocks < 1:
        raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}")
    fw = Framework(framework)
    pin = _cuda_available(fw) if pin_memory is None else pin_memory
    return _new_pools(layout, num_host_blocks, _pool_device("cpu", fw), fw, fill, pin=pin, host=True)


def _cuda_available(framework: Framework) -> bool:
    if framework is Framework.PADDLE:
        import paddle

        return bool(paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0)
    import torch

    return torch.cuda.is_available()


def kv_view_shape(layout: Layout, spec: AttentionLayerSpec, value: bool) -> tuple[int, ...]:
    """Shape of one attention layer's K (``value=False``) or V view over the layout's segments.

    A K (V) taking one segment: ``[num_blocks, kv_heads, block_size, head_dim]``. K and V of different
    widths (MLA) are cut into segments of their greatest common width ``w`` (``layout.key_segments``
    for K, ``layout.value_segments`` for V): ``[num_blocks, kv_heads, block_size, segments, w]``, the
    head's columns ``j*w .. (j+1)*w - 1`` in segment ``j`` (a strided view: segment ``j`` of every
    block is one run, ``num_blocks`` blocks long; ``.reshape(..., head_dim)`` copies it into the plain
    shape)."""
    n = layout.value_segments if value else layout.key_segments
    width = spec.value_head_dim if value else spec.head_dim
    lead = (layout.num_blocks, spec.num_kv_heads, layout.block_size)
    if n == 0:  # zero-width values (MLA without a rotary part keeps keys only)
        return (*lead, 0)
    return (*lead, width) if n == 1 else (*lead, n, width // n)


def segment_kv_view(segments: Any, spec: AttentionLayerSpec, block_size: int) -> Any:
    """Torch or Paddle uint8 ``[n, num_blocks, segment_bytes]`` (``n`` consecutive segments of one layer
    slot) seen as that layer's K or V: ``[num_blocks, kv_heads, block_size, head_dim]`` for ``n == 1``,
    else ``[num_blocks, kv_heads, block_size, n, width]`` (:func:`kv_view_shape`). Same memory, same
    start. A Paddle ``segments`` must start its allocation (Paddle 3.3 reads a typed view of a slice
    at a byte offset from the wrong bytes; :func:`kv_cache_views` views the whole pool instead)."""
    n, num_blocks = int(segments.shape[0]), int(segments.shape[1])
    if is_paddle_tensor(segments):
        if n and segments._offset() != 0:
            raise ValueError("segment_kv_view: a Paddle segment run must start its allocation (offset 0)")
        typed = segments if spec.dtype.itemsize == 1 or not n else segments.view(paddle_dtype(spec.dtype))
        return _paddle_kv_view(typed, spec, block_size)
    if n == 0:  # zero-width values: an empty view of the right shape and dtype
        dtype = segments.dtype if spec.dtype.itemsize == 1 else torch_dtype(spec.dtype)
        return segments.new_empty((num_blocks, spec.num_kv_heads, block_size, 0), dtype=dtype)
    t = segments if spec.dtype.itemsize == 1 else segments.view(torch_dtype(spec.dtype))
    t = t.view(n, num_blocks, spec.num_kv_heads, block_size, -1)
    return t[0] if n == 1 else t.permute(1, 2, 3, 0, 4)


def kv_cache_views(pools: BlockPools) -> list[Any]:
    """``[k0, v0, k1, v1, ...]`` for the attention layers in slot order: views of the one backing
    allocation, so not FastDeploy's ``caches`` (those are built by
    ``hybridkv.integrations.fastdeploy.worker.kv_cache_list``, one allocation per tensor).
    Quantized (1-byte) KV is seen as uint8, as FastDeploy stores it.

    K takes the slot's segments ``[0, layout.key_segments)``, V the next ``layout.value_segments``.
    Each is ``[num_blocks, kv_heads, block_size, head_dim]`` of the attention dtype when it takes one
    segment; K and V of different widths (MLA) are ``[num_blocks, kv_heads, block_size, segments,
    width]`` (:func:`kv_view_shape`). Views of the pool memory in the pool's framework. Empty for
    models without attention.
    """
    pools.require_slot_major("kv_cache_views")
    layout, kv = pools.layout, pools.layout.kv_group
    if kv is None:
        return []
    views = []
    ks, vs = layout.key_segments, layout.value_segments
    for slot, layer_id in enumerate(kv.layer_ids):
        if layer_id is None:
            continue
        spec = layout.model.layers[layer_id]
        assert isinstance(spec, AttentionLayerSpec)
        for cut in (slice(0, ks), slice(ks, ks + vs)):
            if pools.framework is Framework.PADDLE:  # Paddle's own views, no torch
                # the whole pool seen as the attention dtype, then sliced in elements: a typed view of
                # an offset slice reads the wrong bytes in Paddle 3.3
                typed = pools.data if spec.dtype.itemsize == 1 else pools.data.view(paddle_dtype(spec.dtype))
                views.append(_paddle_kv_view(typed[slot, cut], spec, layout.block_size))
                continue
            t = segment_kv_view(pools.torch_data[slot, cut], spec, layout.block_size)
            views.append(from_torch(t, pools.framework))
    return views


def _paddle_kv_view(run: Any, spec: AttentionLayerSpec, block_size: int) -> Any:
    """Paddle ``[n, num_blocks, segment_bytes / itemsize]`` of the attention dtype (uint8 for 1-byte KV):
    ``n`` consecutive segments already typed, seen as :func:`segment_kv_view`'s shapes. Same memory."""
    n, num_blocks = int(run.shape[0]), int(run.shape[1])
    lead = [num_blocks, spec.num_kv_heads, block_size]
    if n == 0:  # zero-width values: an empty tensor of the right shape and dtype
        import paddle

        return paddle.zeros([*lead, 0], dtype="uint8" if spec.dtype.itemsize == 1 else paddle_dtype(spec.dtype),
                            device=run.place)  # fmt: skip
    t = run.reshape([n, *lead, -1])
    return t[0] if n == 1 else t.transpose([1, 2, 3, 0, 4])


def read_state(pools: BlockPools, group: int, slot: int, blocks: Any) -> dict[str, Any]:
    """Reference read of one state (not a view): component name -> new tensor of its shape, in the
    pools' framework (torch, or Paddle computed through Paddle alone).

    ``blocks``: the state set's ``blocks_per_state`` block ids in table order; null blocks read zeros.
    """
    pools.require_slot_major("read_state")
    entry = pools.layout.state_layer(group, slot)
    if entry is None:
        raise ValueError(f"state group {group} has no layer in slot {slot}")
    spec = entry[1]
    if pools.framework is Framework.PADDLE:
        from hybridkv.ops import _paddle

        return _paddle.read_state(pools, group, slot, spec, blocks)
    import torch

    row = to_torch(blocks).to(pools.device, torch.int64).reshape(1, -1)
    if row.shape[1] < pools.layout.blocks_per_state[group]:
        raise ValueError(
            f"a state of group {group} spans {pools.layout.blocks_per_state[group]} block ids, got {row.shape[1]}"
        )
    address, null = state_byte_addresses(pools.layout, pools.num_blocks, row, spec.state_bytes)
    flat = pools.torch_data[slot].reshape(-1)[address[0]].masked_fill(null[0], 0)
    offsets = spec.component_offsets()
    return {  # a quantized component: its stored bytes (values, then float32 scales)
        c.name: flat[offsets[c.name] : offsets[c.name] + c.nbytes]
        if c.dtype.quantized
        else flat[offsets[c.name] : offsets[c.name] + c.nbytes].view(torch_dtype(c.dtype)).view(c.shape)
        for c in spec.components
    }


@dataclass(frozen=True, eq=False)
class StateBuffers:
    """Batched contiguous states: per state layer and component a ``[batch_size, *shape]`` tensor.

    All tensors are views of one uint8 backing buffer ``data`` (``torch_data`` in torch), laid out by
    ``regions`` (256-byte aligned). ``tensors[(group, slot)][name]`` is in the buffers' framework.
    """

    layout: Layout
    batch_size: int
    groups: tuple[int, ...]
    regions: tuple[BufferRegion, ...]
    data: Any
    framework: Framework
    tensors: dict[tuple[int, int], dict[str, Any]]
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def torch_data(self) -> torch.Tensor:
        """``data`` in torch (a DLPack view made on first use for Paddle buffers: imports torch)."""
        return _torch_alias(self.data, self.framework, self.cache)

    def layer(self, group: int, slot: int) -> dict[str, Any]:
        """Component name -> ``[batch_size, *shape]`` tensor of state group ``group``'s layer in ``slot``."""
        return self.tensors[(group, slot)]

    def by_layer_id(self) -> dict[int, dict[str, Any]]:
        """Model layer id -> component name -> ``[batch_size, *shape]`` tensor."""
        return {r.layer_id: self.tensors[(r.group, r.slot)] for r in self.regions}

    @property
    def device(self) -> torch.device | DeviceId:
        return paddle_device(self.data) if self.framework is Framework.PADDLE else self.data.device

    def region_bytes(self, region: BufferRegion) -> Any:
        """``[batch_size, nbytes]`` uint8 view of one region, in the buffers' framework."""
        size = self.batch_size * region.row_stride
        raw = self.data[region.buffer_offset : region.buffer_offset + size]
        if self.framework is Framework.PADDLE:
            return raw.reshape([self.batch_size, -1])
        return raw.view(self.batch_size, -1)


def allocate_state_buffers(
    layout: Layout,
    batch_size: int,
    group: int | None = None,
    device: str | Any = "cuda",
    framework: Framework | str = "torch",
    fill: int | float | str | None = None,
    compute_dtype: DType | str | None = None,
) -> StateBuffers:
    """One backing buffer with a ``[batch_size, *component.shape]`` view per state layer and component,
    for state group ``group`` or (None) every state group. Owned by the caller.

    A quantized component (int8 / fp8 values and their scales) is seen as its stored bytes, uint8
    ``[batch_size, nbytes]``, unless ``compute_dtype`` is given: then it, and every float16
    component, is ``[batch_size, *shape]`` of ``compute_dtype``, which gather_states fills
    dequantized and scatter_states quantizes (:mod:`hybridkv.ops.states.quant`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    fw = Framework(framework)
    groups = tuple(range(layout.num_state_groups)) if group is None else (group,)
    for g in groups:
        if not 0 <= g < layout.num_state_groups:
            raise ValueError(f"state group {g} does not exist: the layout has {layout.num_state_groups}")
    regions, pos = [], 0
    compute = None if compute_dtype is None else DType.parse(str(compute_dtype).removeprefix("torch."))
    for g in groups:
        for slot in range(layout.group_size):
            entry = layout.state_layer(g, slot)
            if entry is None:
                continue
            layer_id, spec = entry
            for c, off in zip(spec.components, spec.component_offsets().values(), strict=True):
                computed = compute is not None and (c.dtype.quantized or c.dtype is DType.FLOAT16)
                row = c.numel * compute.itemsize if computed else 0  # type: ignore[union-attr]
                name = compute.value if computed else None  # type: ignore[union-attr]
                regions.append(BufferRegion(g, slot, layer_id, c.name, off, c.nbytes, pos, name, row))
                pos += -(-batch_size * (row or c.nbytes) // BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES
    size, dev = max(pos, BUFFER_ALIGN_BYTES), _pool_device(device, fw)
    if fw is Framework.PADDLE:
        data = paddle_zeros([size], dev)
    else:
        import torch

        data = torch.zeros(size, dtype=torch.uint8, device=dev)
    byte = _fill_byte(fill)
    if byte is not None:
        data.fill_(byte)
    tensors: dict[tuple[int, int], dict[str, Any]] = {}
    for r in regions:
        spec = layout.model.layers[r.layer_id]
        c = spec.component(r.name)
        raw = data[r.buffer_offset : r.buffer_offset + batch_size * r.row_stride]
        dtype = DType(r.compute) if r.compute else c.dtype
        if dtype.quantized:  # stored bytes: values, then float32 scales
            view = raw.reshape([batch_size, c.nbytes]) if fw is Framework.PADDLE else raw.view(batch_size, c.nbytes)
        elif fw is Framework.PADDLE:
            # Paddle 3.3's view(dtype) of a slice that starts at a byte offset reads from offset / itemsize:
            # view the whole buffer (256-byte aligned regions), then slice in elements
            n, first = dtype.itemsize, r.buffer_offset // dtype.itemsize
            whole = data.view(paddle_dtype(dtype))
            view = whole[first : first + batch_size * r.row_stride // n].reshape([batch_size, *c.shape])
        else:
            view = raw.view(torch_dtype(dtype)).view(batch_size, *c.shape)
        tensors.setdefault((r.group, r.slot), {})[r.name] = view
    return StateBuffers(layout, batch_size, groups, tuple(regions), data, fw, tensors)

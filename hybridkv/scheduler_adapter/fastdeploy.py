"""FastDeploy drop-in: the cache manager surface its resource manager calls, and ``ForwardMeta`` filling.

:class:`FastDeployBlockManager` answers the calls ``ResourceManager`` / ``ResourceManagerV1`` make on
``PrefixCacheManager`` (``can_allocate_gpu_blocks``, ``allocate_gpu_blocks``, ``recycle_gpu_blocks``,
``release_block_ids``, ``gpu_free_block_list``, ``num_gpu_blocks``) and the resource manager's own
``available_block_num`` / ``_free_blocks`` / ``_trigger_preempt`` path, from one
:class:`HybridBlockManager`, so state sets are counted with the KV blocks. FastDeploy's calls are
per block list; the manager's are per request: the first ``allocate_gpu_blocks(n, req_id)`` of a
request admits it (KV for ``n`` blocks plus its state sets), later ones append ``n`` KV blocks,
and once every KV block of a request has been recycled its state sets go back too.

:func:`attach` sets ``ForwardMeta.caches`` (the attention K/V views of the layer slot tensors, in
FastDeploy's ``[k0, v0, k1, v1, ...]`` order by model layer id), ``block_tables`` and the new
fields ``state_block_tables``, ``state_layer_slots``, ``has_initial_state``. torch and paddle are
imported lazily, from the type of the pool tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any, NamedTuple

import numpy as np

from hybridkv.blockmgr.errors import RequestStateError
from hybridkv.blockmgr.layout import Layout
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestId
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType
from hybridkv.blockmgr.units import cdiv
from hybridkv.scheduler_adapter.metadata import StepMetadata


class _FreeBlocks:
    """Stands in for ``gpu_free_block_list``: FastDeploy only takes its ``len``."""

    __slots__ = ("_manager",)

    def __init__(self, manager: HybridBlockManager) -> None:
        self._manager = manager

    def __len__(self) -> int:
        return self._manager.num_available_blocks


class FastDeployBlockManager:
    """``PrefixCacheManager``'s block surface plus the resource manager's preemption path.

    Block ids handed out are the manager's; the caller keeps them in ``request.block_tables``
    exactly as with FastDeploy's own heap. Ownership: the manager owns the blocks; a request's
    blocks (KV and state) return when all its KV ids were recycled, or on :meth:`release_block_ids`
    / :meth:`free_request`.
    """

    def __init__(self, manager: HybridBlockManager) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self._owner: dict[int, RequestId] = {}  # KV block id -> request, for recycles without req_id
        self._recycled: dict[RequestId, set[int]] = {}

    # ---- PrefixCacheManager surface ------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.manager.pool.num_usable

    @property
    def gpu_free_block_list(self) -> _FreeBlocks:
        return _FreeBlocks(self.manager)

    @property
    def num_cpu_blocks(self) -> int:
        return self.manager.host_pool.num_usable if self.manager.host_pool is not None else 0

    @property
    def available_gpu_resource(self) -> float:
        return self.manager.num_available_blocks / self.num_gpu_blocks

    @property
    def num_state_blocks_per_request(self) -> int:
        return self.manager.num_state_blocks

    def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
        """True if ``num_blocks`` KV blocks plus one request's state sets (and the watermark) are free.

        FastDeploy does not say which request asks, so this reserves state sets for a new request
        every time: conservative for appends by ``num_state_blocks_per_request`` blocks, never
        over-admitting. :meth:`blocks_needed` is the exact count for a known request.
        """
        need = num_blocks + self.manager.num_state_blocks + self.manager.watermark_blocks
        return need <= self.manager.num_available_blocks

    def blocks_needed(self, request_id: RequestId, num_blocks: int) -> int:
        """Exact blocks ``allocate_gpu_blocks(num_blocks, request_id)`` takes (state sets on admission)."""
        if request_id in self.manager.requests:
            return num_blocks
        return self.manager.blocks_to_admit(num_blocks * self.block_size) + self.manager.watermark_blocks

    def allocate_gpu_blocks(self, num_blocks: int, req_id: RequestId | None = None) -> list[int]:
        """``num_blocks`` new KV block ids of request ``req_id`` (admitting it with its state sets first).

        Raises :class:`RequestStateError` without ``req_id`` (the manager allocates per request),
        :class:`NoFreeBlocksError` / :class:`RequestTooLargeError` when the blocks are not there;
        nothing changes then (FastDeploy asserts instead).
        """
        if req_id is None:
            raise RequestStateError(
                "allocate_gpu_blocks needs req_id: state sets are allocated per request. FastDeploy's newer "
                "ResourceManagerV1._allocate_gpu_blocks passes it; older ones need the one-line patch in "
                "docs/fastdeploy.md"
            )
        tokens = num_blocks * self.block_size
        if req_id in self.manager.requests:
            self.manager.append(req_id, tokens)  # whole blocks: never a copy-on-write
        else:
            self.manager.allocate(req_id, tokens)
        rec = self.manager.requests[req_id]
        ids = rec.kv_blocks[rec.num_kv_blocks - num_blocks :].tolist() if num_blocks else []
        for b in ids:
            self._owner[b] = req_id
        return ids

    def recycle_gpu_blocks(self, gpu_block_ids: Iterable[int] | int, req_id: RequestId | None = None) -> None:
        """Give KV ids back; when all of a request's KV ids are back, free the request (state too).

        Ids of requests already released (:meth:`release_block_ids`) are ignored, which is what
        FastDeploy's ``_free_blocks`` does after ``release_block_ids`` with prefix caching on.
        """
        ids = [gpu_block_ids] if isinstance(gpu_block_ids, int | np.integer) else [int(b) for b in gpu_block_ids]
        by_request: dict[RequestId, list[int]] = {}
        for b in ids:
            owner = self._owner.get(b)
            if owner is not None and (req_id is None or owner == req_id):
                by_request.setdefault(owner, []).append(b)
        for rid, blocks in by_request.items():
            back = self._recycled.setdefault(rid, set())
            back.update(blocks)
            if back.issuperset(self.manager.requests[rid].kv_blocks.tolist()):
                self._free(rid)

    def release_block_ids(self, task: Any) -> None:
        """Free everything ``task`` holds (KV and state sets)."""
        if task.request_id in self.manager.requests:
            self._free(task.request_id)

    release_block_ids_async = release_block_ids

    @staticmethod
    def get_required_block_num(token_num: int, block_size: int) -> int:
        return cdiv(token_num, block_size)

    def update_cache_blocks(self, task: Any, block_size: int, num_computed_tokens: int) -> None:
        """No prefix cache behind this facade yet: nothing is cached."""
        task.num_cached_blocks = 0

    def request_match_blocks(self, task: Any, block_size: int) -> tuple[list[int], int, dict]:
        return [], 0, {}

    # ---- ResourceManager surface ---------------------------------------------------------------
    def available_block_num(self) -> int:
        return self.manager.num_available_blocks

    def total_block_number(self) -> int:
        return self.num_gpu_blocks

    def get_gpu_cache_usage_perc(self) -> float:
        return 1.0 - self.available_gpu_resource

    def allocate_request(self, request: Any, num_new_tokens: int) -> list[int]:
        """Request-level path: grow ``request.block_tables`` to cover ``num_computed_tokens + num_new_tokens``
        (admitting the request with its state sets on first use); returns the new ids."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        new = self.allocate_gpu_blocks(max(total - len(request.block_tables), 0), request.request_id)
        request.block_tables.extend(new)
        return new

    def free_request(self, request: Any) -> None:
        """``ResourceManagerV1._free_blocks``: KV and state sets back, ``block_tables`` emptied."""
        if request.request_id in self.manager.requests:
            self._free(request.request_id)
        request.block_tables = []
        request.num_cached_blocks = 0

    def trigger_preempt(
        self,
        running: MutableSequence[Any],
        request: Any,
        num_new_blocks: int,
        preempted_reqs: list[Any],
        scheduled_reqs: list[Any],
        preempt_task: Callable[[Any], Any] | None = None,
    ) -> bool:
        """``ResourceManagerV1._trigger_preempt`` with the exact count: pop the newest running request
        (recompute: blocks freed, ``num_computed_tokens = 0``) until ``request`` can get its
        ``num_new_blocks``. Returns False if ``request`` itself had to go. ``preempt_task(req)``
        builds the task appended to ``scheduled_reqs`` (default: the request)."""
        while self.blocks_needed(request.request_id, num_new_blocks) > self.manager.num_available_blocks:
            if not running:
                return False
            victim = running.pop()
            self.free_request(victim)
            victim.num_computed_tokens = 0
            preempted_reqs.append(victim)
            scheduled_reqs.append(preempt_task(victim) if preempt_task else victim)
            if victim is request:
                return False
        return True

    def state_block_tables(self, request_ids_by_slot: Sequence[RequestId | None]) -> np.ndarray:
        """``[num_state_groups, num_slots, blocks_per_state]`` int32 in FastDeploy's batch-slot order
        (``request.idx``): row ``i`` holds the live state sets of the request in slot ``i``; empty
        slots (None) are null rows."""
        m = self.manager
        table = np.zeros((m.num_state_groups, len(request_ids_by_slot), m.blocks_per_state), dtype=np.int32)
        live = [(i, rid) for i, rid in enumerate(request_ids_by_slot) if rid is not None]
        if live:
            rows, rids = zip(*live, strict=True)
            table[:, list(rows)] = m.state_table(list(rids))
        return table

    def attach_slots(
        self,
        forward_meta: Any,
        pools: Any,
        request_ids_by_slot: Sequence[RequestId | None],
        num_layers: int | None = None,
    ) -> Any:
        """For FastDeploy's own scheduler and runner (rows = batch slots, ``block_tables`` and sequence
        lengths filled by the runner): set ``caches``, ``state_block_tables``, ``state_layer_slots`` and
        ``has_initial_state`` (``seq_lens_decoder > 0``). Returns ``forward_meta``."""
        slots = _slot_tensors(pools)
        layout = self.manager.layout
        forward_meta.caches = kv_cache_list(layout, slots, num_layers)
        forward_meta.state_block_tables = _like(self.state_block_tables(request_ids_by_slot), slots[0])
        forward_meta.state_layer_slots = state_layer_slots(layout, slots)
        if forward_meta.seq_lens_decoder is not None:
            forward_meta.has_initial_state = forward_meta.seq_lens_decoder.reshape([-1]) > 0
        return forward_meta

    def attach(self, forward_meta: Any, metadata: StepMetadata, pools: Any, **kwargs: Any) -> Any:
        """:func:`attach` (rows in the order of a :class:`~hybridkv.scheduler_adapter.Scheduler` plan)."""
        return attach(forward_meta, metadata, pools, **kwargs)

    def _free(self, rid: RequestId) -> None:
        for b in self.manager.requests[rid].kv_blocks.tolist():
            self._owner.pop(b, None)
        self._recycled.pop(rid, None)
        self.manager.free(rid)


# ---- ForwardMeta --------------------------------------------------------------------------------
class StateLayerSlot(NamedTuple):
    """Where a recurrent layer's state lives: state group (row of ``state_block_tables``), layer slot,
    and that slot's tensor ``[num_segments, num_blocks, segment_bytes]`` uint8 (the same memory the
    attention layer of that slot sees through ``caches``)."""

    layer_id: int
    group: int
    slot: int
    pool: Any


def _slot_tensors(pools: Any) -> list[Any]:
    if hasattr(pools, "slots"):
        return list(pools.slots())
    return list(pools)


def _is_paddle(t: Any) -> bool:
    return type(t).__module__.startswith("paddle")


def _view(t: Any, dtype: DType, shape: Sequence[int]) -> Any:
    if _is_paddle(t):
        import paddle

        return t.view(getattr(paddle, dtype.value)).reshape(list(shape))
    import torch

    return t.view(getattr(torch, dtype.value)).view(*shape)


def _like(arr: np.ndarray, like: Any) -> Any:
    """``arr`` as a tensor of ``like``'s framework, on its device."""
    if _is_paddle(like):
        import paddle

        return paddle.to_tensor(arr, place=like.place)
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr)).to(like.device)


def kv_cache_list(layout: Layout, slots: Sequence[Any], num_layers: int | None = None) -> list[Any]:
    """FastDeploy's ``caches``: entry ``2*l`` / ``2*l+1`` is attention layer ``l``'s K / V view,
    ``[num_blocks, kv_heads, block_size, head_dim]`` of the layer slot holding it; entries of layers
    without KV are None (FastDeploy allocates a pair for every layer; no backend reads those).
    ``num_layers`` defaults to the model's layer count."""
    n = len(layout.model.layers) if num_layers is None else num_layers
    caches: list[Any] = [None] * (2 * n)
    kv = layout.kv_group
    if kv is None:
        return caches
    for slot, layer_id in enumerate(kv.layer_ids):
        if layer_id is None:
            continue
        spec = layout.model.layers[layer_id]
        assert isinstance(spec, AttentionLayerSpec)
        t = slots[slot]
        shape = (t.shape[1], spec.num_kv_heads, layout.block_size, spec.head_dim)
        caches[2 * layer_id] = _view(t[0], spec.dtype, shape)
        caches[2 * layer_id + 1] = _view(t[1], spec.dtype, shape)
    return caches


def state_layer_slots(layout: Layout, slots: Sequence[Any]) -> dict[int, StateLayerSlot]:
    """Model layer id -> :class:`StateLayerSlot` for every recurrent layer."""
    out = {}
    for g, group in enumerate(layout.state_groups):
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is not None:
                out[layer_id] = StateLayerSlot(layer_id, g, slot, slots[slot])
    return out


def attach(
    forward_meta: Any, metadata: StepMetadata, pools: Any, num_layers: int | None = None, set_seq_lens: bool = False
) -> Any:
    """Fill ``forward_meta`` (FastDeploy's ``ForwardMeta`` or anything with its field names) for one step.

    ``pools``: a :class:`hybridkv.ops.pools.BlockPools` or a list of layer slot tensors
    ``[num_segments, num_blocks, segment_bytes]`` uint8 (torch or paddle). Sets ``caches``,
    ``block_tables`` int32 ``[B, W]``, ``state_block_tables`` int32 ``[G, B, blocks_per_state]``,
    ``speculative_state_block_tables`` int32 ``[K, G, B, blocks_per_state]``, ``state_layer_slots``,
    ``has_initial_state`` bool ``[B]``, ``hybridkv_metadata``; with ``set_seq_lens`` also the
    sequence lengths, ``cu_seqlens_q/k`` and ``batch_id_per_token`` (FastDeploy's runner normally
    fills those itself). Returns ``forward_meta``.
    """
    slots = _slot_tensors(pools)
    layout = metadata.layout
    if len(slots) != layout.num_layer_slots:
        raise ValueError(f"pools have {len(slots)} layer slots, the layout has {layout.num_layer_slots}")
    like = slots[0]
    forward_meta.caches = kv_cache_list(layout, slots, num_layers)
    forward_meta.block_tables = _like(metadata.block_tables, like)
    forward_meta.state_block_tables = _like(metadata.state_tables, like)
    forward_meta.speculative_state_block_tables = _like(metadata.speculative_state_tables, like)
    forward_meta.state_layer_slots = state_layer_slots(layout, slots)
    forward_meta.has_initial_state = _like(metadata.has_initial_state, like)
    forward_meta.hybridkv_metadata = metadata
    if set_seq_lens:
        for name in ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q", "cu_seqlens_k"):
            setattr(forward_meta, name, _like(getattr(metadata, name), like))
        forward_meta.batch_id_per_token = _like(metadata.batch_id_per_token, like)
    return forward_meta

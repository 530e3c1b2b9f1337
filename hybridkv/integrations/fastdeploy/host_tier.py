"""Patch W6: the host pool of the prefix cache's host tier in a FastDeploy worker, and the step's
device <-> host copies (patch E9's ``tier_copies`` task field), run before the step's other copies.

A host block is one device block's row of every allocation of
:class:`~hybridkv.integrations.fastdeploy.worker.FastDeployCaches` (block-major, so a run of
consecutive host ids is one copy). Everything runs in the caches' framework: a Paddle worker's host
pool is Paddle memory (pinned with CUDA) and no torch is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.types import TIER_COPIES_FIELD
from hybridkv.integrations.fastdeploy.worker import BlockIdError, FastDeployCaches, _host_array, check_block_ids
from hybridkv.ops.pools import BlockPools
from hybridkv.planner.layout import Layout
from hybridkv.units import as_count


@dataclass(frozen=True, eq=False)
class FastDeployHostCaches:
    """The worker's host pool for hybridkv's host tier (and its swaps): host block ``h`` of the
    manager (``HybridBlockManager(num_host_blocks=N)`` hands out ``0 .. N-1``) holds one device
    block's row of every allocation of :class:`FastDeployCaches`.

    ``pools``: :func:`hybridkv.ops.pools.allocate_host_pools`, block-major uint8
    ``[N, num_layer_slots, num_segments, segment_bytes]`` (a host block is one contiguous
    ``block_bytes * num_layer_slots`` chunk, so a run of consecutive host ids is one copy).
    ``scales[s]``: ``(k, v)`` float32 ``[N, kv_heads, block_size]`` for a ``block_wise_fp8`` slot
    ``s``, else None. The object owns the (pinned, with CUDA) memory."""

    layout: Layout
    pools: BlockPools
    scales: tuple[tuple[Any, Any] | None, ...]

    @property
    def num_blocks(self) -> int:
        return self.pools.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one host block: every segment row and scale row of one device block."""
        scales = sum(int(np.prod(t.shape[1:])) * 4 for pair in self.scales if pair is not None for t in pair)
        return int(np.prod(self.pools.data.shape[1:])) + scales  # uint8 rows; float32 scales


def allocate_host_caches(
    caches: FastDeployCaches, num_host_blocks: int, pin_memory: bool | None = None
) -> FastDeployHostCaches:
    """The host pool for ``caches``: ``num_host_blocks`` blocks (the manager's ``num_host_blocks``;
    with :meth:`~hybridkv.integrations.fastdeploy.facade.FastDeployBlockManager.from_cache_config`,
    ``facade.manager.host_pool.num_usable``). Pinned by default when CUDA is there. ``TypeError`` /
    ``ValueError`` for other objects or a count below 1."""
    if not isinstance(caches, FastDeployCaches):
        raise TypeError(f"allocate_host_caches needs FastDeployCaches, got {type(caches).__name__}")
    n = as_count(num_host_blocks, "num_host_blocks", minimum=1)
    layout = caches.layout
    if len(caches.segments) != layout.group_size or any(len(seg) != layout.num_segments for seg in caches.segments):
        raise ValueError("allocate_host_caches: the caches do not have the layout's layer slots and segments")
    from hybridkv.ops.pools import allocate_host_pools

    pools = allocate_host_pools(layout, n, framework=caches.framework, pin_memory=pin_memory)
    scales: list[tuple[Any, Any] | None] = []
    for pair in caches.scales:
        if pair is None:
            scales.append(None)
            continue
        shape = (n, *tuple(int(d) for d in pair[0].shape)[1:])
        scales.append((_host_zeros(pools.data, shape), _host_zeros(pools.data, shape)))
    return FastDeployHostCaches(layout, pools, tuple(scales))


def _host_zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """float32 zeros in host memory of ``like``'s framework, pinned when ``like`` is."""
    out = tensors_.zeros(like, shape, "float32")
    pinned = like.place.is_cuda_pinned_place() if tensors_.is_paddle(like) else like.is_pinned()
    return out.pin_memory() if pinned else out


def _host_ids(host: FastDeployHostCaches, values: Any, what: str, distinct: bool) -> np.ndarray:
    arr = _host_array(values, what)
    bad = (arr < 0) | (arr >= host.num_blocks)
    if bad.any():
        raise BlockIdError(f"{what}: {sorted(set(arr[bad].tolist()))[:5]} are not host blocks 0..{host.num_blocks - 1}")
    if distinct and np.unique(arr).size != arr.size:
        values_, counts = np.unique(arr, return_counts=True)
        raise BlockIdError(f"{what}: host blocks {values_[counts > 1][:5].tolist()} appear more than once")
    return arr


def _tier_pairs(
    caches: FastDeployCaches, host: FastDeployHostCaches, copies: Any, key: str
) -> tuple[np.ndarray, np.ndarray]:
    """``copies[key]`` = ``[[device...], [host...]]``, checked: real device blocks of the layout, host
    blocks of the pool, equal lengths, no destination twice (host for ``offload``, device for ``onload``)."""
    pair = copies.get(key)
    if isinstance(pair, str | bytes) or not hasattr(pair, "__len__") or len(pair) != 2:
        raise TypeError(f"tier_copies[{key!r}] must be [[device...], [host...]], got {pair!r}")
    dev = check_block_ids(caches.layout, pair[0], f"tier_copies[{key!r}] device", distinct=key == "onload")
    hst = _host_ids(host, pair[1], f"tier_copies[{key!r}] host", distinct=key == "offload")
    if dev.ndim != 1 or hst.ndim != 1 or dev.size != hst.size:
        raise ValueError(f"tier_copies[{key!r}]: device and host ids must be two lists of equal length")
    return dev, hst


def run_tier_copies(caches: FastDeployCaches, host: FastDeployHostCaches, copies: Any) -> int:
    """W6: run one step's host-tier copies (the ``tier_copies`` field patch E9 sets, from
    :meth:`~hybridkv.integrations.fastdeploy.facade.FastDeployBlockManager.take_tier_copies`):
    first ``offload`` (device -> host: cached blocks the step evicted), then ``onload`` (host ->
    device: the step's host hits, a host checkpoint straight into the live sets). Every row of
    every allocation moves: segments and ``block_wise_fp8`` scales, so a state block's bytes move
    with it. Run it before the step's ``state_copies`` and forward (docs/contract.md stages 0 and
    3b). Both lists are checked before anything moves. Returns the bytes moved.

    Reference path, like :func:`copy_blocks`: per allocation one gather of the device rows, one
    copy per run of consecutive host ids (``hybridkv.ops.swap.runs.host_runs``), synchronous."""
    if not isinstance(caches, FastDeployCaches) or not isinstance(host, FastDeployHostCaches):
        raise TypeError(
            f"run_tier_copies needs FastDeployCaches and FastDeployHostCaches, got {type(caches).__name__}, "
            f"{type(host).__name__}"
        )
    if host.layout is not caches.layout and host.layout != caches.layout:
        raise ValueError("run_tier_copies: the host pool was allocated for another layout than the caches")
    if not isinstance(copies, dict) or set(copies) != {"offload", "onload"}:
        raise TypeError(f"tier_copies must be a dict with keys 'offload' and 'onload', got {copies!r}")
    out = _tier_pairs(caches, host, copies, "offload")
    back = _tier_pairs(caches, host, copies, "onload")
    moved = 0
    for (dev, hst), to_host in ((out, True), (back, False)):
        if dev.size:
            _swap_rows(caches, host, dev, hst, to_host)
            moved += int(dev.size) * host.bytes_per_block
    return moved


def _swap_rows(
    caches: FastDeployCaches, host: FastDeployHostCaches, dev: np.ndarray, hst: np.ndarray, to_host: bool
) -> None:
    """``host[hst[i]] <-> device[dev[i]]`` in every allocation (sorted by host id, one copy per run),
    in the caches' framework."""
    from hybridkv.ops.swap.runs import host_runs

    order = np.argsort(hst, kind="stable")
    dev, hst = dev[order], hst[order]
    runs = host_runs(hst)
    pairs: list[tuple[Any, Any]] = []
    data = host.pools.data  # [N, slots, segments, segment_bytes]
    for s, segs in enumerate(caches.segments):
        pairs.extend((t, data[:, s, k]) for k, t in enumerate(segs))
        if caches.scales[s] is not None:
            assert host.scales[s] is not None
            pairs.extend(zip(caches.scales[s], host.scales[s], strict=True))  # type: ignore[arg-type]
    for t, h in pairs:
        idx = tensors_.index(t, dev)
        if to_host:
            rows = tensors_.to_host(t[idx])
            for a, b in runs:
                first = int(hst[a])
                h[first : first + b - a] = rows[a:b]
        else:
            rows = tensors_.concat([h[int(hst[a]) : int(hst[a]) + b - a] for a, b in runs], axis=0)
            t[idx] = tensors_.to_like(rows, t)


def run_step_tier_copies(caches: FastDeployCaches, host: FastDeployHostCaches, tasks: Iterable[Any]) -> int:
    """W6 in ``insert_tasks_v1``, before any task's ``state_copies``: run the ``tier_copies`` of the
    step's tasks (E9 sets it on the first task of a batch; tasks without it are passed over), in
    task order. Returns the bytes moved."""
    moved = 0
    for task in tasks:
        copies = getattr(task, TIER_COPIES_FIELD, None)
        if copies is not None:
            moved += run_tier_copies(caches, host, copies)
    return moved

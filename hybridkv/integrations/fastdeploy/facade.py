"""FastDeploy drop-in, engine side: the cache-manager surface ``ResourceManagerV1`` calls.

:class:`FastDeployBlockManager` stands where FastDeploy builds its cache manager and answers, with
their signatures and return shapes, both name sets ``ResourceManagerV1`` uses:

- legacy ``PrefixCacheManager``: ``can_allocate_gpu_blocks(n)``, ``allocate_gpu_blocks(n, req_id)``,
  ``recycle_gpu_blocks(ids, req_id)``, ``release_block_ids(task)``, ``request_match_blocks(task,
  block_size)`` -> ``(common_block_ids, matched_token_num, hit_info)``, ``update_cache_blocks``,
  ``get_required_block_num``, ``write_cache_to_storage``, ``update_cache_config``,
  ``gpu_free_block_list`` / ``num_gpu_blocks`` / ``num_cpu_blocks`` / ``available_gpu_resource``;
- v1 ``CacheManager`` (``enable_cache_manager_v1``): ``match_prefix(request)`` (sets
  ``request.match_result``), ``allocate_gpu_blocks(request, n)`` (``[]`` on failure),
  ``request_finish(request)``, ``can_allocate_device_blocks``, ``num_free_device_blocks``.

The engine and the facade agree explicitly (docs/fastdeploy.md, patch series
:data:`PATCH_SERIES`, written against FastDeploy 7808a119): the patched ``ResourceManagerV1.__init__``
calls :meth:`FastDeployBlockManager.bind_engine` with the series name, the cache-manager mode and the
splitwise role. Until then every call but the count reads of ``ResourceManager.info()`` raises
:class:`EnginePatchError` naming the patch, so an engine without the series stops at its first call.
A request's state sets are charged once, where FastDeploy charges a new request: the patched
``get_new_block_nums`` lines of ``schedule()``'s WAITING branch and of ``preallocate_resource_in_p`` /
``_in_d`` add :meth:`FastDeployBlockManager.state_blocks_for` ``(request)``. That call is the
request's ticket: its first ``allocate_gpu_blocks(n)`` takes ``n`` blocks, the state sets first, and
returns the ``n - S`` KV ids; a first allocation without a ticket raises :class:`EnginePatchError`
(it never returns fewer KV ids than the engine meant to ask for). Counting is exact: a query for
``n`` blocks is ``n`` blocks (plus the blocks pending prefix hits pin, each counted once).

Prefix caching goes through hybridkv's prefix cache (KV hash chain + state checkpoints): a hit
shares cached KV blocks and fills the live state sets from a checkpoint. A match
(``request_match_blocks`` / ``match_prefix``) is pending until the request's first
``allocate_gpu_blocks`` takes it, a release drops it, or a new match of the same request replaces
it; it lapses at the next :meth:`~FastDeployBlockManager.begin_step` (FastDeploy matches and
allocates within one ``schedule()``), and an allocation of that request then refuses until it is
matched again. The state copies and tables a worker needs travel in the task
(:meth:`FastDeployBlockManager.task_fields`); the worker side is
:mod:`hybridkv.integrations.fastdeploy.worker`.

**Host tier** (``PrefixCacheConfig(host_tier=True)``, built from FastDeploy's ``swap_space`` by
:meth:`FastDeployBlockManager.from_cache_config`): cached blocks evicted from the device are
offloaded to the host pool and stay matchable. A hit on host-resident blocks is admitted at its
match, as FastDeploy's ``PrefixCacheManager.request_match_blocks`` allocates its
``gpu_recv_block_ids`` there: the block table FastDeploy gets then names the device blocks that
receive the host blocks, and ``hit_info`` splits the hit into device (``gpu_*``) and host
(``cpu_*``) parts. The step's device <-> host copies reach the worker through patch E9
(:meth:`~FastDeployBlockManager.take_tier_copies` on the first task of the batch, field
:data:`TIER_COPIES_FIELD`); copies handed out in a step stay pinned until the next
:meth:`~FastDeployBlockManager.begin_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.blockmgr.prefix.host_tier import HostTier
from hybridkv.blockmgr.records import BlockCopies, RequestId, SwapPlan
from hybridkv.errors import NoFreeBlocksError, RequestStateError
from hybridkv.integrations.fastdeploy.contract import EngineContractMixin, allocation_args
from hybridkv.integrations.fastdeploy.prefix import PrefixMixin
from hybridkv.integrations.fastdeploy.splitwise import SplitwiseMixin
from hybridkv.integrations.fastdeploy.types import (  # noqa: F401 (public names of this module too)
    ALLOCATE_FORMS,
    HYBRID_TASK_FIELDS,
    PATCH_SERIES,
    SPLITWISE_ROLES,
    TIER_COPIES_FIELD,
    EnginePatchError,
    HitMetrics,
    MatchResult,
    _FreeBlocks,
    _Hit,
    _Node,
    _Pending,
    _token_ids,
)
from hybridkv.integrations.fastdeploy.worker import (
    FastDeployCaches,
    StateLayerSlot,
    StateTables,
    kv_cache_list,
    state_layer_slots,
)
from hybridkv.planner.layout import Layout
from hybridkv.scheduler_adapter.cost import GpuSpec
from hybridkv.scheduler_adapter.metadata import StepMetadata
from hybridkv.units import as_count, cdiv, is_integer


class FastDeployBlockManager(EngineContractMixin, SplitwiseMixin, PrefixMixin):
    """FastDeploy's cache manager over one :class:`HybridBlockManager` (KV and state in one pool).

    Block ids are the manager's; FastDeploy keeps the KV ids in ``request.block_tables`` as with its
    own heap. Ownership: the manager owns every block; a request's KV and state go back on
    ``release_block_ids`` / ``request_finish``, or once ``recycle_gpu_blocks`` got all its KV ids.
    Raises ``ValueError`` for a manager with a watermark (FastDeploy reserves decode blocks itself)
    or without attention layers. Answers only an engine that bound itself (:meth:`bind_engine`).

    ``gpu``: the device's :class:`~hybridkv.scheduler_adapter.cost.GpuSpec` (its measured host
    link rate); with it, a host hit's ``cpu_cache_prepare_time`` is the modelled time of its host ->
    device copies, without it 0.0 (the facade does not run the copies, so it cannot time them).
    ``metrics``: prefix-hit counters over all matches (:class:`HitMetrics`, host hits included).
    """

    def __init__(self, manager: HybridBlockManager, cache_config: Any = None, gpu: GpuSpec | None = None) -> None:
        if manager.watermark_blocks:
            raise ValueError("use watermark=0 under FastDeploy: its scheduler keeps its own decode reservation")
        if manager.layout.kv_group is None:
            raise ValueError("FastDeploy's scheduler needs a KV block table: the model has no attention layer")
        if gpu is not None and not isinstance(gpu, GpuSpec):
            raise TypeError(f"gpu must be a GpuSpec (its host link rate models cpu_cache_prepare_time), got {gpu!r}")
        self.manager = manager
        self.gpu = gpu
        self.metrics = HitMetrics()
        self.block_size = manager.block_size
        self.cache_config = cache_config
        self.enable_prefix_caching = manager.prefix_cache is not None
        self._pending: dict[RequestId, _Pending] = {}  # matches of this step, not yet allocated
        self._lapsed: set[RequestId] = set()  # requests whose match lapsed at begin_step, not matched since
        self._recycled: dict[RequestId, set[int]] = {}
        self._copies: dict[RequestId, BlockCopies] = {}  # run before the request's next forward
        self._fresh: set[int] = set()  # chain keys of checkpoints reserved in this step (not yet written)
        self._binding: tuple[bool, str] | None = None  # (cache_manager_v1, splitwise_role) of the bound engine
        self._tickets: set[RequestId] = set()  # requests whose first allocation includes their state sets
        self._stepped = False  # begin_step (patch E4) ran at least once: checkpoint pins get released
        self._transfers = {}  # decode role: pending import plans (SplitwiseMixin)
        self._admitted: set[RequestId] = set()  # host hits admitted at their match, not allocated by the engine yet
        self._take_epoch = 0  # pin epoch of the last take_tier_copies (host tier)
        self._took_tier_copies = False  # take_tier_copies (patch E9) ran at least once
        self._untaken_steps = 0  # begin_steps in a row that found tier copies queued

    @classmethod
    def from_cache_config(
        cls,
        layout: Layout,
        cache_config: Any,
        prefix: PrefixCacheConfig | None = None,
        gpu: GpuSpec | None = None,
    ) -> FastDeployBlockManager:
        """Patch E1's facade from FastDeploy's ``CacheConfig`` (``fastdeploy/config.py``, read at
        0009064e6f6ed105cfa5d39c4a52021251e275a2): its CPU-cache fields map to hybridkv's host pool.

        - ``enable_prefix_caching`` (bool): a prefix cache (``prefix``, default ``PrefixCacheConfig()``);
        - ``swap_space`` (GiB of host memory per rank; None: no CPU cache): a host pool of
          ``floor(swap_space * 2**30 / layout.bytes_per_block)`` blocks of the hybrid layout (KV and
          state blocks alike). FastDeploy's own ``num_cpu_blocks`` divides the same bytes by its
          KV-only ``bytes_per_block``, so with ``swap_space`` set that count is not used;
        - ``num_cpu_blocks`` (only when ``swap_space`` is None): that many host blocks of the layout;
        - prefix caching and a host pool together turn the host tier on (``host_tier=True``):
          evicted cached blocks go to the host pool, which swaps share.

        ``block_size`` must equal the layout's. Raises ``TypeError`` / ``ValueError`` before
        anything is built: a config without these fields' types, a negative or non-finite
        ``swap_space``, one smaller than a block, a negative ``num_cpu_blocks``, ``prefix`` given
        with prefix caching off.
        """
        if not isinstance(layout, Layout):
            raise TypeError(f"from_cache_config needs a Layout, got {type(layout).__name__}")
        if cache_config is None:
            raise TypeError("from_cache_config needs FastDeploy's cache_config, got None")
        block_size = getattr(cache_config, "block_size", layout.block_size)
        if as_count(block_size, "cache_config.block_size", minimum=1) != layout.block_size:
            raise ValueError(f"cache_config.block_size {block_size} differs from the layout's {layout.block_size}")
        enable = getattr(cache_config, "enable_prefix_caching", False)
        if not isinstance(enable, bool):
            raise TypeError(f"cache_config.enable_prefix_caching must be a bool, got {enable!r}")
        if prefix is not None and not enable:
            raise ValueError("a PrefixCacheConfig was given but cache_config.enable_prefix_caching is False")
        swap = getattr(cache_config, "swap_space", None)
        if swap is not None:
            if isinstance(swap, bool) or not isinstance(swap, int | float):
                raise TypeError(f"cache_config.swap_space must be a number of GiB or None, got {swap!r}")
            if not math.isfinite(swap) or swap < 0:
                raise ValueError(f"cache_config.swap_space must be a finite number of GiB >= 0, got {swap}")
            host = int(swap * 2**30 // layout.bytes_per_block)
            if swap > 0 and host == 0:
                raise ValueError(
                    f"cache_config.swap_space {swap} GiB holds no block of {layout.bytes_per_block} bytes (the "
                    "hybrid layout's block, KV and state)"
                )
        else:
            cpu = getattr(cache_config, "num_cpu_blocks", None)
            host = 0 if cpu is None else as_count(cpu, "cache_config.num_cpu_blocks")
        config = (prefix or PrefixCacheConfig()) if enable else None
        if config is not None and host > 0 and not config.host_tier:
            config = replace(config, host_tier=True)
        manager = HybridBlockManager(layout, num_host_blocks=host, prefix_cache=config)
        return cls(manager, cache_config, gpu)

    # ---- counts ---------------------------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        """The pool's blocks, the profiled ``total_block_num`` (``total_block_number()``); hybridkv's
        null block 0 is one of them and is never free (it shows as used)."""
        return self.manager.layout.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now: not held, not cached (``len(gpu_free_block_list)``, as FastDeploy's
        cache managers count it: evictable cached blocks are used until evicted)."""
        return self.manager.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds (KV and checkpoints): taken by an allocation when needed."""
        cache = self.manager.prefix_cache
        return 0 if cache is None else cache.num_evictable

    @property
    def num_cpu_blocks(self) -> int:
        """Host blocks of the prefix cache's host tier (the host pool it shares with swaps); 0
        without the tier (a swap-only host pool is not FastDeploy's CPU cache). FastDeploy reads
        ``num_cpu_blocks > 0`` as "a match may take blocks" and checks, before each match, that the
        whole prompt fits (``schedule()``'s WAITING branch, ``preallocate_resource_in_p``)."""
        tier = self._tier
        return self.manager.host_pool.num_usable if tier is not None and self.manager.host_pool is not None else 0

    @property
    def _tier(self) -> HostTier | None:
        cache = self.manager.prefix_cache
        return cache.tier if cache is not None else None

    @property
    def num_state_blocks_per_request(self) -> int:
        """Blocks of one request's state sets: what the WAITING branch adds to ``get_new_block_nums``."""
        return self.manager.num_state_blocks

    @property
    def num_free_device_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable), less the evictable blocks that
        pending matches pin. Each pinned block counts once, however many matches share it (a union,
        not a sum), and only while it is still evictable; a match pins until it lapses (see
        :meth:`begin_step`). The state sets a host hit took at its match count as available until
        the request's first allocation takes them (its count includes them, E2): FastDeploy matches
        and allocates one request at a time, so the count its ``can_allocate_gpu_blocks`` sees is
        exactly what that allocation takes."""
        reserved = len(self._admitted) * self.manager.num_state_blocks
        return self.manager.num_available_blocks - self._pinned_by_matches() + reserved

    def _pinned_by_matches(self, exclude: RequestId | None = None) -> int:
        """Evictable blocks the pending matches (but ``exclude``'s) hold on to, each counted once:
        the union of their cached KV blocks and the state blocks of the distinct checkpoints they
        read. Counted now, so blocks taken or evicted since a match no longer count."""
        cache = self.manager.prefix_cache
        if cache is None or not self._pending:
            return 0
        kv: set[int] = set()
        checkpoints: set[int] = set()
        for rid, p in self._pending.items():
            if rid == exclude:
                continue
            kv.update(p.block_ids)
            if p.checkpoint_key is not None:
                checkpoints.add(p.checkpoint_key)
        if not kv and not checkpoints:
            return 0
        return cache.num_protected(np.fromiter(sorted(kv), dtype=np.int64, count=len(kv)), checkpoints)

    @property
    def gpu_free_block_list(self) -> _FreeBlocks:
        return _FreeBlocks(self)

    @property
    def available_gpu_resource(self) -> float:
        """Free blocks over all blocks, as FastDeploy's ``CacheManager.available_gpu_resource``."""
        return self.num_free_blocks / self.num_gpu_blocks

    def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
        """True if ``num_blocks`` blocks can be taken now (evicting cached blocks as needed).
        ``TypeError`` for a count that is not an integer. A negative count is True, as FastDeploy's
        own managers answer it (``PrefixCacheManager`` and v1 ``CacheManager`` compare the free count
        with it): develop c1b7c083's ``get_new_block_nums`` has no ``max(block_num, 0)``, so a
        request holding more blocks than its tokens need asks for a negative count."""
        self._require("can_allocate_gpu_blocks")
        if not is_integer(num_blocks):
            raise TypeError(f"can_allocate_gpu_blocks: num_blocks must be an integer, got {num_blocks!r}")
        return int(num_blocks) <= self.num_free_device_blocks

    can_allocate_device_blocks = can_allocate_gpu_blocks

    @staticmethod
    def get_required_block_num(input_token_num: int, block_size: int) -> int:
        return cdiv(input_token_num, block_size)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_gpu_blocks(self, *args: Any, **kwargs: Any) -> list[int]:
        """Legacy ``allocate_gpu_blocks(num_blocks, req_id)`` or v1 ``allocate_gpu_blocks(request, num_blocks)``.

        The form is chosen on exact types: an integer first argument (``int`` or a numpy integer,
        not a bool or float) is the legacy form, an object with ``request_id`` the v1 form (keyword
        ``num_blocks`` / ``req_id`` / ``request`` too). Anything else raises ``TypeError`` naming
        both forms (:data:`ALLOCATE_FORMS`), a negative count ``ValueError``, before any change.

        Returns the new KV block ids for ``request.block_tables``. The first call of a request admits
        it: ``num_blocks`` includes its state sets, for which the engine took a ticket
        (:meth:`state_blocks_for`); without one it raises :class:`EnginePatchError`. In the decode
        role the admission is an import plan (:mod:`.splitwise`). When the blocks are not
        there, legacy raises :class:`NoFreeBlocksError` and v1 returns ``[]``, as FastDeploy's
        ``CacheManager`` does; every other refusal raises in both forms. Nothing changes on refusal.
        """
        self._require("allocate_gpu_blocks")
        v1, rid, num_blocks = allocation_args(args, kwargs)
        assert self._binding is not None
        if v1 != self._binding[0]:
            want = "allocate_gpu_blocks(request, n)" if self._binding[0] else "allocate_gpu_blocks(n, req_id)"
            mode = ("legacy", "v1")[self._binding[0]]
            raise TypeError(f"allocate_gpu_blocks: the engine bound in {mode} mode calls {want}")
        if v1:
            try:
                return self._allocate(rid, num_blocks)
            except NoFreeBlocksError:
                return []  # what CacheManager.allocate_device_blocks returns when the blocks are not there
        return self._allocate(rid, num_blocks)

    allocate_device_blocks = allocate_gpu_blocks

    def _allocate(self, rid: RequestId, num_blocks: int) -> list[int]:
        m, bs = self.manager, self.block_size
        if rid in self._lapsed and rid not in m.requests:
            raise RequestStateError(
                f"the prefix match of {rid!r} lapsed at begin_step (a match is allocated in the schedule() "
                "that made it): call request_match_blocks / match_prefix again"
            )
        if rid in self._admitted:
            return self._allocate_admitted(rid, num_blocks)
        available = m.num_available_blocks - self._pinned_by_matches(exclude=rid)
        if num_blocks > available:
            raise NoFreeBlocksError(f"allocate_gpu_blocks for {rid!r}", num_blocks, self.num_free_device_blocks)
        rec = m.requests.get(rid)
        if rec is not None:  # running: grow by whole blocks (the manager counts allocated token slots)
            if num_blocks:
                self._copies[rid] = self._copies.get(rid, BlockCopies.empty()).concat(m.append(rid, num_blocks * bs))
            return rec.kv_blocks[rec.num_kv_blocks - num_blocks :].tolist()
        num_kv = self._first_kv_blocks(rid, num_blocks)
        pending = self._pending.get(rid)
        shared = len(pending.block_ids) if pending else 0
        tokens = pending.token_ids if pending else None
        if self._role() == "decode":  # the receive side: blocks held until the prefill side wrote them
            self._transfers[rid] = m.import_request(rid, num_kv * bs)
            self._tickets.discard(rid)
            self._pending.pop(rid, None)
            return m.requests[rid].kv_blocks.tolist()
        alloc = m.allocate(rid, (shared + num_kv) * bs, token_ids=tokens)
        self._tickets.discard(rid)
        del_pending = self._pending.pop(rid, None)
        rec = m.requests[rid]
        if alloc.num_cached_tokens != (del_pending.num_cached_tokens if del_pending else 0) or (
            del_pending is not None and rec.kv_blocks[:shared].tolist() != del_pending.block_ids
        ):
            m.free(rid)  # the hit changed since request_match_blocks: refuse rather than mix blocks
            raise RequestStateError(f"prefix hit of {rid!r} changed between match and allocation: match again")
        if len(alloc.copies):
            self._copies[rid] = alloc.copies
        return rec.kv_blocks[shared:].tolist()

    def _first_kv_blocks(self, rid: RequestId, num_blocks: int) -> int:
        """The KV blocks of a request's first ``allocate_gpu_blocks(num_blocks)``: the count less the
        state sets E2's ticket added (raises when the ticket is missing or the count is short)."""
        if rid not in self._tickets:
            raise EnginePatchError(
                f"first allocate_gpu_blocks of {rid!r} ({num_blocks} blocks) without its state sets: patch E2 adds "
                "cache_manager.state_blocks_for(request) where the engine computes a new request's block need "
                "(docs/fastdeploy.md); without it the engine would get fewer KV ids than it asked for"
            )
        num_kv = num_blocks - self.manager.num_state_blocks
        if num_kv < 0:
            raise RequestStateError(
                f"first allocate_gpu_blocks of {rid!r} asks {num_blocks} blocks, fewer than the "
                f"{self.manager.num_state_blocks} state blocks state_blocks_for added"
            )
        return num_kv

    def _allocate_admitted(self, rid: RequestId, num_blocks: int) -> list[int]:
        """The first allocation of a host hit admitted at its match: ``num_blocks`` includes the
        state sets (E2's ticket), which the match took already; the rest are new KV blocks past the
        hit. Returns their ids (the hit's ids went out with the match)."""
        m = self.manager
        num_kv = self._first_kv_blocks(rid, num_blocks)
        if num_kv > m.num_available_blocks - self._pinned_by_matches(exclude=rid):
            raise NoFreeBlocksError(f"allocate_gpu_blocks for {rid!r}", num_blocks, self.num_free_device_blocks)
        copies = m.append(rid, num_kv * self.block_size) if num_kv else BlockCopies.empty()
        self._admitted.discard(rid)
        self._tickets.discard(rid)
        if len(copies):
            self._copies[rid] = self._copies.get(rid, BlockCopies.empty()).concat(copies)
        rec = m.requests[rid]
        return rec.kv_blocks[rec.num_kv_blocks - num_kv :].tolist()

    # ---- release --------------------------------------------------------------------------------
    def recycle_gpu_blocks(self, gpu_block_ids: Iterable[int] | int, req_id: RequestId | None = None) -> None:
        """Give KV ids back; once all of a request's KV ids are back, the request (state too) is freed.

        Ids of a request already released (``release_block_ids`` runs first under prefix caching) are
        ignored. Without ``req_id`` the owner is the request holding all the ids.
        """
        self._require("recycle_gpu_blocks")
        ids = [int(gpu_block_ids)] if isinstance(gpu_block_ids, int | np.integer) else [int(b) for b in gpu_block_ids]
        if not ids:
            return
        rid = req_id if req_id is not None else self._owner_of(ids)
        rec = self.manager.requests.get(rid) if rid is not None else None
        if rec is None:
            return
        back = self._recycled.setdefault(rid, set())
        back.update(ids)
        if back.issuperset(rec.kv_blocks.tolist()):
            self._free(rid)

    def _owner_of(self, ids: list[int]) -> RequestId | None:
        want = set(ids)
        for rid, rec in self.manager.requests.items():
            if want.issubset(rec.kv_blocks.tolist()):
                return rid
        return None

    def release_block_ids(self, task: Any) -> None:
        """Free everything ``task`` holds (KV, state sets, a pending prefix match)."""
        self._require("release_block_ids")
        self._free(task.request_id)

    release_block_ids_async = release_block_ids

    def request_finish(self, request: Any) -> None:
        """v1 ``CacheManager.request_finish``: cached KV blocks stay in the prefix cache, the rest is freed."""
        self._require("request_finish")
        self._free(request.request_id)

    def free_block_ids(self, need_block_num: int) -> None:
        """Cached blocks are evicted on allocation (they count as available already): nothing to do."""

    free_block_ids_async = free_block_ids

    def write_cache_to_storage(self, req: Any) -> None:
        """No storage backend behind this facade: nothing to write (FastDeploy calls it on every finish
        of the mixed and prefill roles, before ``_free_blocks``)."""
        self._require("write_cache_to_storage")

    def write_cache_to_storage_decode(self, req: Any) -> None:
        """The decode role's ``write_cache_to_storage`` (``finish_requests`` calls it before
        ``_free_blocks``; without it every finished request of a decode instance leaked): no storage
        backend, nothing to write."""
        self._require("write_cache_to_storage_decode")

    def _free(self, rid: RequestId) -> None:
        self._pending.pop(rid, None)
        self._admitted.discard(rid)
        self._lapsed.discard(rid)
        self._recycled.pop(rid, None)
        self._copies.pop(rid, None)
        self._tickets.discard(rid)
        if self._drop_transfer(rid):  # released before its bytes arrived: the import's blocks go back
            return
        rec = self.manager.requests.get(rid)
        if rec is not None:
            self.manager.free(rid)

    # ---- configuration --------------------------------------------------------------------------
    def update_cache_config(self, cache_config: Any) -> None:
        """``ResourceManager.reset_cache_config`` after the worker's profiling run. The worker patch
        computes ``total_block_num`` from the hybrid layout (``plan(...).num_blocks``); if it differs
        from the pool's, the (idle) manager is rebuilt with that many blocks of the same layout.
        Raises ``RequestStateError`` if requests hold blocks then."""
        self._require("update_cache_config")
        self.cache_config = cache_config
        total = getattr(cache_config, "total_block_num", None)
        m = self.manager
        if total is None or int(total) == m.layout.num_blocks:
            return
        if m.requests or self._pending:
            raise RequestStateError(f"cannot resize the pool to {total} blocks while requests hold blocks")
        layout = replace(m.layout, num_blocks=int(total), budget_bytes=int(total) * m.layout.bytes_per_block)
        host = m.host_pool.num_usable if m.host_pool is not None else 0
        config = m.prefix_cache.config if m.prefix_cache is not None else None
        self.manager = HybridBlockManager(layout, num_host_blocks=host, prefix_cache=config)
        self._take_epoch = 0  # (the new manager's pin epochs start again)

    # ---- v1 CacheManager's host backups (write_through_selective): the host tier offloads on eviction ----
    def issue_pending_backup_to_batch_request(self) -> None:
        """``schedule()`` (v1 mode, a non-empty batch) attaches what this returns as evict metadata:
        hybridkv's host tier makes no backups (it offloads a cached block when it is evicted, and
        those copies go through E9's :meth:`take_tier_copies`), so none is pending: None, as
        ``CacheManager`` returns without one."""
        self._require("issue_pending_backup_to_batch_request")
        return None

    def check_and_add_pending_backup(self) -> None:
        """The last call of every v1 ``schedule()``: ``CacheManager`` queues device->host backups of hot
        nodes when it has a host cache; hybridkv's host tier offloads on eviction instead (no
        backups), so nothing is queued, as ``CacheManager`` does without a host cache."""
        self._require("check_and_add_pending_backup")

    def get_pending_backup_count(self) -> int:
        return 0

    # ---- swap (hybridkv's host pool; FastDeploy itself preempts by recompute) -------------------
    def can_swap_out(self, request: Any) -> bool:
        return self.manager.can_swap_out(request.request_id)

    def swap_out(self, request: Any) -> SwapPlan:
        """Plan moving a running request's KV and live state to the host pool; run the plan's block
        copies (every layer slot, like ``swap_cache_all_layers``), then ``plan.commit()``. The worker
        row of the request then becomes -1 (a ``SWAP_OUT`` task)."""
        return self.manager.swap_out(request.request_id)

    def can_swap_in(self, request: Any) -> bool:
        return self.manager.can_swap_in(request.request_id)

    def swap_in(self, request: Any) -> SwapPlan:
        """Plan bringing a swapped request back; after the copies and ``plan.commit()`` its block ids
        are new: ``request.block_tables = kv_block_table(...)`` and a decode task with
        :meth:`task_fields` carries the new state sets to the worker."""
        return self.manager.swap_in(request.request_id)

    def kv_block_table(self, request_id: RequestId) -> list[int]:
        return self.manager.requests[request_id].kv_blocks.tolist()

    # ---- task payload -------------------------------------------------------------------------------
    def state_block_table(self, request_id: RequestId) -> list[list[int]]:
        """The request's live state sets, one list of ``blocks_per_state[g]`` ids per state group."""
        rec = self.manager.requests[request_id]
        return [rec.state[g, :n].tolist() for g, n in enumerate(self.manager.layout.blocks_per_state)]

    def task_fields(self, request_id: RequestId) -> dict[str, Any]:
        """What the prefill ``Request`` / ``ScheduledDecodeTask`` of this step carries to the worker
        (:data:`HYBRID_TASK_FIELDS`): the state sets, ``[[src], [dst]]`` block copies to run before
        the forward (prefix-hit checkpoint -> live, copy-on-write) and after it (live -> checkpoint;
        empty here, filled by :meth:`update_cache_blocks` on the prefill task), and ``tier_copies``
        None (patch E9 sets the step's host-tier copies on the batch's first task afterwards).
        Taking them clears the pending copies."""
        self._require("task_fields")
        pre = self._copies.pop(request_id, BlockCopies.empty())
        return {
            "state_block_tables": self.state_block_table(request_id),
            "state_copies": [pre.src.tolist(), pre.dst.tolist()],
            "checkpoint_copies": [[], []],
            TIER_COPIES_FIELD: None,
        }

    # ---- step metadata (hybridkv Scheduler path) ------------------------------------------------
    def attach(self, forward_meta: Any, metadata: StepMetadata, caches: FastDeployCaches, **kw: Any) -> Any:
        return attach(forward_meta, metadata, caches, **kw)


def attach(forward_meta: Any, metadata: StepMetadata, caches: FastDeployCaches, set_seq_lens: bool = False) -> Any:
    """Fill ``forward_meta`` for one step planned by hybridkv's own :class:`Scheduler` (rows = plan order).

    Sets ``caches`` (:func:`kv_cache_list`), ``block_tables`` int32 ``[B, W]``, ``state_block_tables``
    int32 ``[G, B, blocks_per_state]``, ``speculative_state_block_tables``, ``state_layer_slots``,
    ``has_initial_state`` bool ``[B]``, ``hybridkv_metadata``; with ``set_seq_lens`` also the
    sequence lengths, ``cu_seqlens_q/k`` and ``batch_id_per_token``. Under FastDeploy's own
    scheduler use :class:`StateTables` instead (persistent buffers indexed by ``request.idx``).
    These tensors are new each call: this path is for tests and the simulator, not CUDA graphs.
    """
    layout = metadata.layout
    if caches.layout is not layout:
        raise ValueError("the caches were allocated for a different layout than the step metadata")
    forward_meta.caches = caches.caches
    forward_meta.block_tables = caches.to_tensor(metadata.block_tables)
    forward_meta.state_block_tables = caches.to_tensor(metadata.state_tables)
    forward_meta.speculative_state_block_tables = caches.to_tensor(metadata.speculative_state_tables)
    forward_meta.state_layer_slots = state_layer_slots(caches)
    forward_meta.has_initial_state = caches.to_tensor(metadata.has_initial_state)
    forward_meta.hybridkv_metadata = metadata
    if set_seq_lens:
        for name in ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q", "cu_seqlens_k"):
            setattr(forward_meta, name, caches.to_tensor(getattr(metadata, name)))
        forward_meta.batch_id_per_token = caches.to_tensor(metadata.batch_id_per_token)
    return forward_meta


__all__ = [
    "ALLOCATE_FORMS",
    "HYBRID_TASK_FIELDS",
    "PATCH_SERIES",
    "TIER_COPIES_FIELD",
    "EnginePatchError",
    "FastDeployBlockManager",
    "HitMetrics",
    "FastDeployCaches",
    "MatchResult",
    "StateLayerSlot",
    "StateTables",
    "attach",
    "kv_cache_list",
    "state_layer_slots",
]

"""Prefix exports: a cached prefix that lives on the device and (wholly or partly) in the prefix
cache's host tier, read by a peer instance without bringing it back to this device first.

:func:`export_prefix` resolves a token prefix as a local admission would (``PrefixCache.match``:
the longest cached prefix with a checkpoint at its end, one token left to compute) and names, per KV
block, whether the block is in the device pool or in the host pool, and where the checkpoint is.
Then it **holds** everything the prefix reads until the plan is settled:

- device KV blocks: one reference each (revived from the evictable set as a hit revives them), so
  no eviction can free or reuse them;
- a device checkpoint: held (``PrefixCache.hold``), so it is not evicted;
- host units (KV blocks, a checkpoint): held in the tier (``HostTier.hold``), so neither the tier's
  LRU nor a swap-out can take them.

:meth:`PrefixExport.commit` (the peer has the bytes) and :meth:`PrefixExport.abort` (it does not)
do the same here: they drop the holds. A prefix export copies, it never moves: the cached entries
stay where they are, matchable by local requests meanwhile. An export counts as a use: once
released, its device KV blocks and checkpoint queue at the back of the LRU order, as after a hit.
The peer adopts the bytes as one request's blocks (``import_request`` of ``num_tokens`` tokens: KV
blocks and one live state set, the checkpoint's bytes going into the live set, as a local hit
copies a checkpoint into the live sets), see docs/transfer.md "Host-resident blocks".

Nothing is exported whose bytes are not there yet: a device block or checkpoint, or a host unit,
that a copy handed out and not yet run writes (an onload, an offload, a checkpoint of the last
update) makes the export refuse (:class:`~hybridkv.errors.RequestStateError`; retry after the
executor ran the copies and ``release_pins``).

Framework-free, like the rest of ``blockmgr``: ``hybridkv.transfer`` turns a plan into descriptors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.blockmgr.hashing import as_token_array
from hybridkv.blockmgr.prefix import PrefixHit
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.errors import HybridKVError, RequestStateError
from hybridkv.units import as_count

if TYPE_CHECKING:
    from hybridkv.blockmgr.lifecycle import ManagerCore

_EMPTY = np.empty(0, dtype=np.int32)


class PrefixNotCachedError(HybridKVError, LookupError):
    """The tokens have no cached prefix (with a checkpoint at its end, for hybrid models) to export."""


@dataclass(slots=True, eq=False)
class PrefixExport:
    """A cached prefix held for a peer to read, until :meth:`commit` or :meth:`abort` (once).

    ``blocks``: the prefix as a request's blocks (``num_tokens`` tokens, a multiple of the block
    size; ``kv_blocks`` int32 ``[num_tokens / block_size]`` in chain order; ``state_blocks`` the
    checkpoint's blocks per state group), each id a block of the device pool or of the host pool:
    ``kv_on_host`` (bool ``[num_kv_blocks]``) and ``state_on_host`` say which. The manager owns
    every id; the plan holds them (see the module docstring).
    """

    blocks: RequestBlocks
    kv_on_host: np.ndarray
    state_on_host: bool
    _manager: ManagerCore = field(repr=False)
    _device_kv: np.ndarray = field(repr=False)  # int32 device KV ids referenced by the plan
    _checkpoint_key: int | None = field(repr=False)  # the device checkpoint held, if any
    _host_units: tuple[int, ...] = field(repr=False)  # host tier units held (first host ids)
    settled: bool = False

    @property
    def num_tokens(self) -> int:
        return self.blocks.num_tokens

    def on_host(self) -> np.ndarray:
        """bool ``[blocks.num_blocks]`` in :meth:`RequestBlocks.ids` order (state sets, then KV):
        which ids are host block ids."""
        n_state = sum(s.size for s in self.blocks.state_blocks)
        return np.concatenate((np.full(n_state, self.state_on_host, dtype=bool), self.kv_on_host))

    @property
    def num_host_blocks(self) -> int:
        """Blocks the peer reads from the host pool."""
        return int(self.on_host().sum())

    def commit(self) -> None:
        """The peer has the bytes: drop the holds (the cached entries stay)."""
        self._settle()

    def abort(self) -> None:
        """The peer gave up (or the transfer failed): drop the holds, as :meth:`commit` does."""
        self._settle()

    def _settle(self) -> None:
        if self.settled:
            raise RequestStateError("this prefix export is already settled: export the prefix again")
        self.settled = True
        m = self._manager
        cache = m.prefix_cache
        assert cache is not None
        if self._host_units:
            assert cache.tier is not None
            cache.tier.unhold(self._host_units)
        if self._checkpoint_key is not None:
            holds, key = m._export_checkpoints, self._checkpoint_key
            holds[key] -= 1
            if not holds[key]:
                del holds[key]
                m._unhold(key)
        if self._device_kv.size:
            for i, ids in enumerate(m._export_kv):
                if ids is self._device_kv:
                    del m._export_kv[i]
                    break
            m._drop_kv(self._device_kv)  # cached blocks no one else holds become evictable again


def _token_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as int64 (:func:`~hybridkv.blockmgr.hashing.as_token_array`), strictly: that
    conversion reads Python bools as 0 / 1 (refusing them costs a type test per token on the
    admission path, where the scheduler has checked already); an export is no hot path and its
    caller may be a peer's request, so bools (``TypeError``) and negative ids (``ValueError``) are
    refused here, before any work, rather than exporting the prefix of other tokens."""
    if not isinstance(token_ids, np.ndarray | str | bytes | bytearray | memoryview) and isinstance(token_ids, Iterable):
        if not hasattr(token_ids, "__len__"):  # an iterator: read it once
            token_ids = list(token_ids)
        kinds = set(map(type, token_ids))
        if bool in kinds or np.bool_ in kinds:
            i, t = next((i, t) for i, t in enumerate(token_ids) if isinstance(t, bool | np.bool_))
            raise TypeError(f"token ids must be integers, got {t!r} (a bool) at position {i}")
    tokens = as_token_array(token_ids)
    if tokens.size and int(tokens.min()) < 0:
        i = int(np.argmax(tokens < 0))
        raise ValueError(f"token ids must be >= 0, got {int(tokens[i])} at position {i}")
    return tokens


def exportable_tokens(
    manager: ManagerCore, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None
) -> int:
    """Tokens :func:`export_prefix` would export now (0: none cached); changes nothing. Bad token
    ids raise as in :func:`export_prefix`."""
    tokens = _token_ids(token_ids)
    if manager.prefix_cache is None:
        return 0
    limit = tokens.size if max_tokens is None else as_count(max_tokens, "max_tokens")
    return manager.prefix_cache.match(tokens, limit).num_tokens


def export_prefix(
    manager: ManagerCore, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None
) -> PrefixExport:
    """Hold the longest cached prefix of ``token_ids`` (within ``max_tokens``, one token left to
    compute, as an admission's hit) for a peer to read, wherever its blocks are (device or host).

    Raises ``ValueError`` without a prefix cache, ``TypeError`` for token ids that are not integers
    (bools, floats, strings), ``ValueError`` for negative ones, ``TypeError`` / ``ValueError`` for a
    bad ``max_tokens``, :class:`PrefixNotCachedError` when nothing is cached, and
    :class:`~hybridkv.errors.RequestStateError` when a copy not yet run writes a block of the prefix;
    nothing changes on error. Settle the plan with ``commit`` or ``abort``.
    """
    cache = manager.prefix_cache
    if cache is None:
        raise ValueError("export_prefix needs a manager with a prefix cache (PrefixCacheConfig)")
    tokens = _token_ids(token_ids)
    limit = tokens.size if max_tokens is None else as_count(max_tokens, "max_tokens")
    hit = cache.match(tokens, limit)
    if not hit.num_tokens:
        raise PrefixNotCachedError(
            f"no cached prefix of these {tokens.size} tokens (within {limit}) to export"
            + (": hybrid models need a checkpoint at its end" if manager.num_state_groups else "")
        )
    kv, kv_on_host = _kv_of(manager, hit)
    sets, state_on_host = _state_of(manager, hit)
    tier = cache.tier
    units = tuple(sorted(tier.units_of(hit.host_kv, hit.host_checkpoint))) if tier is not None and hit.on_host else ()
    _check_written(manager, hit, units)
    holds = manager._export_checkpoints
    key = hit.checkpoint_key
    if key is not None and key in cache.pinned and key not in holds:
        raise RequestStateError(
            f"the checkpoint at token {hit.num_tokens} is pinned by a copy not yet run (or held by its request): "
            "export after the executor ran the copies and release_pins"
        )
    # ---- act: nothing below raises --------------------------------------------------------------
    device_kv = hit.kv_blocks.copy()
    if device_kv.size:
        cache.take_hit(PrefixHit(0, device_kv, None, 0, []))  # one reference each, out of the evictable set
        manager._export_kv.append(device_kv)
    if key is not None:
        if key not in holds:
            cache.hold(key)
        holds[key] = holds.get(key, 0) + 1
    if units:
        assert tier is not None
        tier.hold(units)
    blocks = RequestBlocks(hit.num_tokens, kv, sets)
    return PrefixExport(blocks, kv_on_host, state_on_host, manager, device_kv, key, units)


def _kv_of(manager: ManagerCore, hit: PrefixHit) -> tuple[np.ndarray, np.ndarray]:
    """The prefix's KV ids in chain order (device or host ids) and which are host ids."""
    if not manager.layout.kv_group:
        return _EMPTY, np.zeros(0, dtype=bool)
    n = hit.num_tokens // manager.block_size
    on_host = np.zeros(n, dtype=bool)
    on_host[hit.host_index] = True
    kv = np.empty(n, dtype=np.int32)
    kv[~on_host] = hit.kv_blocks
    kv[on_host] = hit.host_kv
    return kv, on_host


def _state_of(manager: ManagerCore, hit: PrefixHit) -> tuple[tuple[np.ndarray, ...], bool]:
    """The checkpoint's ids split per state group (flat state-set order: group by group, table
    order) and whether they are host ids."""
    bps = manager.layout.blocks_per_state
    if not bps:
        return (), False
    on_host = hit.checkpoint_ids is None
    flat = hit.host_checkpoint if on_host else hit.checkpoint_ids
    assert flat is not None and flat.size == sum(bps)
    cuts = np.cumsum(bps)[:-1]
    return tuple(s.astype(np.int32) for s in np.split(np.asarray(flat), cuts)), on_host


def _check_written(manager: ManagerCore, hit: PrefixHit, units: tuple[int, ...]) -> None:
    """Refuse a prefix some of whose bytes a copy handed out and not run yet still writes (an
    onload into a device KV block; an offload filling a host unit, queued or not yet released)."""
    pinned = manager._pin_of[hit.kv_blocks] != 0 if hit.kv_blocks.size else np.zeros(0, dtype=bool)
    tier = manager.prefix_cache.tier if manager.prefix_cache is not None else None
    busy = tier is not None and any(
        u in tier._undrained or (u in tier._pins and manager.pin_epoch > 0) for u in units
    )
    if pinned.any() or busy:
        where = "device KV blocks" if pinned.any() else "host-tier units"
        raise RequestStateError(
            f"{where} of the prefix are touched by copies not yet run: export after the executor ran the "
            "tier's copies and the plan's copies (release_pins)"
        )

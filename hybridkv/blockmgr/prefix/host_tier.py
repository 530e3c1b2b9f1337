"""The prefix cache's host tier: cached KV blocks and checkpoints evicted from the device pool are
offloaded to blocks of the host pool (the one swap preemption uses) and stay matchable there.

Units: a KV block (one host block, keyed by its chain key) or a checkpoint (a state set's
``num_state_blocks`` host blocks, keyed by the chain key of the node it ends). A unit is named by
its first host block id. Each unit keeps the token ids of the block its key ends (compared on a hit,
as the device index compares them), so equal keys alone never serve a block.

- Offload: :meth:`HostTier.offload` takes a victim of a device eviction; host blocks come from the
  free host pool, else from the tier's own least recently used units (never from swaps). A victim
  that finds no room is dropped (as without the tier). The copies (device -> host) are queued.
- Hit: :meth:`HostTier.onload` queues host -> device copies into device blocks the manager
  allocated; the units are touched (most recently used).
- Eviction: plain LRU over units, whatever the device policy. A unit is **held** (not evictable)
  while a queued copy touches it (until :meth:`HostTier.take_copies` hands the copies out) and,
  with pins on, until ``release_pins`` covers the pin epoch of its last copy.
- Swap-outs win: :meth:`HostTier.make_room` evicts unheld units until the host pool has the blocks
  a swap-out needs (``num_evictable`` says how many it can give).

The tier holds no tensors and no device books: the manager's :class:`~hybridkv.blockmgr.prefix.
cache.PrefixCache` owns one and asks it during matching, eviction and admission.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.blockmgr.records import SwapDirection, TierCopies, TierPlan

if TYPE_CHECKING:
    from hybridkv.blockmgr.pool import BlockPool

_EMPTY = np.empty(0, dtype=np.int32)


@dataclass(slots=True)
class TierStats:
    """Counts since the manager was made (blocks; one block = ``Layout.bytes_per_block`` bytes)."""

    offloaded_kv: int = 0  # KV blocks copied device -> host
    offloaded_checkpoints: int = 0  # checkpoints copied device -> host
    dropped: int = 0  # victims that found no host room (dropped as without the tier)
    onloaded_kv: int = 0  # KV blocks copied host -> device (host hits)
    onloaded_checkpoints: int = 0  # checkpoints copied host -> device (into the hit's live sets)
    host_hit_tokens: int = 0  # tokens of host hits served through onloaded KV blocks (counted by onload)
    evicted_kv: int = 0  # KV units dropped from the host
    evicted_checkpoints: int = 0
    given_to_swaps: int = 0  # host blocks freed for swap-outs

    def blocks_out(self, num_state_blocks: int) -> int:
        return self.offloaded_kv + self.offloaded_checkpoints * num_state_blocks

    def blocks_in(self, num_state_blocks: int) -> int:
        return self.onloaded_kv + self.onloaded_checkpoints * num_state_blocks


class HostTier:
    """Host-resident units of the prefix cache over the manager's host pool (shared with swaps).

    ``pin_epoch``: the manager's current pin epoch (0: pins off). ``block_size``: tokens per block;
    ``num_state_blocks``: blocks of one checkpoint.
    """

    def __init__(self, pool: BlockPool, block_size: int, num_state_blocks: int,
                 pin_epoch: Callable[[], int]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_state_blocks = num_state_blocks
        self._epoch = pin_epoch
        # tokens of a unit's block, at the unit's first host id (zero pages cost nothing until written)
        self._tok = np.zeros((pool.num_blocks, block_size), dtype=np.int64)
        self.kv: dict[int, int] = {}  # chain key -> host block
        self.ck: dict[int, np.ndarray] = {}  # chain key -> host ids of the checkpoint (flat state set order)
        self._unit: dict[int, tuple[int, bool]] = {}  # first host id -> (key, is a checkpoint)
        self._lru: OrderedDict[int, None] = OrderedDict()  # first host ids, least recently used first
        self._n_blocks = 0  # host blocks the tier holds
        self._undrained: set[int] = set()  # units a queued (not handed out) copy touches
        self._pins: dict[int, int] = {}  # unit -> pin epoch of its last copy (with pins on)
        self._protect: set[int] = set()  # units a hit being taken needs (not evictable meanwhile)
        self._fresh: set[int] = set()  # units offloaded by the eviction in progress
        self._holds: dict[int, int] = {}  # unit -> holds of pending prefix exports (hold / unhold)
        self._out_dev: list[np.ndarray] = []
        self._out_host: list[np.ndarray] = []
        self._in_dev: list[np.ndarray] = []
        self._in_host: list[np.ndarray] = []
        self.stats = TierStats()

    # ---- counts -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Host blocks the tier holds."""
        return self._n_blocks

    @property
    def num_units(self) -> int:
        return len(self._unit)

    def _size(self, first: int) -> int:
        return self.num_state_blocks if self._unit[first][1] else 1

    def _held(self, first: int) -> bool:
        return first in self._undrained or first in self._protect or first in self._fresh or first in self._holds or (
            first in self._pins and self._epoch() > 0)

    @property
    def num_evictable(self) -> int:
        """Host blocks the tier can give back now (to a swap-out, or to an offload)."""
        held = {u for u in (*self._undrained, *self._protect, *self._fresh, *self._holds) if u in self._unit}
        if self._epoch() > 0:
            held.update(u for u in self._pins if u in self._unit)
        return self._n_blocks - sum(self._size(u) for u in held)

    # ---- lookups ----------------------------------------------------------------------------------
    def kv_blocks(self, keys: Sequence[int], tokens: np.ndarray) -> np.ndarray:
        """Host block of each chain key of ``keys`` (blocks 0, 1, ... of ``tokens``) whose tokens
        match, else -1 (int64 ``[len(keys)]``)."""
        n, bs = len(keys), self.block_size
        if not self.kv or not n:
            return np.full(n, -1, dtype=np.int64)
        hb = np.fromiter(map(self.kv.get, keys, repeat(-1)), dtype=np.int64, count=n)
        found = (hb >= 0).nonzero()[0]
        if found.size:
            rows = tokens[: n * bs].reshape(n, bs)[found]
            bad = ~(self._tok[hb[found]] == rows).all(axis=1)
            hb[found[bad]] = -1
        return hb

    def checkpoint_at(self, key: int, block_tokens: np.ndarray) -> np.ndarray | None:
        """Host ids of the checkpoint at chain key ``key`` whose node block holds ``block_tokens``."""
        ids = self.ck.get(key)
        if ids is None or not np.array_equal(self._tok[int(ids[0])], block_tokens):
            return None
        return ids

    def has_checkpoints(self) -> bool:
        return bool(self.ck)

    # ---- offload (device -> host) -------------------------------------------------------------------
    def begin_eviction(self) -> None:
        self._fresh = set()

    def end_eviction(self) -> None:
        self._fresh = set()

    def offload(self, key: int, block_tokens: np.ndarray, device_ids: np.ndarray, is_checkpoint: bool) -> bool:
        """Keep a device victim (a KV block or a checkpoint's flat ids) on the host: queue the
        copies device -> host; False when the host has no room (the victim is dropped)."""
        table = self.ck if is_checkpoint else self.kv
        old = table.get(key)
        if old is not None:
            first = int(old[0]) if is_checkpoint else int(old)
            if np.array_equal(self._tok[first], block_tokens):  # the same bytes are there already
                self._lru.move_to_end(first)
                return True
            return False  # (a chain-key collision: keep the older unit)
        n = device_ids.size
        if not self._room(n):
            self.stats.dropped += 1
            return False
        host = self.pool.allocate(n)
        first = int(host[0])
        self._tok[first] = block_tokens
        if is_checkpoint:
            self.ck[key] = host.copy()
            self.stats.offloaded_checkpoints += 1
        else:
            self.kv[key] = first
            self.stats.offloaded_kv += 1
        self._unit[first] = (key, is_checkpoint)
        self._lru[first] = None
        self._n_blocks += n
        self._fresh.add(first)
        self._touch_copy(first)
        self._out_dev.append(np.asarray(device_ids, dtype=np.int32).copy())
        self._out_host.append(host.copy())
        return True

    def _room(self, n: int) -> bool:
        """Free ``n`` host blocks (evicting unheld units, least recently used first) if possible;
        nothing is evicted when it is not."""
        if self.pool.num_free >= n:
            return True
        self.make_room(n)  # (evicts nothing when it cannot reach n)
        return self.pool.num_free >= n

    def make_room(self, n: int) -> int:
        """Evict unheld units (least recently used first) until ``n`` host blocks are free, or
        nothing when they cannot make that many free. Returns the blocks freed."""
        freed = 0
        if self.pool.num_free >= n:
            return 0
        victims = []
        for first in self._lru:
            if self._held(first):
                continue
            victims.append(first)
            freed += self._size(first)
            if self.pool.num_free + freed >= n:
                break
        if self.pool.num_free + freed < n:
            return 0
        for first in victims:
            self._drop(first)
        return freed

    def _drop(self, first: int, evicted: bool = True) -> None:
        """Drop unit ``first`` and give its host blocks back (``evicted``: counted as an eviction;
        else its offload was withdrawn before it ran, :meth:`withdraw_offloads`)."""
        key, is_ck = self._unit.pop(first)
        del self._lru[first]
        self._pins.pop(first, None)
        if is_ck:
            ids = self.ck.pop(key)
            self.stats.evicted_checkpoints += int(evicted)
        else:
            del self.kv[key]
            ids = np.array([first], dtype=np.int32)
            self.stats.evicted_kv += int(evicted)
        self._n_blocks -= ids.size
        self.pool.release(ids)

    # ---- onload (host -> device) --------------------------------------------------------------------
    def units_of(self, host_kv: np.ndarray, host_ck: np.ndarray | None) -> set[int]:
        """The units a hit reads: its host KV blocks and its checkpoint's first id."""
        units = set(host_kv.tolist())
        if host_ck is not None:
            units.add(int(host_ck[0]))
        return units

    def onload(self, host_ids: np.ndarray, device_ids: np.ndarray, units: set[int]) -> None:
        """Queue the copies host -> device of a hit (``host_ids[i] -> device_ids[i]``) and touch its
        units (most recently used)."""
        if not host_ids.size:
            return
        kv_units = 0
        for first in units:
            self._lru.move_to_end(first)
            self._touch_copy(first)
            kv_units += not self._unit[first][1]
        # each KV unit of the hit serves one block of its tokens (PrefixCache.stats.hit_tokens_host
        # counts the same tokens as the hit is taken; a checkpoint serves none by itself)
        self.stats.host_hit_tokens += kv_units * self.block_size
        self._in_host.append(np.asarray(host_ids, dtype=np.int32).copy())
        self._in_dev.append(np.asarray(device_ids, dtype=np.int32).copy())

    def _touch_copy(self, first: int) -> None:
        self._undrained.add(first)
        epoch = self._epoch()
        if epoch:
            self._pins[first] = epoch

    # ---- holds (prefix exports: a peer reads the units) -----------------------------------------------
    def hold(self, units: Sequence[int]) -> None:
        """Keep ``units`` (first host ids) on the host until :meth:`unhold`: neither the tier's LRU
        nor a swap-out takes them (a peer reads them, ``blockmgr.transfer_host``). Holds count."""
        missing = [u for u in units if u not in self._unit]
        if missing:
            raise KeyError(f"host tier units {missing} are not held by the tier")
        for u in units:
            self._holds[u] = self._holds.get(u, 0) + 1

    def unhold(self, units: Sequence[int]) -> None:
        """End one :meth:`hold` of each of ``units`` (a unit named twice: two holds). All or nothing:
        ``KeyError`` naming the units without that many holds, before any hold ends."""
        wanted = Counter(units)
        short = sorted(u for u, n in wanted.items() if self._holds.get(u, 0) < n)
        if short:
            raise KeyError(
                f"host tier units {short} are not held (or not as many times as named): nothing was unheld"
            )
        for u in units:
            n = self._holds[u] - 1
            if n:
                self._holds[u] = n
            else:
                del self._holds[u]

    # ---- handing out ---------------------------------------------------------------------------------
    def take_copies(self) -> TierPlan:
        """The queued copies (offloads first, then onloads), in queue order; the units they touch
        stay held by their pin epoch (when pins are on) until ``release_pins`` covers it."""
        plan = TierPlan(
            TierCopies(_cat(self._out_dev), _cat(self._out_host), SwapDirection.OUT),
            TierCopies(_cat(self._in_dev), _cat(self._in_host), SwapDirection.IN),
        )
        self._out_dev, self._out_host, self._in_dev, self._in_host = [], [], [], []
        self._undrained.clear()
        return plan

    def drop_unwritten(self, host_blocks: np.ndarray) -> int:
        """The offloads handed out for ``host_blocks`` (a plan's :class:`TierCopies`) never ran (the
        step that carried them was abandoned): drop the units they were to fill, so that no host hit
        copies back bytes that were never written. Returns the units dropped (``stats.dropped``)."""
        dropped = 0
        for first in dict.fromkeys(np.asarray(host_blocks).tolist()):
            if first in self._unit:  # (a checkpoint's unit is named by its first host block)
                self._drop(first, evicted=False)
                dropped += 1
        self.stats.dropped += dropped
        return dropped

    def withdraw_offloads(self, device_ids: np.ndarray) -> int:
        """Withdraw the queued offloads whose device blocks are among ``device_ids`` (blocks handed to
        a writer that does not wait for stage 0: an import READ from a peer at once) and drop their
        units: the host never receives bytes the writer put there under the evicted block's key.
        Returns the units dropped (counted as ``stats.dropped``), or -1, changing nothing, when a
        queued onload reads one of them (the caller must not hand those blocks out before stage 0)."""
        if not self._out_dev or not device_ids.size:
            return 0
        hit = [np.isin(dev, device_ids).any() for dev in self._out_dev]
        read = _cat(self._in_host) if self._in_host else None
        if read is not None and any(h and np.isin(host, read).any()
                                    for h, host in zip(hit, self._out_host, strict=True)):
            return -1
        dropped, keep_dev, keep_host = 0, [], []
        for dev, host, conflict in zip(self._out_dev, self._out_host, hit, strict=True):
            if not conflict:
                keep_dev.append(dev)
                keep_host.append(host)
                continue
            first = int(host[0])
            if self._unit[first][1]:
                self.stats.offloaded_checkpoints -= 1
            else:
                self.stats.offloaded_kv -= 1
            self._drop(first, evicted=False)
            self._undrained.discard(first)
            self._fresh.discard(first)
            self.stats.dropped += 1
            dropped += 1
        self._out_dev, self._out_host = keep_dev, keep_host
        return dropped

    def queued(self) -> TierPlan:
        """The copies :meth:`take_copies` would hand out now, without handing them out."""
        return TierPlan(
            TierCopies(_cat(self._out_dev), _cat(self._out_host), SwapDirection.OUT),
            TierCopies(_cat(self._in_dev), _cat(self._in_host), SwapDirection.IN),
        )

    def has_queued(self) -> bool:
        return bool(self._out_dev or self._in_dev)

    def release_pins(self, before: int | None) -> None:
        if before is None:
            self._pins.clear()
        elif self._pins:
            self._pins = {u: e for u, e in self._pins.items() if e >= before}

    # ---- integrity ------------------------------------------------------------------------------------
    def host_ids(self) -> list[np.ndarray]:
        """Every host block the tier holds (one array per unit)."""
        out = [np.array(list(self.kv.values()), dtype=np.int32)]
        out += list(self.ck.values())
        return out

    def check(self) -> list[str]:
        problems = []
        ids = np.concatenate(self.host_ids()) if self._unit else _EMPTY
        if ids.size != self._n_blocks or np.unique(ids).size != ids.size:
            problems.append("host tier: its blocks are miscounted or held twice")
        if set(self._lru) != set(self._unit) or len(self._unit) != len(self.kv) + len(self.ck):
            problems.append("host tier: its LRU order and its units disagree")
        for first, (key, is_ck) in self._unit.items():
            held = self.ck.get(key) if is_ck else self.kv.get(key)
            if held is None or (int(held[0]) if is_ck else int(held)) != first:
                problems.append(f"host tier: unit {first} (key {key}) is not where its key says")
                break
        if any(u not in self._unit for u in self._undrained):
            problems.append("host tier: a queued copy touches a unit the tier no longer holds")
        if any(u not in self._unit or n <= 0 for u, n in self._holds.items()):
            problems.append("host tier: a prefix export holds a unit the tier no longer holds")
        return problems


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

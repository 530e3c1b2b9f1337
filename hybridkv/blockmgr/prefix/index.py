"""The prefix cache's books and its index: node slots, the chain key -> slot map, the chain memo.

Every array the cache keeps is made here (nodes by slot; cached KV blocks, LRU orders, ticks and
FLOPs by block id; checkpoints by their first block id), so the parts above (placement, eviction,
registration, matching) hold behaviour only. ``host`` is the manager's view the cache needs
(:class:`CacheHost`): its pool, per-block use bytes, layout and pin epoch; the cache does not
import the host.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.hashing import (  # _C, _MASK: the chain's constants, inlined in _register_few
    TokenArray,
)
from hybridkv.blockmgr.prefix import kernels as prefix_kernels

if TYPE_CHECKING:
    from hybridkv.blockmgr.pool import BlockPool
    from hybridkv.planner.layout import Layout
from hybridkv.blockmgr.prefix.config import (
    _EMPTY,
    _FEW,
    CheckpointPolicy,
    EvictionPolicy,
    NodeView,
    PrefixCacheConfig,
    _Counters,
)
from hybridkv.blockmgr.prefix.host_tier import HostTier
from hybridkv.blockmgr.prefix.slotmap import SlotMap
from hybridkv.models.flops import flop_coefficients


class CacheHost(Protocol):
    """What the prefix cache reads and writes of its manager: the pool (reference counts, sizes),
    the per-block use bytes, the layout (block size, the model's bytes and FLOPs), the state set
    size and the pin epoch of copies handed out now. ``HybridBlockManager`` is one."""

    layout: Layout
    pool: BlockPool
    host_pool: BlockPool | None  # the host (swap) pool: the host tier's blocks
    use: np.ndarray  # int8 [num_blocks]: BlockUse of each block, written by the cache for its blocks
    block_size: int
    num_state_groups: int
    num_state_blocks: int
    _has_kv: bool

    @property
    def pin_epoch(self) -> int: ...


class ChainIndex:
    """The cache's books (arrays, maps, counters) and the chain index over them."""

    def __init__(self, host: CacheHost, config: PrefixCacheConfig | None = None) -> None:
        self.host = host
        self.config = config or PrefixCacheConfig()
        self.block_size = bs = host.block_size
        layout = host.layout
        nb = layout.num_blocks
        # ---- nodes, by slot
        cap = max(256, nb)  # about one node per block; zero pages cost nothing until written
        # chain key -> slot: with the kernels, a SlotMap (its arrays are what the compiled
        # registration writes into); else a dict
        self._fast = kernels.ENABLED
        self._slot: dict[int, int] | SlotMap = SlotMap(cap) if self._fast else {}
        self._key = np.zeros(cap, dtype=np.int64)
        self._pos = np.zeros(cap, dtype=np.int64)
        self._kv = np.zeros(cap, dtype=np.int32)  # 0: no KV block
        self._ck = np.full(cap, -1, dtype=np.int64)  # checkpoint slot (its first block id), -1: none
        self._tok = np.zeros((cap, bs), dtype=np.int64)
        # free slots, a stack: _free[:_n_free], popped from the end (low slots first)
        self._free = np.arange(cap - 1, -1, -1, dtype=np.int64)
        self._n_free = cap
        self._reg_out = np.empty((2, _FEW), dtype=np.int64)  # scratch: the compiled registration's keys, slots
        # the slots of the last chain looked up whole (a request's keys, asked about at its
        # checkpoints and its release): kept with a copy of the keys, checked before reuse (a
        # freed slot has position 0)
        self._memo_keys: list[int] = []
        self._memo_slots = np.empty(64, dtype=np.int64)  # [:len(_memo_keys)] used
        self._memo_karr = np.empty(64, dtype=np.int64)
        # nodes removed and created so far: a remembered chain whose counts still hold needs no check
        self._removed = self._created = 0
        self._memo_gen = (-1, -1)
        # ---- cached KV blocks, by block id
        self._node_of = np.full(nb, -1, dtype=np.int64)  # KV block -> slot of the node it caches
        # evictable KV blocks on no node: second copies whose node caches another one, kept by rules
        # that keeps_second_copies (Registration.adopt_copies, release's twins); evicted in their turn
        self._stale = np.zeros(nb, dtype=bool)
        self._n_mapped = 0  # KV blocks mapped to nodes
        # whether each unit is evictable (a KV block) or live (a checkpoint, by slot), and the LRU
        # order it was last queued with: one array each, indexed like the LRU queue's codes (a KV
        # block at its id, a checkpoint at nb + its slot), so the queue's liveness is one gather;
        # the KV and checkpoint halves are views
        self._q_live = np.zeros(2 * nb, dtype=bool)
        self._q_order = np.zeros(2 * nb, dtype=np.int64)
        self._kv_evictable, self._ck_live = self._q_live[:nb], self._q_live[nb:]
        self._kv_order, self._ck_order = self._q_order[:nb], self._q_order[nb:]
        self._n_evictable = 0
        # what flop_aware ranks, by block id: a cached KV block's, or a checkpoint's at its slot
        # (its first block id; a block is one or the other, and each value is written when the
        # block becomes one): the tick of its last use (a KV block's release, a checkpoint made or
        # hit; float64: ranked as is, exact below 2**53) and log1p(FLOPs it saves per byte) (kept
        # only under flop_aware). One array each, so the ranking gathers all candidates at once
        self._ticks = np.zeros(nb, dtype=np.float64)
        self._lfpb = np.zeros(nb, dtype=np.float64)
        # scratch: flop_aware's candidates (padded to whole 8-byte words for the compiled scan), their ids
        self._cand_words = np.zeros(-(-nb // 8) * 8, dtype=bool)
        self._cand = self._cand_words[:nb]
        self._cand_ids = np.zeros(self._cand_words.size, dtype=np.int64)
        self._views()
        # one counter orders every LRU event (KV blocks released, checkpoints made or hit)
        self._order = 0
        # the LRU queue: entries [head, tail) in LRU order, a KV block (code = its id, queued when it
        # becomes evictable) or a checkpoint (code = -1 - its slot, queued when made or hit); an
        # entry is stale once its unit is taken back, evicted or queued again (order mismatch)
        self._fifo = np.zeros(max(1024, nb), dtype=np.int64)
        self._fifo_ord = np.zeros(self._fifo.size, dtype=np.int64)
        self._head = self._tail = 0
        self._passed = np.zeros(2 * nb + 1, dtype=bool)  # scratch: queue codes eviction passes over (code + nb)
        self._front = 0  # orders of demoted entries count down from here (they queue at the front)
        # ---- checkpoints, by slot (first block id)
        self._ck_ids: dict[int, np.ndarray] = {}  # checkpoint slot -> its flat block ids
        self._ck_node: dict[int, int] = {}  # checkpoint slot -> node slot
        self._tick = 0
        self.stats = _Counters()
        # keys of checkpoints a pending copy reads (a hit) or writes (a new checkpoint), with the
        # manager's pin epoch: evicting one before the executor ran the copy would hand its blocks
        # to another writer
        self.pinned: dict[int, int] = {}
        # of those, the keys a hit's copy reads (with the epoch of the last such hit): never cancelled
        self._reads: dict[int, int] = {}

        # state-only models: chain nodes that hold nothing (they mark where cached prefixes go, for
        # branch points), least recently used first, at most _bare_cap of them
        self._bare: OrderedDict[int, None] = OrderedDict()
        self._bare_cap = max(1024, 4 * host.pool.num_usable)
        self._ckpt_bytes = host.num_state_blocks * layout.bytes_per_block
        self._flops = flop_coefficients(layout.model)
        self._bytes_per_block = layout.bytes_per_block
        self._rank_flops = self.config.eviction is EvictionPolicy.FLOP_AWARE
        self._recent: TokenArray | None = None  # the tokens last matched (see _recent_tokens)
        self.tier: HostTier | None = None
        if self.config.host_tier:
            if host.host_pool is None:
                raise ValueError("PrefixCacheConfig(host_tier=True) needs a host pool: pass num_host_blocks > 0")
            self.tier = HostTier(host.host_pool, bs, host.num_state_blocks, lambda: host.pin_epoch)
        self._chain_memo = bool(host.num_state_groups) and (
            self.config.demote_tail or self.config.checkpoint is CheckpointPolicy.BRANCH_SPACED)

    @property
    def num_checkpoints(self) -> int:
        return len(self._ck_ids)

    @property
    def num_cached_kv(self) -> int:
        """Cached KV blocks no request holds (evictable)."""
        return self._n_evictable

    @property
    def num_nodes(self) -> int:
        return len(self._slot)

    def checkpoint_keys(self) -> list[int]:
        """Chain keys of the nodes holding checkpoints, least recently used first."""
        slots = sorted(self._ck_ids, key=lambda s: self._ck_order[s])
        return [int(self._key[self._ck_node[s]]) for s in slots]

    @property
    def nodes(self) -> dict[int, NodeView]:
        """Every chain node, as copies (slow: for tests and inspection)."""
        return {key: self._view(key, s) for key, s in self._slot.items()}

    def node(self, key: int) -> NodeView | None:
        s = self._slot.get(key)
        return None if s is None else self._view(key, s)

    def _view(self, key: int, s: int) -> NodeView:
        ck = int(self._ck[s])
        return NodeView(key, tuple(self._tok[s].tolist()), int(self._pos[s]), int(self._kv[s]),
                        self._ck_ids[ck] if ck >= 0 else None)

    def cached_kv_blocks(self) -> np.ndarray:
        """Evictable cached KV block ids (ascending)."""
        return np.flatnonzero(self._kv_evictable).astype(np.int32)

    def checkpoint_blocks(self) -> np.ndarray:
        if not self._ck_ids:
            return np.empty(0, dtype=np.int32)
        return np.concatenate(list(self._ck_ids.values()))

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _next_order(self, n: int) -> int:
        first = self._order
        self._order += n
        return first

    def _grow(self, need: int) -> None:
        cap = self._key.size
        new = max(2 * cap, cap + need)
        self._key = np.concatenate((self._key, np.zeros(new - cap, dtype=np.int64)))
        self._pos = np.concatenate((self._pos, np.zeros(new - cap, dtype=np.int64)))
        self._kv = np.concatenate((self._kv, np.zeros(new - cap, dtype=np.int32)))
        self._ck = np.concatenate((self._ck, np.full(new - cap, -1, dtype=np.int64)))
        tok = np.zeros((new, self.block_size), dtype=np.int64)
        tok[:cap] = self._tok
        self._tok = tok
        # the new slots go under the free ones (popped after them), the lowest on top
        free = np.empty(new, dtype=np.int64)  # (room for every slot)
        free[: new - cap] = np.arange(new - 1, cap - 1, -1)
        free[new - cap : new - cap + self._n_free] = self._free[: self._n_free]
        self._free = free
        self._n_free += new - cap
        self._views()

    def _views(self) -> None:
        """Memoryviews of the node and block arrays, for scalar reads and writes at half numpy's
        cost (the scalar registration path); remade when the node arrays grow."""
        self._mv = tuple(memoryview(a) for a in (self._key, self._pos, self._kv, self._ck, self._node_of, self._lfpb,
                                                 self._free))

    def _new_slots(self, keys: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Create nodes (no blocks yet) for ``keys``; ``tokens``: ``[n, block_size]``. Their slots."""
        n = keys.size
        if n > self._n_free:
            self._grow(n - self._n_free)
        self._n_free -= n
        slots = self._free[self._n_free : self._n_free + n][::-1].copy()
        self._key[slots] = keys
        self._pos[slots] = positions
        self._kv[slots] = 0
        self._ck[slots] = -1
        self._tok[slots] = tokens
        if self._fast:
            self._slot.put(keys, slots)
        else:
            self._slot.update(zip(keys.tolist(), slots.tolist(), strict=True))
        self._created += 1
        return slots

    def _remove_nodes(self, slots: np.ndarray) -> None:
        """Forget nodes that hold nothing (their slots are reused)."""
        if not slots.size:
            return
        keys = self._key[slots]
        if self._fast:
            self._slot.remove(keys)
        else:
            deque(map(self._slot.__delitem__, keys.tolist()), maxlen=0)  # the deletions in C, not a bytecode loop
        if self._bare:
            for k in keys.tolist():
                self._bare.pop(k, None)
        self._pos[slots] = 0  # a free slot (what _chain_slots checks)
        self._free[self._n_free : self._n_free + slots.size] = slots
        self._n_free += slots.size
        self._removed += 1

    def _free_slot(self, slot: int) -> None:
        """:meth:`_remove_nodes` of one slot whose key is already out of the maps."""
        self._pos[slot] = 0
        self._free[self._n_free] = slot
        self._n_free += 1
        self._removed += 1

    def _lookup(self, keys: list[int] | np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (-1: no node): one compiled call (SlotMap), or dict lookups run in C
        (map), not a bytecode loop."""
        if self._fast:
            return self._slot.lookup(np.asarray(keys, dtype=np.int64))
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        return np.fromiter(map(self._slot.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def _chain_slots(self, keys: list[int]) -> np.ndarray:
        """The slots of the chain ``keys`` (-1: no node), read-only (a view of the memo, valid until
        the next call). The last chain asked about is remembered with its slots: when ``keys``
        extends it (the same request again, after more registration; a chain key stands for its
        whole prefix, so the last remembered key is compared), only the new keys and the
        remembered slots that went stale (node removed, slot reused, node created since) are looked
        up, and the memo grows in place (a long request's checkpoints cost their new blocks, not
        its whole chain)."""
        memo, m, n = self._memo_keys, len(self._memo_keys), len(keys)
        if m and m <= n and keys[m - 1] == memo[-1]:
            slots, karr = self._memo_slots[:m], self._memo_karr[:m]
            removed, created = self._memo_gen
            if removed != self._removed:  # a remembered slot may have been freed or reused
                s = np.maximum(slots, 0)
                stale = ((slots < 0) | (self._pos[s] == 0) | (self._key[s] != karr)).nonzero()[0]
            elif created != self._created:  # a missing node may exist now
                stale = (slots < 0).nonzero()[0]
            else:
                stale = _EMPTY
            if stale.size:
                slots[stale] = self._lookup([keys[i] for i in stale.tolist()])
            if m < n:
                more = keys[m:]
                self._memo_put(m, self._lookup(more), np.array(more, dtype=np.int64))
                memo.extend(more)
        else:
            self._memo_keys = keys[:]
            self._memo_put(0, self._lookup(keys), np.array(keys, dtype=np.int64))
        self._memo_gen = (self._removed, self._created)
        return self._memo_slots[:n]

    def _memo_put(self, at: int, slots: np.ndarray, karr: np.ndarray) -> None:
        """Remembered slots and keys ``[at, at + len(slots))`` (the arrays grow by doubling)."""
        end = at + slots.size
        if end > self._memo_slots.size:
            cap = max(end, 2 * self._memo_slots.size)
            for name in ("_memo_slots", "_memo_karr"):
                grown = np.empty(cap, dtype=np.int64)
                grown[:at] = getattr(self, name)[:at]
                setattr(self, name, grown)
        self._memo_slots[at:end] = slots
        self._memo_karr[at:end] = karr

    def _remember_chain(self, keys: list[int], start: int, slots: np.ndarray, new: np.ndarray) -> None:
        """``register`` added ``keys[start:]`` at ``slots`` (keys ``new``): extend the remembered
        chain if it was ``keys[:start]`` (its last key compared), else start it (when ``start == 0``)."""
        memo = self._memo_keys
        if start == 0:
            self._memo_keys = keys[:]
            self._memo_put(0, slots, new)
            self._memo_gen = (self._removed, self._created)
        elif len(memo) == start and keys[start - 1] == memo[-1]:
            memo.extend(keys[start:])
            self._memo_put(start, slots, new)

    def _verified(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Whether each of ``slots`` (blocks 0, 1, ... of ``tokens``) exists and holds exactly those
        tokens."""
        n, bs = slots.size, self.block_size
        ok = slots >= 0
        if not n or not ok.any():
            return ok
        if kernels.ENABLED:  # row by row, no gathered copy
            prefix_kernels.rows_equal(self._tok, slots, tokens, ok)
            return ok
        s = np.where(ok, slots, 0)
        ok &= (self._tok[s] == tokens[: n * bs].reshape(n, bs)).all(axis=1)
        return ok

    def has_checkpoint(self, key: int) -> bool:
        slot = self._slot.get(key)
        return slot is not None and self._ck[slot] >= 0

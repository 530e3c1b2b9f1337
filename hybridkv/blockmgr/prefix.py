"""Prefix caching for hybrid models: a KV hash chain plus recurrent-state checkpoints.

- KV: every full block of a request's tokens is a **node** of a hash chain (key = the chain key of
  :mod:`~hybridkv.blockmgr.hashing`; token ids are compared on a hit). Blocks are shared by
  reference count; a block whose count drops to zero stays cached (evictable) until evicted.
- State: a **checkpoint** is a state set per state group frozen at a block-aligned position and
  owned by the cache. A hit is the longest prefix ``p`` whose KV blocks are all cached **and** that
  has a checkpoint at exactly ``p``; the request's live sets are then filled by a copy.
- Checkpoint policies (:class:`CheckpointPolicy`) choose the positions; eviction policies
  (:class:`EvictionPolicy`) choose what to drop when the pool runs short.

Data layout: nodes live in numpy arrays indexed by a **slot** (key, position, KV block, checkpoint,
the block's token ids); one map takes chain keys to slots (a dict, or with the compiled kernels a
:class:`~hybridkv.blockmgr.slotmap.SlotMap`, into which a prefill chunk's blocks register in one
compiled call). Free slots are a stack (an array). Per-block state (evictable, tick, LRU
order, FLOPs per byte) lives in arrays indexed by block id, per-checkpoint state in arrays indexed by
the checkpoint's first block id. Matching, registration, release and eviction work on whole
requests at once: no Python object per cached block.

The cache holds no tensors; the manager runs it (``HybridBlockManager(..., prefix_cache=...)``).
"""

from __future__ import annotations

import enum
import functools
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.checkpoint_policy import (
    DEFAULT_ALIGN_TOKENS,
    DEFAULT_GAP_FRACTION,
    back_off_points,
    spaced_grids,
    spaced_positions,
)
from hybridkv.blockmgr.flops import flop_coefficients, prefill_flops
from hybridkv.blockmgr.hashing import (  # _C, _MASK: the chain's constants, inlined in _register_few
    _C,
    _C64,
    _MASK,
    ROOT_KEY,
    TokenArray,
    as_token_array,
    block_hashes,
    chain_key,
    chain_keys,
    chain_keys_array,
    key_from_hash,
    keys_from_hashes,
)
from hybridkv.blockmgr.records import BlockUse
from hybridkv.blockmgr.slotmap import SlotMap

if TYPE_CHECKING:
    from hybridkv.blockmgr.manager import HybridBlockManager

__all__ = [
    "ROOT_KEY",
    "CheckpointPolicy",
    "EvictionPolicy",
    "NodeView",
    "PrefixCache",
    "PrefixCacheConfig",
    "PrefixHit",
    "chain_keys",
]

_EMPTY = np.empty(0, dtype=np.int32)


class CheckpointPolicy(enum.Enum):
    NONE = "none"  # KV only: hits need a checkpoint, so hybrid models never hit
    EVERY_N_BLOCKS = "every_n_blocks"  # at every n-th block boundary of the input
    BRANCH_AND_LAST = "branch_and_last"  # where a request leaves the cached prefixes, and at its input's end
    BRANCH_LAST_ALIGNED = "branch_last_aligned"  # branch, finished request's end, input end on coarse grids
    BRANCH_SPACED = "branch_spaced"  # branch, finished request's end, grid back-offs, a minimum gap apart


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    FLOP_AWARE = "flop_aware"  # alpha * normalized FLOPs saved per byte + normalized recency


@dataclass(frozen=True, slots=True)
class PrefixCacheConfig:
    """``every_n``: block interval of ``every_n_blocks``. ``alpha``: weight of FLOP efficiency.
    ``evict_batch_fraction``: each eviction frees at least this fraction of the pool (both
    policies), so ranking the candidates is paid rarely."""

    checkpoint: CheckpointPolicy = CheckpointPolicy.BRANCH_SPACED
    eviction: EvictionPolicy = EvictionPolicy.LRU
    every_n: int = 8
    alpha: float = 1.0
    evict_batch_fraction: float = 0.01
    align_tokens: tuple[int, ...] = DEFAULT_ALIGN_TOKENS  # branch_last_aligned: back-off grids, finest first
    # branch_spaced: back-off grids; None: 512 and the checkpoint's bytes in KV tokens (the model's
    # state bytes / KV bytes per token) rounded up to a power of two (see checkpoint_policy.spaced_grids)
    spaced_align_tokens: tuple[int, ...] | None = None
    # branch_spaced: minimum tokens between checkpoints on one chain; None: ``gap_fraction`` of the
    # checkpoint's bytes in KV tokens
    min_gap_tokens: int | None = None
    gap_fraction: float = DEFAULT_GAP_FRACTION
    # hybrid models: a released request's cached KV past the deepest checkpoint on its chain can only
    # mark a branch, never serve a hit: it goes to the front of the LRU queue (evicted first)
    demote_tail: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", CheckpointPolicy(self.checkpoint))
        object.__setattr__(self, "eviction", EvictionPolicy(self.eviction))
        align = (self.align_tokens,) if isinstance(self.align_tokens, int) else tuple(self.align_tokens)
        if not align or any(not isinstance(a, int) or a <= 0 for a in align):
            raise ValueError(f"align_tokens must be positive numbers of tokens, got {self.align_tokens!r}")
        object.__setattr__(self, "align_tokens", align)
        spaced = self.spaced_align_tokens
        if spaced is not None:
            spaced = (spaced,) if isinstance(spaced, int) else tuple(spaced)
            if not spaced or any(not isinstance(a, int) or a <= 0 for a in spaced):
                raise ValueError(f"spaced_align_tokens must be positive token counts, got {self.spaced_align_tokens!r}")
            object.__setattr__(self, "spaced_align_tokens", spaced)
        if self.min_gap_tokens is not None and self.min_gap_tokens < 0:
            raise ValueError(f"min_gap_tokens must be >= 0 or None, got {self.min_gap_tokens}")
        if self.gap_fraction < 0:
            raise ValueError(f"gap_fraction must be >= 0, got {self.gap_fraction}")
        if self.every_n <= 0:
            raise ValueError(f"every_n must be a positive number of blocks, got {self.every_n}")


class NodeView(NamedTuple):
    """A copy of one chain node's books (for tests and inspection; the cache keeps arrays)."""

    key: int
    tokens: tuple[int, ...]
    position: int  # the node's block ends at this token position
    kv_block: int  # 0: no KV block cached for it
    checkpoint: np.ndarray | None  # flat block ids of the state sets at ``position``


class PrefixHit(NamedTuple):
    num_tokens: int  # tokens served from the cache (0 = miss)
    kv_blocks: np.ndarray  # int32 KV block ids of the hit, chain order (empty for state-only models)
    checkpoint_key: int | None  # chain key of the node holding the checkpoint at num_tokens
    num_matched_tokens: int  # tokens whose KV blocks are cached (>= num_tokens): the branch point
    keys: list[int]  # chain keys of the blocks below num_tokens
    checkpoint_ids: np.ndarray | None = None  # the checkpoint's flat block ids (read by the hit's copy)

    @property
    def num_blocks(self) -> int:
        """KV blocks the hit shares."""
        return int(self.kv_blocks.size)


def _miss(matched_tokens: int = 0) -> PrefixHit:
    return PrefixHit(0, _EMPTY, None, matched_tokens, [], None)


@dataclass(slots=True)
class _Counters:
    hit_tokens: int = 0
    checkpoints_made: int = 0
    checkpoints_evicted: int = 0
    kv_evicted: int = 0


_TWO64 = 1 << 64
_FEW = 16  # register() of up to this many blocks goes block by block (scalar path)


def _norm(x: np.ndarray) -> np.ndarray:
    """``(x - min) / (max - min)`` (a new array), zeros when all are equal."""
    low = x.min()
    span = x.max() - low
    if span > 0:
        y = x - low
        y /= span
        return y
    return np.zeros_like(x)


class PrefixCache:
    """The cache's books; all block movements go through the manager's pool and ``use`` bytes."""

    def __init__(self, manager: HybridBlockManager, config: PrefixCacheConfig | None = None) -> None:
        self.m = manager
        self.config = config or PrefixCacheConfig()
        self.block_size = bs = manager.block_size
        layout = manager.layout
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
        # state-only models: chain nodes that hold nothing (they mark where cached prefixes go, for
        # branch points), least recently used first, at most _bare_cap of them
        self._bare: OrderedDict[int, None] = OrderedDict()
        self._bare_cap = max(1024, 4 * manager.pool.num_usable)
        self._ckpt_bytes = manager.num_state_blocks * layout.bytes_per_block
        self._flops = flop_coefficients(layout.model)
        self._bytes_per_block = layout.bytes_per_block
        self._rank_flops = self.config.eviction is EvictionPolicy.FLOP_AWARE
        self._recent: TokenArray | None = None  # the tokens last matched (see _recent_tokens)
        self._chain_memo = bool(manager.num_state_groups) and (
            self.config.demote_tail or self.config.checkpoint is CheckpointPolicy.BRANCH_SPACED)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        """Blocks eviction can free now (checkpoints pinned by this step's copies excluded)."""
        return self._n_evictable + (len(self._ck_ids) - len(self.pinned)) * self.m.num_state_blocks

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

    def cancel_checkpoints(self, epoch: int) -> np.ndarray:
        """Drop the checkpoints pinned in ``epoch`` (taken then, their copies not yet handed to an
        executor); returns their block ids (the caller frees them and drops the copies)."""
        keys = [k for k, e in self.pinned.items() if e == epoch]
        parts = []
        for key in keys:
            del self.pinned[key]
            parts.append(self._drop_checkpoint(int(self._ck[self._slot[key]])))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def release_pins(self, before: int | None = None) -> None:
        """The copies reading or writing checkpoints pinned in epochs ``< before`` (all: None) ran."""
        if before is None:
            self.pinned.clear()
        elif self.pinned:
            self.pinned = {k: e for k, e in self.pinned.items() if e >= before}

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

    # ---- slots -------------------------------------------------------------------------------
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
            # the earlier part is as valid as it was: keep its counts unless it was just checked

    def _verified(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Whether each of ``slots`` (blocks 0, 1, ... of ``tokens``) exists and holds exactly those
        tokens."""
        n, bs = slots.size, self.block_size
        ok = slots >= 0
        if not n or not ok.any():
            return ok
        if kernels.ENABLED:  # row by row, no gathered copy
            kernels.rows_equal(self._tok, slots, tokens, ok)
            return ok
        s = np.where(ok, slots, 0)
        ok &= (self._tok[s] == tokens[: n * bs].reshape(n, bs)).all(axis=1)
        return ok

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int] | np.ndarray | TokenArray, max_tokens: int) -> PrefixHit:
        """The longest hit within ``min(max_tokens, len(token_ids) - 1)`` tokens (one token is
        always left to compute, so the forward has logits to sample). A :class:`TokenArray` (the
        admission's) keeps the block hashes computed here for the registration that follows."""
        memo = self._recent_tokens(token_ids)
        if memo is None:
            return _miss()  # the first block is not cached: a miss without hashing the rest
        tokens = memo.view()
        bs = self.block_size
        limit = (tokens.size - 1) // bs  # the chain over the whole input: branch point
        max_blocks = min(max(max_tokens, 0), tokens.size - 1) // bs
        if limit <= 0 or not self._slot:
            return _miss()
        h = memo.block_hashes(limit, bs)
        if self.m._has_kv and key_from_hash(int(h[0]), ROOT_KEY) not in self._slot:
            return _miss()  # the first block is not cached: a miss
        karr = keys_from_hashes(h[:limit])
        keys = karr.tolist()
        slots = self._lookup(karr if self._fast else keys)
        ok = self._verified(slots, tokens)
        if not self.m._has_kv:
            return self._match_state_only(keys, slots, ok, max_blocks)
        s = np.where(ok, slots, 0)
        ok &= self._kv[s] > 0
        n = limit if ok.all() else int(np.argmin(ok))  # the cached chain: blocks [0, n)
        m = min(n, max_blocks)
        if self.m.num_state_groups == 0:
            best = m
        else:
            with_ck = np.flatnonzero(self._ck[s[:m]] >= 0)
            best = int(with_ck[-1]) + 1 if with_ck.size else 0
        if not best:
            return _miss(n * bs)
        kv = self._kv[s[:best]].copy()
        if not self.m.num_state_groups:
            return PrefixHit(best * bs, kv, None, n * bs, keys[:best], None)
        ck = int(self._ck[s[best - 1]])
        return PrefixHit(best * bs, kv, keys[best - 1], n * bs, keys[:best], self._ck_ids[ck])

    def _recent_tokens(self, token_ids: Sequence[int] | np.ndarray | TokenArray) -> TokenArray | None:
        """``token_ids`` as a :class:`TokenArray` whose block hashes serve the next match of the same
        tokens: a scheduler asks about a request (``match_prefix``, ``can_allocate``), then admits it
        (``allocate``, whose registration reuses them). The array last matched is kept; tokens equal
        to it (compared) share its hashes. None: raw token ids (not a ``TokenArray``) of a KV model
        whose first block is not cached, a miss found by hashing that block alone."""
        recent = self._recent
        if isinstance(token_ids, TokenArray):
            if recent is not None and recent is not token_ids:
                token_ids.adopt_hashes(recent)
            self._recent = token_ids
            return token_ids
        tokens = as_token_array(token_ids)
        if recent is not None and recent.same_as(tokens):
            return recent
        bs = self.block_size
        if self.m._has_kv and tokens.size > bs and chain_keys_array(tokens, bs, 0, 1)[0] not in self._slot:
            return None
        self._recent = memo = TokenArray(tokens)
        return memo

    def _match_state_only(self, keys: list[int], slots: np.ndarray, ok: np.ndarray, max_blocks: int) -> PrefixHit:
        """No KV: a hit needs only the deepest checkpoint on the request's chain (chain keys hash
        every earlier block, and that block's tokens are compared); the branch point is the deepest
        block any cached chain reached (bare nodes may have been trimmed: an estimate)."""
        found = np.flatnonzero(ok)
        if not found.size:
            return _miss()
        matched = int(found[-1]) + 1
        within = found[found < max_blocks]
        with_ck = np.flatnonzero(self._ck[slots[within]] >= 0)
        if not with_ck.size:
            return _miss(matched * self.block_size)
        best = int(within[with_ck[-1]]) + 1
        ck = int(self._ck[slots[best - 1]])
        return PrefixHit(best * self.block_size, _EMPTY, keys[best - 1], matched * self.block_size, keys[:best],
                         self._ck_ids[ck])

    def num_pinned(self, hit: PrefixHit) -> int:
        """Evictable blocks a hit holds on to: the cached KV blocks it takes back (it shares them)
        and, while its copy is made, the one checkpoint it reads (not the others on its chain).
        Admission counts them as taken."""
        ckpt = {hit.checkpoint_key} if hit.checkpoint_key is not None else set()
        return self.num_protected(hit.kv_blocks, ckpt)

    def take_hit(self, hit: PrefixHit) -> np.ndarray:
        """Reference the hit's KV blocks (reviving evictable ones); returns them in chain order."""
        now = self._now()
        ids = hit.kv_blocks if self.m._has_kv else _EMPTY
        if ids.size:
            self._ticks[ids] = now
            self._n_evictable -= int(np.count_nonzero(self._kv_evictable[ids]))
            self._kv_evictable[ids] = False
            self.m.pool.incref(ids)
            self.m.use[ids] = BlockUse.KV
        if hit.checkpoint_key is not None:
            ck = int(self._ck[self._slot[hit.checkpoint_key]])
            self._ticks[ck] = now
            self._ck_order[ck] = order = self._next_order(1)
            self._enqueue_one(-1 - ck, order)
            self.pinned[hit.checkpoint_key] = self.m.pin_epoch
        self.stats.hit_tokens += hit.num_tokens
        return ids

    def _next_order(self, n: int) -> int:
        first = self._order
        self._order += n
        return first

    # ---- registration ------------------------------------------------------------------------
    def _fpb(self, positions: np.ndarray | int) -> np.ndarray | float:
        """FLOPs of each block's tokens (the block ending at ``positions``) per byte of one block
        (a Python float for an int: the same operations, so the same value)."""
        (lin, quad), bs = self._flops, self.block_size
        return (lin * bs + quad * (2 * positions - bs) * bs) / self._bytes_per_block  # (inlined in _register_few)

    def register(self, token_ids: Sequence[int] | np.ndarray | TokenArray, keys: list[int], kv_blocks: np.ndarray,
                 num_tokens: int) -> None:
        """Add the full blocks of ``token_ids[:num_tokens]`` beyond ``len(keys)`` to the chain.

        ``keys`` (the request's chain so far) is extended in place; ``kv_blocks`` are the request's
        KV blocks (empty for state-only models). A block whose node already has a KV block stays
        private to the request (two requests computed the same content). A :class:`TokenArray`
        (a request's record) keeps its block hashes, so each block is hashed once.
        """
        memo = token_ids if isinstance(token_ids, TokenArray) else None
        tokens = memo.view() if memo is not None else as_token_array(token_ids)
        bs = self.block_size
        start = len(keys)
        end = min(num_tokens, tokens.size) // bs
        if end <= start:
            return
        h = memo.block_hashes(end, bs)[start:end] if memo is not None else None
        few = end - start <= _FEW and self.m._has_kv  # a prefill chunk, a decode block: scalar path
        if few and self._fast:  # in one compiled call unless the parent is missing or slots run short
            if h is None:
                h = block_hashes(tokens[start * bs : end * bs].reshape(end - start, bs))
            if self._register_compiled(tokens, keys, kv_blocks, start, h, True):
                return
        if start:
            self.ensure(tokens, keys, kv_blocks, start - 1)  # a parent to hang the new blocks on
        parent = keys[-1] if keys else ROOT_KEY
        if few:
            self._register_few(tokens, keys, kv_blocks, start, end, parent, h)
            return
        if end - start == 1:  # one block of a state-only model: scalar path, same key and books
            if h is not None:
                key = key_from_hash(int(h[0]), parent)
            else:
                key = chain_key(tokens[start * bs : end * bs], parent)
            keys.append(key)
            self._place(key, tokens, start, kv_blocks)
            return
        if h is not None:
            new = keys_from_hashes(h, parent)
        else:
            new = chain_keys_array(tokens, bs, start, end, parent)
        new_list = new.tolist()
        keys.extend(new_list)
        if not self.m._has_kv:
            for j, key in enumerate(new_list, start):
                self._place(key, tokens, j, kv_blocks)
            return
        slots = self._lookup(new_list)
        miss = (slots < 0).nonzero()[0]
        if miss.size == slots.size:  # all new (a fresh prefill): contiguous, no gathers, no KV yet
            slots = self._new_slots(new, np.arange(start + 1, end + 1, dtype=np.int64) * bs,
                                    tokens[start * bs : end * bs].reshape(end - start, bs))
            if self._chain_memo:
                self._remember_chain(keys, start, slots, new)
            blocks = kv_blocks[start:end]
            free = self._node_of[blocks] < 0  # the request's own blocks: unmapped unless it re-created them
            if not free.all():
                blocks, slots = blocks[free], slots[free]
            self._map_kv(slots, blocks)
            return
        if miss.size:
            j = miss + start
            slots[miss] = self._new_slots(new[miss], (j + 1) * bs, tokens[: end * bs].reshape(end, bs)[j])
        if self._chain_memo:
            self._remember_chain(keys, start, slots, new)
        blocks = kv_blocks[start:end]
        take = (self._kv[slots] == 0) & (self._node_of[blocks] < 0)
        if take.any():
            self._map_kv(slots[take], blocks[take])

    def _map_kv(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Nodes ``slots`` now cache the KV ``blocks``."""
        self._kv[slots] = blocks
        self._node_of[blocks] = slots
        self._n_mapped += blocks.size
        if self._rank_flops:
            self._lfpb[blocks] = np.log1p(self._fpb(self._pos[slots]))

    def _register_few(self, tokens: np.ndarray, keys: list[int], kv_blocks: np.ndarray, start: int, end: int,
                      parent: int, h: np.ndarray | None) -> None:
        """:meth:`register` of blocks ``[start, end)`` (a few, KV model) on Python ints, block by
        block: the same keys, slots (taken from the free list in block order, after the same
        growth), KV mapping and FLOPs as the array path, without numpy's per-call setup."""
        bs, n = self.block_size, end - start
        if h is None:
            h = block_hashes(tokens[start * bs : end * bs].reshape(n, bs))
        if self._fast:
            self._slot.reserve(n)
            if self._register_compiled(tokens, keys, kv_blocks, start, h, False):
                return  # (else the free slots may run short: the growth is decided below)
        get = self._slot.get
        new_keys, found, key = [], [], parent & _MASK
        for hv in h.tolist():  # key_from_hash, inlined
            key = (_C * key + hv) & _MASK
            signed = key - _TWO64 if key >> 63 else key
            new_keys.append(signed)
            found.append(get(signed))
        keys.extend(new_keys)
        missing = found.count(None)
        if missing > self._n_free:
            self._grow(missing - self._n_free)
        if missing:
            self._created += 1
        d, n_free = self._slot, self._n_free
        key_a, pos_a, kv_a, ck_a, node_of, lfpb, free = self._mv  # (after the growth above)
        rank, tok = self._rank_flops, self._tok
        (lin, quad), per = self._flops, self._bytes_per_block  # _fpb's formula, inlined below
        blocks = kv_blocks[start:end].tolist()
        for i, key in enumerate(new_keys):
            slot = found[i]
            j = start + i
            if slot is None:
                n_free -= 1
                slot = found[i] = free[n_free]
                key_a[slot], pos_a[slot], kv_a[slot], ck_a[slot] = key, (j + 1) * bs, 0, -1
                tok[slot] = tokens[j * bs : (j + 1) * bs]
                d[key] = slot
            block = blocks[i]
            if not kv_a[slot] and node_of[block] < 0:
                kv_a[slot] = block
                node_of[block] = slot
                self._n_mapped += 1
                if rank:
                    lfpb[block] = math.log1p((lin * bs + quad * (2 * pos_a[slot] - bs) * bs) / per)
        self._n_free = n_free
        if self._chain_memo:
            self._remember_chain(keys, start, np.array(found, dtype=np.int64), np.array(new_keys, dtype=np.int64))

    def _register_compiled(self, tokens: np.ndarray, keys: list[int], kv_blocks: np.ndarray, start: int,
                           h: np.ndarray, check: bool) -> bool:
        """:meth:`_register_few` in one compiled call (:func:`~hybridkv.blockmgr.kernels.register_few`,
        the same books). False, with nothing changed, when the free slots or the key map's room
        could run short (the caller grows them as the scalar path does) or, with ``check``, when
        the chain's last key (the parent) has no node (the caller re-creates it)."""
        sm, out, (lin, quad), n = self._slot, self._reg_out, self._flops, h.size
        n_free, created, mapped = kernels.register_few(
            h, keys[-1] if start else ROOT_KEY, check and start > 0, _C64, sm.tab, sm.meta, self._key,
            self._pos, self._kv, self._ck, self._tok, tokens, start, kv_blocks[start : start + n], self._node_of,
            self._lfpb, self._rank_flops, lin, quad, self._bytes_per_block, self._free, self._n_free, out)
        if created < 0:
            return False
        self._n_free = n_free
        keys.extend(out[0, :n].tolist())
        if created:
            self._created += 1
        self._n_mapped += mapped
        if self._chain_memo:
            self._remember_chain(keys, start, out[1, :n], out[0, :n])
        return True

    def ensure(self, token_ids: Sequence[int] | np.ndarray, keys: list[int], kv_blocks: np.ndarray, j: int) -> int:
        """The slot of block ``j`` of a request's chain, re-created with any missing ancestors.

        A request whose block duplicated a cached one keeps a private copy; if the cached copy is
        later evicted, its node goes, and the request's own block takes its place here.
        """
        slot = self._slot.get(keys[j])
        if slot is not None:
            return slot
        tokens = as_token_array(token_ids)
        i = j
        while i > 0 and self.m._has_kv and keys[i - 1] not in self._slot:  # state-only: no chain needed
            i -= 1
        for t in range(i, j + 1):
            slot = self._place(keys[t], tokens, t, kv_blocks)
        return slot  # type: ignore[return-value]

    def _place(self, key: int, tokens: np.ndarray, j: int, kv_blocks: np.ndarray) -> int:
        """Node ``key`` (created if new); block ``j`` of the request becomes its KV if it has none."""
        bs = self.block_size
        slot = self._slot.get(key)
        if slot is None:
            if not self._n_free:
                self._grow(1)
            self._n_free -= 1
            slot = int(self._free[self._n_free])
            self._key[slot], self._pos[slot], self._kv[slot], self._ck[slot] = key, (j + 1) * bs, 0, -1
            self._tok[slot] = tokens[j * bs : (j + 1) * bs]
            self._slot[key] = slot
            self._created += 1
        if self.m._has_kv:
            block = int(kv_blocks[j])
            if not self._kv[slot] and self._node_of[block] < 0:
                self._kv[slot] = block
                self._node_of[block] = slot
                self._n_mapped += 1
                if self._rank_flops:
                    self._lfpb[block] = math.log1p(self._fpb(int(self._pos[slot])))
        elif self._ck[slot] < 0:  # a bare node of a state-only model: bounded, LRU
            self._bare[key] = None
            self._bare.move_to_end(key)
            while len(self._bare) > self._bare_cap:
                old, _ = self._bare.popitem(last=False)
                self._free_slot(self._slot.pop(old))
        return slot

    def release(self, ids: np.ndarray, chain: list[int] | None = None) -> np.ndarray:
        """KV blocks whose count reached zero: cached ones become evictable; returns the rest.

        ``chain``: the chain keys of the request releasing them, if it is one request's chain. With
        ``demote_tail`` (hybrid models), the released blocks past the deepest checkpoint on that chain
        (without ``chain``: among the released blocks) go to the front of the LRU queue: no hit can
        end there, they only mark where a branch would leave the cached prefix."""
        if not self._n_mapped or ids.size == 0:
            return ids
        now = self._now()
        keep = self._node_of[ids] >= 0
        kept = ids[keep]
        if kept.size:
            # a request's blocks come in chain order; queue the tail first, so that among blocks
            # released together LRU takes a chain's end before its root (which would orphan the rest)
            first = self._next_order(kept.size)
            queued = kept[::-1]
            self._kv_order[queued] = orders = np.arange(first, first + kept.size)
            self.m.use[kept] = BlockUse.CACHED_KV
            self._kv_evictable[kept] = True
            self._n_evictable += int(kept.size)
            self._ticks[kept] = now
            dead = self._dead_tail(kept, chain) if self.config.demote_tail and self.m.num_state_groups else None
            if dead is not None:
                dead = dead[::-1]  # in queue order: deepest first, the chain is cut from its end
                tail, back = queued[dead], queued[~dead]
                self._front -= tail.size
                self._kv_order[tail] = front = np.arange(self._front, self._front + tail.size)
                self._ticks[tail] = 0
                self._enqueue(back, orders[~dead])  # the rest queue at the back as usual
                self._enqueue_front(tail, front)
            else:
                self._enqueue(queued, orders)
        return ids[~keep]

    def _dead_tail(self, kept: np.ndarray, chain: list[int] | None) -> np.ndarray | None:
        """Which of ``kept`` (cached blocks in chain order) lie past the deepest checkpoint (a mask),
        or None when none do."""
        if chain is not None:
            deepest = self.deepest_checkpoint(chain)
            if deepest >= len(chain) * self.block_size:  # at the chain's end: nothing lies past it
                return None
            pos = self._pos[self._node_of[kept]]
        else:
            nodes = self._node_of[kept]
            pos = self._pos[nodes]
            ck = self._ck[nodes] >= 0
            deepest = int(pos[ck].max()) if ck.any() else 0
        if not deepest:  # no checkpoint on the chain: its KV is how a later request finds where it
            return None  # branches (and checkpoints there), so it stays in plain LRU order
        dead = pos > deepest
        return dead if dead.any() else None

    @functools.cached_property
    def checkpoint_tokens(self) -> float:
        """A checkpoint's bytes in tokens of KV: the model's state bytes / its KV bytes per token
        (a property of the model, not of the layout's block size)."""
        model = self.m.layout.model
        return model.state_bytes / max(model.kv_bytes_per_token, 1)

    @functools.cached_property
    def min_gap(self) -> int:
        """``branch_spaced``'s minimum spacing in tokens (independent of the layout's block size)."""
        cfg = self.config
        return cfg.min_gap_tokens if cfg.min_gap_tokens is not None else int(cfg.gap_fraction * self.checkpoint_tokens)

    @functools.cached_property
    def spaced_grids(self) -> tuple[int, ...]:
        """``branch_spaced``'s back-off grids in tokens (configured, or derived from bytes)."""
        return self.config.spaced_align_tokens or spaced_grids(self.checkpoint_tokens)

    @property
    def spaces_checkpoints(self) -> bool:
        """Whether the policy needs the deepest checkpoint below a position (``below``)."""
        return self.config.checkpoint is CheckpointPolicy.BRANCH_SPACED

    def planned_checkpoints(self, input_len: int, branch: int, below: int) -> list[int]:
        """``branch_spaced``: the input positions it checkpoints above ``below`` (the deepest
        checkpoint on the request's chain), ascending."""
        return spaced_positions(input_len, branch, below, self.block_size, self.spaced_grids, self.min_gap)

    def wants_checkpoint(self, position: int, input_len: int, branch: int, final: bool = False, below: int = 0) -> bool:
        """Whether the policy checkpoints at ``position`` of an input of ``input_len`` tokens that
        left the cached prefixes at ``branch`` (block-aligned positions only). ``final``: the
        position is the last block boundary of a finishing request's tokens, reply included (a later
        turn that repeats the conversation hits there): ``branch_and_last``, ``branch_last_aligned``
        and ``branch_spaced`` take it, ``every_n_blocks`` only on its grid. ``below``: the deepest
        checkpoint on the request's chain below ``position`` (``branch_spaced`` keeps its gap from it)."""
        cfg, bs = self.config, self.block_size
        if position <= 0 or position % bs or not self.m.num_state_groups:
            return False
        if cfg.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS:
            return (position // bs) % cfg.every_n == 0
        wanted = self._wanted_positions(input_len, branch, below)
        return wanted is not None and (final or position in wanted)

    def _wanted_positions(self, input_len: int, branch: int, below: int) -> set[int] | None:
        """The input positions the policy checkpoints (None: ``none``, and ``every_n_blocks``, whose
        grid has no end): the one place each policy's positions are named."""
        cfg, bs = self.config, self.block_size
        if cfg.checkpoint is CheckpointPolicy.BRANCH_AND_LAST:
            return {branch, (input_len // bs) * bs}
        if cfg.checkpoint is CheckpointPolicy.BRANCH_LAST_ALIGNED:
            return {branch, *back_off_points(input_len, branch, bs, cfg.align_tokens)}
        if cfg.checkpoint is CheckpointPolicy.BRANCH_SPACED:
            return set(self.planned_checkpoints(input_len, branch, below))
        return None

    def next_checkpoint(self, num_tokens: int, input_len: int, branch: int, below: int = 0) -> int | None:
        """The first position ``p`` with ``num_tokens < p <= input_len`` (on the block grid past
        ``num_tokens``'s block) where :meth:`wants_checkpoint` is true, or None; computed from the
        policy's positions, not by asking at every block. ``below``: as for :meth:`wants_checkpoint`."""
        cfg, bs = self.config, self.block_size
        lo = (num_tokens // bs + 1) * bs
        if lo > input_len or not self.m.num_state_groups:
            return None
        if cfg.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS:
            step = cfg.every_n * bs
            p = -(-lo // step) * step
            return p if p <= input_len else None
        wanted = self._wanted_positions(input_len, branch, below)
        if wanted is None:
            return None
        found = [p for p in wanted if lo <= p <= input_len and p % bs == 0]
        return min(found) if found else None

    def deepest_checkpoint(self, keys: list[int], end: int | None = None) -> int:
        """Token position of the deepest checkpoint among the chain ``keys[:end]`` (0: none)."""
        n = len(keys) if end is None else min(max(end, 0), len(keys))
        if not n or not self._ck_ids:
            return 0
        get, ck = self._slot.get, self._ck
        for i in range(n - 1, max(n - 5, -1), -1):  # the chain's end first (a request's own checkpoint)
            slot = get(keys[i])
            if slot is not None and ck[slot] >= 0:
                return (i + 1) * self.block_size
        n -= 4  # none in the last four blocks
        if n <= 0:
            return 0
        slots = self._chain_slots(keys)[:n]
        held = ((slots >= 0) & (self._ck[np.maximum(slots, 0)] >= 0)).nonzero()[0]
        return (int(held[-1]) + 1) * self.block_size if held.size else 0

    def has_checkpoint(self, key: int) -> bool:
        slot = self._slot.get(key)
        return slot is not None and self._ck[slot] >= 0

    def checkpoint_protect(self, key: int) -> tuple[int, np.ndarray] | None:
        """None when node ``key`` holds a checkpoint already; else its slot (-1: no node, see
        :meth:`ensure`) and what the eviction that makes room for a checkpoint there must keep: the
        KV block the node caches (empty if none). Kept, that block keeps the node (eviction removes
        only the nodes of its victims), so the slot stays valid across that eviction."""
        slot = self._slot.get(key)
        if slot is None:
            return -1, _EMPTY
        if self._ck[slot] >= 0:
            return None
        return slot, (self._kv[slot : slot + 1].copy() if self._kv[slot] else _EMPTY)

    def add_checkpoint(self, slot: int, blocks: np.ndarray) -> None:
        """Node ``slot`` (from :meth:`ensure`) now holds the checkpoint ``blocks`` (flat state set ids)."""
        key = int(self._key[slot])
        assert self._ck[slot] < 0 and self._pos[slot] > 0  # a node, without a checkpoint
        ck = int(blocks[0])
        self._ck[slot] = ck
        self._ck_ids[ck] = blocks
        self._ck_node[ck] = slot
        self._ck_live[ck] = True
        self._tick += 1  # _now()
        self._ticks[ck] = self._tick
        self._ck_order[ck] = order = self._order  # _next_order(1)
        self._order += 1
        self._enqueue_one(-1 - ck, order)
        if self._rank_flops:
            self._lfpb[ck] = math.log1p(prefill_flops(self._flops, int(self._pos[slot])) / self._ckpt_bytes)
        if self._bare:
            self._bare.pop(key, None)
        self.pinned[key] = self.m.pin_epoch
        kernels.put(self.m.use, blocks, BlockUse.CHECKPOINT.value)
        self.stats.checkpoints_made += 1

    def check(self) -> list[str]:
        """Problems with the cache's own books (slots, block and checkpoint arrays); used by
        ``check_integrity``."""
        problems = []
        slots = np.fromiter(self._slot.values(), dtype=np.int64, count=len(self._slot))
        keys = np.fromiter(self._slot.keys(), dtype=np.int64, count=len(self._slot))
        if not np.array_equal(self._key[slots], keys):
            problems.append("the prefix cache's key -> slot map disagrees with its slots")
        free = self._free[: self._n_free]
        if np.unique(free).size != free.size or np.isin(free, slots).any():
            problems.append("a node slot is both free and in use")
        kv = self._kv[slots]
        mapped = np.flatnonzero(self._node_of >= 0)
        if mapped.size != self._n_mapped or not np.array_equal(np.sort(kv[kv > 0]), mapped):
            problems.append("cached KV blocks and the nodes holding them disagree")
        elif not np.array_equal(self._node_of[kv[kv > 0]], slots[kv > 0]):
            problems.append("a cached KV block is not mapped to its node")
        if int(self._kv_evictable.sum()) != self._n_evictable or (self._kv_evictable & (self._node_of < 0)).any():
            problems.append("the prefix cache's evictable KV blocks are miscounted or not cached")
        ck = self._ck[slots]
        held = slots[ck >= 0]
        live = np.zeros_like(self._ck_live)
        live[self._ck[held]] = True
        if (
            held.size != len(self._ck_ids)
            or not np.array_equal(live, self._ck_live)
            or any(self._ck_node.get(int(self._ck[s])) != s for s in held.tolist())
            or any(int(ids[0]) != c for c, ids in self._ck_ids.items())
        ):
            problems.append("the prefix cache's checkpoints and the nodes holding them disagree")
        empty = slots[(kv == 0) & (ck < 0)]
        if empty.size and (not self._bare or any(int(k) not in self._bare for k in self._key[empty])):
            problems.append(f"chain node {int(self._key[empty[0]])} holds nothing and is not bounded (leak)")
        bare_slots = [self._slot.get(k) for k in self._bare]
        if len(self._bare) > self._bare_cap or any(s is None or self._kv[s] or self._ck[s] >= 0 for s in bare_slots):
            problems.append("bare chain nodes over their bound or holding blocks")
        queued = self._fifo[self._live_queue()]
        kv_q, ck_q = queued[queued >= 0], -1 - queued[queued < 0]
        if (kv_q.size != self._n_evictable or np.unique(kv_q).size != kv_q.size or ck_q.size != len(self._ck_ids)
                or set(ck_q.tolist()) != set(self._ck_ids)):
            problems.append("the LRU queue disagrees with the evictable KV blocks and checkpoints")
        if any(not self.has_checkpoint(k) for k in self.pinned):
            problems.append("a pinned key has no checkpoint")
        return problems

    # ---- eviction ----------------------------------------------------------------------------
    def evict(
        self,
        num_blocks: int,
        protect: np.ndarray = _EMPTY,
        protect_ckpt: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> np.ndarray:
        """Evict units until at least ``num_blocks`` blocks are freed; returns the freed ids.

        ``protect``: KV block ids that stay (the hit being taken); ``protect_ckpt``: node keys whose
        checkpoints stay. The caller has checked that enough is evictable.
        """
        if num_blocks <= 0:
            return np.empty(0, dtype=np.int32)
        target = max(num_blocks, int(self.config.evict_batch_fraction * self.m.pool.num_usable))
        target = max(num_blocks, min(target, self.num_evictable - self.num_protected(protect, protect_ckpt)))
        if self.config.eviction is EvictionPolicy.LRU:
            kv, ck = self._lru_victims(target, protect, protect_ckpt)
        else:
            kv, ck = self._flop_aware_victims(target, protect, protect_ckpt)
        ids = self._drop_all(kv, ck)
        kernels.put(self.m.pool.ref_counts, ids, 0)
        kernels.put(self.m.use, ids, BlockUse.FREE.value)
        return ids

    def _held_checkpoints(self, protect_ckpt: set[int]) -> list[int]:
        """Slots of the checkpoints eviction may not take: protected or pinned."""
        return [int(self._ck[s]) for k in (*protect_ckpt, *self.pinned)
                if (s := self._slot.get(k)) is not None and self._ck[s] >= 0]  # fmt: skip

    def _enqueue_one(self, code: int, order: int) -> None:
        """:meth:`_enqueue` of one entry (a checkpoint made or hit), without building arrays."""
        if self._tail < self._fifo.size:
            self._fifo[self._tail] = code
            self._fifo_ord[self._tail] = order
            self._tail += 1
        else:
            self._enqueue(np.array([code], dtype=np.int64), np.array([order], dtype=np.int64))

    def _enqueue(self, blocks: np.ndarray, orders: np.ndarray) -> None:
        """Append evictable KV blocks (with their LRU orders, ascending) to the queue."""
        n = blocks.size
        if self._tail + n > self._fifo.size:
            self._repack(n, front=False)
        self._fifo[self._tail : self._tail + n] = blocks
        self._fifo_ord[self._tail : self._tail + n] = orders
        self._tail += n

    def _enqueue_front(self, codes: np.ndarray, orders: np.ndarray) -> None:
        """Put entries (orders below every queued one, ascending) at the front of the LRU queue."""
        n = codes.size
        if self._head < n:
            self._repack(n, front=True)
        self._head -= n
        self._fifo[self._head : self._head + n] = codes
        self._fifo_ord[self._head : self._head + n] = orders

    def _repack(self, n: int, front: bool) -> None:
        """Rebuild the queue from its live entries (same order), with room for ``n`` more at the back,
        or at both ends (``front``), growing it if it is still short."""
        live = self._live_queue()
        size = max(self._fifo.size, 2 * (live.size + n))
        start = (size - live.size) // 2 if front else 0  # front: >= n free before and after
        fifo, ords = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
        fifo[start : start + live.size], ords[start : start + live.size] = self._fifo[live], self._fifo_ord[live]
        self._fifo, self._fifo_ord, self._head, self._tail = fifo, ords, start, start + live.size

    def _live_queue(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """Queue positions in ``[start, end)`` (default: all) whose entries are live."""
        start = self._head if start is None else start
        end = self._tail if end is None else end
        code, order = self._fifo[start:end], self._fifo_ord[start:end]
        unit = np.where(code >= 0, code, (self._node_of.size - 1) - code)  # -1 - slot -> nb + slot
        live = self._q_live[unit]
        live &= self._q_order[unit] == order
        return live.nonzero()[0] + start

    def num_protected(self, protect: np.ndarray, protect_ckpt: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Evictable blocks that ``evict(..., protect, protect_ckpt)`` may not take."""
        if protect.size == 1:  # (a checkpoint's node: a scalar read, not a gather)
            n = int(self._kv_evictable[protect[0]])
        else:
            n = int(np.count_nonzero(self._kv_evictable[protect])) if protect.size else 0
        for key in protect_ckpt:
            s = self._slot.get(key)
            if s is not None and self._ck[s] >= 0 and key not in self.pinned:
                n += self.m.num_state_blocks
        return n

    def _lru_victims(self, target: int, protect: np.ndarray, protect_ckpt: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """Least recently used first, off the front of the LRU queue: KV blocks by their release (a
        chain's tail first) and checkpoints by their last use, in one order; protected KV blocks,
        protected and pinned checkpoints are passed over (and stay queued)."""
        held = [-1 - ck for ck in self._held_checkpoints(protect_ckpt)]  # their queue codes
        nsb, nb = self.m.num_state_blocks, self._node_of.size
        passed = self._passed  # marked for this call, cleared before returning
        any_passed = bool(protect.size or held)
        if any_passed:
            marks = np.array(protect.tolist() + held, dtype=np.int64)
            marks += nb
            passed[marks] = True
        if kernels.ENABLED:  # the same victims and queue, in one compiled scan
            out = np.empty((2, min(self._tail - self._head, target)), dtype=np.int64)  # (each victim frees >= 1)
            n_kv, n_ck, self._head = kernels.lru_victims(
                self._fifo, self._fifo_ord, self._head, self._tail, self._q_live, self._q_order, passed, nb, nsb,
                target, marks.size if any_passed else 0, out)
            if any_passed:
                passed[marks] = False
            return out[0, :n_kv], out[1, :n_ck]
        parts, held_parts, end, step, got, n_ck = [], [], self._head, target + target // 4 + 64, 0, 0
        while got < target and end < self._tail:  # live, unprotected entries from the front
            stop = min(end + step, self._tail)
            pos = self._live_queue(end, stop)
            code = self._fifo[pos]
            if any_passed:
                mask = passed[code + nb]
                if mask.any():  # passed over: they stay queued, in order
                    held_parts.append(pos[mask])
                    keep = ~mask
                    pos, code = pos[keep], code[keep]
            parts.append(code)
            parts.append(pos)
            k = int(np.count_nonzero(code < 0))  # checkpoints among them
            n_ck += k
            got += code.size + k * (nsb - 1)
            end = stop
        if any_passed:
            passed[marks] = False
        if not parts:
            return _EMPTY, _EMPTY
        code = np.concatenate(parts[::2]) if len(parts) > 2 else parts[0]
        pos = np.concatenate(parts[1::2]) if len(parts) > 2 else parts[1]
        if n_ck:  # the shortest prefix that frees target blocks
            count = int(np.where(code >= 0, 1, nsb).cumsum().searchsorted(target)) + 1
        else:  # KV blocks only: one block each
            count = target
        if pos.size:  # the queue's front up to the last victim keeps only its passed-over live entries
            last = int(pos[min(count, pos.size) - 1])
            keep = np.concatenate(held_parts) if held_parts else _EMPTY
            if keep.size:
                keep = keep[keep <= last]
            new_head = last + 1 - keep.size
            self._fifo[new_head : last + 1] = self._fifo[keep]
            self._fifo_ord[new_head : last + 1] = self._fifo_ord[keep]
            self._head = new_head
        victims = code[:count]
        if not n_ck:
            return victims, _EMPTY
        return victims[victims >= 0], -1 - victims[victims < 0]

    def _flop_aware_victims(
        self, target: int, protect: np.ndarray, protect_ckpt: set[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Lowest utility first: ``alpha * norm(log1p(FLOPs saved per byte)) + norm(recency)`` over
        all candidates (evictable KV blocks and live checkpoints, less the protected and pinned
        ones). A checkpoint saves the FLOPs of the prefix it ends, a KV block those of its own
        tokens; FLOPs per byte spans orders of magnitude, so it is compared on a log scale (the log
        is taken once, when the block or checkpoint enters the cache). Ties go to KV blocks (lowest
        id first), then to checkpoints (least recently used first)."""
        cand = np.logical_or(self._kv_evictable, self._ck_live, out=self._cand)  # by block id: one gather each
        if protect.size:
            cand[protect] = False
        held = self._held_checkpoints(protect_ckpt)
        if held:
            cand[held] = False
        if kernels.ENABLED:  # the same victims, in one compiled pass
            return kernels.flop_aware_victims(self._cand_words, self._ck_live, self._ticks, self._lfpb,
                                              float(self.config.alpha), int(target), self.m.num_state_blocks,
                                              self._cand_ids)
        ids = cand.nonzero()[0]
        if not ids.size:
            return _EMPTY, _EMPTY
        tick = self._ticks[ids]
        utility = _norm(self._lfpb[ids])  # alpha * norm(lfpb) + norm(tick), in place
        utility *= self.config.alpha
        utility += _norm(tick)
        # the victims are a prefix of the order by utility, at most ``target`` candidates long
        # (each frees >= 1 block): rank only the candidates at or below the target-th utility
        # (ties included), which is that prefix exactly
        k = min(utility.size, target)
        if k < utility.size:
            near = (utility <= np.partition(utility, k - 1)[k - 1]).nonzero()[0]
            ids, utility, tick = ids[near], utility[near], tick[near]
        # by utility, then KV blocks before checkpoints, KV blocks by id, checkpoints by tick
        # (distinct): a stable sort by utility is that order (the ids ascend) unless a checkpoint
        # ties with another candidate (KV blocks tie often: demoted tails share tick 0; the oldest
        # checkpoint at the highest FLOPs and the newest KV block at the lowest both rank 1.0)
        order = utility.argsort(kind="stable")
        is_ck = self._ck_live[ids[order]]
        u = utility[order]
        tie = u[1:] == u[:-1]
        if tie.any():
            bad = (tie & (is_ck[1:] | is_ck[:-1])).nonzero()[0]  # sorted positions i, i + 1 tie, one a checkpoint
            if bad.size:
                order = self._order_ties(order, tie, bad, ids, tick)
                is_ck = self._ck_live[ids[order]]
        ids = ids[order]
        size = np.where(is_ck, self.m.num_state_blocks, 1)  # blocks each frees
        n = int(size.cumsum().searchsorted(target)) + 1  # the shortest prefix freeing target
        ids, is_ck = ids[:n], is_ck[:n]
        return ids[~is_ck], ids[is_ck]

    def _order_ties(self, order: np.ndarray, tie: np.ndarray, bad: np.ndarray, ids: np.ndarray,
                    tick: np.ndarray) -> np.ndarray:
        """``order`` (a stable sort by utility of candidates ``ids``) with each group of equal
        utilities that holds a checkpoint (``bad``: sorted positions that tie with the next, one
        of them a checkpoint) put in the ranking's order: KV blocks by id, then checkpoints by
        tick. A few groups (the usual case: the oldest checkpoint and the newest cheapest KV block
        both at utility 1.0) are sorted group by group; many, all at once."""
        # the secondary key, in sorted order: a KV block's id (below nb), nb + a checkpoint's tick
        key = np.where(self._ck_live[ids], tick + self._node_of.size, ids)[order]
        if bad.size > 8:  # every group by the secondary key, the groups in place
            group = np.concatenate(([0], np.cumsum(~tie)))
            return order[np.lexsort((key, group))]
        order, end = order.copy(), -1
        for i in bad.tolist():
            if i <= end:  # in the group just sorted
                continue
            start, end = i, i + 1
            while start and tie[start - 1]:
                start -= 1
            while end < tie.size and tie[end]:
                end += 1
            order[start : end + 1] = order[start : end + 1][key[start : end + 1].argsort(kind="stable")]
        return order

    def _drop_all(self, kv: np.ndarray, ck_slots: np.ndarray) -> np.ndarray:
        """Drop the KV blocks ``kv`` and the checkpoints ``ck_slots``; the freed ids (KV first, in
        victim order)."""
        parts = [kv.astype(np.int32)]
        if kv.size:
            slots = self._node_of[kv]
            self._kv[slots] = 0
            self._node_of[kv] = -1
            self._n_mapped -= int(kv.size)
            self._kv_evictable[kv] = False
            self._n_evictable -= int(kv.size)
            self.stats.kv_evicted += int(kv.size)
            self._remove_nodes(slots[self._ck[slots] < 0])
        for ck in ck_slots.tolist():
            parts.append(self._drop_checkpoint(ck))
        return np.concatenate(parts)

    def _drop_checkpoint(self, ck: int) -> np.ndarray:
        """Drop the checkpoint in slot ``ck``; its block ids (the node goes if it holds nothing now)."""
        ids = self._ck_ids.pop(ck)
        slot = self._ck_node.pop(ck)
        self._ck[slot] = -1
        self._ck_live[ck] = False
        self.stats.checkpoints_evicted += 1
        if not self._kv[slot]:  # the node holds nothing now
            key = int(self._key[slot])
            del self._slot[key]
            if self._bare:
                self._bare.pop(key, None)
            self._free_slot(slot)
        return ids

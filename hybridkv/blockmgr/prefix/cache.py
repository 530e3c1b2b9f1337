"""The :class:`PrefixCache` the manager owns: matching a request's tokens, taking a hit, the pins of
checkpoints whose copies have not run, and the integrity check of the cache's own books. It stands on
the parts below it (index -> placement -> eviction -> registration), each one subject."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr.hashing import (  # _C, _MASK: the chain's constants, inlined in _register_few
    ROOT_KEY,
    TokenArray,
    as_token_array,
    chain_keys_array,
    key_from_hash,
    keys_from_hashes,
)
from hybridkv.blockmgr.prefix.config import _EMPTY, PrefixHit, _miss
from hybridkv.blockmgr.prefix.registration import Registration
from hybridkv.blockmgr.records import BlockUse


class PrefixCache(Registration):
    """The cache's books; all block movements go through the manager's pool and ``use`` bytes."""

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
        if self.host._has_kv and key_from_hash(int(h[0]), ROOT_KEY) not in self._slot:
            return _miss()  # the first block is not cached: a miss
        karr = keys_from_hashes(h[:limit])
        keys = karr.tolist()
        slots = self._lookup(karr if self._fast else keys)
        ok = self._verified(slots, tokens)
        if not self.host._has_kv:
            return self._match_state_only(keys, slots, ok, max_blocks)
        s = np.where(ok, slots, 0)
        ok &= self._kv[s] > 0
        n = limit if ok.all() else int(np.argmin(ok))  # the cached chain: blocks [0, n)
        m = min(n, max_blocks)
        if self.host.num_state_groups == 0:
            best = m
        else:
            with_ck = np.flatnonzero(self._ck[s[:m]] >= 0)
            best = int(with_ck[-1]) + 1 if with_ck.size else 0
        if not best:
            return _miss(n * bs)
        kv = self._kv[s[:best]].copy()
        if not self.host.num_state_groups:
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
        if self.host._has_kv and tokens.size > bs and chain_keys_array(tokens, bs, 0, 1)[0] not in self._slot:
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
        ids = hit.kv_blocks if self.host._has_kv else _EMPTY
        if ids.size:
            self._ticks[ids] = now
            self._n_evictable -= int(np.count_nonzero(self._kv_evictable[ids]))
            self._kv_evictable[ids] = False
            self.host.pool.incref(ids)
            self.host.use[ids] = BlockUse.KV
        if hit.checkpoint_key is not None:
            ck = int(self._ck[self._slot[hit.checkpoint_key]])
            self._ticks[ck] = now
            self._ck_order[ck] = order = self._next_order(1)
            self._enqueue_one(-1 - ck, order)
            self.pinned[hit.checkpoint_key] = self.host.pin_epoch
        self.stats.hit_tokens += hit.num_tokens
        return ids

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

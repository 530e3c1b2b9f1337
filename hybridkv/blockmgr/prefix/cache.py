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

HELD = 1 << 62  # the pin of a checkpoint held by its request (PrefixCache.hold), never released by epoch

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
        tier = self.tier if self.tier is not None and self.tier.num_units else None
        if limit <= 0 or not (self._slot or tier is not None):
            return _miss()
        h = memo.block_hashes(limit, bs)
        if self.host._has_kv and self._uncached_first(key_from_hash(int(h[0]), ROOT_KEY)):
            return _miss()  # the first block is not cached: a miss
        karr = keys_from_hashes(h[:limit])
        keys = karr.tolist()
        slots = self._lookup(karr if self._fast else keys)
        ok = self._verified(slots, tokens)
        if not self.host._has_kv:
            return self._match_state_only(keys, slots, ok, max_blocks, tokens if tier is not None else None)
        s = np.where(ok, slots, 0)
        if tier is not None:
            return self._match_tiered(keys, slots, s, ok, tokens, limit, max_blocks)
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

    def _uncached_first(self, key: int) -> bool:
        """Whether the chain's first block (key ``key``) is cached neither on the device nor on the host."""
        return key not in self._slot and (self.tier is None or key not in self.tier.kv)

    def _match_tiered(self, keys: list[int], slots: np.ndarray, s: np.ndarray, ok: np.ndarray, tokens: np.ndarray,
                      limit: int, max_blocks: int) -> PrefixHit:
        """:meth:`match` of a KV model with the host tier: a block is cached when its KV is on the
        device or (its node absent or without KV) on the host; a checkpoint, when it is on either
        (the device's preferred). Host-resident blocks and checkpoint are named in the hit."""
        tier = self.tier
        assert tier is not None
        bs = self.block_size
        dev = ok & (self._kv[s] > 0)
        host = tier.kv_blocks(keys, tokens)
        host[dev | ((slots >= 0) & ~ok)] = -1  # on the device, or a device node with other tokens: not from the host
        avail = dev | (host >= 0)
        n = limit if avail.all() else int(np.argmin(avail))  # the cached chain: blocks [0, n)
        m = min(n, max_blocks)
        host_ck = None
        ck_key = None
        if self.host.num_state_groups == 0:
            best = m
        else:
            dev_ck = ok[:m] & (self._ck[s[:m]] >= 0)
            best = 0
            for j in range(m - 1, -1, -1):
                if dev_ck[j]:
                    best, ck_key = j + 1, keys[j]
                    break
                if tier.ck:
                    ids = tier.checkpoint_at(keys[j], tokens[j * bs : (j + 1) * bs])
                    if ids is not None:
                        best, host_ck = j + 1, ids
                        break
        if not best:
            return _miss(n * bs)
        on_dev = dev[:best]
        kv = self._kv[s[:best]][on_dev]
        host_index = (~on_dev).nonzero()[0]
        host_kv = host[host_index].astype(np.int32)
        ck_ids = self._ck_ids[int(self._ck[s[best - 1]])] if ck_key is not None else None
        return PrefixHit(best * bs, kv, ck_key, n * bs, keys[:best], ck_ids, host_index, host_kv, host_ck)

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
        if self.host._has_kv and tokens.size > bs and self._uncached_first(int(chain_keys_array(tokens, bs, 0, 1)[0])):
            return None
        self._recent = memo = TokenArray(tokens)
        return memo

    def _match_state_only(self, keys: list[int], slots: np.ndarray, ok: np.ndarray, max_blocks: int,
                          tokens: np.ndarray | None = None) -> PrefixHit:
        """No KV: a hit needs only the deepest checkpoint on the request's chain (chain keys hash
        every earlier block, and that block's tokens are compared); the branch point is the deepest
        block any cached chain reached (bare nodes may have been trimmed: an estimate). ``tokens``
        (with the host tier): a checkpoint on the host counts too, when it is deeper."""
        if tokens is not None and self.tier is not None and self.tier.ck:
            bs = self.block_size
            for j in range(min(len(keys), max_blocks) - 1, -1, -1):
                if ok[j] and self._ck[slots[j]] >= 0:
                    break  # the deepest checkpoint on the device is at least as deep
                ids = self.tier.checkpoint_at(keys[j], tokens[j * bs : (j + 1) * bs])
                if ids is not None:
                    found = np.flatnonzero(ok)
                    matched = max(int(found[-1]) + 1 if found.size else 0, j + 1)
                    return PrefixHit((j + 1) * bs, _EMPTY, None, matched * bs, keys[: j + 1], None,
                                     _EMPTY, _EMPTY, ids)
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
        if hit.host_kv.size:
            self.stats.hit_tokens_host += int(hit.host_kv.size) * self.block_size
        if hit.checkpoint_key is not None:
            ck = int(self._ck[self._slot[hit.checkpoint_key]])
            self._ticks[ck] = now
            self._ck_order[ck] = order = self._next_order(1)
            self._enqueue_one(-1 - ck, order)
            self._reads[hit.checkpoint_key] = self.host.pin_epoch
            if self.pinned.get(hit.checkpoint_key) != HELD:  # (a held one stays held by its request)
                self.pinned[hit.checkpoint_key] = self.host.pin_epoch
        self.stats.hit_tokens += hit.num_tokens
        return ids

    def cancel_checkpoints(self, epoch: int) -> np.ndarray:
        """Drop the checkpoints pinned in ``epoch`` (taken then, their copies not yet handed to an
        executor); returns their block ids (the caller frees them and drops the copies). A checkpoint a
        hit's copy reads (not yet run) is kept: dropping it would free the copy's source."""
        keys = [k for k, e in self.pinned.items() if e == epoch and k not in self._reads]
        parts = []
        for key in keys:
            del self.pinned[key]
            parts.append(self._drop_checkpoint(int(self._ck[self._slot[key]])))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def release_pins(self, before: int | None = None, since: int = 0) -> None:
        """The copies reading or writing checkpoints pinned in epochs ``< before`` (all: None) ran;
        checkpoints pinned in epochs ``< since`` stay unevictable (a later call releases them)."""
        if self.rules.queues_on_release and self.pinned:  # queued when their pin is released
            done = [k for k, e in self.pinned.items() if (before is None or e < before) and since <= e < HELD]
            self._requeue_checkpoints(done)
        if before is None and not since and HELD not in self.pinned.values():
            self.pinned.clear()
            self._reads.clear()
        elif self.pinned:  # (held ones stay: their requests release them)
            self.pinned = {k: e for k, e in self.pinned.items()
                           if (before is not None and e >= before) or e < since or e == HELD}  # fmt: skip
            self._reads = {k: e for k, e in self._reads.items() if (before is not None and e >= before) or e < since}

    def held_release_frees(self, key: int) -> bool:
        """Whether :meth:`release_held` makes node ``key``'s checkpoint evictable at once (it is
        held, and no hit's copy still reads it)."""
        return self.pinned.get(key) == HELD and key not in self._reads

    def hold(self, key: int) -> None:
        """Pin the checkpoint of node ``key`` until :meth:`release_held`: a request's lent live sets
        (``in_place_state``), held until the request's next step."""
        self.pinned[key] = HELD

    def detach_held(self, key: int) -> np.ndarray:
        """Take the held checkpoint of node ``key`` out of the cache (its request keeps running in
        those sets); returns its block ids."""
        self.pinned.pop(key, None)
        return self._drop_checkpoint(int(self._ck[self._slot[key]]), evicted=False)

    def caches_block(self, block: int) -> bool:
        """Whether KV block ``block`` is the cached copy of a node (held by requests or evictable):
        its bytes are that node's tokens, so no request may write into it."""
        return bool(self._node_of[block] >= 0)

    def checkpoint_ids(self, key: int) -> np.ndarray | None:
        """The flat block ids of node ``key``'s checkpoint, or None when it has none."""
        slot = self._slot.get(key)
        if slot is None or self._ck[slot] < 0:
            return None
        return self._ck_ids[int(self._ck[slot])]

    def note_read(self, key: int, epoch: int) -> None:
        """A copy handed out in pin ``epoch`` (not a hit's: a fork's, an append's, a swap's) reads or
        writes the blocks of node ``key``'s checkpoint, made where those blocks were (no copy of its
        own): it stays unevictable and is never cancelled until that epoch's copies ran."""
        self._reads[key] = max(self._reads.get(key, 0), epoch)
        if self.pinned.get(key, 0) < epoch:  # (a held one stays held)
            self.pinned[key] = epoch

    def release_held(self, key: int) -> None:
        """End :meth:`hold`: the checkpoint is evictable, at the back of the LRU queue (or, while a
        copy not yet run reads it, when its epoch is released)."""
        if self.pinned.get(key) == HELD:
            read = self._reads.get(key)
            if read is not None:  # a hit's copy still reads it: its epoch releases it (and queues it)
                self.pinned[key] = read
            else:
                del self.pinned[key]
                self._requeue_checkpoints([key])

    def _requeue_checkpoints(self, keys: list[int]) -> None:
        """Put the checkpoints of nodes ``keys`` at the back of the LRU queue (a held checkpoint, or
        one of a policy that ``queues_on_release``: its sets are the request's until then)."""
        for key in keys:
            slot = self._slot.get(key)
            if slot is None or self._ck[slot] < 0:
                continue
            ck = int(self._ck[slot])
            self._ck_order[ck] = order = self._next_order(1)
            self._enqueue_one(-1 - ck, order)

    def adopt(self, keys: list[int], tokens: np.ndarray, index: np.ndarray, blocks: np.ndarray) -> None:
        """A host hit's onloaded KV: block ``index[i]`` of the chain ``keys`` (tokens ``tokens``) is
        cached again in the device block ``blocks[i]`` (referenced by the hit's request; its copy
        host -> device runs before any forward reads it). Nodes are created where missing."""
        if not index.size:
            return
        bs = self.block_size
        karr = np.array([keys[j] for j in index.tolist()], dtype=np.int64)
        slots = self._lookup(karr if self._fast else karr.tolist())
        miss = (slots < 0).nonzero()[0]
        if miss.size:
            j = index[miss]
            rows = tokens[: (int(index[-1]) + 1) * bs].reshape(-1, bs)[j]
            slots[miss] = self._new_slots(karr[miss], (j + 1) * bs, rows)
        if self._bare:
            for k in karr.tolist():
                self._bare.pop(k, None)
        self._map_kv(slots, blocks)

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
        unmapped = self._kv_evictable & (self._node_of < 0)
        if int(self._kv_evictable.sum()) != self._n_evictable or (unmapped != self._stale).any():
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
        if self.tier is not None:
            problems += self.tier.check()
        return problems

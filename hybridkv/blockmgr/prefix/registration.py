"""Registration: computed blocks enter the chain (a scalar path for a few blocks, a compiled one,
an array path for many), checkpoints are added, and released KV blocks become evictable."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.hashing import (  # _C, _MASK: the chain's constants, inlined in _register_few
    _C,
    _C64,
    _MASK,
    ROOT_KEY,
    TokenArray,
    as_token_array,
    block_hashes,
    chain_key,
    chain_keys_array,
    key_from_hash,
    keys_from_hashes,
)
from hybridkv.blockmgr.prefix import kernels as prefix_kernels
from hybridkv.blockmgr.prefix.config import _EMPTY, _FEW, _TWO64
from hybridkv.blockmgr.prefix.eviction import Eviction
from hybridkv.blockmgr.records import BlockUse
from hybridkv.models.flops import prefill_flops


class Registration(Eviction):
    """Blocks and checkpoints entering the cache; released blocks becoming evictable."""

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
        few = end - start <= _FEW and self.host._has_kv  # a prefill chunk, a decode block: scalar path
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
        if not self.host._has_kv:
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
        """:meth:`_register_few` in one compiled call (:func:`~hybridkv.blockmgr.prefix.kernels.register_few`,
        the same books). False, with nothing changed, when the free slots or the key map's room
        could run short (the caller grows them as the scalar path does) or, with ``check``, when
        the chain's last key (the parent) has no node (the caller re-creates it)."""
        sm, out, (lin, quad), n = self._slot, self._reg_out, self._flops, h.size
        n_free, created, mapped = prefix_kernels.register_few(
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
        while i > 0 and self.host._has_kv and keys[i - 1] not in self._slot:  # state-only: no chain needed
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
        if self.host._has_kv:
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

    def release(self, ids: np.ndarray, chain: list[int] | None = None, twins: np.ndarray = _EMPTY) -> np.ndarray:
        """KV blocks whose count reached zero: cached ones become evictable; returns the rest.

        ``twins``: of ``ids``, second copies (:meth:`twins`) that stay evictable too, on no node,
        queued with the rest, as vLLM's block hash table keeps every copy of a block until it is
        evicted (matching finds the node's copy; evicting a twin loses nothing).

        ``chain``: the chain keys of the request releasing them, if it is one request's chain. With
        ``demote_tail`` (hybrid models), the released blocks past the deepest checkpoint on that chain
        (without ``chain``: among the released blocks) go to the front of the LRU queue: no hit can
        end there, they only mark where a branch would leave the cached prefix."""
        if not self._n_mapped or ids.size == 0:
            return ids
        now = self._now()
        keep = self._node_of[ids] >= 0
        if twins.size:
            self._stale[twins] = True
            keep |= np.isin(ids, twins)
        kept = ids[keep]
        if kept.size:
            # a request's blocks come in chain order; queue the tail first, so that among blocks
            # released together LRU takes a chain's end before its root (which would orphan the rest)
            first = self._next_order(kept.size)
            queued = kept[::-1]
            self._kv_order[queued] = orders = np.arange(first, first + kept.size)
            self.host.use[kept] = BlockUse.CACHED_KV
            self._kv_evictable[kept] = True
            self._n_evictable += int(kept.size)
            self._ticks[kept] = now
            dead = self._dead_tail(kept, chain) if self.config.demote_tail and self.host.num_state_groups else None
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

    def twins(self, ids: np.ndarray, chain: list[int]) -> np.ndarray:
        """Of a request's KV blocks ``ids`` (in chain order, the first ``len(chain)`` full and
        registered under ``chain``), those that are second copies: on no node, while their node
        caches another block (the request computed the block while another request's copy was
        held, so :meth:`register` left its own private). None with ``demote_tail``, whose queue
        order reads each released block's node."""
        k = min(len(chain), ids.size)
        if not k or not self._n_mapped or self.config.demote_tail:
            return _EMPTY
        own = ids[:k]
        private = self._node_of[own] < 0
        if not private.any():
            return _EMPTY
        slots = self._lookup(chain[:k])
        node_kv = np.where(slots >= 0, self._kv[np.maximum(slots, 0)], 0)
        twin = private & (node_kv != 0) & (node_kv != own)
        return own[twin].astype(np.int64)

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
        self.pinned[key] = self.host.pin_epoch
        kernels.put(self.host.use, blocks, BlockUse.CHECKPOINT.value)
        self.stats.checkpoints_made += 1

    def adopt_copies(self, keys: list[int], kv_blocks: np.ndarray, start: int, end: int) -> np.ndarray:
        """Nodes of ``keys[start:end]`` whose cached KV block is evictable (no request holds it)
        while the request owning ``kv_blocks`` computed the same content into a block of its own
        (:meth:`register` left that one private) cache the request's block instead, so the copy that
        is released last is the one kept. The old blocks, on no node now, hold nothing a match can
        find: they are returned for the caller to give back to the pool, or, for rules that
        ``keeps_second_copies`` (vLLM's hash table keeps every copy and frees the newest last), stay
        evictable where they are in the LRU queue, evicted in their turn (then none is returned).
        Checkpoints stay on their nodes."""
        end = min(end, len(keys), kv_blocks.size)
        if end <= start or not self.host._has_kv:
            return _EMPTY
        slots = self._lookup(keys[start:end])
        blocks = kv_blocks[start:end].astype(np.int64)
        found = slots >= 0
        slots, blocks = slots[found], blocks[found]
        old = self._kv[slots].astype(np.int64)
        stale = (old != 0) & (old != blocks) & (self._node_of[blocks] < 0)
        stale &= self._kv_evictable[old]
        if not stale.any():
            return _EMPTY
        slots, blocks, old = slots[stale], blocks[stale], old[stale]
        self._node_of[old] = -1
        self._kv[slots] = blocks
        self._node_of[blocks] = slots
        if self._rank_flops:
            self._lfpb[blocks] = self._lfpb[old]
        if self.rules.keeps_second_copies:  # still evictable, queued where they were
            self._stale[old] = True
            return _EMPTY
        self._kv_evictable[old] = False  # (their queue entries are dead now)
        self._n_evictable -= int(old.size)
        return old.astype(np.int32)

"""Compiled loops of the prefix cache: the LRU queue's scan, ``flop_aware``'s ranking, the
registration of a few blocks into the key -> slot map, and the token comparison of a match. Used
when :data:`hybridkv.blockmgr.kernels.ENABLED`; each has a numpy twin in the part that calls it."""

from __future__ import annotations

import math

import numpy as np

from hybridkv.blockmgr.kernels import _jit
from hybridkv.blockmgr.prefix.slotmap import _km_index, _km_insert


@_jit
def rows_equal(tok, slots, tokens, out):  # type: ignore[no-untyped-def]
    """``out[j] &= tok[slots[j]] == tokens[j * bs : (j + 1) * bs]`` for each ``j`` where ``out[j]``
    (``bs``: ``tok``'s row length; a row stops at its first difference)."""
    bs = tok.shape[1]
    for j in range(slots.size):
        if out[j]:
            row, base = slots[j], j * bs
            for c in range(bs):
                if tok[row, c] != tokens[base + c]:
                    out[j] = False
                    break



# ---- LRU eviction ---------------------------------------------------------------------------------
@_jit
def lru_victims(fifo, ords, head, tail, q_live, q_order, passed, nb, ck_blocks, target, n_marks, out):  # type: ignore[no-untyped-def]
    """The victims of ``PrefixCache._lru_victims`` (see there), off the front of the queue
    ``fifo[head:tail]`` (codes: a KV block id, or ``-1 - checkpoint id``; ``ords``: their orders).
    An entry is live when ``q_live[unit]`` and ``q_order[unit] == ords[pos]`` (``unit``: the code,
    or ``nb + checkpoint id``); live entries marked in ``passed[code + nb]`` (``n_marks`` marks) are
    passed over and stay queued. The shortest prefix of the rest freeing ``target`` blocks (a
    checkpoint frees ``ck_blocks``) are the victims, in order: KV block ids into ``out[0]``,
    checkpoint ids into ``out[1]``; the queue's front up to the last victim keeps only its
    passed-over entries (moved up, in order). Returns ``(KV victims, checkpoint victims, new head)``."""
    held = np.empty(n_marks, dtype=np.int64)
    got, count, n_ck, nh, last = 0, 0, 0, 0, -1
    for p in range(head, tail):
        if got >= target:
            break
        code = fifo[p]
        unit = code if code >= 0 else (nb - 1) - code
        if not q_live[unit] or q_order[unit] != ords[p]:
            continue
        if n_marks and passed[code + nb]:
            held[nh] = p
            nh += 1
            continue
        if code >= 0:
            out[0, count - n_ck] = code
            got += 1
        else:
            out[1, n_ck] = -1 - code
            n_ck += 1
            got += ck_blocks
        count += 1
        last = p
    if not count:
        return 0, 0, head
    k = 0
    while k < nh and held[k] < last:
        k += 1
    keep_codes, keep_ords = fifo[held[:k]], ords[held[:k]]  # (copies: the moves may overlap)
    new_head = last + 1 - k
    for i in range(k):
        fifo[new_head + i] = keep_codes[i]
        ords[new_head + i] = keep_ords[i]
    return count - n_ck, n_ck, new_head


# ---- flop_aware ranking ---------------------------------------------------------------------------
@_jit
def _before(u, k, a, b):  # type: ignore[no-untyped-def]
    """Whether position ``a`` sorts before ``b`` by ``(u, k, position)``."""
    if u[a] != u[b]:
        return u[a] < u[b]
    if k[a] != k[b]:
        return k[a] < k[b]
    return a < b


@_jit
def _sort_by(u, k):  # type: ignore[no-untyped-def]
    """The positions ``0..n-1`` ordered by ``(u, k, position)``: a bottom-up merge sort (one
    pass over a composite order, instead of stable sorts one key at a time)."""
    n = u.size
    a = np.arange(n)
    b = np.empty(n, dtype=np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j, o = lo, mid, lo
            while i < mid and j < hi:
                if _before(u, k, a[j], a[i]):
                    b[o] = a[j]
                    j += 1
                else:
                    b[o] = a[i]
                    i += 1
                o += 1
            while i < mid:
                b[o] = a[i]
                i += 1
                o += 1
            while j < hi:
                b[o] = a[j]
                j += 1
                o += 1
        a, b = b, a
        width *= 2
    return a


@_jit
def flop_aware_victims(cand, is_ck, ticks, lfpb, alpha, target, ck_blocks, buf):  # type: ignore[no-untyped-def]
    """The victims of ``PrefixCache._flop_aware_victims`` (see there): candidates are the ids where
    ``cand`` is set (a KV block, or a checkpoint's first block where ``is_ck``); utility
    ``alpha * norm(lfpb) + norm(ticks)`` over them, computed with the same operations in the same
    order as the numpy path (so the same floats); order by utility, then KV blocks by id, then
    checkpoints by tick (then id); the shortest prefix freeing ``target`` blocks (a checkpoint frees
    ``ck_blocks``). ``cand``'s size is a multiple of 8 (padded with False); ``buf``: int64 scratch of
    its size. Returns ``(KV block ids, checkpoint ids)`` (int64, in victim order)."""
    nb = cand.size
    count = 0
    words = cand.view(np.uint64)  # (cand's size is a multiple of 8): skip 8 ids at a time
    for w in range(words.size):
        if words[w]:
            for b in range(8 * w, 8 * w + 8):  # without a branch per id
                buf[count] = b
                count += cand[b]
    ids = buf[:count].copy()
    if not count:
        return ids, ids
    tick = np.empty(count, dtype=np.float64)
    util = np.empty(count, dtype=np.float64)
    for c in range(count):
        tick[c] = ticks[ids[c]]
        util[c] = lfpb[ids[c]]
    lo, hi, tlo, thi = util[0], util[0], tick[0], tick[0]
    for c in range(1, count):
        lo, hi = min(lo, util[c]), max(hi, util[c])
        tlo, thi = min(tlo, tick[c]), max(thi, tick[c])
    span, tspan = hi - lo, thi - tlo
    ulo, uhi = np.inf, -np.inf
    for c in range(count):  # _norm(lfpb) * alpha + _norm(tick), operation for operation
        u = (util[c] - lo) / span if span > 0 else 0.0
        u *= alpha
        u += (tick[c] - tlo) / tspan if tspan > 0 else 0.0
        util[c] = u
        ulo, uhi = min(ulo, u), max(uhi, u)
    # The order is by utility first, so it is the order of any monotone bucketing of the
    # utilities, each bucket ranked alone: bucket the candidates (a counting sort, stable), then
    # rank bucket by bucket, only until the victims free target blocks (usually a few checkpoints,
    # from the first buckets). Equal utilities share a bucket.
    nbk = min(count, 4096)
    scale = nbk / (uhi - ulo) if uhi > ulo else 0.0
    bucket = np.empty(count, dtype=np.int64)
    first = np.zeros(nbk + 1, dtype=np.int64)
    for c in range(count):
        b = min(int((util[c] - ulo) * scale), nbk - 1)
        bucket[c] = b
        first[b + 1] += 1
    for b in range(nbk):
        first[b + 1] += first[b]
    fill = first[:nbk].copy()
    members = np.empty(count, dtype=np.int64)  # candidates by bucket, ascending within each
    for c in range(count):
        members[fill[bucket[c]]] = c
        fill[bucket[c]] += 1
    out = np.empty(count, dtype=np.int64)
    n, freed, b = 0, 0, 0
    while freed < target and b < nbk:
        ranked = members[first[b] : first[b + 1]]
        m = ranked.size
        if m > 1:  # by utility, then a KV block's id (below nb) or nb + a checkpoint's tick, then the id
            u = np.empty(m, dtype=np.float64)
            key = np.empty(m, dtype=np.float64)
            for q in range(m):
                c = ranked[q]
                u[q] = util[c]
                key[q] = tick[c] + nb if is_ck[ids[c]] else ids[c]
            ranked = ranked[_sort_by(u, key)]
        for q in range(m):
            if freed >= target:
                break
            i = ids[ranked[q]]
            out[n] = i
            n += 1
            freed += ck_blocks if is_ck[i] else 1
        b += 1
    ids = out[:n]
    mask = is_ck[ids]
    return ids[~mask], ids[mask]


@_jit
def register_few(h, parent, need_parent, c, tab, meta, node_key, node_pos, node_kv, node_ck, node_tok, tokens,  # type: ignore[no-untyped-def]
                 start, blocks, node_of, lfpb, rank, lin, quad, per, free, n_free, out):
    """``PrefixCache._register_few`` with the key map above: blocks ``start, start + 1, ...`` of
    ``tokens`` (block hashes ``h``, uint64) after the chain key ``parent``. Each block's chain key
    ``c * key + h`` (mod 2**64, as int64); a new key gets a node at the slot popped from the stack
    ``free[:n_free]`` (position, no KV block, no checkpoint, its tokens); a node without a KV block
    caches the request's block (``blocks[i]``) unless that block caches another node already, with
    ``log1p`` of its FLOPs per byte when ``rank``. ``out[0]``: the keys, ``out[1]``: the slots.
    Returns ``(n_free, nodes created, KV blocks mapped)``, or ``(n_free, -1, 0)`` with nothing
    changed when the stack holds fewer than ``h.size`` slots, the map has no room for as many keys
    (``meta[2]``: its most keys), or ``need_parent`` and ``parent`` has no node."""
    bs = node_tok.shape[1]
    shift = meta[1]
    if n_free < h.size or meta[0] + h.size > meta[2] or (need_parent and _km_index(tab, shift, parent) < 0):
        return n_free, -1, 0
    key = np.uint64(parent)
    created, mapped = 0, 0
    for i in range(h.size):
        key = c * key + h[i]
        signed = np.int64(key)
        cell = _km_index(tab, shift, signed)
        if cell >= 0:
            slot = tab[cell, 1]
        else:
            n_free -= 1
            slot = free[n_free]
            _km_insert(tab, meta, cell, signed, slot)
            created += 1
            j = start + i
            node_key[slot] = signed
            node_pos[slot] = (j + 1) * bs
            node_kv[slot] = 0
            node_ck[slot] = -1
            node_tok[slot, :] = tokens[j * bs : (j + 1) * bs]
        block = blocks[i]
        if node_kv[slot] == 0 and node_of[block] < 0:
            node_kv[slot] = block
            node_of[block] = slot
            mapped += 1
            if rank:
                lfpb[block] = math.log1p((lin * bs + quad * (2 * node_pos[slot] - bs) * bs) / per)
        out[0, i] = signed
        out[1, i] = slot
    return n_free, created, mapped

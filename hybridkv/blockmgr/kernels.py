"""Compiled loops for the paths that numpy cannot vectorize well: block hashes, the pool's free
extents, the prefix cache's key -> slot map and the registration of a few blocks into it, the LRU
queue's scan, ``flop_aware``'s eviction ranking, and scattered writes with int32 ids.

Optional: with numba installed (``pip install hybridkv[jit]``; vLLM already depends on it) the
functions below are compiled on first use and cached on disk; without it, or with the environment
variable ``HYBRIDKV_JIT=0``, :data:`ENABLED` is False and callers use their numpy / list paths.
Both paths make the same decisions on the same inputs (the tests run both against references).

Ownership: every function works in place on arrays its caller owns and allocates nothing the
caller keeps, except the victim arrays of :func:`flop_aware_victims`. They hold the GIL while they
run (no ``nogil``): the books they change are the manager's, which is single-threaded.

Free extents are three int64 arrays of one capacity (the most extents a pool can have): ``s`` and
``e``, the starts and ends of ``n`` disjoint, non-adjacent extents ``[s[i], e[i])`` in id order,
and ``k``, the same extents as keys ``length << 32 | start`` in ascending order (best fit is the
first key >= ``n << 32``; the largest extent is the last).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:  # numba is optional
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

ENABLED: bool = numba is not None and os.environ.get("HYBRIDKV_JIT", "1") != "0"

_MASK = (1 << 32) - 1


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Compile ``fn`` lazily with numba (cached on disk) when it is available; else leave it as is.
    Without a writable cache location (a read-only install and no writable home or
    ``NUMBA_CACHE_DIR``, where numba refuses ``cache=True``) it compiles in each process instead."""
    if numba is None:
        return fn
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit()(fn)


# ---- scattered writes -----------------------------------------------------------------------------
@_jit
def _put(a, ids, value):  # type: ignore[no-untyped-def]
    for i in range(ids.size):
        a[ids[i]] = value


def put(a: np.ndarray, ids: np.ndarray, value: int) -> None:
    """``a[ids] = value``, compiled when :data:`ENABLED`: numpy converts int32 ids (the pool's) to
    intp before it writes, which costs more than the write for the few ids of a step."""
    if ENABLED:
        _put(a, ids, value)
    else:
        a[ids] = value


# ---- block hashes ---------------------------------------------------------------------------------
@_jit
def hash_blocks(blocks, salt, m1, out):  # type: ignore[no-untyped-def]
    """``hashing.block_hashes`` in one pass: ``out[r] = sum_c mix((blocks[r, c] + salt[c]) * m1)``
    with ``mix(x) = x ^ (x >> 29)``, all mod 2**64 (uint64; the int64 tokens' bits)."""
    n, bs = blocks.shape
    sh = np.uint64(29)
    for r in range(n):
        acc = np.uint64(0)
        for c in range(bs):
            x = (np.uint64(blocks[r, c]) + salt[c]) * m1
            x ^= x >> sh
            acc += x
        out[r] = acc


@_jit
def chain_keys(h, parent, c, out):  # type: ignore[no-untyped-def]
    """``out[j]``: the chain key ``c * key + h[j]`` (mod 2**64, as int64) of block ``j``, after the
    key ``parent`` (``hashing.keys_from_hashes``)."""
    key = np.uint64(parent)
    for j in range(h.size):
        key = c * key + h[j]
        out[j] = np.int64(key)


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


# ---- free extents ---------------------------------------------------------------------------------
@_jit
def _bisect(a, n, x):  # type: ignore[no-untyped-def]
    """The first index ``i`` in ``[0, n)`` with ``a[i] >= x`` (``n`` if none); ``a[:n]`` ascending."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def _insert_key(k, n, key):  # type: ignore[no-untyped-def]
    """Insert ``key`` into the ascending ``k[:n]`` (``k`` has room for one more)."""
    i = _bisect(k, n, key)
    j = n
    while j > i:
        k[j] = k[j - 1]
        j -= 1
    k[i] = key


@_jit
def _delete_key(k, n, key):  # type: ignore[no-untyped-def]
    """Remove ``key`` (present) from the ascending ``k[:n]``."""
    for j in range(_bisect(k, n, key), n - 1):
        k[j] = k[j + 1]


@_jit
def _replace_key(k, n, old, new):  # type: ignore[no-untyped-def]
    """Replace ``old`` (present) by ``new`` (absent) in the ascending ``k[:n]``, moving only the keys
    between their two places (an extent that grows or shrinks moves little in the length order)."""
    i = _bisect(k, n, old)
    if new < old:
        j = _bisect(k, i, new)
        while i > j:
            k[i] = k[i - 1]
            i -= 1
    else:
        j = _bisect(k, n, new) - 1  # (k[i] == old < new: j >= i)
        while i < j:
            k[i] = k[i + 1]
            i += 1
    k[i] = new


@_jit
def _delete_extent(s, e, n, j):  # type: ignore[no-untyped-def]
    for q in range(j, n - 1):
        s[q] = s[q + 1]
        e[q] = e[q + 1]


@_jit
def take(s, e, k, n_ext, n, ref_counts, out):  # type: ignore[no-untyped-def]
    """Take ``n`` ids (at most the free ones, checked by the caller) into ``out[:n]`` (int32) and set
    their reference counts to 1. Best fit: the shortest extent that holds ``n`` (lowest start among
    equals), cut from its front. Otherwise the largest extents first (highest start among equals),
    whole, and the last one cut from its front. Returns ``(number of extents now, one id run)``."""
    i = _bisect(k, n_ext, n << 32)
    if i < n_ext:  # best fit
        key = k[i]
        length, start = key >> 32, key & _MASK
        j = _bisect(s, n_ext, start)
        if length > n:
            s[j] = start + n
            _replace_key(k, n_ext, key, ((length - n) << 32) | (start + n))
        else:
            _delete_key(k, n_ext, key)
            _delete_extent(s, e, n_ext, j)
            n_ext -= 1
        for x in range(n):
            out[x] = start + x
            ref_counts[start + x] = 1
        return n_ext, True
    left, pos, cnt, removed, parts = n, 0, n_ext, 0, 0
    while left > 0:  # fragmented
        cnt -= 1
        key = k[cnt]
        length, start = key >> 32, key & _MASK
        parts += 1
        j = _bisect(s, n_ext, start)  # (s is intact until the compaction below)
        got = min(length, left)
        for x in range(got):
            out[pos + x] = start + x
            ref_counts[start + x] = 1
        pos += got
        left -= got
        if length > got:  # the last one: its rest stays free, in the same place by start
            s[j] = start + got
            _insert_key(k, cnt, ((length - got) << 32) | (start + got))
            cnt += 1
        else:
            e[j] = -1  # taken whole: removed below
            removed += 1
    if removed:
        w = 0
        for r in range(n_ext):
            if e[r] >= 0:
                s[w] = s[r]
                e[w] = e[r]
                w += 1
        n_ext = w
    return n_ext, parts == 1


@_jit
def free_run(s, e, k, n_ext, start, end):  # type: ignore[no-untyped-def]
    """Return ``[start, end)`` (free, outside every extent) to the extents, merging neighbours.
    Returns the number of extents now."""
    j = _bisect(s, n_ext, start)  # the first extent after the run
    before = j > 0 and e[j - 1] == start
    after = j < n_ext and s[j] == end
    if before:
        prev = s[j - 1]
        nk = n_ext
        if after:  # the run closes a gap
            last = e[j]
            _delete_key(k, nk, ((last - end) << 32) | end)
            nk -= 1
            _delete_extent(s, e, n_ext, j)
            n_ext -= 1
            end = last
        e[j - 1] = end
        _replace_key(k, nk, ((start - prev) << 32) | prev, ((end - prev) << 32) | prev)
        return n_ext
    if after:
        last = e[j]
        s[j] = start
        _replace_key(k, n_ext, ((last - end) << 32) | end, ((last - start) << 32) | start)
        return n_ext
    q = n_ext
    while q > j:
        s[q] = s[q - 1]
        e[q] = e[q - 1]
        q -= 1
    s[j] = start
    e[j] = end
    _insert_key(k, n_ext, ((end - start) << 32) | start)
    return n_ext + 1


@_jit
def free_sorted(s, e, k, n_ext, ids):  # type: ignore[no-untyped-def]
    """Return distinct free ids (ascending, outside every extent) to the extents. A few runs go one
    :func:`free_run` each; many are merged with the extents in one pass and the keys are rebuilt.
    Returns the number of extents now."""
    m = ids.size
    runs = 1
    for i in range(1, m):
        if ids[i] != ids[i - 1] + 1:
            runs += 1
    if runs <= 8:
        a = 0
        for i in range(1, m + 1):
            if i == m or ids[i] != ids[i - 1] + 1:
                n_ext = free_run(s, e, k, n_ext, ids[a], ids[i - 1] + 1)
                a = i
        return n_ext
    tmp_s, tmp_e = np.empty(n_ext + m, dtype=np.int64), np.empty(n_ext + m, dtype=np.int64)
    i, j, w = 0, 0, 0
    while i < n_ext or j < m:
        if j == m or (i < n_ext and s[i] < ids[j]):
            a, b = s[i], e[i]
            i += 1
        else:
            a = ids[j]
            b = a + 1
            j += 1
        if w and tmp_e[w - 1] == a:
            tmp_e[w - 1] = b
        else:
            tmp_s[w] = a
            tmp_e[w] = b
            w += 1
    for q in range(w):
        s[q] = tmp_s[q]
        e[q] = tmp_e[q]
        k[q] = ((tmp_e[q] - tmp_s[q]) << 32) | tmp_s[q]
    k[:w].sort()
    return w


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


# ---- the prefix cache's key -> slot map -----------------------------------------------------------
# Open addressing with linear probing in one int64 array ``tab`` of shape ``[size, 2]`` (a power of
# two of cells: the key, then its slot, -1 for an empty cell; one cache line holds both) and
# ``meta = [count, shift, most keys]`` (``shift``: 64 - log2(size); ``most keys``: the load the
# caller allows, ``SlotMap``: one half). A key's home cell is the top bits of ``key * _GOLD``
# (Fibonacci hashing); removal shifts the probe run back (no tombstones).
_GOLD = 0x9E3779B97F4A7C15


@_jit
def _km_home(key, shift):  # type: ignore[no-untyped-def]
    return np.int64((np.uint64(key) * np.uint64(_GOLD)) >> np.uint64(shift))


@_jit
def _km_index(tab, shift, key):  # type: ignore[no-untyped-def]
    """The cell holding ``key``, or ``-1 - cell`` of the empty cell that ends its probe run."""
    mask = tab.shape[0] - 1
    i = _km_home(key, shift)
    while tab[i, 1] >= 0:
        if tab[i, 0] == key:
            return i
        i = (i + 1) & mask
    return -1 - i


@_jit
def km_get(tab, meta, key):  # type: ignore[no-untyped-def]
    """The slot of ``key`` (-1: absent)."""
    i = _km_index(tab, meta[1], key)
    return tab[i, 1] if i >= 0 else -1


@_jit
def km_lookup(tab, meta, keys, out):  # type: ignore[no-untyped-def]
    """``out[j]``: the slot of ``keys[j]`` (-1: absent)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        out[j] = tab[i, 1] if i >= 0 else -1


@_jit
def _km_insert(tab, meta, found, key, val):  # type: ignore[no-untyped-def]
    """Put ``key`` (absent: ``found`` is ``_km_index``'s ``-1 - cell``) in that empty cell with ``val``."""
    cell = -1 - found
    tab[cell, 0] = key
    tab[cell, 1] = val
    meta[0] += 1


@_jit
def km_put(tab, meta, keys, vals):  # type: ignore[no-untyped-def]
    """Map each of ``keys`` to the value at the same position (replacing a present key's)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        if i < 0:
            _km_insert(tab, meta, i, keys[j], vals[j])
        else:
            tab[i, 1] = vals[j]


@_jit
def _km_remove_at(tab, shift, i):  # type: ignore[no-untyped-def]
    """Empty cell ``i``, moving back the later entries of its probe run that may live there."""
    mask = tab.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if tab[j, 1] < 0:
            break
        h = _km_home(tab[j, 0], shift)
        if (j > i and (h <= i or h > j)) or (j < i and h <= i and h > j):  # home not in (i, j]
            tab[i, 0] = tab[j, 0]
            tab[i, 1] = tab[j, 1]
            i = j
    tab[i, 1] = -1


@_jit
def km_remove(tab, meta, keys, out):  # type: ignore[no-untyped-def]
    """Remove each of ``keys``; ``out[j]``: the slot it had (-1: it was absent)."""
    shift = meta[1]
    for j in range(keys.size):
        i = _km_index(tab, shift, keys[j])
        if i < 0:
            out[j] = -1
            continue
        out[j] = tab[i, 1]
        _km_remove_at(tab, shift, i)
        meta[0] -= 1


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

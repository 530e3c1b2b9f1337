"""Compiled loops of the pool's free extents (:class:`~hybridkv.blockmgr.pool.JitBlockPool`).

Free extents are three int64 arrays of one capacity (the most extents a pool can have): ``s`` and
``e``, the starts and ends of ``n`` disjoint, non-adjacent extents ``[s[i], e[i])`` in id order,
and ``k``, the same extents as keys ``length << 32 | start`` in ascending order (best fit is the
first key >= ``n << 32``; the largest extent is the last). Compiled with numba when
:data:`hybridkv.blockmgr.kernels.ENABLED`.
"""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr.kernels import _jit

_MASK = (1 << 32) - 1


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

"""The switch and the decorator of the compiled hot paths, and scattered writes with int32 ids.

Optional: with numba installed (``pip install hybridkv[jit]``; vLLM already depends on it) the
kernels are compiled on first use and cached on disk; without it, or with the environment variable
``HYBRIDKV_JIT=0``, :data:`ENABLED` is False and callers use their numpy / list paths. Both paths
make the same decisions on the same inputs (the tests run both against references).

Each kernel lives beside the part it speeds up, decorated with :func:`_jit` from here:
:mod:`~hybridkv.blockmgr.pool_kernels` (the pool's free extents), :mod:`~hybridkv.blockmgr.hashing`
(block hashes, chain keys), :mod:`~hybridkv.blockmgr.prefix.slotmap` (the key -> slot map) and
:mod:`~hybridkv.blockmgr.prefix.kernels` (the LRU scan, ``flop_aware``'s ranking, the registration
of a few blocks, the token comparison of a match). Every caller reads :data:`ENABLED` here when it
runs, so one switch turns them all off.

Ownership: every kernel works in place on arrays its caller owns and allocates nothing the caller
keeps, except the victim arrays of ``flop_aware_victims``. They hold the GIL while they run (no
``nogil``): the books they change are the manager's, which is single-threaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:  # numba is optional
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

ENABLED: bool = numba is not None and os.environ.get("HYBRIDKV_JIT", "1") != "0"

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



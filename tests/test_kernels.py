"""The compiled kernels (``hybridkv.blockmgr.kernels``, numba) against the numpy / list paths they
replace, through the manager: two managers run the same random workload, one with the kernels and
one without, and must agree on every id handed out and on every book afterwards (pool extents and
counts, the prefix cache's node arrays, key map, KV mapping, LRU queue, FLOPs and ticks)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr import kernels, pool_kernels
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.errors import AllocationError
from hybridkv.planner.layout import plan

from .manager_fixtures import tiny_model

pytestmark = pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")


def _manager(jit: bool, eviction: str, checkpoint: str, num_blocks: int) -> HybridBlockManager:
    was = kernels.ENABLED
    kernels.ENABLED = jit  # the pool's implementation is chosen when it is made
    try:
        config = PrefixCacheConfig(CheckpointPolicy(checkpoint), EvictionPolicy(eviction), every_n=2)
        return HybridBlockManager(plan(tiny_model(), num_blocks * 256, block_size=4), prefix_cache=config)
    finally:
        kernels.ENABLED = was


def _books(m: HybridBlockManager) -> dict:
    c, p = m.prefix_cache, m.pool
    live = c._live_queue()
    return {
        "extents": p.free_extents(), "free": p.num_free, "loose": list(p._loose), "rc": p.ref_counts.tolist(),
        "use": m.use.tolist(), "slot": sorted(c._slot.items()), "free_slots": c._free[: c._n_free].tolist(),
        "key": c._key.tolist(), "pos": c._pos.tolist(), "kv": c._kv.tolist(), "ck": c._ck.tolist(),
        "tok": c._tok.tolist(), "node_of": c._node_of.tolist(), "lfpb": c._lfpb.tolist(),
        "ticks": c._ticks.tolist(), "queue": c._fifo[live].tolist(), "orders": c._fifo_ord[live].tolist(),
        "mapped": c._n_mapped, "evictable": c._n_evictable, "stats": repr(c.stats),
    }


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
@pytest.mark.parametrize("checkpoint", ["every_n_blocks", "branch_spaced"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_same_workload_gives_the_same_ids_and_books_with_and_without_kernels(eviction, checkpoint, data):
    num_blocks = data.draw(st.integers(40, 160))
    ms = {jit: _manager(jit, eviction, checkpoint, num_blocks) for jit in (False, True)}
    prompts: list[list[int]] = []
    running: list[int] = []
    was = kernels.ENABLED

    def both(fn):  # noqa: ANN001, ANN202
        out = {}
        for jit, m in ms.items():
            kernels.ENABLED = jit
            try:
                out[jit] = fn(m)
            except AllocationError as e:
                out[jit] = type(e)
            finally:
                kernels.ENABLED = was
        assert out[False] == out[True]
        return out[True]

    for rid in range(data.draw(st.integers(1, 25))):
        if prompts and data.draw(st.booleans()):  # a prompt that extends or branches off an earlier one
            base = data.draw(st.sampled_from(prompts))
            tokens = base[: data.draw(st.integers(0, len(base)))] + [data.draw(st.integers(0, 3))
                                                                      for _ in range(data.draw(st.integers(1, 40)))]
        else:
            tokens = [data.draw(st.integers(0, 3)) for _ in range(data.draw(st.integers(1, 60)))]
        prompts.append(tokens)

        chunk = data.draw(st.sampled_from([4, 8, 64]))

        def admit(m, tokens=tokens, rid=rid, chunk=chunk):  # noqa: ANN001, ANN202
            cached = m.match_prefix(tokens)
            first = min(len(tokens), cached + chunk)
            if not m.can_allocate(first, token_ids=tokens):
                return None
            a = m.allocate(rid, first, token_ids=tokens)
            rec = m.requests[rid]
            out = [a.num_cached_tokens, rec.kv_blocks.tolist(), m._set_ids(rec.state).tolist(),
                   m.checkpoint(rid).src.tolist()]
            while rec.num_tokens < len(tokens):
                m.release_pins()
                stop = m.next_checkpoint_position(rid) or len(tokens)
                n = min(stop - rec.num_tokens, chunk)
                if not m.can_append(rid, n):
                    break
                m.append(rid, n)
                out.append(m.checkpoint(rid).dst.tolist())
            m.release_pins()
            out.append(rec.kv_blocks.tolist())
            return out

        if both(admit) is not None:
            running.append(rid)
        while running and (len(running) > data.draw(st.integers(0, 4)) or data.draw(st.booleans())):
            victim = running.pop(data.draw(st.integers(0, len(running) - 1)))
            both(lambda m, r=victim: m.free(r))
        if data.draw(st.integers(0, 4)) == 0:  # the books, now and then (always at the end)
            assert _books(ms[False]) == _books(ms[True])
    for rid in running:
        both(lambda m, r=rid: m.free(r))
    assert _books(ms[False]) == _books(ms[True])
    for m in ms.values():
        m.check_integrity()


def test_kernels_compile_without_a_writable_cache(monkeypatch):
    """A read-only install with no writable cache directory: numba refuses ``cache=True`` (it
    raises when the function is decorated), so the kernels compile per process instead of
    breaking the import."""
    import importlib.util

    import numba.core.caching
    import numpy as np

    monkeypatch.setattr(numba.core.caching.CacheImpl, "_locator_classes", [])
    spec = importlib.util.spec_from_file_location("pool_kernels_uncached", pool_kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # raised RuntimeError before the fallback
    s, e, k = (np.zeros(8, dtype=np.int64) for _ in range(3))
    s[0], e[0], k[0] = 1, 10, (9 << 32) | 1
    out, counts = np.empty(3, dtype=np.int32), np.zeros(10, dtype=np.int32)
    assert module.take(s, e, k, 1, 3, counts, out) == (1, True)
    assert out.tolist() == [1, 2, 3] and s[0] == 4


def test_hybridkv_jit_0_turns_the_kernels_off():
    """``HYBRIDKV_JIT=0``: the numpy / list paths, with numba installed."""
    import os
    import subprocess
    import sys

    code = "from hybridkv.blockmgr import kernels, pool; print(kernels.ENABLED, type(pool.make_pool(10)).__name__)"
    for value, expected in (("0", "False BlockPool"), ("1", "True JitBlockPool")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HYBRIDKV_JIT": value},
                             capture_output=True, text=True, check=True)
        assert out.stdout.split() == expected.split()

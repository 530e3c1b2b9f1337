"""The block pool against its previous implementation (``pool_reference.py``): the same ids, in the
same order, for every allocation of a random workload (state sets, decode single blocks, scattered
frees, loose-id merges, a full pool), the same free extents after every step, and its own books."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.pool import BlockPool, JitBlockPool, run_bounds, runs
from tests.pool_reference import ReferencePool

EXAMPLES = int(os.environ.get("POOL_EXAMPLES", "300"))

op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 40)),
    st.tuples(st.just("alloc1"), st.integers(1, 6)),  # a burst of single-block allocations
    st.tuples(st.just("release"), st.integers(0, 10**6)),  # one held allocation, whole
    st.tuples(st.just("scatter"), st.integers(0, 10**6)),  # every other id of several allocations
    st.tuples(st.just("free1"), st.integers(0, 10**6)),  # one id of a held allocation
    st.tuples(st.just("extents"), st.just(0)),  # a view that merges the loose ids
    st.tuples(st.just("holes"), st.integers(1, 6)),  # equal-length holes: ties for best fit and largest-first
)


def _books(p) -> tuple:  # noqa: ANN001
    return (p.num_free, list(p._loose), p.ref_counts.tolist())


# both implementations of the free extents: Python lists, and numpy arrays with compiled kernels
POOLS = [BlockPool, pytest.param(JitBlockPool, marks=pytest.mark.skipif(kernels.numba is None, reason="numba"))]


@pytest.mark.parametrize("pool_class", POOLS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(num_blocks=st.integers(8, 160), loose_cap=st.sampled_from([0, 3, 4096]), ops=st.lists(op, max_size=80))
def test_same_ids_as_the_reference_pool(pool_class: type[BlockPool], num_blocks: int, loose_cap: int,
                                        ops: list) -> None:
    new, ref = pool_class(num_blocks), ReferencePool(num_blocks)
    new._loose_cap = ref._loose_cap = loose_cap
    held: list[np.ndarray] = []
    for kind, arg in ops:
        if kind in ("alloc", "alloc1"):
            sizes = [arg] if kind == "alloc" else [1] * arg
            for n in sizes:
                if n > new.num_free:
                    with pytest.raises(ValueError):
                        new.allocate(n)
                    with pytest.raises(ValueError):
                        ref.allocate(n)
                    continue
                a, b = new.allocate(n), ref.allocate(n)
                assert a.dtype == np.int32 and a.tolist() == b.tolist()
                assert new.last_allocation_was_run == ref.last_allocation_was_run
                held.append(a.copy())
        elif kind == "release" and held:
            ids = held.pop(arg % len(held))
            new.release(ids)
            ref.release(ids.copy())
        elif kind == "scatter" and held:
            k = 1 + arg % min(len(held), 4)
            take = [held.pop((arg + i) % len(held)) for i in range(k)]
            ids = np.concatenate(take)
            odd, even = ids[1::2], ids[::2]
            for part in (odd, even):
                if part.size:
                    new.ref_counts[part] -= 1
                    ref.ref_counts[part] -= 1
                    new.free(part)
                    ref.free(part.copy())
        elif kind == "free1" and held:
            j = arg % len(held)
            ids = held[j]
            one, rest = ids[arg % ids.size : arg % ids.size + 1], np.delete(ids, arg % ids.size)
            new.release(one)
            ref.release(one.copy())
            if rest.size:
                held[j] = rest
            else:
                held.pop(j)
        elif kind == "holes":  # 6 allocations of `arg` ids, every other one released
            made = []
            for _ in range(6):
                if arg > new.num_free:
                    break
                a = new.allocate(arg)
                assert a.tolist() == ref.allocate(arg).tolist()
                made.append(a.copy())
            for i, ids in enumerate(made):
                if i % 2:
                    new.release(ids)
                    ref.release(ids.copy())
                else:
                    held.append(ids)
        elif kind == "extents":
            assert new.free_extents() == ref.free_extents()
            assert new.largest_free_extent() == ref.largest_free_extent()
        assert _books(new) == _books(ref)
        assert new.check_free_extents() == []
        assert list(zip(new._starts, new._ends, strict=True)) == list(ref._by_start.items())
    for ids in held:
        new.release(ids)
        ref.release(ids.copy())
    assert new.free_extents() == ref.free_extents() == [(1, num_blocks)]
    assert new.num_free == num_blocks - 1


@pytest.mark.parametrize("pool_class", POOLS)
def test_fragmented_allocation_takes_the_largest_extents_first(pool_class: type[BlockPool]) -> None:
    p = pool_class(40)
    ids = p.allocate(39)  # 1..39
    for lo, hi in ((2, 5), (8, 11), (14, 20), (25, 28)):  # free extents of 3, 3, 6, 3
        p.ref_counts[lo:hi] = 0
        p.free(np.arange(lo, hi, dtype=np.int32))
    got = p.allocate(10)  # no extent holds 10: [14, 20), then the 3s from the highest start
    assert got.tolist() == [14, 15, 16, 17, 18, 19, 25, 26, 27, 8]
    assert not p.last_allocation_was_run
    assert p.free_extents() == [(2, 5), (9, 11)]
    assert p.check_free_extents() == []
    del ids


@pytest.mark.parametrize("pool_class", POOLS)
def test_a_scattered_free_merges_with_every_neighbour(pool_class: type[BlockPool]) -> None:
    p = pool_class(20)
    p.allocate(19)
    evens = np.arange(2, 20, 2, dtype=np.int32)
    p.ref_counts[evens] = 0
    p.free(evens)
    assert p.free_extents() == [(i, i + 1) for i in range(2, 20, 2)]
    odds = np.arange(3, 19, 2, dtype=np.int32)
    p.ref_counts[odds] = 0
    p.free(odds)
    assert p.free_extents() == [(2, 19)]  # 19 is still held
    assert p.check_free_extents() == []


def test_run_bounds() -> None:
    assert runs(np.array([], dtype=np.int32)) == []
    assert runs(np.array([4, 5, 6])) == [(4, 7)]
    starts, ends = run_bounds(np.array([1, 2, 5, 7, 8, 9]))
    assert starts.tolist() == [1, 5, 7] and ends.tolist() == [3, 6, 10]


@pytest.mark.parametrize("pool_class", POOLS)
def test_bad_frees_are_refused_and_change_nothing(pool_class: type[BlockPool]) -> None:
    p = pool_class(10)
    p.allocate(3)
    before = p.free_extents()
    with pytest.raises(ValueError):
        p.free(np.array([0, 1], dtype=np.int32))  # the null block
    with pytest.raises(ValueError):
        p.free(np.array([9, 10], dtype=np.int32))
    with pytest.raises(ValueError):
        p.free(np.array([10], dtype=np.int32))
    with pytest.raises(ValueError):
        p.allocate(8)
    assert p.free_extents() == before and p.num_free == 6

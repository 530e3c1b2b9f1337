"""Atomicity: an injected failure leaves usage(), every table and the pools exactly as before."""

import numpy as np
import pytest

from hybridkv.blockmgr.records import RequestStatus
from hybridkv.errors import AllocationError, HybridKVError

from .manager_fixtures import tiny_manager


def snapshot(m):
    running = [r for r, rec in m.requests.items() if rec.status is RequestStatus.RUNNING and rec.pending is None]
    return (
        m.usage(),
        m.block_table(running).tolist(),
        m.state_table(running).tolist(),
        [m.speculative_table(r).tolist() for r in running],
        {r: (rec.num_tokens, rec.status, rec.host_blocks.tolist()) for r, rec in m.requests.items()},
        m.pool.free_extents(),
        m.pool.ref_counts.tolist(),
        m.use.tolist(),
        m.host_pool.free_extents(),
        m.host_pool.ref_counts.tolist(),
    )


def crowded(host_blocks=20):
    """a: 10 tokens, b: 4 tokens (swapped out), c fills the pool to one free block."""
    m = tiny_manager(num_blocks=40, num_host_blocks=host_blocks)
    m.allocate("a", 10)
    m.allocate("b", 4)
    m.swap_out("b").commit()
    m.allocate("c", 4 * 17)  # 17 + 6 = 23 -> 39 - 9 - 23 = 7 free
    m.allocate("d", 1)  # 7 free -> 0 free
    assert m.usage().free == 0
    return m


FAILING_OPS = {
    "allocate, pool exhausted": lambda m: m.allocate("x", 1),
    "append, pool exhausted": lambda m: m.append("a", 4),
    "fork, pool exhausted": lambda m: m.fork("a", "x"),
    "speculation, pool exhausted": lambda m: m.begin_speculation("a", 1),
    "swap in, pool exhausted": lambda m: m.swap_in("b"),
    "allocate, never fits": lambda m: m.allocate("x", 10_000),
    "allocate, duplicate id": lambda m: m.allocate("a", 1),
    "commit speculation, bad count": lambda m: m.commit_speculation("a", 3),
    "free, unknown id": lambda m: m.free("nobody"),
    "append to a swapped request": lambda m: m.append("b", 1),
}


@pytest.mark.parametrize("name", sorted(FAILING_OPS))
def test_failed_operation_changes_nothing(name):
    m = crowded()
    before = snapshot(m)
    with pytest.raises((HybridKVError, ValueError)):
        FAILING_OPS[name](m)
    assert snapshot(m) == before
    m.check_integrity()


def test_host_pool_exhausted_swap_out_changes_nothing():
    m = crowded(host_blocks=12)  # b holds 7 host blocks, a needs 9
    before = snapshot(m)
    assert not m.can_swap_out("a")
    with pytest.raises(AllocationError, match="host blocks"):
        m.swap_out("a")
    assert snapshot(m) == before


@pytest.mark.parametrize("direction", ["out", "in"])
def test_aborted_swap_plan_changes_nothing(direction):
    m = crowded(host_blocks=40)
    if direction == "in":
        m.free("c")  # room to swap b back in
    before = snapshot(m)
    plan = m.swap_out("a") if direction == "out" else m.swap_in("b")
    assert len(plan) == (9 if direction == "out" else 7)
    m.check_integrity()  # the reservation is accounted while pending
    plan.abort()
    assert snapshot(m) == before
    m.check_integrity()


def test_state_sets_and_kv_are_never_aliased_after_swaps():
    m = crowded(host_blocks=40)
    m.free("c")
    m.swap_in("b").commit()
    m.swap_out("a").commit()
    m.swap_in("a").commit()
    owners = np.concatenate([m.state_table([r]).ravel() for r in m.requests])
    assert np.unique(owners).size == owners.size
    m.check_integrity()

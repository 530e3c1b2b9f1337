"""Scenario tests: exact block ids after every operation of the manager contract."""

import numpy as np
import pytest

from hybridkv.blockmgr.records import RequestStatus
from hybridkv.errors import (
    DuplicateRequestError,
    NoFreeBlocksError,
    RequestStateError,
    RequestTooLargeError,
    UnknownRequestError,
)

from .manager_fixtures import tiny_manager


def ids(a) -> list:
    return np.asarray(a).tolist()


def test_lifecycle_pins_block_ids():
    m = tiny_manager()
    m.allocate("a", 10)  # 3 KV blocks + 2 state sets of 3, one run: state first
    assert ids(m.state_table(["a"])[:, 0]) == [[1, 2, 3], [4, 5, 6]]
    assert ids(m.block_table(["a"])) == [[7, 8, 9]]
    m.allocate("b", 4)
    assert ids(m.state_table(["b"])[:, 0]) == [[10, 11, 12], [13, 14, 15]]
    assert ids(m.block_table(["b"])) == [[16]]
    assert len(m.append("a", 2)) == 0 and ids(m.block_table(["a"])) == [[7, 8, 9]]  # 12 tokens: still 3 blocks
    m.append("a", 1)
    assert ids(m.block_table(["a"])) == [[7, 8, 9, 17]]
    m.free("b")
    assert m.pool.free_extents() == [(10, 17), (18, 40)]
    m.allocate("c", 4)  # best fit: the 7-block hole b left
    assert ids(m.state_table(["c"])[:, 0]) == [[10, 11, 12], [13, 14, 15]] and ids(m.block_table(["c"])) == [[16]]
    m.check_integrity()

    copies = m.fork("a", "d")  # KV shared, state copied
    assert ids(m.block_table(["d"])) == [[7, 8, 9, 17]]
    assert ids(m.state_table(["d"])[:, 0]) == [[18, 19, 20], [21, 22, 23]]
    assert ids(copies.src) == [1, 2, 3, 4, 5, 6] and ids(copies.dst) == [18, 19, 20, 21, 22, 23]
    assert m.pool.ref_counts[[7, 8, 9, 17]].tolist() == [2, 2, 2, 2]
    cow = m.append("d", 1)  # 13 tokens: block 17 is partly filled and shared -> private copy
    assert ids(cow.src) == [17] and ids(cow.dst) == [24]
    assert ids(m.block_table(["d"])) == [[7, 8, 9, 24]] and m.pool.ref_counts[17] == 1
    m.check_integrity()

    plan = m.swap_out("a")  # KV first, then the live state sets
    assert ids(plan.device_blocks) == [7, 8, 9, 17, 1, 2, 3, 4, 5, 6]
    assert ids(plan.host_blocks) == list(range(0, 10))  # the host pool has no null block
    plan.commit()
    assert m.requests["a"].status is RequestStatus.SWAPPED
    assert m.pool.ref_counts[[7, 8, 9]].tolist() == [1, 1, 1]  # d still holds them
    assert m.pool.free_extents() == [(1, 7), (17, 18), (25, 40)]
    plan = m.swap_in("a")
    assert ids(plan.device_blocks) == list(range(25, 35)) and ids(plan.host_blocks) == list(range(0, 10))
    plan.commit()
    assert ids(m.block_table(["a"])) == [[25, 26, 27, 28]]
    assert ids(m.state_table(["a"])[:, 0]) == [[29, 30, 31], [32, 33, 34]]
    assert m.requests["a"].num_tokens == 13
    m.check_integrity()

    for r in ("a", "c", "d"):
        m.free(r)
    m.check_integrity()
    assert m.pool.free_extents() == [(1, 40)] and m.usage().free == 39


def test_batch_views_pad_on_the_null_block():
    m = tiny_manager()
    m.allocate("a", 10)
    m.allocate("b", 1)
    table = m.block_table(["b", "a"], num_rows=4, width=5)
    assert table.dtype == np.int32 and ids(table) == [[16, 0, 0, 0, 0], [7, 8, 9, 0, 0], [0] * 5, [0] * 5]
    state = m.state_table(["a", "b"], num_rows=3)
    assert state.shape == (2, 3, 3) and state.flags.c_contiguous
    assert ids(state[:, 2]) == [[0, 0, 0], [0, 0, 0]]
    assert ids(state[1, 1]) == [13, 14, 15]


@pytest.mark.parametrize(("num_accepted", "live", "kv", "tokens"), [
    (0, [[1, 2, 3], [4, 5, 6]], [19, 20], 5),  # none accepted: live set kept, both drafts' KV dropped
    (1, [[7, 8, 9], [10, 11, 12]], [19, 20], 6),  # one accepted: speculative set 0 becomes live
    (2, [[13, 14, 15], [16, 17, 18]], [19, 20], 7),  # all accepted: speculative set 1 becomes live
])
def test_speculation_commit_exchanges_set_ids(num_accepted, live, kv, tokens):
    m = tiny_manager()
    m.allocate("a", 4, num_speculative=2)  # 1 KV + 3 x 6 state blocks
    assert ids(m.speculative_table("a")) == [[[7, 8, 9], [10, 11, 12]], [[13, 14, 15], [16, 17, 18]]]
    assert ids(m.block_table(["a"])) == [[19]]
    m.begin_speculation("a", 2)  # already has two sets: nothing allocated
    assert m.usage().free == 39 - 19
    m.append("a", 3)  # verify step: the last sampled token + 2 drafts
    assert ids(m.block_table(["a"])) == [[19, 20]]
    m.commit_speculation("a", num_accepted)
    assert ids(m.state_table(["a"])[:, 0]) == live
    assert ids(m.block_table(["a"])) == [kv] and m.requests["a"].num_tokens == tokens
    u = m.usage()
    assert (u.state_live, u.state_speculative) == (6, 12)
    m.check_integrity()


def test_speculation_truncates_rejected_blocks():
    m = tiny_manager()
    m.allocate("a", 4)
    m.begin_speculation("a", 4)
    assert m.speculative_table("a").shape == (4, 2, 3)
    m.append("a", 5)  # 9 tokens: blocks [KV0, new, new]
    assert m.requests["a"].num_kv_blocks == 3
    m.commit_speculation("a", 0)  # 4 rejected -> 5 tokens -> 2 blocks
    assert m.requests["a"].num_kv_blocks == 2 and m.requests["a"].num_tokens == 5
    m.end_speculation("a")
    assert m.usage().state_speculative == 0
    m.check_integrity()


def test_state_only_model_and_watermark():
    m = tiny_manager(watermark=0.25)  # 9 of 39 usable blocks kept back from admission
    assert m.watermark_blocks == 9
    assert m.blocks_to_admit(10) == 3 + 6
    m.allocate("a", 40)  # 10 + 6 = 16
    assert m.can_allocate(4)  # 7 + 9 <= 23
    assert not m.can_allocate(4 * 9)  # 9 + 6 + 9 > 23
    with pytest.raises(NoFreeBlocksError, match="available"):
        m.allocate("b", 4 * 9)


def test_errors_name_the_request_and_the_fix():
    m = tiny_manager()
    with pytest.raises(RequestTooLargeError, match="needs 106 blocks, pool has 39 in total: raise the memory budget"):
        m.allocate("big", 400)
    m.allocate("a", 4)
    with pytest.raises(DuplicateRequestError):
        m.allocate("a", 4)
    with pytest.raises(UnknownRequestError, match="unknown request 'zz'"):
        m.free("zz")
    plan = m.swap_out("a")
    with pytest.raises(RequestStateError, match="pending swap plan"):
        m.append("a", 1)
    plan.abort()
    with pytest.raises(RequestStateError, match="already settled"):
        plan.commit()
    with pytest.raises(RequestStateError, match="not swapped out"):
        m.swap_in("a")
    with pytest.raises(ValueError, match="num_accepted"):
        m.commit_speculation("a", 1)


def test_contiguous_state_sets_in_a_fresh_pool():
    m = tiny_manager(num_blocks=200)
    for i in range(10):
        m.allocate(i, 7)
    for i in range(10):
        state = m.state_table([i])[:, 0].ravel()
        assert np.all(np.diff(state) == 1)


def test_pool_single_block_fast_path_keeps_state_sets_whole():
    """Freed single ids are reused last-in first-out by allocate(1); an n > 1 allocation that no
    extent holds merges them back first, so it still comes out as one run."""
    from hybridkv.blockmgr.pool import BlockPool

    p = BlockPool(12)  # ids 1..11
    singles = [p.allocate(1) for _ in range(4)]
    assert [int(s[0]) for s in singles] == [1, 2, 3, 4]  # from the extents: best fit, in id order
    rest = p.allocate(7)  # 5..11: the pool is full
    p.release(singles[1])
    p.release(singles[2])
    assert p.num_free == 2 and p.check_free_extents() == []
    again = p.allocate(1)
    assert int(again[0]) == 3 and p.ref_counts[3] == 1  # the most recently freed id
    with pytest.raises(ValueError):
        again[0] = 9  # one-id results are read-only views
    p.release(again)
    run = p.allocate(2)  # no extent holds 2: the loose ids 2, 3 merge into one
    assert run.tolist() == [2, 3] and p.last_allocation_was_run
    p.release(run)
    p.release(singles[0])
    assert p.free_extents() == [(1, 4)] and p.largest_free_extent() == 3  # views merge loose ids
    p.release(rest)
    p.release(singles[3])
    assert p.free_extents() == [(1, 12)] and p.num_free == 11 and p.check_free_extents() == []


def test_pool_integrity_sees_a_bad_loose_id():
    from hybridkv.blockmgr.pool import BlockPool

    p = BlockPool(12)
    a = p.allocate(1)
    p.release(a)
    assert p.check_free_extents() == []
    p._loose.append(5)  # 5 is inside the free extent [2, 12): freed twice
    assert any("loose" in msg for msg in p.check_free_extents())
    p._loose.pop()
    b = p.allocate(1)
    p.ref_counts[b] = 0
    p._loose.append(int(b[0]))
    p.ref_counts[b] = 1  # a loose id that is referenced
    assert any("loose" in msg for msg in p.check_free_extents())


def test_manager_decode_appends_reuse_freed_single_blocks():
    m = tiny_manager()
    m.allocate("a", 4)  # 1 KV + 2 state sets
    m.allocate("b", 4)
    m.append("a", 1)  # a second KV block, from the extents
    m.free("b")
    m.check_integrity()
    m.allocate("c", 4)
    m.append("c", 1)
    m.check_integrity()
    for r in ("a", "c"):
        m.free(r)
    m.check_integrity()
    assert m.pool.free_extents() == [(1, 40)] and m.usage().free == 39

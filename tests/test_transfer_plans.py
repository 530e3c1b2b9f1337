"""Transfer plans: export pins a request until settled, import admits one atomically; nothing leaks."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.errors import DuplicateRequestError, NoFreeBlocksError, RequestStateError
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.blockmgr.transfer_plans import RequestBlocks, TransferDirection

from .manager_fixtures import tiny_manager


def books(m):
    """Everything a transfer plan may touch (compare before and after an abort)."""
    return (
        m.usage(),
        m.pool.free_extents(),
        m.pool.ref_counts.tolist(),
        m.use.tolist(),
        {r: (rec.num_tokens, rec.status, rec.kv_blocks.tolist(), rec.state.tolist()) for r, rec in m.requests.items()},
        m.tables.kv.tolist(),
        m.tables.state.tolist(),
    )


def test_export_pins_the_request_until_commit_frees_it():
    m = tiny_manager()
    m.allocate("a", 10)  # state sets 1-3, 4-6 then KV 7-9
    plan = m.export_request("a")
    assert plan.direction is TransferDirection.EXPORT and len(plan) == 9
    assert plan.blocks.kv_blocks.tolist() == [7, 8, 9]
    assert [s.tolist() for s in plan.blocks.state_blocks] == [[1, 2, 3], [4, 5, 6]]
    assert plan.blocks.ids().tolist() == list(range(1, 10))
    m.check_integrity()
    for op in (
        lambda: m.append("a", 1),
        lambda: m.free("a"),
        lambda: m.block_table(["a"]),
        lambda: m.swap_out("a"),
        lambda: m.export_request("a"),
        lambda: m.fork("a", "a2"),
    ):
        with pytest.raises(RequestStateError):
            op()
    m.check_integrity()
    plan.commit()
    assert "a" not in m.requests and m.pool.free_extents() == [(1, 40)]
    m.check_integrity()
    with pytest.raises(RequestStateError, match="settled"):
        plan.abort()


def test_export_abort_unpins_and_the_request_runs_on():
    m = tiny_manager()
    m.allocate("a", 10)
    before = books(m)
    m.export_request("a").abort()
    assert books(m) == before
    m.append("a", 3)  # 13 tokens: a fourth KV block
    assert m.block_table(["a"]).tolist() == [[7, 8, 9, 10]]
    m.check_integrity()


def test_import_allocates_other_ids_and_runs_after_commit():
    m = tiny_manager()
    m.allocate("x", 4)  # ids 1-7 taken here: the import gets others than the source's 1-9
    plan = m.import_request("r", 10)
    assert plan.direction is TransferDirection.IMPORT
    assert [s.tolist() for s in plan.blocks.state_blocks] == [[8, 9, 10], [11, 12, 13]]
    assert plan.blocks.kv_blocks.tolist() == [14, 15, 16] and plan.blocks.num_tokens == 10
    m.check_integrity()
    with pytest.raises(RequestStateError):
        m.block_table(["r"])  # not running before its bytes arrived
    with pytest.raises(RequestStateError):
        m.free("r")
    plan.commit()
    assert m.block_table(["r"]).tolist() == [[14, 15, 16]]
    assert m.state_table(["r"])[:, 0].tolist() == [[8, 9, 10], [11, 12, 13]]
    m.append("r", 3)
    m.check_integrity()
    with pytest.raises(RequestStateError):
        plan.commit()


def test_import_abort_leaves_the_manager_as_it_was():
    m = tiny_manager()
    m.allocate("x", 4)
    m.allocate("y", 9)
    m.free("x")  # a hole at 1-7 makes the import's ids a best-fit run elsewhere
    before = books(m)
    plan = m.import_request("r", 30)
    m.check_integrity()
    plan.abort()
    assert books(m) == before
    m.check_integrity()


def test_import_is_atomic_on_errors():
    m = tiny_manager()
    m.allocate("x", 4 * 30)  # 30 KV + 6 state blocks: 3 left
    before = books(m)
    with pytest.raises(NoFreeBlocksError):
        m.import_request("r", 8)
    with pytest.raises(DuplicateRequestError):
        m.import_request("x", 1)
    assert books(m) == before
    assert not m.can_import(8)
    m.check_integrity()


def test_import_abort_with_a_prefix_cache():
    m = HybridBlockManager(tiny_manager().layout, prefix_cache=PrefixCacheConfig())
    plan = m.import_request("r", 12)
    m.check_integrity()
    plan.abort()
    assert m.pool.free_extents() == [(1, 40)]
    m.check_integrity()


def test_request_blocks_round_trip_the_wire():
    blocks = RequestBlocks(10, np.array([7, 9], np.int32), (np.array([1, 2], np.int32), np.array([5], np.int32)))
    back = RequestBlocks.from_wire(blocks.to_wire())
    assert back.to_wire() == blocks.to_wire() and back.same_shape(blocks)
    assert not back.same_shape(blocks._replace(num_tokens=11))


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "free", "export", "import", "settle"]), st.integers(0, 40)),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=int(os.environ.get("HYBRIDKV_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(OPS, st.booleans())
def test_random_plans_keep_the_books(ops, commit_first):
    """Random lifecycles with export and import plans settled in any order: integrity after every step,
    and a pool that drains back to one free extent."""
    m = tiny_manager()
    plans, next_id = {}, 0
    for op, n in ops:
        running = [r for r, rec in m.requests.items() if rec.pending is None]
        try:
            if op == "alloc":
                m.allocate(next_id, n)
                next_id += 1
            elif op == "import":
                plans[next_id] = m.import_request(next_id, n)
                next_id += 1
            elif op == "append" and running:
                m.append(running[n % len(running)], n % 5)
            elif op == "free" and running:
                m.free(running[n % len(running)])
            elif op == "export" and running:
                r = running[n % len(running)]
                plans[r] = m.export_request(r)
            elif op == "settle" and plans:
                r = sorted(plans)[n % len(plans)]
                plan = plans.pop(r)
                plan.commit() if (n % 2 == 0) == commit_first else plan.abort()
        except NoFreeBlocksError:
            pass
        m.check_integrity()
    for plan in plans.values():
        plan.abort()
    for r in list(m.requests):
        m.free(r)
    m.check_integrity()
    assert m.pool.free_extents() == [(1, 40)]

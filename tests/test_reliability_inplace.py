"""Regression tests for the in-place flow's defects of the reliability issue (issue 43): 3, 4, 5, 6,
14 and the small refusals found beside them. Each failed on the code before its fix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridkv.blockmgr.integrity import check_integrity
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec
from hybridkv.errors import UnknownRequestError
from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig
from tests.test_scheduler_data import _manager

IN_PLACE = PrefixCacheConfig(
    checkpoint=CheckpointPolicy.VLLM_ALIGN, demote_tail=False, evict_batch_fraction=0.0, in_place_state=True
)
ALIGN = dataclasses.replace(IN_PLACE, in_place_state=False)


def _lent_checkpoint(m, rid="a"):
    """A request whose live sets are the checkpoint at 8 (9 tokens: the replay boundary is 8)."""
    m.allocate(rid, 0, token_ids=list(range(1, 10)))
    m.append(rid, 8)
    assert not len(m.checkpoint(rid))
    assert m.prefix_cache.match(list(range(1, 10)), 9).num_tokens == 8
    return m._set_ids(m.requests[rid].state).copy()


# ---- 3 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["free", "append"])
def test_a_lent_checkpoint_a_fork_copy_still_reads_stays_unevictable_until_the_copy_ran(how):
    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    live = _lent_checkpoint(m)
    copies = m.fork("a", "c")  # reads a's live sets: the checkpoint
    assert np.isin(copies.src, live).all()
    if how == "free":
        m.free("a")
    else:
        m.append("a", 1)
        m.begin_pin_epoch()
        m.append("a", 1)  # the lent checkpoint is given back now, while the fork's copy has not run
    assert m.prefix_cache.num_evictable == 0, "the checkpoint the fork's copy reads was counted evictable"
    # everything available can really be taken, and no block the copy reads is handed out
    n = m.num_available_blocks
    assert m.can_allocate(n)
    m.allocate("big", n)
    assert not np.isin(m.requests["big"].kv_blocks, live).any()
    check_integrity(m)
    m.free("big")
    m.release_pins()
    assert m.prefix_cache.num_evictable == m.num_state_blocks  # evictable once the copy ran
    check_integrity(m)


# ---- 4 ---------------------------------------------------------------------------------------------
def test_free_keeping_state_gives_back_the_sets_held_from_the_boundary_before():
    m = _manager("uniform", 40, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    m.allocate("a", 0, token_ids=list(range(1, 18)))  # 17 tokens: the replay boundary is 16
    m.append("a", 8)
    m.checkpoint("a")  # a held state at 8, lent where it is
    m.append("a", 8)  # new live sets; the ones of 8 held until the next append
    assert "a" in m._held
    m.release_pins()
    m.mark_computed("a", 16)
    assert m.free_keeping_state("a")  # (no checkpoint was made after the forward to 16)
    m.release_pins()
    assert not m._held and not m._lent and not m._export_held
    check_integrity(m)
    u = m.usage()
    assert u.state_live == 0 and u.pending_free == 0, f"blocks held for good after free_keeping_state: {u}"
    assert u.free + u.kv_cached + u.checkpoints == m.pool.num_usable


# ---- 5 ---------------------------------------------------------------------------------------------
def test_free_keeping_state_on_a_model_without_recurrent_layers_frees_the_request():
    model = ModelSpec("attn", (AttentionLayerSpec(1, 8, DType.BFLOAT16),), params_active=1e6)
    layout = plan(model, 32 * plan(model, 1 << 20, block_size=4).bytes_per_block, block_size=4)
    m = HybridBlockManager(layout, prefix_cache=ALIGN)
    m.allocate("a", 0, token_ids=list(range(1, 10)))
    m.append("a", 8)
    m.checkpoint("a")
    assert m.free_keeping_state("a") is False
    assert "a" not in m.requests
    check_integrity(m)


# ---- 6 ---------------------------------------------------------------------------------------------
def test_in_place_state_with_speculative_tokens_is_refused_at_construction():
    m = _manager("uniform", 40, 0, 0.0, IN_PLACE)
    with pytest.raises(ValueError, match="in_place_state"):
        Scheduler(m, SchedulerConfig(num_speculative_tokens=2))
    Scheduler(_manager("uniform", 40, 0, 0.0, ALIGN), SchedulerConfig(num_speculative_tokens=2))


# ---- 14 --------------------------------------------------------------------------------------------
def test_cancel_checkpoints_never_frees_blocks_a_fork_copy_of_the_same_epoch_reads():
    m = _manager("uniform", 40, 0, 0.0, ALIGN)
    m.allocate("a", 0, token_ids=list(range(1, 10)))
    m.append("a", 8)
    m.mark_computed("a", 8)
    e = m.begin_pin_epoch()
    live = m._set_ids(m.requests["a"].state).copy()
    copies = m.fork("a", "c")  # a copy of epoch e reads a's live sets
    assert np.isin(copies.src, live).all()
    assert m.free_keeping_state("a")  # the live sets become the checkpoint at 8, where they are
    dropped = m.cancel_checkpoints(e)
    assert not np.isin(dropped, live).any(), "cancelled a checkpoint whose blocks the fork's copy reads"
    m.allocate("b", 4 * (m.num_available_blocks - m.num_state_blocks))
    assert not np.isin(m.requests["b"].kv_blocks, live).any()
    check_integrity(m)


# ---- the small refusals ----------------------------------------------------------------------------
def test_checkpoint_exported_must_be_a_position():
    m = _manager("uniform", 24, 0, 0.0, ALIGN)
    m.allocate("a", 0, token_ids=list(range(1, 10)))
    m.append("a", 8)
    with pytest.raises(TypeError, match="exported"):
        m.checkpoint("a", exported="x")
    with pytest.raises(TypeError, match="exported"):
        m.checkpoint("a", exported=True)
    check_integrity(m)


def test_reclaim_lent_of_an_unknown_request_is_an_error():
    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    with pytest.raises(UnknownRequestError):
        m.reclaim_lent("nobody")


# ---- 2 ---------------------------------------------------------------------------------------------
def test_an_import_never_receives_a_block_whose_offload_to_the_host_tier_is_queued():
    """A decode instance with a host tier imports a request (a pull from a peer): the eviction that
    makes room queues offloads of the evicted cached blocks, and the import's READ lands at once,
    before stage 0 of the next plan could run them."""
    m = _manager("uniform", 24, 32, 0.0, PrefixCacheConfig(), host_tier=True)
    for i in range(3):  # cached prefixes filling the pool
        rid = f"p{i}"
        ids = [100 * i + t for t in range(1, 22)]
        m.allocate(rid, 21, token_ids=ids)
        m.mark_computed(rid, 20)
        m.checkpoint(rid)
        m.free(rid)
    m.take_tier_copies()
    assert m.prefix_cache.num_evictable > 0
    plan = m.import_request("imp", 4 * (m.num_available_blocks - m.num_state_blocks))
    queued = m.take_tier_copies().offload
    mine = np.concatenate((m.requests["imp"].kv_blocks, m._set_ids(m.requests["imp"].state)))
    assert not np.isin(queued.device_blocks, mine).any(), "an offload reads a block the import's READ overwrites"
    assert m.prefix_cache.tier.stats.dropped > 0, "the import evicted no block whose offload was queued"
    plan.commit()
    check_integrity(m)

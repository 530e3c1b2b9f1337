"""In-place checkpoints (``PrefixCacheConfig(in_place_state=True)``) under hybridkv's own checkpoint
policies, with and without a prefill kernel that exports states from inside chunks (several per
chunk): every request reads exactly its own bytes, checked by the data-checking executor of
``tests/test_scheduler_data.py`` (its shadow follows every block through lent, held and new live
sets and through the exported sets), with forks, aborts, tiny pools, recompute preemptions and a
second batch; and the manager's books in the flow.

The mechanism is the one ``tests/test_vllm_in_place.py`` checks under vLLM's align mode: the state a
forward ends on at a block boundary where the policy keeps a checkpoint stays in the live sets (the
checkpoint, no copy), the request's next append takes new live sets and copies the state over.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.integrity import check_integrity
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.scheduler_adapter.cost import PreemptionMode
from tests.test_scheduler_data import WORKLOAD, _manager, run_data_workload

EXAMPLES = int(os.environ.get("IN_PLACE_EXAMPLES", "120"))
OWN_POLICIES = [p for p in CheckpointPolicy if p is not CheckpointPolicy.VLLM_ALIGN]

own_in_place = st.builds(
    PrefixCacheConfig,
    # every_n_blocks twice: checkpoints at (nearly) every block boundary keep the pool short of blocks
    st.sampled_from([*OWN_POLICIES, CheckpointPolicy.EVERY_N_BLOCKS]),
    st.sampled_from(EvictionPolicy),
    st.sampled_from([1, 1, 2, 3]),
    evict_batch_fraction=st.sampled_from([0.01, 0.3]),
    demote_tail=st.booleans(),
    export_alignment=st.sampled_from([None, None, 4, 8]),  # block size 4: one or two blocks
    in_place_state=st.just(True),
)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    kind=WORKLOAD["kind"],
    actions=WORKLOAD["actions"],
    num_blocks=WORKLOAD["num_blocks"],
    watermark=WORKLOAD["watermark"],
    max_num_seqs=WORKLOAD["max_num_seqs"],
    max_tokens=WORKLOAD["max_tokens"],
    admission=WORKLOAD["admission"],
    run_aborted=WORKLOAD["run_aborted"],
    seed=WORKLOAD["seed"],
    second_batch=WORKLOAD["second_batch"],
    second_config=st.tuples(st.integers(1, 5), st.integers(4, 24), st.just(0)),
    cancel_at_end=WORKLOAD["cancel_at_end"],
    prefix=own_in_place,
)
def test_in_place_checkpoints_of_own_policies_read_exactly_their_own_bytes(**kw):
    run_data_workload(
        mode=PreemptionMode.RECOMPUTE, k=0, num_host_blocks=0, sync_swaps=False, accept_rate=0.0, **kw
    )  # fmt: skip


def test_a_checkpoint_of_an_own_policy_is_the_live_sets_until_the_next_append():
    """``branch_and_last`` keeps the input's end: no copy after the forward, the live sets are the
    checkpoint (matchable, held: not evictable); the next append takes new sets and copies the state
    over; the one after gives the checkpoint to the LRU queue."""
    cfg = PrefixCacheConfig(checkpoint=CheckpointPolicy.BRANCH_AND_LAST, in_place_state=True)
    m = _manager("uniform", 24, 0, 0.0, cfg)
    m.begin_pin_epoch()
    ids = list(range(1, 10))  # 9 tokens: the input's end, floored to a block, is 8
    m.allocate("a", 0, token_ids=ids)
    m.append("a", 8)
    assert not len(m.checkpoint("a"))  # no copy
    live = m._set_ids(m.requests["a"].state).copy()
    assert m.prefix_cache.match(ids, 9).num_tokens == 8
    assert np.array_equal(np.sort(m.prefix_cache.checkpoint_blocks()), np.sort(live))
    m.release_pins()
    assert m.prefix_cache.num_evictable == 0
    assert m.num_new_kv_blocks("a", 1) == 1 + m.num_state_blocks
    copies = m.append("a", 1)
    new = m._set_ids(m.requests["a"].state)
    assert not np.isin(new, live).any() and np.array_equal(copies.src[: live.size], live)
    m.release_pins()
    m.append("a", 1)
    assert m.prefix_cache.num_evictable == m.num_state_blocks  # (its KV blocks are the request's)
    check_integrity(m)
    m.free("a")
    m.release_pins()
    check_integrity(m)
    assert m.num_available_blocks == m.pool.num_usable


def test_several_exports_of_one_chunk_are_checkpoints_none_held():
    """``every_n_blocks`` (every block) with a kernel exporting on a one-block grid: one chunk of
    three blocks exports two states (positions 4 and 8) and ends on the third; with in-place
    checkpoints the exports are checkpoints at once (evictable after the pins), none held."""
    cfg = PrefixCacheConfig(checkpoint=CheckpointPolicy.EVERY_N_BLOCKS, every_n=1, export_alignment=4,
                            in_place_state=True)  # fmt: skip
    m = _manager("uniform", 32, 0, 0.0, cfg)
    m.begin_pin_epoch()
    m.allocate("a", 0, token_ids=list(range(1, 14)))
    assert m.export_positions("a", 0, 12) == (4, 8)
    m.append("a", 12)
    for p in (4, 8):
        assert m.reserve_export("a", p) is not None
    m.checkpoint("a", exported=(4, 8))
    m.release_pins()
    assert m.prefix_cache.num_evictable == 2 * m.num_state_blocks  # the exports; 12 is the live sets
    m.append("a", 1)
    m.release_pins()
    m.append("a", 1)
    assert m.prefix_cache.num_evictable == 3 * m.num_state_blocks
    check_integrity(m)
    m.free("a")
    m.release_pins()
    check_integrity(m)

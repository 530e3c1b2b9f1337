"""``PrefixCacheConfig(in_place_state=True)`` (the ``vllm_align`` state flow of ``--engine vllm``):
every request reads exactly its own bytes, checked by the data-checking executor of
``tests/test_scheduler_data.py`` (its shadow follows every block through lent, held and new live
sets), with forks, aborts, tiny pools, recompute preemptions and a second batch; and the manager's
books and refusals.

In that flow a state a forward ends on at a block boundary stays in the live sets where they are
(the checkpoint, when it is one the policy keeps matchable), the next append takes new live sets
and copies the state over, and the sets of the boundary before are given back then: the blocks are
taken and freed when vLLM 0.33's ``MambaManager`` takes and frees them (``tests/test_vllm_scheduler.py``
checks the whole runs against vLLM's real scheduler).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.integrity import check_integrity
from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.errors import RequestStateError
from hybridkv.scheduler_adapter.cost import PreemptionMode
from tests.test_scheduler_data import WORKLOAD, _manager, run_data_workload

EXAMPLES = int(os.environ.get("IN_PLACE_EXAMPLES", "120"))
IN_PLACE = PrefixCacheConfig(
    checkpoint=CheckpointPolicy.VLLM_ALIGN, demote_tail=False, evict_batch_fraction=0.0, in_place_state=True
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
    run_aborted=WORKLOAD["run_aborted"],
    seed=WORKLOAD["seed"],
    second_batch=WORKLOAD["second_batch"],
    second_config=st.tuples(st.integers(1, 5), st.integers(4, 24), st.just(0)),
    cancel_at_end=WORKLOAD["cancel_at_end"],
    exports=st.sampled_from([0, 1, 1, 2]),
)
def test_in_place_states_read_exactly_their_own_bytes(exports, **kw):
    """``exports``: the prefill kernel also writes the state at the input's last block boundary
    from inside the chunk that reaches the input's end (GDN's ``export_alignment``; a grid of one
    or two blocks) into sets reserved with the chunk, which become the checkpoint there."""
    prefix = IN_PLACE if not exports else dataclasses.replace(IN_PLACE, export_alignment=4 * exports)
    run_data_workload(
        mode=PreemptionMode.RECOMPUTE, k=0, num_host_blocks=0, prefix=prefix, sync_swaps=False,
        accept_rate=0.0, **kw,
    )  # fmt: skip


def _lend_one(m, tokens=8):
    """Admit a request with token ids, run a forward to a block boundary and checkpoint it there."""
    ids = list(range(1, tokens + 1))
    m.allocate("a", 0, token_ids=ids)
    m.append("a", tokens)
    m.checkpoint("a")
    return ids


def test_a_lent_state_is_replaced_at_the_next_append_and_freed_one_later():
    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    _lend_one(m)  # 8 tokens: the input's last boundary before its last token is 4: a held state at 8
    rec = m.requests["a"]
    lent = m._set_ids(rec.state).copy()
    assert "a" in m._lent and m.checkpoint_blocks_due("a") == 0
    before = m.num_available_blocks
    assert m.num_new_kv_blocks("a", 1) == 1 + m.num_state_blocks  # a KV block and new live sets
    copies = m.append("a", 1)
    new = m._set_ids(rec.state)
    assert not np.isin(new, lent).any()
    assert np.array_equal(copies.src[: lent.size], lent) and np.array_equal(copies.dst[: lent.size], new)
    assert m.num_available_blocks == before - 1 - m.num_state_blocks  # the lent sets are held
    m.release_pins()
    check_integrity(m)
    m.append("a", 1)  # the next step gives the held sets back
    assert m.num_available_blocks == before - 1
    check_integrity(m)
    m.free("a")
    m.release_pins()
    check_integrity(m)
    assert m.num_available_blocks == m.pool.num_usable


def test_a_lent_checkpoint_is_the_live_sets_and_stays_pinned_until_given_back():
    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    m.allocate("a", 0, token_ids=list(range(1, 10)))  # 9 tokens: the replay boundary is 8
    m.append("a", 8)
    assert not len(m.checkpoint("a"))  # no copy: the live sets are the checkpoint
    live = m._set_ids(m.requests["a"].state).copy()
    assert m.prefix_cache.match(list(range(1, 10)), 9).num_tokens == 8
    assert np.array_equal(np.sort(m.prefix_cache.checkpoint_blocks()), np.sort(live))
    m.release_pins()  # epochs do not release it: its request does
    assert m.prefix_cache.num_evictable == 0
    check_integrity(m)
    m.append("a", 1)
    m.release_pins()
    m.append("a", 1)  # given back: evictable now
    assert m.prefix_cache.num_evictable == m.num_state_blocks
    m.free("a")
    m.release_pins()
    check_integrity(m)


def test_in_place_state_refuses_what_it_cannot_follow():
    with pytest.raises(ValueError, match="host pool"):
        _manager("uniform", 24, 8, 0.0, IN_PLACE)
    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    _lend_one(m)
    with pytest.raises(RequestStateError, match="speculative"):
        m.begin_speculation("a", 1)
    check_integrity(m)


def test_a_failed_append_keeps_the_held_sets():
    """An append that cannot take its blocks raises and changes nothing: the sets held from the
    boundary before stay held (they are given back only by an append that goes through)."""
    from hybridkv.errors import NoFreeBlocksError

    m = _manager("uniform", 24, 0, 0.0, IN_PLACE)
    m.begin_pin_epoch()
    _lend_one(m)
    m.append("a", 1)  # new live sets; the lent ones are held now
    m.release_pins()
    assert "a" in m._held
    m.allocate("hog", (m.num_available_blocks - m.num_state_blocks) * m.block_size)  # what is left
    before = (m.num_available_blocks, m.pool.num_free, dict(m._held), m.requests["a"].num_tokens)
    with pytest.raises(NoFreeBlocksError):
        m.append("a", 64)  # needs far more than the held sets give back
    after = (m.num_available_blocks, m.pool.num_free, dict(m._held), m.requests["a"].num_tokens)
    assert after[0:2] == before[0:2] and after[2].keys() == before[2].keys() and after[3] == before[3]
    check_integrity(m)

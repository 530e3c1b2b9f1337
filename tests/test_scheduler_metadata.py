"""Step metadata: exact arrays of a mixed decode + draft + prefill-chunk step, padded to a fixed batch."""

import numpy as np
import pytest

from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig, StepOutputs, build_step_metadata
from tests.test_scheduler import tiny_manager


def test_mixed_step_arrays_with_padding_rows_at_the_null_block():
    m = tiny_manager(64)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=12, num_speculative_tokens=2))
    s.add_request("d", 5, 8)
    s.add_request("p", 14, 2)
    p0 = s.step()  # d: 5-token prefill; p: first 7 tokens (budget 12)
    s.update(StepOutputs({"d": [1]}))
    plan = s.step()  # d decodes 1 + 2 drafts; p: 7 more tokens (budget 12 - 3 = 9 -> 7 left)

    def shape(p):
        return [(r.num_computed_tokens, r.num_scheduled_tokens, r.num_drafts) for r in p.scheduled]

    assert shape(p0) == [(0, 5, 0), (0, 7, 0)] and shape(plan) == [(5, 1, 2), (7, 7, 0)]
    md = build_step_metadata(m, plan, batch_size=4, max_blocks_per_seq=6)
    d_kv, p_kv = m.block_table(["d"])[0], m.block_table(["p"])[0]

    assert md.request_ids == ("d", "p") and md.num_rows == 2 and md.batch_size == 4 and md.num_tokens == 10
    np.testing.assert_array_equal(md.positions, [5, 6, 7, 7, 8, 9, 10, 11, 12, 13])
    np.testing.assert_array_equal(md.batch_id_per_token, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(md.seq_lens_this_time, [3, 7, 0, 0])
    np.testing.assert_array_equal(md.seq_lens_encoder, [0, 7, 0, 0])
    np.testing.assert_array_equal(md.seq_lens_decoder, [5, 7, 0, 0])
    np.testing.assert_array_equal(md.cu_seqlens_q, [0, 3, 10, 10, 10])
    np.testing.assert_array_equal(md.cu_seqlens_k, [0, 8, 22, 22, 22])
    np.testing.assert_array_equal(md.has_initial_state, [True, True, False, False])
    np.testing.assert_array_equal(md.num_drafts, [2, 0, 0, 0])
    np.testing.assert_array_equal(md.samples, [True, True, False, False])
    assert md.block_tables.shape == (4, 6) and md.block_tables.dtype == np.int32
    np.testing.assert_array_equal(md.block_tables[0, :2], d_kv[:2])
    np.testing.assert_array_equal(md.block_tables[1, :4], p_kv[:4])
    assert not md.block_tables[2:].any() and not md.block_tables[0, 2:].any()
    # slots: block * 4 + offset for positions 5..7 of d and 7..13 of p
    expected = [d_kv[q // 4] * 4 + q % 4 for q in (5, 6, 7)] + [p_kv[q // 4] * 4 + q % 4 for q in range(7, 14)]
    np.testing.assert_array_equal(md.slot_mapping, expected)
    assert md.state_tables.shape == (2, 4, 2)
    np.testing.assert_array_equal(md.state_tables[:, :2], m.state_table(["d", "p"]))
    assert not md.state_tables[:, 2:].any()
    assert md.speculative_state_tables.shape == (2, 2, 4, 2)
    np.testing.assert_array_equal(md.speculative_state_tables[:, :, 0], m.speculative_table("d")[:2])
    assert not md.speculative_state_tables[:, :, 1:].any()
    # no block is both KV and state of the batch
    kv_ids = set(md.block_tables[md.block_tables > 0].tolist())
    assert kv_ids.isdisjoint(md.state_tables[md.state_tables > 0].tolist())


def test_fixed_sizes_too_small_are_refused():
    m = tiny_manager(64)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    for i in range(3):
        s.add_request(i, 9, 2)
    plan = s.step()
    with pytest.raises(ValueError, match="batch_size=2"):
        build_step_metadata(m, plan, batch_size=2)
    with pytest.raises(ValueError, match="max_blocks_per_seq=2"):
        build_step_metadata(m, plan, max_blocks_per_seq=2)


def test_empty_step():
    s = Scheduler(tiny_manager(16))
    md = build_step_metadata(s.manager, s.step(), batch_size=2)
    assert md.num_tokens == 0 and md.positions.size == 0 and md.block_tables.shape == (2, 0)
    np.testing.assert_array_equal(md.cu_seqlens_q, [0, 0, 0])

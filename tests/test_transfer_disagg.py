"""Prefill/decode roles over two schedulers in one process (the loopback engine moves the bytes)."""

import numpy as np
import pytest

from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.scheduler_adapter.disagg import DecodeRole, PrefillRole
from hybridkv.scheduler_adapter.requests import StepOutputs
from hybridkv.scheduler_adapter.scheduler import SchedulerConfig
from hybridkv.transfer import TransferError
from hybridkv.transfer.handoff import BlocksMessage
from hybridkv.transfer.loopback import LoopbackEngine, LoopbackHub, connect_pair, regions_of_array
from hybridkv.transfer.testing import mini_layout, mini_mamba2, mini_minimax, reference_bytes, seeded_pool


def sample(plan, token=7):
    return StepOutputs({r.request_id: [token] for r in plan.scheduled if r.samples})


def roles(model=mini_minimax, num_blocks=200):
    layout = mini_layout(model(), num_blocks)
    src, dst = seeded_pool(layout, 1), seeded_pool(layout, 2)
    config = SchedulerConfig(max_num_batched_tokens=32)
    prefill = PrefillRole(layout, regions_of_array(layout, src), config)
    decode = DecodeRole(layout, regions_of_array(layout, dst), config)
    hub = LoopbackHub()
    p_engine, d_engine = LoopbackEngine("prefill", prefill.pool, hub), LoopbackEngine("decode", decode.pool, hub)
    connect_pair(p_engine, d_engine)
    return layout, src, dst, prefill, decode, p_engine, d_engine


@pytest.mark.parametrize("model", [mini_minimax, mini_mamba2])
def test_requests_prefill_here_and_decode_there(model):
    layout, src, dst, prefill, decode, p_engine, d_engine = roles(model)
    prompts = {"a": list(range(100, 130)), "b": 45, "c": list(range(9))}  # chunked: 32 tokens per step
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt)
    handoffs, steps = [], 0
    while prefill.scheduler.has_unfinished:
        handoffs += prefill.update(sample(prefill.step(), token=ord("x")))
        steps += 1
    assert steps >= 3 and sorted(h.request_id for h in handoffs) == ["a", "b", "c"]
    assert prefill.num_pending_handoffs == 3  # exported, pinned: nothing freed before the peer read it
    prefill.manager.check_integrity()
    for h in handoffs:
        offered = BlocksMessage.from_bytes(h.offer).blocks
        plan = decode.pull(d_engine, "prefill", h, max_new_tokens=4, timeout_s=1.0)
        assert reference_bytes(dst, layout, plan.blocks) == reference_bytes(src, layout, offered)
        assert h.first_token == ord("x") and not h.stopped
    assert sorted(prefill.settle(p_engine, "decode")) == ["a", "b", "c"]
    assert prefill.num_pending_handoffs == 0 and not prefill.manager.requests
    prefill.manager.check_integrity()
    assert prefill.manager.pool.free_extents() == [(1, layout.num_blocks)]
    # decode: the first row of each request computes the first token's KV and samples the second
    first = decode.step()
    assert sorted((r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in first.scheduled) == [
        ("a", 30, 1),
        ("b", 45, 1),
        ("c", 9, 1),
    ]
    decode.manager.check_integrity()
    finished, plan = [], first
    while True:
        finished += decode.update(sample(plan)).finished
        decode.manager.check_integrity()
        if not decode.scheduler.has_unfinished:
            break
        plan = decode.step()
    assert sorted(finished) == ["a", "b", "c"]
    done = decode.scheduler.pop_finished()
    assert all(len(done[r].output_token_ids) == 3 for r in done)  # 4 new tokens, the first from prefill
    assert decode.manager.pool.free_extents() == [(1, layout.num_blocks)]


def test_a_failed_pull_leaves_the_decode_side_clean_and_the_prefill_side_frees_on_cancel():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    prefill.add_request("a", 20)
    (h,) = prefill.update(sample(prefill.step()))
    before = (decode.manager.pool.free_extents(), decode.manager.use.tolist())
    p_engine.close()  # the prefill instance vanished
    with pytest.raises(TransferError, match="not connected"):
        decode.pull(d_engine, "prefill", h, max_new_tokens=4, timeout_s=1.0)
    assert (decode.manager.pool.free_extents(), decode.manager.use.tolist()) == before
    assert not decode.manager.requests and not decode.scheduler.has_unfinished
    decode.manager.check_integrity()
    prefill.cancel("a")
    assert prefill.manager.pool.free_extents() == [(1, layout.num_blocks)]
    prefill.manager.check_integrity()


def test_a_stop_at_the_first_token_is_marked_and_cancelled_locally():
    _, _, _, prefill, _, _, _ = roles()
    prefill.add_request("a", 5)
    plan = prefill.step()
    (h,) = prefill.update(StepOutputs({"a": [2]}, finished={"a"}))
    assert h.stopped and plan.scheduled[0].samples
    prefill.cancel("a")
    assert not prefill.manager.requests
    prefill.manager.check_integrity()


def test_loopback_engine_refuses_descriptors_outside_a_region():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    blocks = RequestBlocks(4, np.array([10], np.int32), tuple(np.arange(1, 5, dtype=np.int32) for _ in range(7)))
    from hybridkv.transfer import pair_descriptors

    pairs = pair_descriptors(prefill.pool, blocks, decode.pool, blocks)
    small = regions_of_array(layout, dst[:, :, :5].copy())  # a peer pool of 5 blocks: block 10 is past its end
    with pytest.raises(TransferError, match="past their regions"):
        p_engine.write("decode", pairs, small, b"", 1.0)

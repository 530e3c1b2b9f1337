"""Prefill/decode roles over two schedulers in one process (the loopback engine moves the bytes)."""

import numpy as np
import pytest

from hybridkv.blockmgr.errors import DuplicateRequestError, RequestTooLargeError, UnknownRequestError
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.models.spec import with_state_dtype
from hybridkv.scheduler_adapter.cost import PreemptionMode
from hybridkv.scheduler_adapter.disagg import DecodeRole, PrefillRole
from hybridkv.scheduler_adapter.requests import StepOutputs
from hybridkv.scheduler_adapter.scheduler import SchedulerConfig
from hybridkv.transfer import TransferError
from hybridkv.transfer.errors import HandoffRefusedError
from hybridkv.transfer.handoff import BlocksMessage, notification_for
from hybridkv.transfer.loopback import LoopbackEngine, LoopbackHub, connect_pair, regions_of_array
from hybridkv.transfer.testing import mini_layout, mini_mamba2, mini_minimax, reference_bytes, seeded_pool
from tests.test_transfer_descriptors import _same_states, quantized_states


def sample(plan, token=7):
    return StepOutputs({r.request_id: [token] for r in plan.scheduled if r.samples})


def roles(model=mini_minimax, num_blocks=200, config=None, num_host_blocks=200):
    layout = mini_layout(model(), num_blocks)
    src, dst = seeded_pool(layout, 1), seeded_pool(layout, 2)
    config = config or SchedulerConfig(max_num_batched_tokens=32)
    prefill = PrefillRole(layout, regions_of_array(layout, src), config)
    decode = DecodeRole(layout, regions_of_array(layout, dst), config, num_host_blocks=num_host_blocks)
    hub = LoopbackHub()
    p_engine, d_engine = LoopbackEngine("prefill", prefill.pool, hub), LoopbackEngine("decode", decode.pool, hub)
    connect_pair(p_engine, d_engine)
    return layout, src, dst, prefill, decode, p_engine, d_engine


def mini_mamba2_int8():
    """mini_mamba2 with its ssm state int8 (values then float32 row scales in the set)."""
    return with_state_dtype(mini_mamba2(), "int8")


def mini_minimax_fp8():
    """mini_minimax with its lightning state float8_e4m3fn (values then float32 row scales)."""
    return with_state_dtype(mini_minimax(), "fp8")


@pytest.mark.parametrize("model", [mini_minimax, mini_mamba2, mini_mamba2_int8, mini_minimax_fp8])
def test_requests_prefill_here_and_decode_there(model):
    """Splitwise prefill -> decode: every hand-off's bytes arrive as they were, an int8 / fp8 state's
    values and scales included (checked on their own as well)."""
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
        states = quantized_states(src, layout, offered)
        assert len(states) == (
            0 if model in (mini_minimax, mini_mamba2) else {"mini-mamba2": 4}.get(layout.model.name, 14)
        )
        assert _same_states(quantized_states(dst, layout, plan.blocks), states)
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


def test_a_stop_at_the_first_token_is_marked_and_released_at_once():
    layout, _, _, prefill, decode, _, d_engine = roles()
    prefill.add_request("a", 5)
    plan = prefill.step()
    (h,) = prefill.update(StepOutputs({"a": [2]}, finished={"a"}))
    assert h.stopped and h.offer is None and h.first_token == 2 and plan.scheduled[0].samples
    # "drop it" is true: nothing is pinned, nothing is pending, nothing to cancel
    assert not prefill.manager.requests and prefill.num_pending_handoffs == 0
    assert prefill.manager.pool.free_extents() == [(1, layout.num_blocks)]
    prefill.manager.check_integrity()
    with pytest.raises(UnknownRequestError, match="stopped at its first token"):
        prefill.cancel("a")
    with pytest.raises(ValueError, match="nothing to decode"):
        decode.pull(d_engine, "prefill", h, max_new_tokens=4, timeout_s=1.0)
    assert not decode.manager.requests


def test_loopback_engine_refuses_descriptors_outside_a_region():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    blocks = RequestBlocks(4, np.array([10], np.int32), tuple(np.arange(1, 5, dtype=np.int32) for _ in range(7)))
    from hybridkv.transfer import pair_descriptors

    pairs = pair_descriptors(prefill.pool, blocks, decode.pool, blocks)
    small = regions_of_array(layout, dst[:, :, :5].copy())  # a peer pool of 5 blocks: block 10 is past its end
    with pytest.raises(TransferError, match="past their regions"):
        p_engine.write("decode", pairs, small, b"", 1.0)


# ---- regressions ---------------------------------------------------------------------------------
def small_decode(num_blocks, num_host_blocks=0, prompts=None, config=None):
    """A roomy prefill role, a decode role of ``num_blocks`` blocks, and the hand-offs of ``prompts``
    (the engines keep the pools alive; ``pools`` keeps them for the test's own reads too)."""
    layout, dlayout = mini_layout(mini_mamba2(), 200), mini_layout(mini_mamba2(), num_blocks)
    src, dst = seeded_pool(layout, 1), seeded_pool(dlayout, 2)
    config = config or SchedulerConfig(max_num_batched_tokens=32)
    prefill = PrefillRole(layout, regions_of_array(layout, src), config)
    decode = DecodeRole(dlayout, regions_of_array(dlayout, dst), config, num_host_blocks=num_host_blocks)
    hub = LoopbackHub()
    p_engine, d_engine = LoopbackEngine("prefill", prefill.pool, hub), LoopbackEngine("decode", decode.pool, hub)
    connect_pair(p_engine, d_engine)
    for rid, prompt in (prompts or {}).items():
        prefill.add_request(rid, prompt)
    handoffs = {}
    while prefill.scheduler.has_unfinished:
        handoffs |= {h.request_id: h for h in prefill.update(sample(prefill.step()))}
    pools[:] = [src, dst]
    return prefill, decode, p_engine, d_engine, handoffs


pools: list = []


def decode_books(decode):
    m = decode.manager
    return (
        m.pool.free_extents(),
        m.use.tolist(),
        sorted(map(str, m.requests)),
        sorted(map(str, decode.scheduler.requests)),
    )


def test_a_request_without_token_ids_is_swapped_never_recomputed():
    prompts = {"a": list(range(100, 108)), "b": 8}  # b is handed over without its ids
    prefill, decode, p_engine, d_engine, hs = small_decode(30, num_host_blocks=40, prompts=prompts)
    assert hs["b"].prompt_token_ids is None
    decode.pull(d_engine, "prefill", hs["a"], 40, 1.0)
    decode.pull(d_engine, "prefill", hs["b"], 40, 1.0)
    rows, preempted, done = [], [], []
    for _ in range(300):
        plan = decode.step()
        rows += [r for r in plan.scheduled if r.request_id == "b"]
        preempted += [p for p in plan.preempted if p.request_id == "b"]
        done += decode.update(sample(plan)).finished
        decode.manager.check_integrity()
        if not decode.scheduler.has_unfinished:
            break
    assert preempted, "the pool is too small for both: b must have been preempted"
    assert all(p.mode is PreemptionMode.SWAP for p in preempted)
    assert min(r.num_computed_tokens for r in rows) == 8  # never re-prefilled from stand-in ids
    assert sorted(done) == ["a", "b"]
    assert decode.manager.pool.free_extents() == [(1, decode.manager.layout.num_blocks)]
    assert decode.manager.host_pool.num_free == decode.manager.host_pool.num_usable


def test_a_decode_role_without_a_host_pool_refuses_a_hand_off_without_token_ids():
    prefill, decode, p_engine, d_engine, hs = small_decode(30, prompts={"b": 8})
    before = decode_books(decode)
    with pytest.raises(HandoffRefusedError, match="no host pool"):
        decode.pull(d_engine, "prefill", hs["b"], 40, 1.0)
    assert decode_books(decode) == before
    assert not p_engine.take_notification("decode", notification_for("b"))  # never read: cancel it there
    prefill.cancel("b")
    assert prefill.manager.pool.free_extents() == [(1, prefill.manager.layout.num_blocks)]


def test_an_arrival_holding_its_blocks_is_admitted_ahead_of_recomputed_requests():
    prompts = {rid: list(range(100 * i, 100 * i + 8)) for i, rid in enumerate("abc")}
    prefill, decode, p_engine, d_engine, hs = small_decode(18, prompts=prompts)
    decode.pull(d_engine, "prefill", hs["a"], 30, 1.0)
    decode.pull(d_engine, "prefill", hs["b"], 30, 1.0)
    done, pulled = [], False
    for _ in range(300):
        plan = decode.step()
        assert not plan.is_empty, f"step {plan.step} is empty with {sorted(decode.scheduler.requests)} unfinished"
        done += decode.update(sample(plan)).finished
        if not pulled and any(p.request_id == "b" for p in plan.preempted):
            decode.pull(d_engine, "prefill", hs["c"], 6, 1.0)  # held while a and b wait for room
            pulled = True
        decode.manager.check_integrity()
        if not decode.scheduler.has_unfinished:
            break
    assert pulled and sorted(done) == ["a", "b", "c"]
    assert decode.manager.pool.free_extents() == [(1, decode.manager.layout.num_blocks)]


def test_requests_with_one_prompt_are_admitted_by_id_not_by_their_tokens():
    prompts = {rid: list(range(8)) for rid in "abc"}  # parallel samples of one prompt
    prefill, decode, p_engine, d_engine, hs = small_decode(30, prompts=prompts)
    decode.pull(d_engine, "prefill", hs["a"], 40, 1.0)
    decode.pull(d_engine, "prefill", hs["b"], 40, 1.0)
    done, pulled, recomputed = [], False, set()
    for _ in range(300):
        plan = decode.step()
        for r in plan.scheduled:
            if r.request_id in recomputed:  # back after a recompute: from token 0, not "held" by c's import
                assert r.num_computed_tokens == 0
                recomputed.discard(r.request_id)
        recomputed |= {p.request_id for p in plan.preempted}
        done += decode.update(sample(plan)).finished
        if not pulled and plan.preempted:
            decode.pull(d_engine, "prefill", hs["c"], 6, 1.0)
            pulled = True
        decode.manager.check_integrity()
        if not decode.scheduler.has_unfinished:
            break
    assert pulled and sorted(done) == ["a", "b", "c"]


@pytest.mark.parametrize("why", ["never fits", "id finished, not popped"])
def test_a_pull_the_scheduler_would_refuse_changes_nothing(why):
    prefill, decode, p_engine, d_engine, hs = small_decode(60, prompts={"a": list(range(8))})
    if why == "id finished, not popped":
        decode.pull(d_engine, "prefill", hs["a"], 2, 1.0)
        assert prefill.settle(p_engine, "decode") == ["a"]
        while decode.scheduler.has_unfinished:
            decode.update(sample(decode.step()))
        assert "a" in decode.scheduler.finished
        prefill.add_request("a", list(range(8)))  # the same id again
        (hs["a"],) = prefill.update(sample(prefill.step()))
    before = decode_books(decode)
    with pytest.raises(RequestTooLargeError if why == "never fits" else DuplicateRequestError):
        decode.pull(d_engine, "prefill", hs["a"], 10_000 if why == "never fits" else 4, 1.0)
    assert decode_books(decode) == before
    decode.manager.check_integrity()
    assert not p_engine.take_notification("decode", notification_for("a"))  # not read: the prefill side cancels
    prefill.cancel("a")
    assert not prefill.manager.requests


def test_pulling_one_hand_off_twice_is_refused_before_any_change():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    prefill.add_request("a", list(range(10)))
    (h,) = prefill.update(sample(prefill.step()))
    plan = decode.pull(d_engine, "prefill", h, 4, 1.0)
    expected = reference_bytes(dst, layout, plan.blocks)
    assert p_engine.take_notification("decode", notification_for("a"))
    before = decode_books(decode)
    with pytest.raises(DuplicateRequestError):
        decode.pull(d_engine, "prefill", h, 4, 1.0)  # still queued here
    assert decode_books(decode) == before and decode.manager.requests["a"].pending is None
    assert not p_engine.take_notification("decode", notification_for("a"))  # no second READ
    assert reference_bytes(dst, layout, decode.manager.request_blocks("a")) == expected
    first = decode.step()
    assert [(r.request_id, r.num_computed_tokens) for r in first.scheduled] == [("a", 10)]
    decode.manager.check_integrity()


def test_cancel_of_an_unknown_or_settled_hand_off_raises_a_typed_error():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    with pytest.raises(UnknownRequestError, match="no pending hand-off"):
        prefill.cancel("never")
    prefill.add_request("a", 6)
    (h,) = prefill.update(sample(prefill.step()))
    decode.pull(d_engine, "prefill", h, 4, 1.0)
    assert prefill.settle(p_engine, "decode") == ["a"]
    with pytest.raises(UnknownRequestError, match="settled"):
        prefill.cancel("a")
    prefill.manager.check_integrity()


def test_request_ids_that_json_cannot_bring_back_are_refused_at_add_request():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    for bad in (("t", 1), 1.0, True, None, b"x"):
        with pytest.raises(TypeError, match="use a str or an int"):
            prefill.add_request(bad, 6)
    assert not prefill.scheduler.requests
    prefill.add_request(np.int64(7), list(range(6)))  # a numpy integer travels as int
    (h,) = prefill.update(sample(prefill.step()))
    assert type(h.request_id) is int and h.request_id == 7
    plan = decode.pull(d_engine, "prefill", h, 3, 1.0)
    assert plan.request_id == 7 and prefill.settle(p_engine, "decode") == [7]
    while decode.scheduler.has_unfinished:
        decode.update(sample(decode.step()))
    assert list(decode.scheduler.pop_finished()) == [7]


def test_bad_outputs_leave_the_prefill_plan_updatable():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    prefill.add_request("a", 6)
    plan = prefill.step()
    with pytest.raises(ValueError, match="got no token"):
        prefill.update(StepOutputs({}))
    (h,) = prefill.update(sample(plan))  # the same plan, corrected outputs
    assert h.request_id == "a" and prefill.num_pending_handoffs == 1


def test_aborting_a_queued_arrival_gives_its_blocks_back():
    layout, src, dst, prefill, decode, p_engine, d_engine = roles()
    prefill.add_request("a", list(range(10)))
    (h,) = prefill.update(sample(prefill.step()))
    decode.pull(d_engine, "prefill", h, 4, 1.0)
    decode.scheduler.abort("a")
    assert not decode.manager.requests and not decode.scheduler.has_unfinished
    assert decode.manager.pool.free_extents() == [(1, layout.num_blocks)]
    decode.manager.check_integrity()

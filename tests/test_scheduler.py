"""Scheduler scenarios: admission, preemption by recompute / swap / auto, resume, chunks, drafts, aborts."""

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.blockmgr.records import SwapDirection
from hybridkv.errors import RequestStateError, RequestTooLargeError, UnknownRequestError
from hybridkv.models.presets import preset
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import (
    H200,
    Preemption,
    PreemptionMode,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
    preemption_cost,
)
from hybridkv.scheduler_adapter.scheduler import AdmissionPolicy
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine

RECOMPUTE, SWAP, AUTO = PreemptionMode.RECOMPUTE, PreemptionMode.SWAP, PreemptionMode.AUTO
# the preemption scenarios fill the pool on purpose: vLLM's rule (whole prompt fits now) admits all
# three requests, the default (which keeps room for their decode steps) would not
FULL = AdmissionPolicy.FULL_PROMPT


def tiny_model() -> ModelSpec:
    """1 attention layer (16 B/token/segment) + 2 recurrent layers of 256 B: block_size 4 -> 128 B blocks,
    2 state groups of 2 blocks: a request holds 4 state blocks + ceil(tokens / 4) KV blocks."""
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))
    return ModelSpec("tiny", (attn, rec, rec), params_active=1e6)


def tiny_manager(
    num_blocks: int, num_host_blocks: int = 0, watermark: float = 0.0, prefix: PrefixCacheConfig | None = None
) -> HybridBlockManager:
    layout = plan(tiny_model(), num_blocks * 128, block_size=4)
    assert layout.num_blocks == num_blocks and layout.blocks_per_state == (2, 2)
    return HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark, prefix_cache=prefix)


def run_step(s: Scheduler, engine: SyntheticEngine | None = None):
    p = s.step()
    s.manager.check_integrity()
    s.update((engine or SyntheticEngine(1.0)).run(p))
    s.manager.check_integrity()
    return p


def rows(p):
    return [(r.request_id, r.num_computed_tokens, r.num_scheduled_tokens, r.num_drafts, r.samples) for r in p.scheduled]


# ---- admission ------------------------------------------------------------------------------------
def test_admission_uses_the_managers_one_count_and_fills_the_pool():
    m = tiny_manager(19)  # 18 usable = 3 requests of 8 tokens (2 KV + 4 state blocks each)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, admission=FULL))
    for i in range(4):
        s.add_request(i, 8, 3)
    p = run_step(s)
    assert p.admitted == (0, 1, 2) and rows(p) == [(i, 0, 8, 0, True) for i in range(3)]
    assert m.blocks_to_admit(8) == 6 and m.num_available_blocks == 0
    assert [r.request_id for r in s.waiting] == [3]


def test_default_admission_keeps_room_for_the_admitted_requests_decode_steps():
    """The same pool and requests under the default: each admitted request keeps a block for its
    3 outputs (tokens 9-11: a third KV block), so the third is not admitted next to the two."""
    m = tiny_manager(19)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    assert s.config.admission is AdmissionPolicy.RESERVED
    for i in range(4):
        s.add_request(i, 8, 3)
    p = run_step(s)
    assert p.admitted == (0, 1) and m.num_available_blocks == 6
    while s.has_unfinished:
        assert not run_step(s).preempted
    assert all(len(r.output_token_ids) == 3 for r in s.finished.values())


def _churn(admission: AdmissionPolicy) -> tuple[int, int]:
    """Four requests of 60 prompt tokens and 24 outputs, in 8-token chunks, through a pool that
    holds one of them (21 KV + 4 state blocks; 33 usable blocks) and the first chunk of a second:
    (preemptions, scheduled tokens)."""
    s = Scheduler(tiny_manager(34), SchedulerConfig(max_num_batched_tokens=8, admission=admission))
    for i in range(4):
        s.add_request(i, 60, 24)
    preempted = scheduled = 0
    while s.has_unfinished:
        p = run_step(s)
        preempted += len(p.preempted)
        scheduled += p.num_batched_tokens
    assert sorted(len(r.output_token_ids) for r in s.finished.values()) == [24] * 4
    return preempted, scheduled


def test_admission_never_churns_mid_prefill_on_a_tight_pool():
    """Regression (issue 29): admitting on the first chunk let a request start its prefill, run
    the pool dry before its prompt was in, and be preempted and recomputed. The default and vLLM's
    rule admit a request only when its whole prompt fits: every token runs once (4 x 60 prompt
    tokens and 23 more per request; the last output is never fed back)."""
    assert _churn(AdmissionPolicy.RESERVED) == (0, 4 * 83)
    assert _churn(FULL) == (0, 4 * 83)
    first_chunk_preemptions, first_chunk_tokens = _churn(AdmissionPolicy.FIRST_CHUNK)
    assert first_chunk_preemptions > 0 and first_chunk_tokens > 4 * 83  # the churn this guards against


def test_admission_policy_values_and_bad_reserve_are_checked():
    assert SchedulerConfig(admission="full_prompt").admission is FULL
    with pytest.raises(ValueError):
        SchedulerConfig(admission="eager")
    with pytest.raises(ValueError, match="decode_reserve_steps"):
        SchedulerConfig(decode_reserve_steps=-1)
    assert SchedulerConfig(decode_reserve_steps=None).decode_reserve_steps is None


def test_request_that_can_never_fit_is_rejected_at_submission():
    s = Scheduler(tiny_manager(19))
    with pytest.raises(RequestTooLargeError, match="needs 19 blocks, pool has 18"):
        s.add_request("big", 56, 4)  # 15 KV + 4 state


def test_max_num_seqs_and_priorities_order_admission():
    m = tiny_manager(64)
    s = Scheduler(m, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    s.add_request("low", 4, 2, priority=5)
    s.add_request("mid", 4, 2, priority=1)
    s.add_request("high", 4, 2, priority=0)
    p = run_step(s)
    assert p.admitted == ("high", "mid") and [r.request_id for r in s.waiting] == ["low"]


# ---- preemption -----------------------------------------------------------------------------------
def _fill_three(mode: PreemptionMode, num_host_blocks: int = 0, swap_executor=None) -> Scheduler:
    m = tiny_manager(19, num_host_blocks)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode, admission=FULL), swap_executor)
    for i in range(3):
        s.add_request(i, 8, 3)
    run_step(s)  # all three prefilled, 1 output each; the pool is full
    return s


def test_full_pool_preempts_newest_by_recompute_and_it_resumes_from_scratch():
    s = _fill_three(RECOMPUTE)
    m = s.manager
    p = run_step(s)  # request 0 needs a 3rd KV block for token 9: none free
    assert p.preempted == (Preemption(2, RECOMPUTE),)
    assert rows(p) == [(0, 8, 1, 0, True), (1, 8, 1, 0, True)]
    assert p.admitted == () and 2 not in m.requests
    r2 = s.requests[2]
    assert r2.state is RequestState.WAITING and r2.num_computed_tokens == 0 and len(r2.output_token_ids) == 1
    assert m.usage().free == 18 - 2 * 7  # everything of request 2 came back
    p = run_step(s)  # 0 and 1 produce their 3rd token and finish
    assert set(s.finished) == {0, 1}
    p = run_step(s)  # 2 is readmitted: prompt + its one output, prefilled again
    assert p.admitted == (2,) and rows(p) == [(2, 0, 9, 0, True)]
    while s.has_unfinished:
        run_step(s)
    assert [len(s.finished[i].output_token_ids) for i in range(3)] == [3, 3, 3]
    assert s.finished[2].num_preemptions == 1 and m.usage().free == 18


def test_swap_moves_kv_and_state_to_host_and_back_and_resumes_where_it_was():
    device = np.zeros((19, 8), dtype=np.int64)  # stands in for the block bytes
    host = np.zeros((13, 8), dtype=np.int64)

    def execute(sp):
        if sp.direction is SwapDirection.OUT:
            host[sp.host_blocks] = device[sp.device_blocks]
        else:
            device[sp.device_blocks] = host[sp.host_blocks]

    s = _fill_three(SWAP, num_host_blocks=12, swap_executor=execute)
    m = s.manager
    kv_before = m.block_table([2])[0].copy()
    state_before = m.state_table([2])[:, 0].copy()
    device[kv_before] = 100 + np.arange(kv_before.size)[:, None]
    device[state_before.ravel()] = 200 + np.arange(state_before.size)[:, None]
    expected_kv, expected_state = device[kv_before].copy(), device[state_before.ravel()].copy()

    p = run_step(s)
    assert p.preempted == (Preemption(2, SWAP),)
    (out,) = p.swap_out
    np.testing.assert_array_equal(out.device_blocks, np.concatenate((kv_before, state_before.ravel())))
    assert s.requests[2].state is RequestState.SWAPPED and m.usage().host_used == 6
    device[out.device_blocks] = -1  # the blocks are someone else's now

    p = run_step(s)  # 0 and 1 finish; 2 needs 6 + 1 blocks, only 4 free: stays swapped
    assert p.resumed == () and set(s.finished) == {0, 1}
    p = run_step(s)
    assert p.resumed == (2,) and rows(p) == [(2, 8, 1, 0, True)]  # no recompute: decodes token 9
    (back,) = p.swap_in
    assert m.usage().host_used == 0
    np.testing.assert_array_equal(device[m.block_table([2])[0, :2]], expected_kv)
    np.testing.assert_array_equal(device[m.state_table([2])[:, 0].ravel()], expected_state)
    run_step(s)
    assert len(s.finished[2].output_token_ids) == 3 and m.usage().free == 18


def test_swap_falls_back_to_recompute_without_host_room_or_when_the_copy_fails():
    s = _fill_three(SWAP, num_host_blocks=0)
    assert run_step(s).preempted == (Preemption(2, RECOMPUTE),)

    def broken(sp):
        raise RuntimeError("copy failed")

    s = _fill_three(SWAP, num_host_blocks=12, swap_executor=broken)
    assert run_step(s).preempted == (Preemption(2, RECOMPUTE),)
    assert s.manager.usage().host_used == 0


def test_the_requester_preempts_itself_when_it_is_the_newest():
    m = tiny_manager(13)  # 12 usable: two 8-token requests; the second cannot grow
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, admission=FULL))
    s.add_request("a", 8, 2)
    s.add_request("b", 8, 2, priority=1)
    run_step(s)
    p = s.step()
    assert p.preempted == (Preemption("b", RECOMPUTE),) and rows(p) == [("a", 8, 1, 0, True)]


# ---- auto: swap for long context of a state-heavy model, recompute for short -----------------------
MINIMAX_BLOCK_BYTES = 327_680  # MiniMax-M1 TP8, fp32 state, 64-token blocks: 32 KiB x 10 layer slots


def test_auto_cost_numbers_minimax_m1_tp8_on_h200():
    layout = plan(preset("minimax-m1", "float32", tp_size=8), 1024 * MINIMAX_BLOCK_BYTES, block_size=64)
    assert layout.bytes_per_block == MINIMAX_BLOCK_BYTES and layout.num_state_blocks_per_request == 112
    short = preemption_cost(layout, H200, 1 + 112, 16)  # 16 tokens: 1 KV block + 112 state blocks
    assert short.swap_bytes == 113 * MINIMAX_BLOCK_BYTES  # 37.0 MB, out and back: 1.34 ms at 55.3 GB/s
    assert short.swap_s == pytest.approx(1.339e-3, rel=1e-3)
    assert short.recompute_s == pytest.approx(0.372e-3, rel=1e-2)  # 16 x 11.5 GFLOP at 495 TFLOP/s
    assert short.mode is RECOMPUTE
    long = preemption_cost(layout, H200, 16 + 112, 1024)  # 1,024 tokens: 16 KV blocks + 112 state blocks
    assert long.swap_s == pytest.approx(1.517e-3, rel=1e-3)
    assert long.recompute_s == pytest.approx(23.8e-3, rel=1e-2)
    assert long.mode is SWAP


@pytest.mark.parametrize(("victim_tokens", "expected"), [(16, RECOMPUTE), (1024, SWAP)])
def test_auto_picks_per_victim(victim_tokens, expected):
    """MiniMax-M1 TP8: a pool holding exactly a 64-token request and the victim; the 64-token one
    needs a second KV block for its 65th token, so the victim goes, by the mode the cost picks."""
    victim_blocks = -(-victim_tokens // 64) + 112
    layout = plan(
        preset("minimax-m1", "float32", tp_size=8), (1 + 113 + victim_blocks) * MINIMAX_BLOCK_BYTES, block_size=64
    )
    m = HybridBlockManager(layout, num_host_blocks=200)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=4096, preemption_mode=AUTO, admission=FULL))
    s.add_request("first", 64, 4)
    s.add_request("victim", victim_tokens, 4)
    run_step(s)
    assert m.num_available_blocks == 0
    assert s.preemption_cost(s.requests["victim"]).mode is expected
    p = run_step(s)
    assert p.preempted == (Preemption("victim", expected),)
    assert len(p.swap_out) == (expected is SWAP)


# ---- chunked prefill, speculation, prefix hits -----------------------------------------------------
def test_chunked_prefill_samples_only_on_the_last_chunk():
    s = Scheduler(tiny_manager(32), SchedulerConfig(max_num_batched_tokens=8))
    s.add_request("r", 20, 2)
    assert [rows(run_step(s)) for _ in range(4)] == [
        [("r", 0, 8, 0, False)],
        [("r", 8, 8, 0, False)],
        [("r", 16, 4, 0, True)],
        [("r", 20, 1, 0, True)],
    ]
    assert len(s.finished["r"].output_token_ids) == 2


def test_speculative_decode_commits_accepted_drafts_and_truncates_the_rest():
    m = tiny_manager(64)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, num_speculative_tokens=3))
    s.add_request("r", 6, 10)
    run_step(s)  # prefill: 1 output
    assert m.usage().state_speculative == 3 * 4
    p = s.step()
    assert rows(p) == [("r", 6, 1, 3, True)] and m.requests["r"].num_tokens == 10
    s.update(StepOutputs({"r": [7, 8]}, num_accepted={"r": 1}))
    r = s.requests["r"]
    assert r.output_token_ids[1:] == [7, 8] and r.num_computed_tokens == 8 and m.requests["r"].num_tokens == 8
    m.check_integrity()
    p = s.step()
    assert rows(p) == [("r", 8, 1, 3, True)]
    s.update(StepOutputs({"r": [1, 2, 3, 4]}))  # all accepted (count inferred)
    p = s.step()
    assert rows(p) == [("r", 12, 1, 2, True)]  # 3 outputs left: at most 2 drafts
    with pytest.raises(ValueError, match="accepted"):
        s.update(StepOutputs({"r": [1, 2]}, num_accepted={"r": 2}))


def test_prefix_hits_skip_cached_tokens_and_chunks_end_at_checkpoints():
    m = HybridBlockManager(plan(tiny_model(), 64 * 128, block_size=4), prefix_cache=PrefixCacheConfig())
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    s.add_request("a", list(range(16)), 1)
    p = s.step()
    assert rows(p) == [("a", 0, 16, 0, True)]
    a_kv = m.block_table(["a"])[0].tolist()
    s.update(StepOutputs({"a": [99]}))  # a finishes; its last position (16) was checkpointed first
    assert m.requests == {}

    # same 16 tokens + 3: hit at the checkpoint, KV shared, state copied, prefill starts at 16
    s.add_request("b", [*range(16), 100, 101, 102], 2)
    p = s.step()
    assert rows(p) == [("b", 16, 3, 0, True)] and s.requests["b"].num_cached_tokens == 16
    assert m.block_table(["b"])[0, :4].tolist() == a_kv and m.usage().kv_live == 4 + 1
    live = m.state_table(["b"])[:, 0].ravel().tolist()
    assert len(p.checkpoint_copies) == 4 and len(p.copies) == 4 and p.copies.dst.tolist() == live
    np.testing.assert_array_equal(p.checkpoint_copies.dst, p.copies.src)  # b reads the checkpoint a wrote
    s.update(StepOutputs({"b": [7]}))

    # 8 tokens shared, no checkpoint there: a miss, and the first chunk ends at the branch (8)
    s.add_request("c", [*range(8), *range(200, 212)], 1)
    assert rows(s.step()) == [("b", 19, 1, 0, True), ("c", 0, 8, 0, False)]
    s.update(StepOutputs({"b": [8]}))
    assert rows(s.step()) == [("c", 8, 12, 0, True)]
    m.check_integrity()


# ---- abort -----------------------------------------------------------------------------------------
def test_abort_waiting_running_between_step_and_update_and_swapped():
    s = _fill_three(SWAP, num_host_blocks=12)
    m = s.manager
    s.add_request("w", 4, 2)
    s.abort("w")
    p = s.step()  # 2 swapped out, 0 and 1 scheduled
    s.abort(0)  # mid-step: its row is ignored by update
    s.abort(2)  # swapped: host blocks back
    s.update(SyntheticEngine().run(p))
    m.check_integrity()
    assert m.usage().host_used == 0 and set(m.requests) == {1}
    assert {k: v.state for k, v in s.finished.items()} == {
        "w": RequestState.ABORTED,
        0: RequestState.ABORTED,
        2: RequestState.ABORTED,
    }
    with pytest.raises(UnknownRequestError):
        s.abort(0)


def test_step_twice_without_update_is_refused():
    s = Scheduler(tiny_manager(32))
    s.add_request("r", 4, 2)
    s.step()
    with pytest.raises(RequestStateError, match="update"):
        s.step()

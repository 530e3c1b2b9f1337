"""Regressions: configurations checked at construction (``SchedulerConfig``, ``PrefixCacheConfig``),
prefix exports refusing token ids they would misread, the host tier's hit counter and its atomic
``unhold``, and the FastDeploy worker allocating every segment of a layout with side segments."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.transfer_host import export_prefix, exportable_tokens
from hybridkv.scheduler_adapter import H200, Preemption, PreemptionMode, SchedulerConfig
from hybridkv.scheduler_adapter.requests import AdmissionPolicy

from .test_host_tier import A, Rig, offloaded_a
from .test_manager_atomic import snapshot

NAN, INF = math.nan, math.inf


# ---- 9: SchedulerConfig ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_scheduler_config_turns_preemption_strings_into_the_enum(mode):
    assert SchedulerConfig(preemption_mode=mode.value).preemption_mode is mode
    assert SchedulerConfig(preemption_mode=mode).preemption_mode is mode


def test_scheduler_config_refuses_an_unknown_preemption_mode_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"preemption_mode must be one of recompute, swap, auto, got 'eager'"):
        SchedulerConfig(preemption_mode="eager")
    with pytest.raises(ValueError, match=r"admission must be one of reserved, full_prompt, first_chunk, got 'eager'"):
        SchedulerConfig(admission="eager")
    with pytest.raises(TypeError, match="preemption_mode"):
        SchedulerConfig(preemption_mode=None)


def test_a_recompute_string_really_recomputes():
    """With a host pool a swap is possible: the string 'recompute' used to fail the preemptor's
    ``is PreemptionMode.RECOMPUTE`` test, and every victim was swapped."""
    from tests.test_scheduler import _fill_three, run_step

    s = _fill_three("recompute", num_host_blocks=12)
    p = run_step(s)
    assert p.preempted == (Preemption(2, PreemptionMode.RECOMPUTE),) and p.swap_out == ()
    assert s.manager.usage().host_used == 0


def test_an_auto_string_needs_params_active_like_the_enum():
    from hybridkv.blockmgr.manager import HybridBlockManager
    from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec
    from hybridkv.planner.layout import plan
    from hybridkv.scheduler_adapter import Scheduler

    model = ModelSpec("no-flops", (AttentionLayerSpec(1, 8, DType.BFLOAT16),))
    m = HybridBlockManager(plan(model, 64 * 64 * 32, block_size=4))
    with pytest.raises(ValueError, match="params_active"):
        Scheduler(m, SchedulerConfig(preemption_mode="auto"))


BAD_SCHEDULER = [
    ({"max_num_seqs": 2.5}, TypeError, "max_num_seqs"),
    ({"max_num_seqs": 8.0}, TypeError, "max_num_seqs"),
    ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
    ({"max_num_seqs": "8"}, TypeError, "max_num_seqs"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
    ({"max_num_batched_tokens": INF}, TypeError, "max_num_batched_tokens"),
    ({"max_num_batched_tokens": NAN}, TypeError, "max_num_batched_tokens"),
    ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
    ({"num_speculative_tokens": NAN}, TypeError, "num_speculative_tokens"),
    ({"num_speculative_tokens": -1}, ValueError, "num_speculative_tokens"),
    ({"num_speculative_tokens": False}, TypeError, "num_speculative_tokens"),
    ({"chunked_prefill": "no"}, TypeError, "chunked_prefill"),
    ({"chunked_prefill": 1}, TypeError, "chunked_prefill"),
    ({"decode_reserve_steps": 2.5}, TypeError, "decode_reserve_steps"),
    ({"decode_reserve_steps": True}, TypeError, "decode_reserve_steps"),
    ({"decode_reserve_steps": -1}, ValueError, "decode_reserve_steps"),
    ({"gpu": "h200"}, TypeError, "gpu"),
    ({"max_num_batched_tokens": 4, "num_speculative_tokens": 4}, ValueError, "num_speculative_tokens"),
]


def _refusal(config, kwargs, error, field) -> str:
    """``config(**kwargs)`` raises ``error`` in one line naming ``field``; returns the message."""
    with pytest.raises(error) as e:
        config(**kwargs)
    message = str(e.value)
    assert field in message and len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_SCHEDULER, ids=[repr(k) for k, _, _ in BAD_SCHEDULER])
def test_scheduler_config_checks_every_field_at_construction(kwargs, error, field):
    message = _refusal(SchedulerConfig, kwargs, error, field)
    assert repr(next(iter(kwargs.values())))[:3] in message, message  # the value it got


def test_scheduler_config_keeps_its_valid_forms():
    c = SchedulerConfig(np.int64(4), np.int32(64), np.int16(2), "swap", H200, False, "full_prompt", np.int64(3))
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.num_speculative_tokens, c.decode_reserve_steps) == (4, 64, 2, 3)
    assert all(type(v) is int for v in (c.max_num_seqs, c.max_num_batched_tokens, c.num_speculative_tokens))
    assert c.preemption_mode is PreemptionMode.SWAP and c.admission is AdmissionPolicy.FULL_PROMPT
    assert dataclasses.replace(c, max_num_seqs=2).max_num_seqs == 2  # (replace runs the checks again)
    assert SchedulerConfig(decode_reserve_steps=None).decode_reserve_steps is None


# ---- 10: PrefixCacheConfig ------------------------------------------------------------------------
BAD_PREFIX = [
    ({"host_tier": "no"}, TypeError, "host_tier"),
    ({"host_tier": 1}, TypeError, "host_tier"),
    ({"checkpoint": "vllm_align", "in_place_state": "no"}, TypeError, "in_place_state"),
    ({"demote_tail": "yes"}, TypeError, "demote_tail"),
    ({"export_alignment": 2.5}, TypeError, "export_alignment"),
    ({"export_alignment": True}, TypeError, "export_alignment"),
    ({"export_alignment": 0}, ValueError, "export_alignment"),
    ({"gap_fraction": NAN}, ValueError, "gap_fraction"),
    ({"gap_fraction": INF}, ValueError, "gap_fraction"),
    ({"gap_fraction": -0.5}, ValueError, "gap_fraction"),
    ({"gap_fraction": "0.25"}, TypeError, "gap_fraction"),
    ({"gap_fraction": True}, TypeError, "gap_fraction"),
    ({"min_gap_tokens": 2.5}, TypeError, "min_gap_tokens"),
    ({"min_gap_tokens": -1}, ValueError, "min_gap_tokens"),
    ({"every_n": 2.5}, TypeError, "every_n"),
    ({"every_n": True}, TypeError, "every_n"),
    ({"every_n": 0}, ValueError, "every_n"),
    ({"alpha": NAN}, ValueError, "alpha"),
    ({"alpha": INF}, ValueError, "alpha"),
    ({"alpha": -1.0}, ValueError, "alpha"),
    ({"alpha": None}, TypeError, "alpha"),
    ({"evict_batch_fraction": -0.5}, ValueError, "evict_batch_fraction"),
    ({"evict_batch_fraction": NAN}, ValueError, "evict_batch_fraction"),
    ({"evict_batch_fraction": 5.0}, ValueError, "evict_batch_fraction"),
    ({"align_tokens": (True,)}, TypeError, "align_tokens"),
    ({"align_tokens": (16.0,)}, TypeError, "align_tokens"),
    ({"align_tokens": 0}, ValueError, "align_tokens"),
    ({"align_tokens": ()}, ValueError, "align_tokens"),
    ({"align_tokens": "512"}, TypeError, "align_tokens"),
    ({"spaced_align_tokens": (False, 64)}, TypeError, "spaced_align_tokens"),
    ({"spaced_align_tokens": (-4,)}, ValueError, "spaced_align_tokens"),
    ({"checkpoint": "everywhere"}, ValueError, "checkpoint"),
    ({"eviction": "mru"}, ValueError, "eviction"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_PREFIX, ids=[repr(k) for k, _, _ in BAD_PREFIX])
def test_prefix_cache_config_checks_every_field_at_construction(kwargs, error, field):
    _refusal(PrefixCacheConfig, kwargs, error, field)


def test_prefix_cache_config_lists_the_valid_policies():
    with pytest.raises(ValueError, match="none, every_n_blocks, branch_and_last"):
        PrefixCacheConfig(checkpoint="everywhere")
    with pytest.raises(ValueError, match="lru, flop_aware"):
        PrefixCacheConfig(eviction="mru")


def test_prefix_cache_config_keeps_its_valid_forms():
    c = PrefixCacheConfig("every_n_blocks", "flop_aware", np.int64(2), alpha=0, evict_batch_fraction=1,
                          align_tokens=np.int64(512), spaced_align_tokens=[16, np.int32(64)], min_gap_tokens=0,
                          gap_fraction=0, export_alignment=np.int64(64))
    assert c.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS and c.eviction is EvictionPolicy.FLOP_AWARE
    assert c.every_n == 2 and type(c.every_n) is int and c.align_tokens == (512,) and c.spaced_align_tokens == (16, 64)
    assert c.alpha == 0.0 and c.evict_batch_fraction == 1.0 and c.export_alignment == 64
    assert PrefixCacheConfig(evict_batch_fraction=0.0, demote_tail=np.bool_(False)).demote_tail is False
    assert dataclasses.replace(c, host_tier=True).host_tier is True


def test_a_manager_never_sees_a_bad_gap_fraction():
    """``gap_fraction=nan`` used to pass the config and fail in the manager's constructor (a float
    conversion error)."""
    with pytest.raises(ValueError, match="gap_fraction"):
        PrefixCacheConfig(gap_fraction=NAN)


# ---- 11: prefix exports refuse token ids they would misread ----------------------------------------
B = [j % 2 for j in range(24)]  # 0 / 1 tokens: bools would be read as these


@pytest.fixture
def cached_b() -> Rig:
    r = Rig()
    r.run("b", B)
    r.m.free("b")
    r.m.release_pins()
    assert exportable_tokens(r.m, B) == 16  # the ints hit
    return r


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([bool(t) for t in B], TypeError),
        ([*B[:-1], True], TypeError),
        ([np.bool_(t) for t in B], TypeError),
        ([*B[:-1], 1.0], TypeError),
        ([*B[:-1], "1"], TypeError),
        ([*B[:-1], None], TypeError),
        ([*B[:-1], -1], ValueError),
        (np.array([*B[:-1], -1]), ValueError),
        (np.array(B, dtype=bool), TypeError),
    ],
    ids=["bools", "one-bool", "numpy-bools", "float", "str", "none", "negative", "negative-array", "bool-array"],
)
def test_export_prefix_refuses_bad_token_ids_before_any_work(cached_b, tokens, error):
    m = cached_b.m
    before = snapshot(m)
    holds = dict(m._export_checkpoints), list(m._export_kv)
    with pytest.raises(error, match="token"):
        export_prefix(m, tokens)
    with pytest.raises(error, match="token"):
        exportable_tokens(m, tokens)
    assert snapshot(m) == before and (dict(m._export_checkpoints), list(m._export_kv)) == holds


def test_export_prefix_still_takes_integer_ids_of_every_kind(cached_b):
    m = cached_b.m
    for tokens in (B, tuple(B), np.array(B), np.array(B, dtype=np.int32), [np.int64(t) for t in B], iter(B)):
        assert exportable_tokens(m, tokens) == 16
    plan = export_prefix(m, np.array(B, dtype=np.uint16))
    assert plan.num_tokens == 16
    plan.abort()
    m.check_integrity()


# ---- 13: the host tier's hit counter and its atomic unhold ----------------------------------------
def test_host_hit_tokens_count_the_tokens_host_hits_serve():
    r = offloaded_a()
    st, cache = r.tier.stats, r.m.prefix_cache
    assert st.host_hit_tokens == cache.stats.hit_tokens_host == 0
    hit = cache.match(A, len(A))
    assert hit.on_host and hit.host_kv.size
    assert r.run("a2", A) == 16
    assert cache.stats.hit_tokens_host == hit.host_kv.size * r.m.block_size > 0
    assert st.host_hit_tokens == cache.stats.hit_tokens_host
    r.m.check_integrity()


def test_unhold_of_a_unit_not_held_changes_nothing():
    r = offloaded_a()
    tier = r.tier
    first, second, *_ = sorted(tier._unit)
    tier.hold([first])
    for bad in ([first, second], [first, first], [first, 10**9]):
        with pytest.raises(KeyError, match="not held"):
            tier.unhold(bad)
        assert tier._holds == {first: 1}, bad  # nothing unheld, the first one included
    tier.hold([first, second])
    tier.unhold([first, first])
    assert tier._holds == {second: 1}
    tier.unhold([second])
    assert tier._holds == {} and not tier.check()


# ---- 7: FastDeploy worker caches of a layout with side segments ------------------------------------
def _qwen4_exp_layout():
    from hybridkv.models.hf import spec_from_hf_config
    from hybridkv.planner.layout import plan
    from tests.hf_tiny_configs import CASES

    spec = spec_from_hf_config({"model_type": "qwen4_exp_text", **CASES["qwen4_exp_text"]})
    probe = plan(spec, 1 << 24)
    return plan(spec, 12 * probe.bytes_per_block)


def test_worker_caches_hold_every_segment_and_a_state_reads_back_its_bytes():
    torch = pytest.importorskip("torch")
    from hybridkv.scheduler_adapter.fastdeploy_state import read_state_bytes, write_state_bytes
    from hybridkv.scheduler_adapter.fastdeploy_worker import allocate_caches

    layout = _qwen4_exp_layout()
    assert layout.side_segments > 0 and max(layout.key_segments, layout.value_segments) > 1
    assert layout.num_segments == layout.key_segments + layout.value_segments + layout.side_segments
    caches = allocate_caches(layout, framework="torch")
    assert all(len(segs) == layout.num_segments for segs in caches.segments)
    seg_shape = (layout.num_blocks, layout.segment_bytes)
    for segs in caches.segments:
        assert all(tuple(t.shape) == seg_shape and t.dtype == torch.uint8 for t in segs)
        # K's segments share one allocation, V's the next, the side segments one of their own
        k, v = layout.key_segments, layout.value_segments
        starts = {t.untyped_storage().data_ptr() for t in segs}
        assert len(starts) == 3
        assert segs[0].data_ptr() == segs[0].untyped_storage().data_ptr()
        assert segs[k].data_ptr() == segs[k].untyped_storage().data_ptr()
        assert segs[k + v].data_ptr() == segs[k + v].untyped_storage().data_ptr()
    # FastDeploy's caches: K then V of each attention layer, each starting its own allocation
    for i, t in enumerate(caches.caches):
        if t is not None:
            assert t.data_ptr() == t.untyped_storage().data_ptr(), i
    rng = np.random.default_rng(0)
    written = {}
    for layer_id, slot in caches.layer_slots.items():
        nbytes = layout.model.layers[layer_id].state_bytes
        assert nbytes > (layout.key_segments + layout.value_segments) * layout.segment_bytes  # reaches the side run
        blocks = list(range(2 + 3 * slot.slot, 2 + 3 * slot.slot + layout.blocks_per_state[slot.group]))
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        write_state_bytes(slot, layout, blocks, data)
        written[layer_id] = (blocks, data)
    for layer_id, (blocks, data) in written.items():
        slot = caches.layer_slots[layer_id]
        np.testing.assert_array_equal(read_state_bytes(slot, layout, blocks, data.size), data)

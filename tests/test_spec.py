"""Presets reproduce shared/MODELS.md; tensor parallelism divides or fails clearly."""

import pytest

from hybridkv.errors import SpecError, TensorParallelError
from hybridkv.models.presets import PRESET_NAMES, default_state_dtype, preset
from hybridkv.models.spec import DType, ModelSpec, RecurrentLayerSpec, StateComponent

KiB, MiB = 1024, 1024**2

# (preset, state dtype) -> exact state bytes per request, derived from MODELS.md's shapes
STATE_BYTES = {
    ("minimax-m1", "float32"): 70 * 64 * 128 * 128 * 4,
    ("minimax-m1", "bfloat16"): 70 * 64 * 128 * 128 * 2,
    ("qwen3-next-80b-a3b", "bfloat16"): 36 * (32 * 128 * 128 * 2 + 8192 * 3 * 2),
    ("qwen3-next-80b-a3b", "float32"): 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2),
    ("nemotron-h-8b", "bfloat16"): 24 * (128 * 64 * 128 * 2 + 10240 * 3 * 2),
    ("nemotron-h-8b", "float32"): 24 * (128 * 64 * 128 * 4 + 10240 * 3 * 2),
    ("jamba-1.5-mini", "bfloat16"): 28 * (8192 * 16 * 2 + 8192 * 3 * 2),
    ("mamba2-2.7b", "bfloat16"): 64 * (80 * 64 * 128 * 2 + 5376 * 3 * 2),
    ("mamba2-2.7b", "float32"): 64 * (80 * 64 * 128 * 4 + 5376 * 3 * 2),
    ("rwkv7-1.5b", "float32"): 24 * (32 * 64 * 64 * 4 + 2 * 2048 * 2),
    ("gla-1.3b", "bfloat16"): 24 * 4 * 256 * 512 * 2,
    ("gla-1.3b", "float32"): 24 * 4 * 256 * 512 * 4,
    ("retnet-7b", "float16"): 32 * (16 * 256 * 432 * 2 + 16 * 4),
    ("retnet-7b", "float32"): 32 * (16 * 256 * 432 * 4 + 16 * 4),
    ("jamba-1.5-mini", "float32"): 28 * (8192 * 16 * 4 + 8192 * 3 * 2),
    ("qwen3.5-27b", "float32"): 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2),
    ("qwen3.5-35b-a3b", "float32"): 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2),
    ("kimi-linear-48b-a3b", "float32"): 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2),
    # Zamba2: every layer a Mamba2 state (conv over d_inner + 2 x groups x d_state); 7B bf16 = the 74.3 MiB a
    # public survey of vLLM's state shapes gives for Zamba2-7B-Instruct (docs/models.md)
    ("zamba2-7b", "bfloat16"): 81 * (112 * 64 * 64 * 2 + (7168 + 2 * 2 * 64) * 3 * 2),
    ("zamba2-7b", "float32"): 81 * (112 * 64 * 64 * 4 + (7168 + 2 * 2 * 64) * 3 * 2),
    ("zamba2-2.7b", "float32"): 54 * (80 * 64 * 64 * 4 + (5120 + 2 * 64) * 3 * 2),
    ("zamba2-1.2b", "float32"): 38 * (64 * 64 * 128 * 4 + (4096 + 2 * 128) * 3 * 2),
}
# The rounded figures of MODELS.md's "state per request" column, in MiB
TABLE_MIB = {
    ("minimax-m1", "float32"): 280,
    ("minimax-m1", "bfloat16"): 140,
    ("qwen3-next-80b-a3b", "bfloat16"): 37.7,
    ("qwen3-next-80b-a3b", "float32"): 73.7,
    ("nemotron-h-8b", "bfloat16"): 49.4,
    ("nemotron-h-8b", "float32"): 97.4,
    ("jamba-1.5-mini", "bfloat16"): 8.3,
    ("mamba2-2.7b", "bfloat16"): 82,
    ("mamba2-2.7b", "float32"): 162,
    ("rwkv7-1.5b", "float32"): 12.2,
    ("gla-1.3b", "bfloat16"): 24,
    ("gla-1.3b", "float32"): 48,
    ("retnet-7b", "float16"): 108,
    ("retnet-7b", "float32"): 216,
    ("jamba-1.5-mini", "float32"): 15.3,
    ("qwen3.5-27b", "float32"): 146.8,
    ("qwen3.5-35b-a3b", "float32"): 61.4,
    ("kimi-linear-48b-a3b", "float32"): 41.4,
    ("zamba2-7b", "bfloat16"): 74.3,
    ("zamba2-7b", "float32"): 145.2,
    ("zamba2-2.7b", "float32"): 69.1,
    ("zamba2-1.2b", "float32"): 76.9,
}
KV_PER_TOKEN = {
    "minimax-m1": 40 * KiB,
    "qwen3-next-80b-a3b": 24 * KiB,
    "nemotron-h-8b": 16 * KiB,
    "jamba-1.5-mini": 16 * KiB,
    "mamba2-2.7b": 0,
    "rwkv7-1.5b": 0,
    "gla-1.3b": 0,
    "retnet-7b": 0,
    "qwen3.5-27b": 16 * 2 * 4 * 256 * 2,  # 64 KiB
    "qwen3.5-35b-a3b": 10 * 2 * 2 * 256 * 2,  # 20 KiB
    "kimi-linear-48b-a3b": 7 * (512 + 64) * 2,  # MLA latent + rotary key, one head
    "falcon-h1-7b": 44 * 2 * 2 * 128 * 2,  # 44 KiB: K/V in every (hybrid) layer
    "zamba2-7b": 13 * 2 * 32 * 224 * 2,  # 364 KiB: MHA K/V of the shared block in each hybrid layer
    "zamba2-2.7b": 9 * 2 * 32 * 160 * 2,  # 180 KiB
    "zamba2-1.2b": 6 * 2 * 32 * 128 * 2,  # 96 KiB
}
LAYER_COUNTS = {  # (all layers, attention, recurrent)
    "minimax-m1": (80, 10, 70),
    "qwen3-next-80b-a3b": (48, 12, 36),
    "nemotron-h-8b": (52, 4, 24),
    "jamba-1.5-mini": (32, 4, 28),
    "mamba2-2.7b": (64, 0, 64),
    "rwkv7-1.5b": (24, 0, 24),
    "gla-1.3b": (24, 0, 24),
    "retnet-7b": (32, 0, 32),
    "qwen3.5-27b": (64, 16, 48),
    "qwen3.5-35b-a3b": (40, 10, 30),
    "kimi-linear-48b-a3b": (27, 7, 20),
    "falcon-h1-7b": (44, 44, 44),  # every layer keeps K/V and a Mamba2 state
    "zamba2-7b": (81, 13, 81),  # hybrid layers keep K/V and their Mamba2 state
    "zamba2-2.7b": (54, 9, 54),
    "zamba2-1.2b": (38, 6, 38),
}
# Default dtypes (issue 27): what transformers keeps in a bf16 model; the figures of docs/models.md
DEFAULT_MIB = {
    "minimax-m1": 140,  # lightning kv bf16 (the activation dtype): 70 x 64 x 128 x 128 x 2 B
    "qwen3-next-80b-a3b": 73.7,
    "nemotron-h-8b": 97.4,
    "jamba-1.5-mini": 15.3,
    "mamba2-2.7b": 162,
}


@pytest.mark.parametrize(("name", "dtype"), sorted(STATE_BYTES))
def test_state_bytes_match_models_md(name, dtype):
    spec = preset(name, dtype)
    assert spec.state_bytes == STATE_BYTES[(name, dtype)]
    assert round(spec.state_bytes / MiB, 1) == pytest.approx(TABLE_MIB[(name, dtype)], abs=0.05)


def test_retnet_keeps_its_fp32_scale_beside_the_kv():
    fp16 = preset("retnet-7b", "float16")
    assert fp16.state_bytes - 108 * MiB == 2 * KiB


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_kv_bytes_per_token_and_layer_counts(name):
    spec = preset(name)
    assert spec.kv_bytes_per_token == KV_PER_TOKEN[name]
    total, attn, rec = LAYER_COUNTS[name]
    assert (len(spec.layers), len(spec.attention_layer_ids), len(spec.recurrent_layer_ids)) == (total, attn, rec)


def test_layer_positions_follow_the_published_patterns():
    assert preset("minimax-m1").attention_layer_ids == tuple(range(7, 80, 8))
    assert preset("qwen3-next-80b-a3b").attention_layer_ids == tuple(range(3, 48, 4))
    assert preset("jamba-1.5-mini").attention_layer_ids == (4, 12, 20, 28)
    assert preset("nemotron-h-8b").attention_layer_ids == (7, 18, 29, 40)


def test_minimax_lightning_state_is_7200_tokens_of_kv():
    spec = preset("minimax-m1", "float32")
    assert spec.state_bytes // spec.kv_bytes_per_token == 7168  # "about 7,200 tokens"


def test_conv_widths_follow_the_derivations():
    def conv(name):
        return preset(name).layers[preset(name).recurrent_layer_ids[0]].component("conv").shape

    assert conv("nemotron-h-8b") == (10240, 3)
    assert conv("mamba2-2.7b") == (5376, 3)
    assert conv("qwen3-next-80b-a3b") == (8192, 3)


def test_state_dtype_only_changes_the_main_state():
    bf16, fp32 = preset("qwen3-next-80b-a3b", "bfloat16"), preset("qwen3-next-80b-a3b", "float32")
    l16, l32 = bf16.layers[0], fp32.layers[0]
    assert l16.component("ssm").dtype is DType.BFLOAT16 and l32.component("ssm").dtype is DType.FLOAT32
    assert l16.component("conv").dtype is l32.component("conv").dtype is DType.BFLOAT16
    conv32 = preset("qwen3-next-80b-a3b", conv_dtype="float32").layers[0]
    assert conv32.component("conv").dtype is DType.FLOAT32 and conv32.component("ssm").dtype is DType.FLOAT32
    assert "--conv-dtype" in preset("qwen3-next-80b-a3b", conv_dtype="float32").dtype_source("gdn.conv")


@pytest.mark.parametrize("name", sorted(DEFAULT_MIB))
def test_default_dtypes_are_what_transformers_keeps_and_say_so(name):
    spec = preset(name)
    assert round(spec.state_bytes / MiB, 1) == pytest.approx(DEFAULT_MIB[name], abs=0.05)
    main = "kv" if name == "minimax-m1" else "ssm"
    layer = spec.layers[spec.recurrent_layer_ids[0]]
    key = f"{layer.mixer}.{main}"
    assert layer.component(main).dtype is (DType.BFLOAT16 if name == "minimax-m1" else DType.FLOAT32)
    assert "transformers" in spec.dtype_source(key)
    assert ("activation dtype" if name == "minimax-m1" else "float32 whatever") in spec.dtype_source(key)
    assert default_state_dtype(name) is layer.component(main).dtype


@pytest.mark.parametrize(
    ("heads", "groups", "d_state", "tp", "per_rank_groups"),
    [
        (80, 1, 128, 2, 1),  # Mamba2-2.7B: the one group replicated on both ranks
        (80, 1, 128, 8, 1),
        (8, 2, 16, 4, 1),  # 2 groups over 4 ranks: each rank's 2 heads sit in one group
        (12, 3, 16, 2, 2),  # 3 groups over 2 ranks: rank 0 holds heads 0-5 = groups 0 and 1
        (16, 4, 16, 8, 1),
        (128, 8, 128, 2, 4),  # divides: split as before
    ],
)
def test_mamba2_groups_are_replicated_when_tp_does_not_divide_them(heads, groups, d_state, tp, per_rank_groups):
    from hybridkv.models.presets import mamba2_layer
    from hybridkv.models.spec import ModelSpec, groups_per_rank

    layer = mamba2_layer(heads, 64, d_state, groups, 4)
    sharded = ModelSpec("m", (layer,)).shard(tp)
    conv = sharded.layers[0].component("conv")
    assert groups_per_rank(heads, groups, tp) == per_rank_groups
    assert conv.shape == (heads * 64 // tp + 2 * d_state * per_rank_groups, 3)
    assert sharded.layers[0].component("ssm").shape == (heads // tp, 64, d_state)
    if groups % tp:
        assert any("replicated" in n for n in sharded.notes)


def test_mamba2_27b_tp2_keeps_2816_conv_channels_per_rank():
    conv = preset("mamba2-2.7b", tp_size=2).layers[0].component("conv")
    assert conv.shape == (2816, 3)  # 5,120 / 2 + 2 x 128: the single group's B and C on both ranks
    assert preset("nemotron-h-8b", tp_size=2).layers[0].component("conv").shape == (4096 + 2 * 4 * 128, 3)


def test_gdn_needs_tp_to_divide_key_and_value_heads():
    with pytest.raises(TensorParallelError, match="heads"):
        preset("qwen3.5-27b", tp_size=32)  # 16 key heads
    assert preset("qwen3.5-27b", tp_size=4).layers[0].component("conv").shape == ((2 * 16 * 128 + 48 * 128) // 4, 3)


def test_mla_latent_is_replicated_and_k_v_widths_differ():
    spec = preset("kimi-linear-48b-a3b", tp_size=4)
    attn = spec.layers[3]
    assert (attn.num_kv_heads, attn.head_dim, attn.value_head_dim) == (1, 512, 64)
    assert attn.kv_bytes_per_token == (512 + 64) * 2
    assert spec.layers[0].component("ssm").shape == (8, 128, 128)
    assert any("replicated KV head" in n for n in spec.notes)


def test_tp8_divides_minimax_heads():
    spec = preset("minimax-m1", "float32", tp_size=8)
    layer = spec.layers[0]
    assert layer.component("kv").shape == (8, 128, 128)
    assert layer.state_bytes == 512 * KiB
    attn = spec.layers[7]
    assert (attn.num_kv_heads, attn.head_dim, attn.num_q_heads) == (1, 128, 8)
    assert spec.tp_size == 8


def test_tp_replicates_kv_heads_when_fewer_than_ranks():
    spec = preset("qwen3-next-80b-a3b", tp_size=8)  # 2 KV heads over 8 ranks: one replicated head each
    assert spec.layers[3].num_kv_heads == 1
    assert spec.layers[0].component("conv").shape == (1024, 3)


@pytest.mark.parametrize(("name", "tp"), [("minimax-m1", 3), ("mamba2-2.7b", 3), ("rwkv7-1.5b", 64)])
def test_tp_that_does_not_divide_is_a_clear_error(name, tp):
    with pytest.raises(TensorParallelError, match=f"tp_size={tp} does not divide"):
        preset(name, tp_size=tp)


def test_sharding_twice_is_refused():
    with pytest.raises(TensorParallelError, match="already sharded"):
        preset("minimax-m1", tp_size=2).shard(2)


def test_unknown_preset_and_dtype_name_the_choices():
    with pytest.raises(SpecError, match="use one of minimax-m1"):
        preset("llama-3")
    with pytest.raises(SpecError, match="float32, bfloat16, float16, int8 or fp8"):
        preset("minimax-m1", "int4")  # int8 / fp8 states are allowed (quantized, with scales)


def test_bad_component_shapes_are_rejected():
    with pytest.raises(SpecError):
        StateComponent("kv", (0, 4), DType.FLOAT32)
    with pytest.raises(SpecError):
        StateComponent("kv", (2, 4), DType.FLOAT32, tp_axis=2)


def test_sliding_window_kv_splits_by_kv_heads_or_replicates_like_attention():
    from hybridkv.models.hf.common import window_layer
    from hybridkv.models.spec import AttentionLayerSpec, ModelSpec

    window = window_layer(AttentionLayerSpec(2, 128, DType.BFLOAT16, 8), 512, "test")
    assert [c.shape for c in window.components] == [(2, 511, 128)] * 2  # transformers keeps window - 1 tokens
    model = ModelSpec("w", (window,))
    assert model.shard(2).layers[0].component("k_window").shape == (1, 511, 128)
    assert model.shard(8).layers[0].component("v_window").shape == (1, 511, 128)  # one replicated head per rank
    assert "replicated head" in " ".join(model.shard(8).notes)
    with pytest.raises(TensorParallelError, match="one must divide the other"):
        model.shard(3)
    with pytest.raises(SpecError, match="at least 2"):
        window_layer(AttentionLayerSpec(2, 128), 1, "test")


def test_cache_view_keeps_the_decoder_layer_of_loop_copies():
    """A looped model (Dory, Inkling 2 Loop) lists per-pass copies after its layers; splitting hybrid
    layers must keep naming the decoder layer each copy re-runs."""
    from hybridkv.models.spec import AttentionLayerSpec, HybridLayerSpec, ModelSpec, RecurrentLayerSpec

    rec = RecurrentLayerSpec("s", (StateComponent("x", (4,), DType.FLOAT32),))
    hybrid = HybridLayerSpec(AttentionLayerSpec(1, 8), rec)
    model = ModelSpec("loop", (rec, hybrid, rec, hybrid), decoder_layer_ids=(0, 1, 2, 1))  # layer 1 runs twice
    assert model.cache_view().decoder_layer_ids == (0, 1, 1, 2, 1, 1)


def test_a_cache_beyond_an_exbibyte_is_refused_before_planning():
    from hybridkv.models.spec import MAX_CACHE_BYTES

    huge = RecurrentLayerSpec("x", (StateComponent("s", (2**31, 2**31), DType.BFLOAT16),))  # 2**63 bytes
    with pytest.raises(SpecError, match="above 2\\*\\*60 bytes"):
        ModelSpec("huge", (huge,))
    fits = RecurrentLayerSpec("x", (StateComponent("s", (2**29, 2**30), DType.BFLOAT16),))  # exactly 2**60
    assert ModelSpec("fits", (fits,)).state_bytes == MAX_CACHE_BYTES

"""Model specs from hybridkv JSON/TOML files and HuggingFace config.json files."""

import json
from pathlib import Path

import pytest

from hybridkv.errors import SpecError
from hybridkv.models.presets import preset
from hybridkv.models.spec_file import load_spec, resolve_model, spec_from_dict, spec_from_hf_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "specs" / "my-hybrid.toml"


def test_example_toml_spec_loads():
    spec = load_spec(EXAMPLE)
    assert spec.name == "my-hybrid"
    assert len(spec.attention_layer_ids) == 8 and len(spec.recurrent_layer_ids) == 24
    assert spec.state_bytes == 24 * (64 * 64 * 128 * 4 + (64 * 64 + 2 * 8 * 128) * 3 * 2)


def test_json_layers_list_with_explicit_components(tmp_path):
    data = {
        "name": "tiny",
        "layers": [
            {
                "kind": "recurrent",
                "mixer": "rwkv",
                "components": [{"name": "wkv", "shape": [4, 64, 64], "dtype": "fp32"}],
            },
            {"kind": "attention", "num_kv_heads": 2, "head_dim": 64},
            {"kind": "none"},
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    spec = load_spec(path)
    assert spec.state_bytes == 4 * 64 * 64 * 4
    assert spec.kv_bytes_per_token == 2 * 2 * 64 * 2
    assert resolve_model(str(path), tp_size=2).layers[0].component("wkv").shape == (2, 64, 64)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"name": "x"}, "needs 'layers' or 'pattern'"),
        ({"pattern": "R", "recurrent": {"mixer": "nope"}}, "has no builder"),
        ({"pattern": "R", "recurrent": {"mixer": "lightning", "num_heads": 4}}, "missing \\['head_dim'\\]"),
        ({"pattern": "AR", "recurrent": {"mixer": "lightning", "num_heads": 4, "head_dim": 8}}, "no attention layer"),
        ({"pattern": "X"}, "pattern character"),
        ({"layers": [{"kind": "mlp"}]}, "kind must be"),
    ],
)
def test_bad_specs_say_what_to_fix(data, match):
    with pytest.raises(SpecError, match=match):
        spec_from_dict(data)


def test_bad_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SpecError, match="not valid json"):
        load_spec(bad)


HF_CONFIGS = {
    "minimax-m1": {
        "model_type": "minimax_m1",
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 6144,
        "attn_type_list": [1 if i % 8 == 7 else 0 for i in range(80)],
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    "nemotron-h-8b": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
    },
    "jamba-1.5-mini": {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    "mamba2-2.7b": {
        "model_type": "mamba2",
        "num_hidden_layers": 64,
        "num_heads": 80,
        "head_dim": 64,
        "state_size": 128,
        "n_groups": 1,
        "conv_kernel": 4,
        "hidden_size": 2560,
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_gives_the_preset_shapes(name, tmp_path):
    spec = spec_from_hf_config(HF_CONFIGS[name])
    # the HF reader keeps transformers' dtypes; the minimax-m1 preset keeps its float32 lightning default
    ref = preset(name, "bfloat16") if name == "minimax-m1" else preset(name)
    assert spec.layers == ref.layers
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    assert resolve_model(str(path), "float32").state_bytes == preset(name, "float32").state_bytes


def test_unknown_hf_model_type():
    with pytest.raises(SpecError, match="model_type 'llama' is not understood"):
        spec_from_hf_config({"model_type": "llama"})


def test_load_spec_takes_tp_size_as_preset_does(tmp_path):
    import json

    from hybridkv.models.presets import preset
    from hybridkv.models.spec_file import load_spec

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["qwen3-next-80b-a3b"]))
    whole, tp2 = load_spec(path), load_spec(path, tp_size=2)
    assert tp2 == whole.shard(2) and tp2.state_bytes * 2 == whole.state_bytes
    assert tp2.state_bytes == preset("qwen3-next-80b-a3b", tp_size=2).state_bytes
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tp_size"):
            load_spec(path, tp_size=bad)


# ---- DeepSeek-sparse (indexed) attention: GLM-5 Next and Qwen4-exp (issue 27) -----------------------
GLM5_NEXT = {
    "model_type": "glm5_next_text",
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 0,
    "index_head_dim": 128,
    "linear_num_heads": 64,
    "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "dtype": "bfloat16",
}


def test_glm5_next_layers_indexer_and_its_shared_layers():
    spec = spec_from_hf_config(GLM5_NEXT)
    assert spec.attention_layer_ids == (3, 7)  # every 4th from 3 without layer_types, as transformers
    mla = spec.layers[3]
    assert (mla.num_kv_heads, mla.head_dim, mla.value_head_dim) == (1, 512, 0)
    assert [(t.name, t.width, t.dtype.value) for t in mla.side] == [("indexer", 257, "bfloat16")]
    assert spec.kv_bytes_per_token == 2 * (512 * 2 + 257 * 2)
    assert spec.layers[0].component("ssm").shape == (64, 128, 128) and spec.layers[0].component("conv").shape == (
        3 * 64 * 128,
        3,
    )
    shared = spec_from_hf_config({**GLM5_NEXT, "index_topk_pattern": "FFFFFFFS"})
    assert shared.layers[7].side == () and shared.layers[3].side == mla.side
    assert shared.dtype_source("indexer.indexer").startswith("bfloat16")
    tp4 = spec.shard(4)  # MLA latent and indexer replicated, KDA heads split
    assert tp4.layers[3].kv_bytes_per_token == mla.kv_bytes_per_token and tp4.layers[3].side == mla.side
    assert tp4.layers[0].component("ssm").shape == (16, 128, 128)


def test_glm5_next_flat_and_composite_configs_read_as_the_text_config():
    text = spec_from_hf_config(GLM5_NEXT)
    flat = spec_from_hf_config({**GLM5_NEXT, "model_type": "glm5_next"})
    composite = spec_from_hf_config({"model_type": "glm5_next", "dtype": "bfloat16", "text_config": GLM5_NEXT})
    assert flat.layers == composite.layers == text.layers
    # the hub's linear_attn_config spelling of the KDA fields (as Kimi Linear's), read as transformers copies it
    hub = {k: v for k, v in GLM5_NEXT.items() if not k.startswith("linear_")}
    hub["linear_attn_config"] = {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4}
    assert spec_from_hf_config(hub).layers == text.layers
    hub["linear_attn_config"]["num_heads"] = 32
    assert spec_from_hf_config(hub).layers[0].component("ssm").shape == (32, 128, 128)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"index_topk_pattern": "FFFSFFFF"}, "no earlier indexed layer runs the indexer"),
        ({"qk_rope_head_dim": 64}, "NoPE"),
        ({"indexer_types": ["full"] * 7 + ["sometimes"]}, "indexer_types names ['sometimes']"),
        ({"index_topk_pattern": "FF"}, "index_topk_pattern must give F or S"),
    ],
)
def test_glm5_next_configs_transformers_would_not_run_are_one_line(change, message):
    with pytest.raises(SpecError) as e:
        spec_from_hf_config({**GLM5_NEXT, **change})
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


QWEN4_EXP = {
    "model_type": "qwen4_exp_text",
    "num_hidden_layers": 8,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "indexer_n_heads": 16,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 256,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "ple_layer_ids": [1, 2],
    "hc_count": 4,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "dtype": "bfloat16",
}


def test_qwen4_exp_indexer_keys_positions_and_ple_state():
    spec = spec_from_hf_config(QWEN4_EXP)
    assert spec.attention_layer_ids == (3, 7)  # every 4th layer (full_attention_interval 4)
    first, second = spec.layers[3], spec.layers[7]
    assert [(t.name, t.width, t.dtype.value) for t in first.side] == [
        ("indexer_keys", 256, "bfloat16"),
        ("positions", 3, "int64"),
    ]
    assert [t.name for t in second.side] == ["indexer_keys"]
    assert spec.kv_bytes_per_token == 2 * (2 * 2 * 256 * 2 + 256 * 2) + 3 * 8
    ple = spec.layers[0]
    assert [c.name for c in ple.components] == ["ssm", "conv", "ple_window", "ngram_ids"]
    assert ple.component("ple_window").shape == (4 * 2048, 9) and ple.component("ngram_ids").shape == (2,)
    assert ple.component("ngram_ids").dtype.value == "int64" and spec.layers[2].mixer == "gdn"
    tp2 = spec.shard(2)  # GDN heads split, the PLE state replicated
    assert tp2.layers[0].component("ple_window") == ple.component("ple_window")
    assert tp2.layers[0].component("ssm").shape == (16, 128, 128)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"indexer_head_dim": None}, "needs 'indexer_head_dim'"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads must be 1"),
        ({"ple_layer_ids": [4]}, "ple_layer_ids (one-based) must name linear_attention layers"),
    ],
)
def test_qwen4_exp_configs_transformers_would_not_build_are_one_line(change, message):
    with pytest.raises(SpecError) as e:
        spec_from_hf_config({**QWEN4_EXP, **change})
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1

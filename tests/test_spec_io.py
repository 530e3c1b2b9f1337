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

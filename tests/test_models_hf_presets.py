"""Published configurations through transformers' own config classes (the ``config.json`` that
transformers writes), ``hybridkv plan`` on them, and the planner's bound on state tail waste.

The transformers parts skip with the reason when transformers is not installed."""

from __future__ import annotations

import json
import warnings

import pytest

from hybridkv.cli import main
from hybridkv.models.presets import PRESET_NAMES, default_tp, preset
from hybridkv.models.spec import with_conv_columns
from hybridkv.models.spec_file import load_spec, spec_from_dict
from hybridkv.planner.layout import MAX_STATE_TAIL_SHARE, plan
from tests.test_spec_io import HF_CONFIGS

MiB, GiB = 2**20, 2**30

# Published config values (the model cards' config.json), as keyword arguments of transformers'
# config classes; preset name -> (model_type, values)
PUBLISHED = {
    "qwen3-next-80b-a3b": (
        "qwen3_next",
        {k: v for k, v in HF_CONFIGS["qwen3-next-80b-a3b"].items() if k != "model_type"},
    ),
    "nemotron-h-8b": (
        "nemotron_h",
        {k: v for k, v in HF_CONFIGS["nemotron-h-8b"].items() if k != "model_type"},
    ),
    "jamba-1.5-mini": ("jamba", {k: v for k, v in HF_CONFIGS["jamba-1.5-mini"].items() if k != "model_type"}),
    "mamba2-2.7b": (
        "mamba2",
        {k: v for k, v in HF_CONFIGS["mamba2-2.7b"].items() if k != "model_type"} | {"expand": 2},
    ),
    "minimax-m1": (
        "minimax",
        {
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 6144,
            "layer_types": ["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)],
        },
    ),
    "qwen3.5-27b": (
        "qwen3_5_text",
        {
            "num_hidden_layers": 64,
            "hidden_size": 5120,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
    ),
    "qwen3.5-35b-a3b": (
        "qwen3_5_moe_text",
        {
            "num_hidden_layers": 40,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
    ),
    "kimi-linear-48b-a3b": (
        "kimi_linear",
        {
            "num_hidden_layers": 27,
            "hidden_size": 2304,
            "num_attention_heads": 32,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "linear_attn_config": {
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                "head_dim": 128,
                "num_heads": 32,
                "short_conv_kernel_size": 4,
            },
        },
    ),
    # Falcon-H1-7B-Instruct (sources in hybridkv/models/presets.py): every layer attention + Mamba2
    "falcon-h1-7b": (
        "falcon_h1",
        {
            "num_hidden_layers": 44,
            "hidden_size": 3072,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "mamba_d_ssm": 3072,
            "mamba_n_heads": 24,
            "mamba_d_head": 128,
            "mamba_n_groups": 1,
            "mamba_d_state": 256,
            "mamba_d_conv": 4,
        },
    ),
    # Zamba2 (sources in hybridkv/models/presets.py): mamba layers and hybrid ones (shared block K/V + Mamba2)
    **{
        name: (
            "zamba2",
            {
                "num_hidden_layers": layers,
                "hidden_size": hidden,
                "layers_block_type": ["hybrid" if i in hybrid else "mamba" for i in range(layers)],
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
                "n_mamba_heads": heads,
                "mamba_headdim": 64,
                "mamba_ngroups": groups,
                "mamba_d_state": d_state,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            },
        )
        for name, layers, hidden, hybrid, heads, groups, d_state in (
            ("zamba2-7b", 81, 3584, (6, *range(11, 81, 6)), 112, 2, 64),
            ("zamba2-2.7b", 54, 2560, (6, 12, 18, 24, 30, 36, 42, 47, 51), 80, 1, 64),
            ("zamba2-1.2b", 38, 2048, (5, 11, 17, 23, 29, 35), 64, 1, 128),
        )
    },
}
# transformers' cache bytes per request at its own dtypes (bf16 model; SSM / delta-net float32, conv
# bf16 with kernel_size = 4 columns, MiniMax lightning bf16), from the shapes tests/test_models_hf.py checks
HF_STATE_BYTES = {
    "qwen3-next-80b-a3b": 36 * (32 * 128 * 128 * 4 + 8192 * 4 * 2),
    "nemotron-h-8b": 24 * (128 * 64 * 128 * 4 + 10240 * 4 * 2),
    "jamba-1.5-mini": 28 * (8192 * 16 * 4 + 8192 * 4 * 2),
    "mamba2-2.7b": 64 * (80 * 64 * 128 * 4 + 5376 * 4 * 2),
    "minimax-m1": 70 * 64 * 128 * 128 * 2,
    "qwen3.5-27b": 48 * (48 * 128 * 128 * 4 + 10240 * 4 * 2),
    "qwen3.5-35b-a3b": 30 * (32 * 128 * 128 * 4 + 8192 * 4 * 2),
    "kimi-linear-48b-a3b": 20 * (32 * 128 * 128 * 4 + 12288 * 4 * 2),
    "falcon-h1-7b": 44 * (24 * 128 * 256 * 4 + (3072 + 2 * 256) * 4 * 2),
    "zamba2-7b": 81 * (112 * 64 * 64 * 4 + (7168 + 2 * 2 * 64) * 4 * 2),
    "zamba2-2.7b": 54 * (80 * 64 * 64 * 4 + (5120 + 2 * 64) * 4 * 2),
    "zamba2-1.2b": 38 * (64 * 64 * 128 * 4 + (4096 + 2 * 128) * 4 * 2),
}


def _transformers():
    tf = pytest.importorskip("transformers", reason="needs transformers==5.24.0 (pip install 'hybridkv[tests]')")
    tf.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    return tf


def _written(tmp_path, model_type: str, values: dict):
    """The config.json transformers writes for a hub config of these values: the hub file read by
    ``AutoConfig.from_pretrained``, then ``save_pretrained``."""
    tf = _transformers()
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": "bfloat16", **values}))
    out = tmp_path / "written"
    tf.AutoConfig.from_pretrained(hub).save_pretrained(out)
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_as_transformers_writes_them_give_hf_bytes(name, tmp_path, capsys):
    model_type, values = PUBLISHED[name]
    path = _written(tmp_path, model_type, values)
    spec = load_spec(path)
    assert with_conv_columns(spec, "kernel").state_bytes == HF_STATE_BYTES[name]  # transformers' bytes, exactly
    assert spec.layers == preset(name).layers  # the preset is the published config, through the same reader
    assert main(["plan", "--model", str(path), "--conv-columns", "kernel", "--context", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_bytes_per_request"] == HF_STATE_BYTES[name]
    assert main(["plan", "--model", str(path), "--context", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_bytes_per_request"] == spec.state_bytes
    has_conv = any(c.name == "conv" for _, r in spec.recurrent_layers() for c in r.components)
    assert (spec.state_bytes < HF_STATE_BYTES[name]) is has_conv  # one conv column fewer


def test_nemotron_h_config_written_by_transformers_5_has_only_layers_block_type(tmp_path):
    path = _written(tmp_path, "nemotron_h", PUBLISHED["nemotron-h-8b"][1])
    data = json.loads((path / "config.json").read_text())
    assert "hybrid_override_pattern" not in data and isinstance(data["layers_block_type"], list)
    assert load_spec(path).attention_layer_ids == (7, 18, 29, 40)
    assert "mamba_ssm_cache_dtype" in load_spec(path).dtype_source("mamba2.ssm")


def test_minimax_reads_layer_types_not_a_fixed_period():
    cfg = dict(PUBLISHED["minimax-m1"][1], model_type="minimax", num_hidden_layers=4)
    cfg["layer_types"] = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    assert spec_from_dict(cfg).attention_layer_ids == (0, 3)
    del cfg["layer_types"]
    with pytest.raises(Exception, match="layer_types"):
        spec_from_dict(cfg)  # no list of layer kinds: refused, never the every-8th guess


def test_plan_on_every_transformers_written_tiny_config(tmp_path, capsys):
    from tests.test_models_hf import CASES

    tf = _transformers()
    for model_type, kwargs in CASES.items():
        d = tmp_path / model_type
        tf.CONFIG_MAPPING[model_type](pad_token_id=0, dtype="bfloat16", **kwargs).save_pretrained(d)
        assert main(["plan", "--model", str(d), "--gpu-memory", "1GiB", "--context", "1k", "--json"]) == 0, model_type
        out = json.loads(capsys.readouterr().out)
        spec = load_spec(d)
        assert out["state_bytes_per_request"] == spec.state_bytes, model_type
        assert out["kv_bytes_per_token"] == spec.kv_bytes_per_token and (
            spec.state_bytes > 0 or model_type == "minimax_m2"
        )


@pytest.mark.parametrize(
    "name",
    PRESET_NAMES,
)
def test_state_tail_waste_stays_within_10_percent_at_the_default_block_size(name):
    for tp in sorted({1, default_tp(name)}):
        layout = plan(preset(name, tp_size=tp), 40 * GiB)
        assert layout.state_tail_fraction <= MAX_STATE_TAIL_SHARE, (name, tp, layout.block_size)
        assert any(n.startswith("state tail waste") for n in layout.notes) or not layout.model.state_bytes


def test_zamba2_gets_a_multiple_of_8_when_no_multiple_of_16_bounds_the_tails():
    # a Zamba2-7B layer's state is 65.55 tokens of one layer's K/V: 22% waste at 80 tokens, the best multiple
    # of 16, 9.8% at 72; the note says which attention kernels take such a page
    layout = plan(preset("zamba2-7b"), 40 * GiB)
    assert layout.block_size == 72 and layout.state_tail_fraction <= MAX_STATE_TAIL_SHARE
    assert any("multiple of 8" in n and "FlashAttention" in n and "--block-size 80" in n for n in layout.notes)
    assert plan(preset("zamba2-1.2b"), 40 * GiB).block_size == 136  # 4.9%; no multiple of 8 nearer 64 fits


def test_jamba_gets_48_token_blocks_and_says_why():
    layout = plan(preset("jamba-1.5-mini"), 40 * GiB)
    assert layout.block_size == 48 and layout.blocks_per_state == (3,) * 7
    assert layout.state_tail_fraction == pytest.approx(448 * 1024 * 1 / (15.3125 * MiB), rel=1e-3)
    assert any("not 64" in n and "37.1%" in n for n in layout.notes)
    assert plan(preset("jamba-1.5-mini"), 40 * GiB, block_size=64).block_size == 64  # asked for: kept


def test_hybrid_layers_join_the_kv_group_and_a_state_group():
    spec = spec_from_dict(
        {
            "model_type": "falcon_h1",
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_n_groups": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
        }
    )
    assert spec.attention_layer_ids == spec.recurrent_layer_ids == (0, 1, 2, 3)
    layout = plan(spec, GiB, block_size=16)
    view = layout.model
    assert len(view.layers) == 8 and view.decoder_layer_ids == (0, 0, 1, 1, 2, 2, 3, 3)
    assert layout.kv_group is not None and layout.kv_group.layer_ids == (0, 2, 4, 6)
    assert [g.layer_ids for g in layout.state_groups] == [(1, 3, 5, 7)]
    fp = layout.footprint(100)
    assert fp.state_bytes == spec.state_bytes and fp.kv_bytes == 100 * spec.kv_bytes_per_token
    assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes


def test_mla_k_and_v_of_different_widths_are_laid_out_exactly():
    layout = plan(preset("kimi-linear-48b-a3b"), 40 * GiB)
    assert (layout.key_segments, layout.value_segments) == (8, 1)  # 512 and 64 wide, segments of 64
    assert layout.block_bytes == layout.block_size * (512 + 64) * 2
    fp = layout.footprint(64 * 10)
    assert fp.waste.kv_tail_bytes == 0 and fp.kv_bytes == 640 * 7 * 576 * 2


def test_plan_notes_where_engines_keep_other_dtypes(capsys):
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    note = next(n for n in out["notes"] if n.startswith("engines differ"))
    assert "vLLM keeps gdn.ssm bfloat16" in note and "FastDeploy" not in note  # FastDeploy's GDN pool: fp32 too
    assert out["dtype_sources"]["gdn.ssm"].startswith("float32: transformers")
    assert main(["plan", "--model", "minimax-m1", "--json"]) == 0  # default bf16: what the engines keep
    out = json.loads(capsys.readouterr().out)
    assert not any(n.startswith("engines differ") for n in out["notes"])
    assert out["dtype_sources"]["lightning.kv"].startswith("bfloat16: the activation dtype (transformers")
    assert main(["plan", "--model", "minimax-m1", "--state-dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    note = next(n for n in out["notes"] if n.startswith("engines differ"))
    assert "FastDeploy keeps lightning.kv bfloat16" in note and "vLLM keeps lightning.kv bfloat16" in note
    assert out["dtype_sources"]["lightning.kv"] == "float32: --state-dtype"
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--state-dtype", "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "FastDeploy keeps gdn.ssm float32" in " ".join(out["notes"])
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--conv-dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtypes"]["state"]["gdn.conv"] == "float32"

"""`hybridkv plan` on malformed spec files and HF configs (issue 9, defect 10): one line on stderr,
exit code 2, never a traceback; bad values refused, never silently truncated.

The fuzz tests mutate valid spec files (a value replaced by a value of another type, a key
dropped, bytes of the file changed) and check that no exception escapes ``main`` and that the
loader raises only :class:`SpecError`. CI runs a modest number of examples; set
``HYBRIDKV_FUZZ_EXAMPLES=5000`` for a longer run.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.cli import main
from hybridkv.errors import SpecError
from hybridkv.models.spec_file import load_spec
from tests.test_spec_io import GLM5_NEXT, HF_CONFIGS, QWEN4_EXP

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TOML = ROOT / "examples" / "specs" / "my-hybrid.toml"
FUZZ = settings(
    max_examples=int(os.environ.get("HYBRIDKV_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

LAYERS_SPEC = {
    "name": "tiny",
    "hidden_size": 256,
    "params_active": 1e9,
    "layers": [
        {
            "kind": "recurrent",
            "mixer": "rwkv",
            "components": [{"name": "wkv", "shape": [4, 64, 64], "dtype": "fp32", "tp_axis": 0}],
        },
        {"kind": "recurrent", "mixer": "gla", "num_heads": 4, "k_head_dim": 64, "v_head_dim": 64},
        {"kind": "attention", "num_kv_heads": 2, "head_dim": 64, "num_q_heads": 8, "dtype": "bfloat16"},
        {"kind": "none"},
    ],
}
SEEDS: list[dict[str, Any]] = [
    tomllib.loads(EXAMPLE_TOML.read_text()),
    LAYERS_SPEC,
    *HF_CONFIGS.values(),
    GLM5_NEXT,  # indexed attention: side tensors, K-only MLA
    QWEN4_EXP,
]

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 3, 8.7, 8.0, 1e400, -0.0, float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["bfloat16", "fp32", "full_attention", "mamba2", "A", "RRRA", "", "8"]),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key / index path into a JSON-like tree (the root excluded)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


@st.composite
def mutated_specs(draw) -> dict[str, Any]:
    spec = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = _paths(spec)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = spec
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["kind", "mixer", "layer_types", "attn_type_list", "tp_axis", "junk"]))] = draw(
                ODD_VALUES
            )
        else:
            parent[path[-1]] = draw(ODD_VALUES)
    return spec


def _check_cli(path: Path, capsys) -> None:
    code = main(["plan", "--model", str(path), "--format", "json"])  # any exception escaping fails the test
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["max_requests"] >= 0
    else:
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and err.startswith("hybridkv: error:"), err


@FUZZ
@given(spec=mutated_specs(), tp=st.sampled_from([1, 2, 8]))
def test_mutated_spec_files_never_raise_past_the_loader_or_the_cli(spec, tp, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("fuzz") / "spec.json"
    path.write_text(json.dumps(spec, allow_nan=True))
    try:
        load_spec(path).shard(tp)
    except SpecError:
        pass  # the one error type a malformed spec may raise
    _check_cli(path, capsys)


@FUZZ
@given(data=st.data())
def test_byte_mutated_toml_and_json_files_give_one_line_errors(data, tmp_path_factory, capsys):
    seed = data.draw(st.sampled_from([EXAMPLE_TOML.read_bytes(), json.dumps(HF_CONFIGS["nemotron-h-8b"]).encode()]))
    raw = bytearray(seed)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        i = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        byte = data.draw(st.integers(min_value=0, max_value=255))
        if op == "set":
            raw[i] = byte
        elif op == "insert":
            raw.insert(i, byte)
        elif len(raw) > 1:
            del raw[i]
    suffix = ".toml" if seed.startswith(b"#") else ".json"
    path = tmp_path_factory.mktemp("fuzz") / f"spec{suffix}"
    path.write_bytes(bytes(raw))
    try:
        load_spec(path)
    except SpecError:
        pass
    _check_cli(path, capsys)


# ---- regression: each malformed input of defect 10, named --------------------------------------
MINI_HF = HF_CONFIGS["jamba-1.5-mini"]
QWEN_HF = HF_CONFIGS["qwen3-next-80b-a3b"]
MALFORMED: dict[str, tuple[Any, str]] = {
    "null_field": ({"pattern": "A", "attention": {"num_kv_heads": None, "head_dim": 64}}, "got null"),
    "string_count": ({"pattern": "A", "attention": {"num_kv_heads": "8", "head_dim": 64}}, "whole number"),
    "fractional_kv_heads_not_truncated": (
        {"pattern": "A", "attention": {"num_kv_heads": 8.7, "head_dim": 64}},
        "8.7 (not truncated)",
    ),
    "layers_not_a_list": ({"layers": "RRA"}, "layers: must be a list"),
    "layer_not_a_table": ({"layers": [7]}, "layers[0]: must be a table"),
    "shape_not_a_list": (
        {"layers": [{"kind": "recurrent", "components": [{"name": "s", "shape": 64}]}]},
        "shape: must be a list",
    ),
    "components_not_a_list": ({"layers": [{"kind": "recurrent", "components": "ssm"}]}, "components: must be a list"),
    "mixer_is_a_list": ({"layers": [{"kind": "recurrent", "mixer": ["gla"]}]}, "mixer must be a string"),
    "tp_axis_is_a_string": (
        {"layers": [{"kind": "recurrent", "components": [{"name": "s", "shape": [4], "tp_axis": "0"}]}]},
        "tp_axis",
    ),
    "builder_argument_is_a_float": (
        {"pattern": "R", "recurrent": {"mixer": "gla", "num_heads": 4.5, "k_head_dim": 8, "v_head_dim": 8}},
        "num_heads must be a whole number",
    ),
    "pattern_is_a_list": ({"pattern": ["A"], "attention": {"num_kv_heads": 1, "head_dim": 8}}, "pattern: must be"),
    "attention_is_a_string": ({"pattern": "A", "attention": "gqa"}, "must be a table"),
    "dtype_is_a_number": ({"pattern": "A", "attention": {"num_kv_heads": 1, "head_dim": 8, "dtype": 16}}, "dtype"),
    "hf_attn_layer_period_zero": ({**MINI_HF, "attn_layer_period": 0}, "attn_layer_period must be >= 1"),
    "hf_full_attention_interval_zero": ({**QWEN_HF, "full_attention_interval": 0}, "full_attention_interval"),
    "hf_num_attention_heads_zero": ({**MINI_HF, "num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    "hf_layer_types_is_a_string": ({**QWEN_HF, "layer_types": "full_attention"}, "layer_types: must be a list"),
    "hf_layer_types_wrong_length": ({**QWEN_HF, "layer_types": ["full_attention"] * 3}, "has 3 entries"),
    "hf_num_hidden_layers_huge": ({**MINI_HF, "num_hidden_layers": 10**12}, "above 100,000"),
    "top_level_is_a_list": ([1, 2], "top level must be a table"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_plan_on_a_malformed_spec_prints_one_line_and_exits_2(case, tmp_path, capsys):
    data, match = MALFORMED[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--model", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("hybridkv: error:")
    assert match in err, err
    with pytest.raises(SpecError):
        load_spec(path)


def test_plan_on_a_non_utf8_file_prints_one_line_without_a_traceback(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "jamba", "name": "\xff\xfe"}')
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv", "plan", "--model", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hybridkv: error: {path}: not UTF-8 text (byte 33): a spec file is JSON or TOML"
    ]


def test_integral_floats_are_read_exactly(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"pattern": "A", "attention": {"num_kv_heads": 8.0, "head_dim": 64}}))
    assert load_spec(path).layers[0].num_kv_heads == 8

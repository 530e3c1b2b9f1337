"""Quantized recurrent state in the spec and the planner: int8 / fp8 values with float32 scales
inside the component's bytes, counted by the planner and shown by ``hybridkv plan``."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.errors import SpecError
from hybridkv.models.presets import preset
from hybridkv.models.spec import DType, StateComponent, state_scale_bytes, with_state_scales
from hybridkv.planner.layout import plan

GIB = 2**30


@pytest.mark.parametrize(
    ("scales", "count"), [("row", 16 * 128), ("head", 16), ("tensor", 1)]
)  # [H, d_k, d_v] = [16, 128, 64]
def test_quantized_component_counts_values_then_scales(scales, count):
    c = StateComponent("ssm", (16, 128, 64), "int8", scales=scales)
    assert (c.scale_count, c.scale_group) == (count, 16 * 128 * 64 // count)
    assert c.value_bytes == 16 * 128 * 64 and c.scale_bytes == 4 * count
    assert c.nbytes == c.value_bytes + c.scale_bytes


def test_quantized_dtypes_default_to_row_scales_and_floats_take_none():
    assert StateComponent("ssm", (4, 8, 8), "fp8").scales == "row"
    assert StateComponent("ssm", (4, 8, 8), DType.FLOAT8_E4M3).dtype is DType.FLOAT8_E4M3
    assert StateComponent("ssm", (4, 8, 8), "float16").nbytes == 4 * 8 * 8 * 2
    with pytest.raises(SpecError, match="go with a quantized state dtype"):
        StateComponent("ssm", (4, 8, 8), "float32", scales="row")
    with pytest.raises(SpecError, match="unknown state scale granularity"):
        StateComponent("ssm", (4, 8, 8), "int8", scales="column")


def test_sharding_divides_the_scales_with_the_heads():
    model = preset("qwen3-next-80b-a3b", "int8")
    sharded = preset("qwen3-next-80b-a3b", "int8", tp_size=2)
    assert state_scale_bytes(sharded) * 2 == state_scale_bytes(model) > 0
    ssm = sharded.recurrent_layers()[0][1].component("ssm")  # [16 v heads, 128, 128] at TP2
    assert (ssm.shape, ssm.scale_count) == ((16, 128, 128), 16 * 128)


def test_planner_counts_scale_bytes_and_int8_doubles_state_bound_capacity():
    fp32, int8 = preset("mamba2-2.7b", "float32"), preset("mamba2-2.7b", "int8")
    ssm = int8.recurrent_layers()[0][1].component("ssm")  # [80, 64, 128]: 80 x 64 row scales
    assert int8.state_bytes == 64 * (ssm.value_bytes + 80 * 64 * 4 + 5376 * 3 * 2)
    lay32, lay8 = plan(fp32, 20 * GIB), plan(int8, 20 * GIB)
    assert lay8.footprint(8192).state_bytes == int8.state_bytes
    n32, n8 = lay32.capacity(8192).max_requests, lay8.capacity(8192).max_requests
    assert n8 >= 1.9 * n32 > 0
    coarse = with_state_scales(int8, "tensor")
    assert state_scale_bytes(coarse) == 64 * 4 < state_scale_bytes(int8)


def test_plan_cli_shows_scale_bytes_and_the_gain(capsys):
    assert main(["plan", "--model", "mamba2-2.7b", "--state-dtype", "int8", "--context", "8k", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtypes"]["state"]["mamba2.ssm"] == "int8"
    assert out["state_scale_bytes_per_request"] == 64 * 80 * 64 * 4
    line = next(e for e in out["explain"] if e.startswith("quantized state"))
    assert "float32 scales" in line and "against a float32 state" in line
    assert main(["plan", "--model", "mamba2-2.7b", "--state-dtype", "fp8", "--state-scales", "head", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state_scale_bytes_per_request"] == 64 * 80 * 4

"""`hybridkv plan`: the table, --json, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from hybridkv.cli import main


def test_plan_defaults_print_paged_and_padded_side_by_side(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "minimax-m1, TP8" in out
    header = next(line for line in out.splitlines() if "paged" in line)
    assert "padded" in header
    assert "max concurrent requests" in out and "blocks per state" in out


def test_plan_json_has_block_size_and_blocks_per_state(capsys):
    args = ["plan", "--model", "minimax-m1", "--tp", "8", "--gpu-memory", "80GiB", "--context", "32k", "--json"]
    assert main([*args, "--block-size", "64", "--state-dtype", "float32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_size"] == 64
    assert data["blocks_per_state"] == [16] * 7
    assert data["layouts"]["padded"]["block_size"] == 1024
    assert data["layouts"]["paged"]["max_requests"] >= data["layouts"]["padded"]["max_requests"]


def test_plan_single_layout(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "qwen3-next-80b-a3b",
                "--tp",
                "1",
                "--state-dtype",
                "bfloat16",
                "--layout",
                "padded",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert list(data["layouts"]) == ["padded"] and data["block_size"] == 544


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "llama"], "unknown model 'llama'"),
        (["--tp", "3"], "tp_size=3 does not divide"),
        (["--gpu-memory", "lots"], "cannot read 'lots' as a size"),
        (["--context", "0"], "must be positive"),
        (["--gpu-memory", "1MiB"], "raise the memory budget"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(args, match, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hybridkv: error:")
    assert match in err


def test_console_script_runs_as_a_module():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "plan", "--block-size", "-4"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "must be positive" in proc.stderr

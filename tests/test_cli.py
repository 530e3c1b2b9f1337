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
                "--gpu-memory",  # its weights alone exceed the default GPU at TP1
                "80GiB",
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
        (["--model", "llama"], "--model llama: unknown model"),
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


# ---- issue 15: a CLI a newcomer expects -----------------------------------------------------------
import csv  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import tomllib  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from hybridkv import cli  # noqa: E402
from hybridkv.cli import plan as cli_plan  # noqa: E402
from hybridkv.models import presets as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def _json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_python_m_hybridkv_version_matches_pyproject():
    proc = _run("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert proc.returncode == 0 and proc.stdout.strip() == f"hybridkv {version}"


def test_hybridkv_with_no_arguments_prints_help_not_a_traceback():
    proc = _run()
    assert proc.returncode in (0, 2)
    assert "usage: hybridkv" in proc.stdout + proc.stderr and "plan" in proc.stdout + proc.stderr
    assert "examples:" in proc.stdout and "Traceback" not in proc.stderr


def test_help_has_examples():
    proc = _run("plan", "--help")
    assert proc.returncode == 0 and "examples:" in proc.stdout and "--max-requests" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [["plan", "--tp", "x"], ["plan", "--no-such-flag"], ["plnn"], ["plan", "--format", "xml"], ["plan", "--tp"]],
)
def test_argparse_errors_are_one_line(args):
    proc = _run(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "error:" in proc.stderr


def test_json_into_a_closed_pipe_ends_without_a_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before hybridkv writes, like `| head` on a long output
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hybridkv", "plan", "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr
    assert proc.returncode != 0  # nothing was delivered


def test_gla_works_with_no_other_flags(capsys):
    assert main(["plan", "--model", "gla-1.3b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gla-1.3b, TP1,") and "default for gla-1.3b" in out


@pytest.mark.parametrize("name", P.PRESET_NAMES)
def test_every_preset_default_output_names_its_dtypes(name, capsys):
    assert main(["plan", "--model", name]) == 0
    out = capsys.readouterr().out
    dtype_line = next(line for line in out.splitlines() if line.startswith("dtypes:"))
    model = P.preset(name)
    for layer in model.layers:
        if hasattr(layer, "components"):
            for c in layer.components:
                assert f"{layer.mixer}.{c.name} {c.dtype.value}" in dtype_line
        elif hasattr(layer, "num_kv_heads"):
            assert f"KV {layer.dtype.value}" in dtype_line
    data = _json(capsys, "--model", name)
    assert data["dtypes"] == cli_plan.model_dtypes(model)
    assert data["tp_size"] == P.default_tp(name)


def test_default_tp_is_the_smallest_that_fits_and_is_shown(capsys):
    assert [P.default_tp(n) for n in ("minimax-m1", "qwen3-next-80b-a3b", "nemotron-h-8b", "gla-1.3b")] == [8, 2, 1, 1]
    assert P.default_tp("qwen3-next-80b-a3b", "h100") == 4
    for name in P.PRESET_NAMES:
        tp = P.default_tp(name)
        limit = P.DEFAULT_TP_WEIGHT_FRACTION * P.GPU_MEMORY_BYTES["h200"]
        assert P.weight_bytes_per_gpu(name, tp) <= limit
        smaller = [t for t in P.TP_CHOICES if t < tp]
        assert all(P.weight_bytes_per_gpu(name, t) > limit for t in smaller)


ACCEPTANCE = ["--model", "qwen3-next-80b-a3b", "--gpu", "h200", "--gpu-memory-utilization", "0.9"]


def test_longest_context_for_64_requests_agrees_with_the_forward_direction(capsys):
    data = _json(capsys, *ACCEPTANCE, "--max-requests", "64")
    util = 0.9
    assert data["budget_bytes"] == (int(util * 143771 * 2**20) - int(80e9 * 2 / 2) - 6 * 2**30) // 2**30 * 2**30
    for kind, longest in data["longest_context"].items():
        assert longest > 1024
        at = _json(capsys, *ACCEPTANCE, "--layout", kind, "--context", str(longest))
        assert at["max_requests"] >= 64
        beyond = _json(capsys, *ACCEPTANCE, "--layout", kind, "--context", str(longest + 1))
        assert beyond["max_requests"] < 64
    assert main(["plan", *ACCEPTANCE, "--max-requests", "64"]) == 0
    assert "longest context for 64 requests: paged" in capsys.readouterr().out


def test_memory_for_n_requests_agrees_with_capacity(capsys):
    base = ["--model", "minimax-m1", "--gpu-memory", "40GiB", "--layout", "paged", "--context", "100k"]
    cap = _json(capsys, *base)["max_requests"]
    fits = _json(capsys, *base, "--max-requests", str(cap))["memory_for_requests"]
    over = _json(capsys, *base, "--max-requests", str(cap + 1))["memory_for_requests"]
    assert fits["fits"] and not over["fits"]
    assert fits["cache_bytes"] <= 40 * 2**30 < over["cache_bytes"]


def test_engine_style_aliases_mean_the_same(capsys):
    ours = _json(
        capsys,
        "--model",
        "nemotron-h-8b",
        "--tp",
        "2",
        "--context",
        "8k",
        "--state-dtype",
        "float32",
        "--max-requests",
        "10",
        "--gpu-memory",
        "20GiB",
    )
    engine = _json(
        capsys,
        "--model",
        "nemotron-h-8b",
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "8k",
        "--mamba-ssm-cache-dtype",
        "float32",
        "--max-num-seqs",
        "10",
        "--kv-cache-memory",
        "20GiB",
    )
    assert ours == engine and ours["dtypes"]["state"]["mamba2.ssm"] == "float32"


def test_gpu_needs_weights_for_spec_files_and_explains_the_budget(capsys):
    spec = str(ROOT / "examples" / "specs" / "my-hybrid.toml")
    assert main(["plan", "--model", spec, "--gpu", "h100"]) == 2
    assert "--weights" in capsys.readouterr().err
    data = _json(capsys, "--model", spec, "--gpu", "h100", "--weights", "16GB", "--reserve", "2GiB")
    left = int(0.9 * 81559 * 2**20) - 16 * 10**9 - 2 * 2**30  # the one rule: rounded down to whole GiB
    assert data["budget_bytes"] == left // 2**30 * 2**30 and data["tp_size"] == 1
    assert main(["plan", "--gpu", "h200", "--gpu-memory", "10GiB"]) == 2
    assert main(["plan", "--gpu-memory-utilization", "0.5"]) == 2
    assert main(["plan", "--model", "minimax-m1", "--tp", "4", "--gpu", "h100"]) == 2  # weights alone overflow
    assert "no memory left for the cache" in capsys.readouterr().err


def test_model_directory_with_config_json(tmp_path, capsys):
    from tests.test_spec_io import HF_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["jamba-1.5-mini"]))
    by_dir = _json(capsys, "--model", str(tmp_path), "--tp", "2")
    by_file = _json(capsys, "--model", str(tmp_path / "config.json"), "--tp", "2")
    assert by_dir["layouts"] == by_file["layouts"]
    assert main(["plan", "--model", str(tmp_path / "nothing-here")]) == 2


def test_csv_and_md_formats(capsys):
    assert main(["plan", "--format", "csv"]) == 0
    rows = list(csv.reader(capsys.readouterr().out.splitlines()))
    assert rows[0] == ["quantity", "paged", "padded"] and all(len(r) == 3 for r in rows)
    by_label = {r[0]: r[1:] for r in rows}
    # MiniMax-M1's default lightning state is bf16 (the activation dtype): vLLM's padded page is 512 tokens
    assert by_label["block size (tokens)"] == ["64", "512"] and "lightning.kv bfloat16" in by_label["dtypes"][0]
    assert main(["plan", "--format", "md"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0] == "| quantity | paged | padded |" and len({line.count("|") for line in table}) == 1


def test_attention_free_models_show_the_rows_that_mean_something(capsys):
    data = _json(capsys, "--model", "rwkv7-1.5b", "--tp", "8")
    assert data["layout"] == "padded" and data["block_size"] is None  # padded wastes nothing here, so it leads
    assert data["layouts"]["padded"]["waste_bytes_per_request"]["total_bytes"] == 0
    assert data["layouts"]["paged"]["waste_bytes_per_request"]["total_bytes"] > 0
    assert main(["plan", "--model", "rwkv7-1.5b", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "block size (tokens)" not in out and "KV last-block tail" not in out and "no attention" in out
    chosen = _json(capsys, "--model", "rwkv7-1.5b", "--tp", "8", "--state-block-bytes", "16KiB", "--layout", "paged")
    assert chosen["layouts"]["paged"]["block_bytes"] == 16 * 1024
    assert main(["plan", "--model", "minimax-m1", "--state-block-bytes", "16KiB"]) == 2


def test_longest_context_of_a_state_only_model_is_unbounded(capsys):
    data = _json(capsys, "--model", "mamba2-2.7b", "--max-requests", "10")
    assert set(data["longest_context"].values()) == {None}
    assert main(["plan", "--model", "mamba2-2.7b", "--max-requests", "100000000"]) == 2  # no table at context 1
    assert "do not fit even at one token each" in capsys.readouterr().err


def _assert_not_blank_png(path: Path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
    rgb = img[..., :3].reshape(-1, 3)
    background = np.all(rgb > 0.98, axis=1).mean()
    colours = len(np.unique((rgb * 255).astype(np.uint8), axis=0))
    assert background < 0.97 and colours > 20  # lines, text and axes were drawn, not an empty canvas


def test_plot_writes_an_image_that_is_not_blank(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "capacity.png"
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--plot", str(png)]) == 0
    _assert_not_blank_png(png)
    svg = tmp_path / "capacity.svg"
    assert main(["plan", "--model", "rwkv7-1.5b", "--plot", str(svg)]) == 0
    assert "<svg" in svg.read_text() and "<path" in svg.read_text()
    assert main(["plan", "--plot", str(tmp_path / "x.gif")]) == 2


def test_a_command_module_adds_a_subcommand(monkeypatch, capsys):
    mod = types.ModuleType("hybridkv_test_plugin")

    def add_parser(sub):
        p = sub.add_parser("hello", help="a plugged-in command")
        p.add_argument("--who", default="world")
        return p

    mod.add_parser = add_parser
    mod.run = lambda args: print(f"hello {args.who}") or 0
    monkeypatch.setitem(sys.modules, "hybridkv_test_plugin", mod)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "hybridkv_test_plugin"))
    assert main(["hello", "--who", "you"]) == 0
    assert capsys.readouterr().out.strip() == "hello you"
    assert importlib.import_module("hybridkv.cli") is cli
    assert main(["plan", "--json"]) == 0  # the package's own commands are still there


def test_console_script_with_no_arguments_prints_help():
    import shutil

    script = shutil.which("hybridkv") or str(Path(sys.executable).with_name("hybridkv"))
    if not Path(script).exists():
        pytest.skip("the hybridkv console script is not installed (pip install -e .)")
    proc = subprocess.run([script], capture_output=True, text=True)
    assert proc.returncode in (0, 2) and "usage: hybridkv" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    version = subprocess.run([script, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("hybridkv ")


def test_plan_without_memory_flags_assumes_a_named_gpu_and_says_so_first(capsys, tmp_path):
    # no deployment has an 80 GiB cache for MiniMax-M1 TP8: 0.9 of an H200 less 106 GiB of weights per GPU
    assert main(["plan", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"]["assumed"] and data["gpu"]["name"] == "h200" and data["tp_size"] == 8
    # the one rule of plan and simulate: 0.9 x GPU - weights - 6 GiB reserve, rounded down to whole GiB
    assert data["budget_bytes"] == 14 * 2**30 and data["gpu"]["reserve_bytes"] == 6 * 2**30
    assert main(["plan"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "14.0 GiB" in first and "assumed: one H200" in first and "--gpu-memory" in first
    # a spec file's weights are unknown: the assumed GPU's whole 0.9, said on the budget line
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({"name": "m", "layers": [{"kind": "attention", "num_kv_heads": 2, "head_dim": 64}]}))
    assert main(["plan", "--model", str(spec)]) == 0
    assert "weights 0 B (unknown, not subtracted" in capsys.readouterr().out
    # an explicit cache budget is the cache: GPU facts with it are an error, before any work
    assert main(["plan", "--gpu-memory", "40GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] is None
    assert main(["plan", "--gpu-memory", "40GiB", "--weights", "10GiB"]) == 2
    assert "--weights needs --gpu" in capsys.readouterr().err

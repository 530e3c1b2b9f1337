"""Issue 40: `hybridkv plan` and `simulate` never contradict themselves, give one cache budget for one
GPU, and answer each bad input (no such path, a size without a unit, a typo, a HuggingFace repo id,
a context or budget beyond what the model or GPU has) with one precise line before any work."""

import argparse
import json

import pytest

import hybridkv.sim.compare as sim_compare
from hybridkv.cli import main
from hybridkv.cli.simulate import add_parser, model_defaults
from tests.hf_tiny_configs import CASES


def _err(capsys, *argv: str) -> str:
    """Run the command, which must refuse with exit 2 and one line on stderr and print nothing else."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("hybridkv: error:")
    return err


@pytest.fixture
def no_simulation(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a simulation started before the arguments were checked")

    monkeypatch.setattr(sim_compare, "run_all", refuse)


# ---- plan never prints a table that its own first lines contradict ----------------------------------
def test_more_requests_than_fit_at_one_token_is_refused_not_tabled_at_context_1(capsys):
    err = _err(capsys, "plan", "--max-requests", "100000")
    assert "100,000: that many requests do not fit even at one token each" in err
    assert "at most paged 804, padded 716 fit" in err  # (14 GiB: the pool's state sets alone)


def test_a_layout_the_requests_fit_in_at_no_context_says_so_in_its_column(capsys):
    # 780 requests fit paged (state sets of 8 small blocks) but not padded at any context (716 at most)
    assert main(["plan", "--max-requests", "780"]) == 0
    out = capsys.readouterr().out
    assert "longest context for 780 requests: paged 128, padded 0 (does not fit)" in out
    row = next(line for line in out.splitlines() if line.startswith("context (tokens)"))
    assert row.split()[-3:] == ["fits", "(1", "shown)"] and "128" in row


def test_a_context_no_single_request_fits_in_is_refused_with_the_longest_that_does(capsys):
    err = _err(capsys, "plan", "--context", "10000000")
    assert "not even one request of that length fits" in err and "the budget is 14.0 GiB" in err
    assert "the longest context one request can have here: paged 2,932,352" in err
    # beyond the model's own maximum (MiniMax-M1's config.json: max_position_embeddings 10,240,000)
    err = _err(capsys, "plan", "--context", "20000000")
    assert "beyond minimax-m1's maximum of 10,240,000 tokens" in err


def test_a_config_json_gets_its_own_maximum_context_and_is_not_called_a_spec_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(CASES["lfm2"] | {"model_type": "lfm2", "max_position_embeddings": 128000})
    )
    assert main(["plan", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TP1: a config.json names no tensor-parallel size" in out and "spec file" not in out
    assert "beyond lfm2's maximum of 128,000 tokens" in _err(
        capsys, "plan", "--model", str(tmp_path), "--context", "200k"
    )


# ---- one precise line for each bad input, in both commands -------------------------------------------
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_bad_model_and_size_inputs_get_a_precise_line(command, capsys, no_simulation):
    assert "--model /nonexistent/dir: no such path" in _err(capsys, command, "--model", "/nonexistent/dir")
    assert "./nowhere/config.json: no such path" in _err(capsys, command, "--model", "./nowhere/config.json")
    assert "16 bytes, with no unit; did you mean 16GiB?" in _err(capsys, command, "--gpu-memory", "16")
    err = _err(capsys, command, "--model", "qwen3next")
    assert "unknown model; did you mean qwen3-next" in err
    err = _err(capsys, command, "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8")
    assert "did you mean qwen/qwen3-next-80b-a3b-instruct (the preset qwen3-next-80b-a3b)?" in err
    assert "hybridkv reads no hub" in _err(capsys, command, "--model", "someorg/some-model")


def test_a_known_huggingface_repo_id_is_its_preset_and_the_output_says_so(capsys):
    assert main(["plan", "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "qwen3-next-80b-a3b" and data["tp_size"] == 2
    assert (
        data["explain"][0] == "Qwen/Qwen3-Next-80B-A3B-Instruct: the preset qwen3-next-80b-a3b (its config.json's "
        "layers; hybridkv reads no hub)"
    )


def test_simulate_refuses_a_cache_budget_the_gpu_cannot_hold(capsys, no_simulation):
    err = _err(capsys, "simulate", "--gpu-memory", "500GiB")
    assert "--gpu-memory 500GiB: one H200 has 140.4 GiB less 106.2 GiB of minimax-m1 TP8 weights" in err
    assert "at most 34.2 GiB of cache" in err
    err = _err(capsys, "simulate", "--compare", "gpu-memory=14GiB,40GiB")
    assert "--compare gpu-memory=40GiB: one H200 has" in err


def test_plan_says_when_a_cache_budget_is_more_than_any_gpu_holds_beside_the_weights(capsys):
    # simulate refuses this budget (above); plan answers the question asked but says so in one line
    assert main(["plan", "--gpu-memory", "400GiB", "--json"]) == 0
    explain = json.loads(capsys.readouterr().out)["explain"]
    said = [line for line in explain if line.startswith("--gpu-memory 400.0 GiB is more cache than any GPU")]
    assert len(said) == 1 and "one H200, has 140.4 GiB less 106.2 GiB of minimax-m1 TP8 weights" in said[0]
    assert "so at most 34.2 GiB" in said[0]
    assert main(["plan", "--gpu-memory", "30GiB", "--json"]) == 0
    assert not any("more cache" in line for line in json.loads(capsys.readouterr().out)["explain"])


def test_a_preset_context_beyond_its_config_maximum_is_refused(capsys):
    err = _err(capsys, "plan", "--model", "qwen3-next-80b-a3b", "--context", "1M")
    assert "beyond qwen3-next-80b-a3b's maximum of 262,144 tokens" in err


# ---- one capacity rule -------------------------------------------------------------------------------
def _sim_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["simulate", *argv])


@pytest.mark.parametrize(("model", "gpu"), [("minimax-m1", "h200"), ("qwen3-next", "h200"), ("qwen3-next", "h100")])
def test_plan_and_simulate_give_one_gpu_the_same_cache_budget(model, gpu, capsys):
    assert main(["plan", "--model", model, "--gpu", gpu, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    args = _sim_args("--model", model, "--gpu", gpu)
    said = model_defaults(args)
    assert args.tp == planned["tp_size"] and args.gpu_memory == f"{planned['budget_bytes'] // 2**30}GiB"
    assert planned["budget_bytes"] % 2**30 == 0 and planned["gpu"]["reserve_bytes"] == 6 * 2**30
    # said the same way: the same sum, word for word, in both
    rule = next(s for s in said if s.startswith("cache "))
    assert rule.split(" - reserve")[0] in " ".join(planned["explain"]) and "reserve 6.0 GiB" in rule


def test_a_quantized_state_is_refused_where_a_vllm_column_would_run_it(capsys, no_simulation):
    # vLLM 0.33 keeps no int8 / fp8 state: its column with one would not be vLLM's (issue 41)
    for argv in (("--state-dtype", "int8"), ("--state-dtype", "fp8", "--engine", "vllm"),
                 ("--compare", "engine=hybridkv,vllm", "--state-dtype", "int8")):
        assert "vLLM 0.33 keeps no int8 / fp8 recurrent state" in _err(capsys, "simulate", *argv)

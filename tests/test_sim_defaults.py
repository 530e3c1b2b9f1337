"""`hybridkv simulate`'s per-model defaults: the preset's TP and a cache budget from the GPU, as
`hybridkv plan` computes them, said on stderr; refused (exit 2, before any work) where unknowable."""

import argparse

import pytest

from hybridkv.cli import main
from hybridkv.cli.simulate import add_parser, model_defaults


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["simulate", *argv])


def test_each_model_gets_its_own_tp_and_budget():
    a = _args()  # the embedded default: MiniMax-M1 TP8 on H200s, 14 GiB (as before the defaults moved here)
    said = model_defaults(a)
    assert (a.tp, a.gpu_memory) == (8, "14GiB") and any("106.2 GiB" in s for s in said)
    q = _args("--model", "qwen3-next")  # not MiniMax-M1's TP8 / 14 GiB
    model_defaults(q)
    assert (q.tp, q.gpu_memory) == (2, "45GiB")
    h = _args("--model", "qwen3-next", "--gpu", "h100")
    model_defaults(h)
    assert h.tp == 4 and h.gpu_memory == "28GiB"  # an H100 holds less: TP4, as hybridkv plan --gpu h100
    given = _args("--model", "qwen3-next", "--tp", "4", "--gpu-memory", "3GiB")
    assert model_defaults(given) == [] and (given.tp, given.gpu_memory) == (4, "3GiB")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--compare", "gpu=h200,h100"], "--compare varies the model, TP or GPU"),
        (["--model", "qwen3-next", "--tp", "1"], "leaves no cache"),
        (["--gpu", "tpu"], "--gpu-memory SIZE is needed"),
    ],
)
def test_unknowable_budgets_are_refused_before_any_work(argv, needle, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["simulate", *argv, "--out", str(out), "--no-progress"]) == 2
    assert needle in capsys.readouterr().err and not out.exists()

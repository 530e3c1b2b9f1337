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


def test_compare_defaults_say_only_what_every_configuration_runs():
    a = _args("--compare", "layout=paged,padded", "gpu-memory=8GiB,16GiB")  # budgets from --compare: none said
    said = model_defaults(a)
    assert a.tp == 8 and said == ["TP8: the default for minimax-m1 (--tp to change)"]
    g = _args("--compare", "gpu=h200,h100", "gpu-memory=8GiB,16GiB")  # MiniMax-M1: TP8 on H200s, TP16 on H100s
    with pytest.raises(ValueError, match=r"minimax-m1 on H200: TP8, minimax-m1 on H100: TP16"):
        model_defaults(g)
    b = _args("--compare", "tp=4,8", "--gpu-memory", "20GiB")  # TP from --compare: nothing assumed
    assert model_defaults(b) == [] and b.gpu_memory == "20GiB"
    c = _args("--compare", "gpu=h200,h100", "--gpu-memory", "20GiB", "--model", "qwen3-next")
    with pytest.raises(ValueError, match=r"default TP differs across --compare .*H200: TP2.*H100: TP4"):
        model_defaults(c)  # Qwen3-Next needs TP2 on an H200, TP4 on an H100: one --tp would be wrong for one
    d = _args("--compare", "model=minimax-m1,qwen3-next", "--gpu-memory", "20GiB")
    with pytest.raises(ValueError, match="give --tp N or --compare tp="):
        model_defaults(d)
    e = _args("--compare", "model=minimax-m1,qwen3-next", "--gpu-memory", "20GiB", "--tp", "8")
    assert model_defaults(e) == [] and e.tp == 8

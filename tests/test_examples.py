"""Examples run in CI: each example script must run to the end on a CPU-only machine."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path, capsys):
    if path.name == "hf_continuous_batching.py":
        pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()

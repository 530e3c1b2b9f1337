"""The public API at ``hybridkv`` top level: lazy imports, ``__version__``, and the README's and docs'
Python examples run exactly as written."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hybridkv

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TORCH = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "paddle", "triton"):
            raise ImportError(f"{name} is blocked: a numpy-only install")
sys.meta_path.insert(0, _Block())
"""


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_code(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_version_matches_pyproject():
    assert hybridkv.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_every_public_name_resolves():
    for name in hybridkv.__all__:
        assert getattr(hybridkv, name) is not None, name
    assert hybridkv.plan.__module__ == "hybridkv.planner.layout"
    from hybridkv.planner.layout import plan  # the old home keeps working

    assert plan is hybridkv.plan
    assert hybridkv.Scheduler.__name__ == "Scheduler"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hybridkv.nope  # noqa: B018


def test_readme_python_example_runs_as_written(tmp_path):
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "the README has a Python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 12
    proc = run_code(example, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "finished=('r1',)" in proc.stdout


@pytest.mark.parametrize("doc", ["docs/blockmgr.md", "docs/scheduler.md"])
def test_docs_python_snippets_run_as_written(doc, tmp_path):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has runnable code"
    for code in blocks:
        proc = run_code(code, tmp_path)
        assert proc.returncode == 0, f"{doc}:\n{code}\n{proc.stderr}"


def test_numpy_only_install_imports_the_api_and_its_help():
    code = (
        BLOCK_TORCH
        + """
import pydoc
import hybridkv as hk
assert "gather_states" not in hk.__all__ and "gather_states" not in dir(hk)
layout = hk.plan(hk.preset("gla-1.3b"), 2**30)
hk.HybridBlockManager(layout).allocate("a", 100)
assert "HybridBlockManager" in pydoc.render_doc(hk)
from hybridkv import *  # noqa
try:
    hk.gather_states
except ImportError as e:
    assert "pip install torch" in str(e)
else:
    raise AssertionError("gather_states without torch")
assert not any(m.split(".")[0] in ("torch", "paddle", "triton") for m in sys.modules)
print("ok")
"""
    )
    proc = run_code(code, ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_importing_hybridkv_imports_no_submodule_until_used():
    proc = run_code("import sys, hybridkv; print(sorted(m for m in sys.modules if m.startswith('hybridkv')))", ROOT)
    assert proc.stdout.strip() == "['hybridkv']"

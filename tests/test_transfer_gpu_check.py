"""``python -m hybridkv.transfer.gpu_check``: on a machine without CUDA it says so in one line, and its
verdict reports a side that failed before transferring instead of crashing on it."""

import subprocess
import sys

import pytest

from hybridkv.transfer.gpu_check import _verdict

torch = pytest.importorskip("torch", reason="needs torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "hybridkv.transfer.gpu_check"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "CUDA" in proc.stderr


def test_verdict_of_sides_that_failed_before_transferring():
    err = {"error": "AssertionError: Torch not compiled with CUDA enabled"}
    assert _verdict(err, dict(err)) == [f"src: {err['error']}", f"dst: {err['error']}"]
    assert _verdict({}, {}) == ["no transfer was reported by either side"]
    ok = {"sha256": "a", "ids": [1], "others_untouched": True, "integrity": "ok", "leaked": 0, "notified": True}
    assert _verdict({"kv write": ok}, {"kv write": {**ok, "ids": [2]}}) == []
    bad = {**ok, "ids": [2], "sha256": "b"}
    assert _verdict({"kv write": ok}, {"kv write": bad}) == ["kv write: sha256 equal failed"]

"""The Triton kernels compile for a real GPU target (sm_90) and vectorise aligned copies to 16 bytes.

The interpreter accepts code the compiler would reject; this runs the real compiler (no device needed)
in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90_with_vector_accesses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.ops.ptx_check", "--arch", "90"], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert len(report) == 4 * 2 * 2 + 4  # 4 word sizes x (align 1, align 16 bytes) x (gather, scatter) + copy
    for name, acc in report.items():
        assert acc["loads"] and acc["stores"], name
        if "align=1]" not in name and "copy" not in name:
            assert set(acc["stores"]) & {"st.global.v2.b64", "st.global.v4.b32"}, f"{name} does not vectorise"
    assert set(report["_copy_blocks_kernel[word=8]"]["stores"]) == {"st.global.v2.b64"}

"""The Triton kernels compile for a real GPU target (sm_90): every alignment the host can choose, 16-byte
vector accesses where alignment allows, and no local-memory spills.

The interpreter accepts code the compiler would reject and ignores alignment hints; this runs the real
compiler and ``ptxas`` (no device needed) in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

VECTOR_STORES = {"st.global.v2.b64", "st.global.v4.b32"}
VECTOR_LOADS = {"ld.global.v2.b64", "ld.global.v4.b32"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas is not available here")
    return proc


def compile_report(script: str) -> dict:
    """Run ``script`` (it prints a JSON report as its last line) with the real compiler; skip where
    Triton's ptxas is missing."""
    proc = _run(["-c", script])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ptx_report() -> dict:
    proc = _run(["-m", "hybridkv.ops.ptx_check", "--arch", "90"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_alignment_compiles_for_gather_scatter_and_copy_blocks(ptx_report):
    kernels = ptx_report["kernels"]
    for op in ("_gather_states", "_scatter_states", "_copy_blocks"):
        aligns = sorted(int(name.split("align=")[1].split("B")[0]) for name in kernels if name.startswith(op + "["))
        assert aligns == [1, 2, 4, 8, 16], op
    for name, r in kernels.items():
        assert r["loads"] and r["stores"], name
        assert r["registers"] > 0, name
        if "align=16B" in name:  # 16-byte alignment: 16-byte accesses, the pool/buffer side included
            assert set(r["stores"]) & VECTOR_STORES and set(r["loads"]) & VECTOR_LOADS, f"{name} does not vectorise"
        else:
            assert not set(r["stores"]) & VECTOR_STORES, f"{name} claims vector stores it cannot have"


def test_no_variant_spills_and_presets_only_produce_compiled_alignments(ptx_report):
    kernels = ptx_report["kernels"]
    assert ptx_report["spilling"] == []
    for name, r in kernels.items():
        assert (r["spill_store_bytes"], r["spill_load_bytes"], r["local_sass"]) == (0, 0, 0), name
    presets = ptx_report["preset_alignments"]
    compiled = {name.split("align=")[1].split(":")[0] for name in kernels}
    assert set(presets["states"]) <= compiled and set(presets["copy_blocks"]) <= compiled
    assert "16B" in presets["states"] and "16B" in presets["copy_blocks"]  # most presets: 16-byte accesses
    assert any("retnet-7b" in where and "TP8" in where for where in presets["states"].get("8B", []))


CONTROL = """
import json
from hybridkv.ops import ptx_check as P
from hybridkv.ops.states.kernel import _states_kernel
from hybridkv.ops.addressing import *
sig = {"pool_ptr": "*i16", "buf_ptr": "*i16", "table_ptr": "*i32", "runs_ptr": "*i64", "stride_table_g": "i32",
       "stride_table_b": "i32", "segment_words": "i32", "row_start": "i32"}
consts = dict(NUM_FIELDS=NUM_RUN_FIELDS, F_SRC=RUN_SRC_BASE, F_GROUP=RUN_TABLE_GROUP, F_COLUMN=RUN_COLUMN,
              F_LENGTH=RUN_LENGTH, F_DST=RUN_DST_BASE, F_ROW=RUN_DST_ROW_STRIDE, BLOCK=4096, ALIGN=1, SCATTER=False)
r = P._compile(_states_kernel, sig, consts, ["pool_ptr", "buf_ptr", "table_ptr", "runs_ptr"], 90)
print(json.dumps({"report": r, "spilling": P.spills({"old": r})}))
"""


def test_the_spill_check_sees_the_old_8_kib_tile_of_2_byte_words():
    """Control: the tile used before tile_words (8 KiB of unaligned 2-byte words) spills on sm_90."""
    proc = _run(["-c", CONTROL])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["spilling"] == ["old"], out
    assert out["report"]["registers"] > 64

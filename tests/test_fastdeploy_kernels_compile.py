"""The layer kernels (hybridkv.integrations.fastdeploy.kernels) compile for a real GPU target (sm_90)
at the model sizes, without local-memory spills.

Triton's interpreter accepts code the compiler rejects (tensor int-to-pointer casts, dtype constexprs,
loops bounded by loaded values); this runs the real compiler and ``ptxas`` (no device needed) in a
subprocess without TRITON_INTERPRET, with the tiles :mod:`hybridkv.integrations.fastdeploy.launch`
chooses: MiniMax-M1 lightning (d 128, fp32 state, prefill chunks of ``PREFILL_CHUNK`` tokens, its warps),
Qwen3-Next GDN (d_k = d_v = 128, two value heads per
key head, conv over 8,192 channels, bf16 window).
"""

from __future__ import annotations

import pytest

from tests.test_ops_compile import compile_report

pytest.importorskip("triton")

SCRIPT = r"""
import json
import triton.language as tl
from hybridkv.integrations.fastdeploy import kernels as K
from hybridkv.integrations.fastdeploy.launch import LIGHTNING_WARPS, MAX_CONV_CHANNELS, MIN_DOT, PREFILL_CHUNK
from hybridkv.integrations.fastdeploy.launch import state_tiles
from hybridkv.ops import ptx_check
from hybridkv.ops.ptx_check import _compile

meta = {"ptrs": "*i64", "table_ptr": "*i32", "cu_ptr": "*i32", "dec_ptr": "*i32"}
ints = lambda *names: {n: "i32" for n in names}
addr = ints("component_base", "block_elems", "segment_elems")
bk, bv = state_tiles(128, 128)
out = {}
sig = meta | {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")} | {"decay_ptr": "*fp32"}
sig |= ints("stride_table", "stride_q_t", "stride_q_h", "stride_v_t", "stride_v_h", "stride_o_t", "stride_o_h") | addr
consts = dict(DK=128, DV=128, BK=max(bk, MIN_DOT), BV=max(bv, MIN_DOT), BT=max(PREFILL_CHUNK, MIN_DOT), DT=tl.float32,
              F64=False)
warps, ptx_check.NUM_WARPS = ptx_check.NUM_WARPS, LIGHTNING_WARPS  # as launch.lightning launches it
out["lightning"] = _compile(K.lightning_kernel, sig, consts, [], 90)
ptx_check.NUM_WARPS = warps
sig = meta | {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr")} | {"g_ptr": "*fp32", "beta_ptr": "*fp32"}
sig |= {"o_ptr": "*bf16"}
sig |= ints("stride_table", "stride_q_t", "stride_q_h", "stride_v_t", "stride_v_h", "stride_g_t", "stride_o_t",
            "stride_o_h") | {"scale": "fp32"} | addr
consts = dict(REP=2, DK=128, DV=128, BK=bk, BV=bv, DT=tl.float32, F64=False)
out["gated_delta"] = _compile(K.gated_delta_kernel, sig, consts, [], 90)
sig = meta | {"x_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16"}
sig |= ints("stride_table", "stride_x_t", "stride_o_t") | addr
consts = dict(DIM=8192, TAPS=3, BT=4, BC=MAX_CONV_CHANNELS, DT=tl.bfloat16, F64=False)
out["conv"] = _compile(K.conv_kernel, sig, consts, [], 90)
print(json.dumps(out))
"""


def test_the_layer_kernels_compile_for_sm90_without_spills():
    report = compile_report(SCRIPT)
    assert set(report) == {"lightning", "gated_delta", "conv"}
    for name, r in report.items():
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["local_sass"] == 0, (name, r)

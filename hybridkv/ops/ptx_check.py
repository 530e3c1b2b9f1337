"""Compile the ops' Triton kernels for a CUDA target without a GPU and report their global loads/stores.

``python -m hybridkv.ops.ptx_check [--arch 90]`` prints, per kernel and word size, the PTX
``ld.global``/``st.global`` forms (``v2.b64``/``v4.b32`` = 16-byte vector accesses). It needs
Triton's bundled ``ptxas`` but no device; run it without ``TRITON_INTERPRET`` (the interpreter
replaces the kernels). Tests use it to catch kernels that only the interpreter accepts.
"""

from __future__ import annotations

import argparse
import json
import re

from hybridkv.ops.addressing import (
    NUM_RUN_FIELDS,
    RUN_COLUMN,
    RUN_DST_BASE,
    RUN_DST_ROW_STRIDE,
    RUN_LENGTH,
    RUN_SRC_BASE,
    RUN_TABLE_GROUP,
)

_WORD_TYPES = {8: "i64", 4: "i32", 2: "i16", 1: "u8"}
_ALIGNED_16 = [["tt.divisibility", 16]]


def _accesses(ptx: str) -> dict[str, list[str]]:
    return {
        "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
    }


def compile_kernels(arch: int = 90) -> dict[str, dict[str, list[str]]]:
    """Kernel variant name -> its PTX global ``loads`` and ``stores``. Raises if a kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridkv.ops.blocks.kernel import _copy_blocks_kernel
    from hybridkv.ops.states.kernel import _states_kernel

    target = GPUTarget("cuda", arch, 32)
    report = {}
    for word, ty in _WORD_TYPES.items():
        for align in sorted({1, 16 // word}):
            for scatter in (False, True):
                sig = {"pool_ptr": f"*{ty}", "buf_ptr": f"*{ty}", "table_ptr": "*i32", "runs_ptr": "*i64"}
                sig |= {"stride_table_g": "i32", "stride_table_b": "i32", "segment_words": "i32"}
                consts = dict(NUM_FIELDS=NUM_RUN_FIELDS, F_SRC=RUN_SRC_BASE, F_GROUP=RUN_TABLE_GROUP)
                consts |= dict(F_COLUMN=RUN_COLUMN, F_LENGTH=RUN_LENGTH, F_DST=RUN_DST_BASE)
                consts |= dict(F_ROW=RUN_DST_ROW_STRIDE, BLOCK=8192 // word, ALIGN=align, SCATTER=scatter)
                sig |= {k: "constexpr" for k in consts}
                names = list(sig)
                src = ASTSource(
                    fn=_states_kernel,
                    signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): _ALIGNED_16 for i in range(4)},
                )
                ptx = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
                name = "_scatter_states" if scatter else "_gather_states"
                report[f"{name}[word={word},align={align}]"] = _accesses(ptx)
        sig = {"pool_ptr": f"*{ty}", "src_ptr": "*i64", "dst_ptr": "*i64", "num_blocks": "i32"}
        sig |= {"segment_words": "i32", "BLOCK": "constexpr"}
        src = ASTSource(
            fn=_copy_blocks_kernel,
            signature=sig,
            constexprs={(5,): 8192 // word},
            attrs={(0,): _ALIGNED_16, (4,): _ALIGNED_16},
        )
        ptx = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
        report[f"_copy_blocks_kernel[word={word}]"] = _accesses(ptx)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    print(json.dumps(compile_kernels(args.arch), indent=1))


if __name__ == "__main__":
    main()

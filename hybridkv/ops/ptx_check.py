"""Compile the ops' Triton kernels for a CUDA target without a GPU: global access widths, registers, spills.

``python -m hybridkv.ops.ptx_check [--arch 90]`` compiles gather, scatter and copy_blocks for every
alignment the host can choose (1, 2, 4, 8 and 16 bytes: the ``(word, align)`` pairs of
:func:`~hybridkv.ops._framework.word_and_align`, with the tile of
:func:`~hybridkv.ops._framework.tile_words`) and prints, per variant, the PTX ``ld.global`` /
``st.global`` forms (``v2.b64`` / ``v4.b32`` = 16-byte accesses), the registers ``ptxas -v`` reports,
its spill bytes, and the ``LDL``/``STL`` (local memory) instructions in the SASS. It then lists the
alignments the model presets produce (every preset, TP 1/2/4/8, paged and padded, each state dtype)
and exits with status 1 when any variant spills. It needs Triton's bundled ``ptxas`` and
``cuobjdump`` but no device; run it without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels). ``tests/test_ops_compile.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridkv.ops._framework import tile_words, word_and_align
from hybridkv.ops.addressing import (
    NUM_RUN_FIELDS,
    RUN_COLUMN,
    RUN_DST_BASE,
    RUN_DST_ROW_STRIDE,
    RUN_LENGTH,
    RUN_SRC_BASE,
    RUN_TABLE_GROUP,
)

ALIGN_BYTES = (1, 2, 4, 8, 16)
_WORD_TYPES = {8: "i64", 4: "i32", 2: "i16", 1: "u8"}
_ALIGNED_16 = [["tt.divisibility", 16]]
NUM_WARPS = 4


def _accesses(ptx: str) -> dict[str, list[str]]:
    return {
        "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
    }


def _ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill bytes and local-memory SASS instructions, from ptxas -v and cuobjdump -sass."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    tool = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        # the flags Triton's own ptxas call uses (backends/nvidia/compiler.py, make_cubin)
        gpu = f"--gpu-name={sm_arch_from_capability(arch)}"
        cmd = [tool, "-lineinfo", "-v", "--regAllocOptLevel=2", gpu, str(src), "-o", str(cubin)]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
        sass = subprocess.run(
            [str(Path(tool).with_name("cuobjdump")), "-sass", str(cubin)], check=True, capture_output=True, text=True
        ).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if regs is None or spills is None:
        raise RuntimeError(f"could not read ptxas -v output:\n{log}")
    return {
        "registers": int(regs.group(1)),
        "spill_store_bytes": int(spills.group(1)),
        "spill_load_bytes": int(spills.group(2)),
        "stack_bytes": int(stack.group(1)) if stack else 0,
        "local_sass": len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\s", sass)),
    }


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any], aligned: list[int], arch: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig | {k: "constexpr" for k in consts}
    names = list(sig)
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(k),): _ALIGNED_16 for k in aligned},
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS}).asm["ptx"]
    return _accesses(ptx) | _ptxas_report(ptx, arch)


def compile_kernels(arch: int = 90) -> dict[str, dict[str, Any]]:
    """Variant name -> its PTX global loads/stores, registers and spills. Raises if a kernel does not compile."""
    from hybridkv.ops.blocks.kernel import _copy_blocks_kernel
    from hybridkv.ops.states.kernel import _states_kernel

    report = {}
    for align_bytes in ALIGN_BYTES:
        word, align = word_and_align(align_bytes)
        block, ty = tile_words(word, align), _WORD_TYPES[word]
        tag = f"[align={align_bytes}B: word={word},ALIGN={align},BLOCK={block}]"
        for scatter in (False, True):
            sig = {"pool_ptr": f"*{ty}", "buf_ptr": f"*{ty}", "table_ptr": "*i32", "runs_ptr": "*i64"}
            sig |= {"stride_table_g": "i32", "stride_table_b": "i32", "segment_words": "i32", "row_start": "i32"}
            consts = dict(NUM_FIELDS=NUM_RUN_FIELDS, F_SRC=RUN_SRC_BASE, F_GROUP=RUN_TABLE_GROUP)
            consts |= dict(F_COLUMN=RUN_COLUMN, F_LENGTH=RUN_LENGTH, F_DST=RUN_DST_BASE)
            consts |= dict(F_ROW=RUN_DST_ROW_STRIDE, BLOCK=block, ALIGN=align, SCATTER=scatter)
            aligned = ["pool_ptr", "buf_ptr", "table_ptr", "runs_ptr"]
            name = "_scatter_states" if scatter else "_gather_states"
            report[name + tag] = _compile(_states_kernel, sig, consts, aligned, arch)
        sig = {"pool_ptr": f"*{ty}", "src_ptr": "*i64", "dst_ptr": "*i64", "num_blocks": "i32"}
        sig |= {"segment_words": "i32", "ss_start": "i32", "t_start": "i32"}
        # segment_words carries no divisibility attribute: the ALIGN hint alone must vectorise
        consts = dict(BLOCK=block, ALIGN=align)
        report["_copy_blocks" + tag] = _compile(_copy_blocks_kernel, sig, consts, ["pool_ptr"], arch)
    return report


def preset_alignments() -> dict[str, dict[str, list[str]]]:
    """Alignment (bytes) the host picks for each preset -> the configurations that produce it.

    ``states``: gather/scatter (the segment size and every component's offset and size; buffers and
    pools are at least 256-byte aligned); ``copy_blocks``: the segment size. Covers every preset at
    TP 1, 2, 4 and 8 (where the model shards), paged and padded layouts, and each state dtype.
    """
    from hybridkv.errors import TensorParallelError
    from hybridkv.models.presets import PRESET_NAMES, preset
    from hybridkv.models.spec import RecurrentLayerSpec
    from hybridkv.planner.layout import LayoutKind, plan

    found: dict[str, dict[str, set[str]]] = {"states": {}, "copy_blocks": {}}
    for name in PRESET_NAMES:
        for dtype in ("float32", "bfloat16", "float16"):
            for tp in (1, 2, 4, 8):
                try:
                    model = preset(name, dtype, tp)
                except TensorParallelError:
                    continue
                for kind in LayoutKind:
                    layout = plan(model, 1 << 40, layout=kind)
                    values = [layout.segment_bytes]
                    for spec in model.layers:
                        if isinstance(spec, RecurrentLayerSpec):
                            for c, off in zip(spec.components, spec.component_offsets().values(), strict=True):
                                values += [off, c.nbytes]
                    where = f"{name} {dtype} TP{tp} {kind.value}"
                    for op, vals in (("states", values), ("copy_blocks", values[:1])):
                        word, align = word_and_align(*vals)
                        found[op].setdefault(f"{word * align}B", set()).add(where)
    return {op: {a: sorted(w) for a, w in sorted(by.items())} for op, by in found.items()}


def spills(report: dict[str, dict[str, Any]]) -> list[str]:
    """Variants that use local memory (spill bytes, a stack frame or LDL/STL in the SASS)."""
    keys = ("spill_store_bytes", "spill_load_bytes", "stack_bytes", "local_sass")
    return [name for name, r in report.items() if any(r[k] for k in keys)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    report = compile_kernels(args.arch)
    presets = preset_alignments()
    bad = spills(report)
    print(json.dumps({"kernels": report, "preset_alignments": presets, "spilling": bad}, indent=1))
    if bad:
        print(f"ptx_check: {len(bad)} kernel variants use local memory: {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

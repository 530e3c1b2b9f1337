"""GPU benchmark of hybridkv.ops against the device copy rate and per-layer torch indexing (docs/bench.md).

Cases: gather/scatter of MiniMax-M1 TP1 states (70 lightning layers x [64, 128, 128] fp32, B = 1, 8,
32), Mamba2-2.7B ssm states (64 layers x [80, 64, 128] fp32, B = 64) and Mamba2-2.7B conv states
(64 layers x [5376, 3] bf16, ~31.5 KiB, B = 64), each in one launch for all layers vs torch
``index_select`` / ``index_copy_`` per layer on vLLM-style contiguous per-layer pools; copy_blocks;
swap_blocks in/out vs the pinned copy rate, with host ids that are consecutive (one copy) and truly
scattered (drawn from a host pool 3x larger: about one copy per block). Bandwidth counts bytes read
+ written (swaps: bytes moved over the link). ``triton.testing.do_bench`` medians over at least 25
repetitions (10 with ``--quick``), however long one call takes; the 2 GiB ``y.copy_(x)`` rate
measured in the same process is the denominator. Before any op is timed its result on the device
is compared bit for bit with the reference (``--no-check`` skips that). The first lines printed are
the driver, CUDA, Triton and torch versions. The last cases time the FastDeploy layer kernels
(``layer kernel (torch)`` / ``(paddle)`` rows: MiniMax-M1 TP8 lightning and Qwen3-Next TP2 GDN, a
decode step of B rows and a prefill step of 4 x 512 tokens, ms per layer step and the state bytes
read + written per ms; their outputs are first checked against the numpy reference to 1e-3, on rows
of 40 tokens: the lightning kernel runs prefill rows in chunks of 16).

    python benchmarks/bench_ops_gpu.py            # full run, a few minutes on one H200
    python benchmarks/bench_ops_gpu.py --quick    # smaller sizes, fewer cases

Writes ``benchmarks/results/ops_gpu_<date>_<time>.json`` and prints a table. Without a CUDA device it says
so and exits with status 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB, MiB, KiB = 1024**3, 1024**2, 1024
TARGETS = {
    "large": "states >= 1 MiB, B >= 8: >= 90% of copy bandwidth",
    "small": "B = 1 or states < 64 KiB: >= 80% of copy bandwidth and >= 5x per-layer torch",
    "copy_blocks": ">= 85% of copy bandwidth",
    "swap": ">= 90% of the pinned copy rate in the same direction",
}


_RUN = {"device": "cuda", "smoke": False}  # --cpu-smoke switches to the CPU with tiny sizes


def _size(full: int, quick: int, smoke: int, is_quick: bool) -> int:
    return smoke if _RUN["smoke"] else quick if is_quick else full


def _bench(fn: Callable[[], Any], quick: bool) -> float:
    if _RUN["smoke"]:  # one timed call: checks that the case runs, the figure means nothing
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import torch
    from triton.testing import do_bench

    fn()  # warm (compiles the kernel), then one timed call to size the measurement
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - t0) * 1e3
    min_reps = 10 if quick else 25
    rep_ms = max(30 if quick else 100, min_reps * one_ms)  # do_bench runs about rep_ms / one call's time
    return float(do_bench(fn, warmup=max(10, 2 * one_ms), rep=rep_ms, return_mode="median"))


def versions() -> dict[str, Any]:
    """Driver, CUDA (torch's runtime and the driver's), Triton and torch versions, and the GPU."""
    import ctypes
    import subprocess

    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        info["cuda_driver_api"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        info["cuda_driver_api"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _check(ok: bool, what: str, label: str = "bit-exact") -> None:
    """One op's result on the device against the reference (``label``: how), before it is timed
    (raises, so no figure of a wrong op)."""
    if not ok:
        raise AssertionError(f"{what}: the result on {_RUN['device']} differs from the reference")
    note = " (CPU smoke run: the reference against itself, the script's plumbing only)" if _RUN["smoke"] else ""
    print(f"  {label}: {what}{note}", flush=True)


def _record(case: str, op: str, impl: str, ms: float, nbytes: int, denominator_gbps: float) -> dict[str, Any]:
    gbps = nbytes / ms / 1e6
    return {"case": case, "op": op, "impl": impl, "ms": ms, "bytes": nbytes, "gbps": gbps,
            "fraction_of_copy": gbps / denominator_gbps}  # fmt: skip


def copy_rate(quick: bool) -> dict[str, Any]:
    import torch

    x = torch.empty(_size(2048, 512, 16, quick) * MiB, dtype=torch.uint8, device=_RUN["device"]).random_(0, 255)
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x), quick)
    return {"bytes": 2 * x.numel(), "ms": ms, "gbps": 2 * x.numel() / ms / 1e6}


def pinned_rates(nbytes: int, quick: bool) -> dict[str, float]:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    dev = torch.empty(nbytes, dtype=torch.uint8, device=_RUN["device"])
    h2d = _bench(lambda: dev.copy_(host, non_blocking=True), quick)
    d2h = _bench(lambda: host.copy_(dev, non_blocking=True), quick)
    return {"in_gbps": nbytes / h2d / 1e6, "out_gbps": nbytes / d2h / 1e6, "bytes": nbytes}


def _models():
    from hybridkv.models.presets import preset
    from hybridkv.models.spec import ModelSpec, RecurrentLayerSpec, StateComponent

    def only(name: str, shape: tuple[int, ...], dtype: str) -> ModelSpec:
        layer = RecurrentLayerSpec("mamba2", (StateComponent(name, shape, dtype),))
        return ModelSpec(f"mamba2-2.7b-{name}", (layer,) * 64)

    return {
        "minimax-m1": preset("minimax-m1", "float32", 8 if _RUN["smoke"] else 1),  # smoke: 512 KiB states
        "mamba2-ssm": only("ssm", (80, 64, 128), "float32"),
        "mamba2-conv": only("conv", (80 * 64 + 2 * 128, 3), "bfloat16"),
    }


def state_case(model, batch: int, copy_gbps: float, quick: bool, check: bool) -> list[dict[str, Any]]:
    """gather/scatter of every state layer of ``model`` for ``batch`` requests: hybridkv vs per-layer torch."""
    import torch

    from hybridkv.models.spec import RecurrentLayerSpec

    state_layers = [spec for spec in model.layers if isinstance(spec, RecurrentLayerSpec)]
    nbytes = 2 * batch * sum(spec.state_bytes for spec in state_layers)
    name = f"{model.name} {len(state_layers)} layers x {state_layers[0].state_bytes / MiB:.3g} MiB, B={batch}"
    records = _hybridkv_states(model, batch, name, nbytes, copy_gbps, quick, check)
    torch.cuda.empty_cache()
    records += _torch_states(state_layers, batch, name, nbytes, copy_gbps, quick)
    torch.cuda.empty_cache()
    small = batch == 1 or state_layers[0].state_bytes < 64 * KiB
    for op in ("gather", "scatter"):
        mine, theirs = (r for r in records if r["op"] == op)
        mine["speedup_vs_torch"] = theirs["ms"] / mine["ms"]
        if small:
            mine["target"] = TARGETS["small"]
            mine["pass"] = mine["fraction_of_copy"] >= 0.80 and mine["speedup_vs_torch"] >= 5.0
        elif state_layers[0].state_bytes >= MiB and batch >= 8:
            mine["target"] = TARGETS["large"]
            mine["pass"] = mine["fraction_of_copy"] >= 0.90
    return records


def _hybridkv_states(model, batch, name, nbytes, copy_gbps, quick, check) -> list[dict[str, Any]]:
    """One launch for all layers of all state groups, random block order, pool sized to the batch."""
    import dataclasses

    import numpy as np
    import torch

    from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, scatter_states
    from hybridkv.planner.layout import plan

    probe = plan(model, 1 << 50, block_size=64)
    needed = sum(probe.blocks_per_state) * batch + 1
    layout = plan(model, needed * probe.bytes_per_block, block_size=64)
    pools = allocate_pools(layout, _RUN["device"])
    pools.torch_data.random_(0, 255)
    pools.torch_data[:, :, 0].zero_()
    ids = np.random.default_rng(0).permutation(np.arange(1, layout.num_blocks))
    table = np.zeros((layout.num_state_groups, batch, max(layout.blocks_per_state)), dtype=np.int32)
    pos = 0
    for g, bps in enumerate(layout.blocks_per_state):
        table[g, :, :bps] = ids[pos : pos + batch * bps].reshape(batch, bps)
        pos += batch * bps
    table_dev = torch.from_numpy(table).to(_RUN["device"])
    out = allocate_state_buffers(layout, batch, device=_RUN["device"])
    mine = "naive" if _RUN["smoke"] else "triton"  # the CPU smoke run checks the script, not the kernel
    if check:
        ref = allocate_state_buffers(layout, batch, device=_RUN["device"])
        gather_states(pools, table, None, ref, backend="naive")
        gather_states(pools, table_dev, None, out, backend=mine, validate=False)
        _sync()
        _check(torch.equal(ref.torch_data, out.torch_data), f"{name}: gather")
        del ref
        out.torch_data.random_(0, 255)
        want = pools.torch_data.clone()
        ref_pools = dataclasses.replace(pools, data=want, cache={})
        scatter_states(ref_pools, table, None, out, backend="naive")
        scatter_states(pools, table_dev, None, out, backend=mine, validate=False)
        _sync()
        _check(torch.equal(want, pools.torch_data), f"{name}: scatter")
        del want, ref_pools
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    gather_ms = _bench(lambda: gather_states(pools, table_dev, None, out, validate=False), quick)
    scatter_ms = _bench(lambda: scatter_states(pools, table_dev, None, out, validate=False), quick)
    return [
        _record(name, "gather", "hybridkv (1 launch)", gather_ms, nbytes, copy_gbps),
        _record(name, "scatter", "hybridkv (1 launch)", scatter_ms, nbytes, copy_gbps),
    ]


def _torch_states(state_layers, batch, name, nbytes, copy_gbps, quick) -> list[dict[str, Any]]:
    """vLLM-style baseline: one contiguous ``[num_slots, *state]`` pool per layer, random slots."""
    import torch

    spec = state_layers[0].components[0]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype.value]
    device = _RUN["device"]
    slots = [torch.empty((batch + 1, *spec.shape), dtype=dtype, device=device) for _ in state_layers]
    outs = [torch.empty((batch, *spec.shape), dtype=dtype, device=device) for _ in state_layers]
    idx = torch.randperm(batch + 1, device=device)[:batch]

    def torch_gather():
        for pool, o in zip(slots, outs, strict=True):
            torch.index_select(pool, 0, idx, out=o)

    def torch_scatter():
        for pool, o in zip(slots, outs, strict=True):
            pool.index_copy_(0, idx, o)

    return [
        _record(name, "gather", "torch index_select per layer", _bench(torch_gather, quick), nbytes, copy_gbps),
        _record(name, "scatter", "torch index_copy_ per layer", _bench(torch_scatter, quick), nbytes, copy_gbps),
    ]


def blocks_and_swap_case(copy_gbps: float, pinned: dict[str, float], quick: bool, check: bool) -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from hybridkv.models.presets import preset
    from hybridkv.ops import allocate_host_pools, allocate_pools, copy_blocks, swap_blocks
    from hybridkv.ops.swap.runs import host_runs
    from hybridkv.planner.layout import plan

    model = preset("minimax-m1", "float32", 8 if _RUN["smoke"] else 1)
    probe = plan(model, 1 << 50, block_size=64)
    num_pairs = max(2, _size(1024, 256, 1, quick) * MiB // probe.bytes_per_block)
    layout = plan(model, (2 * num_pairs + 1) * probe.bytes_per_block, block_size=64)
    device = _RUN["device"]
    pools = allocate_pools(layout, device)
    pools.torch_data.random_(0, 255)
    pools.torch_data[:, :, 0].zero_()
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.arange(1, layout.num_blocks))
    src = torch.from_numpy(ids[:num_pairs]).to(device)
    dst = torch.from_numpy(ids[num_pairs : 2 * num_pairs]).to(device)
    name = f"minimax-m1 blocks of {layout.bytes_per_block / MiB:.3g} MiB ({layout.group_size} slots), {num_pairs} pairs"
    nbytes = 2 * num_pairs * layout.bytes_per_block
    data = pools.torch_data

    def torch_copy():
        data[:, :, dst] = data[:, :, src]

    if check:
        want = data.clone()
        want[:, :, dst] = want[:, :, src]
        copy_blocks(pools, src, dst, backend="naive" if _RUN["smoke"] else "triton")
        _sync()
        _check(torch.equal(want, data), f"{name}: copy_blocks")
        del want
    mine = _record(name, "copy_blocks", "hybridkv (1 launch)", _bench(lambda: copy_blocks(pools, src, dst), quick),
                   nbytes, copy_gbps)  # fmt: skip
    src_host, dst_host = ids[:num_pairs].tolist(), ids[num_pairs : 2 * num_pairs].tolist()
    staged = _record(name, "copy_blocks", "hybridkv, host ids (checked)",
                     _bench(lambda: copy_blocks(pools, src_host, dst_host), quick), nbytes, copy_gbps)  # fmt: skip
    theirs = _record(name, "copy_blocks", "torch advanced indexing", _bench(torch_copy, quick), nbytes, copy_gbps)
    mine |= {"speedup_vs_torch": theirs["ms"] / mine["ms"], "target": TARGETS["copy_blocks"]}
    mine["pass"] = mine["fraction_of_copy"] >= 0.85
    records = [mine, staged, theirs]
    num_host_blocks = 3 * num_pairs  # room for scattered ids: a permutation of num_pairs ids sorts back to one run
    host = allocate_host_pools(layout, num_host_blocks)
    moved = num_pairs * layout.bytes_per_block
    dev_ids = ids[:num_pairs]
    dev_index = torch.from_numpy(dev_ids).to(device)
    for host_order in ("consecutive", "scattered"):
        if host_order == "consecutive":
            host_ids = np.arange(num_pairs)
        else:
            host_ids = rng.choice(num_host_blocks, size=num_pairs, replace=False)
        num_copies = len(host_runs(np.sort(host_ids)))
        case = f"minimax-m1 swap {num_pairs} blocks, {host_order} host ids ({num_copies} copies)"  # device ids random
        if check:
            host_index = torch.from_numpy(host_ids)
            swap_blocks(pools, host, dev_ids, host_ids, "out").synchronize()
            got = host.torch_data[host_index].to(device)
            _check(torch.equal(got, data.permute(2, 0, 1, 3)[dev_index]), f"{case}: swap out")
            host.torch_data[host_index] = torch.randint_like(host.torch_data[host_index], 0, 255)
            swap_blocks(pools, host, dev_ids, host_ids, "in").synchronize()
            got = data.permute(2, 0, 1, 3)[dev_index].cpu()
            _check(torch.equal(got, host.torch_data[host_index]), f"{case}: swap in")
            del got
        for direction in ("out", "in"):
            ms = _bench(lambda d=direction, h=host_ids: swap_blocks(pools, host, dev_ids, h, d).wait(), quick)
            rate = pinned[f"{direction}_gbps"]
            rec = _record(case, f"swap_{direction}", "hybridkv", ms, moved, rate)
            rec["fraction_of_pinned"] = rec.pop("fraction_of_copy")
            rec |= {"target": TARGETS["swap"], "pass": rec["fraction_of_pinned"] >= 0.90, "host_copies": num_copies}
            records.append(rec)
    return records


def _wall_ms(fn: Callable[[], Any], sync: Callable[[], Any], reps: int) -> float:
    """Median-free wall time per call over ``reps`` calls between two device synchronisations (Paddle
    launches run on Paddle's stream, which torch's events in ``do_bench`` would not time)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / reps


def segments_case(copy_gbps: float, quick: bool, check: bool) -> list[dict[str, Any]]:
    """FastDeploy's per-segment caches (docs/fastdeploy.md W1): one lightning layer's states of B
    requests gathered / scattered through the pointer-table kernel (hybridkv.ops.segments) and through
    the index moves, on torch and, when Paddle with CUDA is installed, on Paddle tensors."""
    from hybridkv.integrations.fastdeploy.state import gather_state_bytes, scatter_state_bytes
    from hybridkv.integrations.fastdeploy.worker import allocate_caches
    from hybridkv.models.presets import preset
    from hybridkv.ops._framework import interpreter_on
    from hybridkv.planner.layout import plan

    batch = 1 if _RUN["smoke"] else 8 if quick else 32
    model = preset("minimax-m1", "bfloat16", 8)
    probe = plan(model, 1 << 30, block_size=64)
    layout = plan(model, (batch * sum(probe.blocks_per_state) + 64) * probe.bytes_per_block, block_size=64)
    frameworks = ["torch"]
    try:
        import paddle

        if paddle.device.is_compiled_with_cuda() and not _RUN["smoke"]:
            frameworks.append("paddle")
    except ImportError:
        pass
    kernel = "naive" if _RUN["smoke"] and not interpreter_on() else "triton"
    records = []
    for fw in frameworks:
        device = "cpu" if _RUN["smoke"] else "gpu:0"
        caches = allocate_caches(layout, framework=fw, device=device)
        slot = caches.layer_slots[0]
        nbytes = layout.model.layers[0].state_bytes
        rng = np.random.default_rng(0)
        tables = rng.permutation(np.arange(1, layout.num_blocks))[: batch * layout.blocks_per_state[slot.group]]
        tables = tables.reshape(batch, -1)
        data = rng.integers(0, 256, (batch, nbytes), dtype=np.uint8)
        scatter_state_bytes(slot, layout, tables, data, backend="naive")
        if check:
            a = gather_state_bytes(slot, layout, tables, nbytes, backend=kernel)
            _check(np.array_equal(np.asarray(a.cpu().numpy()), data), f"segments gather ({fw}, B={batch})")
        if fw == "paddle":
            import paddle

            sync = paddle.device.synchronize
        else:
            sync = _sync
        reps = 1 if _RUN["smoke"] else 20 if quick else 100
        name = f"minimax-m1 TP8 layer 0 per-segment caches B={batch} ({nbytes // KiB} KiB states)"
        for op, run in (("gather", gather_state_bytes), ("scatter", scatter_state_bytes)):
            arg = nbytes if op == "gather" else data
            for impl, backend in ((f"segments kernel ({fw})", kernel), (f"index moves ({fw})", "naive")):
                call = functools.partial(run, slot, layout, tables, arg, backend=backend)
                records.append(_record(name, op, impl, _wall_ms(call, sync, reps), 2 * batch * nbytes, copy_gbps))
    return records


def _layer_step(model_name: str, tp: int, fw: str, batch: int, tokens: int, fresh: bool):
    """(call(backend) -> output, caches' sync, state bytes per call) for one recurrent layer of
    ``model_name`` at TP ``tp`` over FastDeploy's per-segment caches: ``batch`` rows of ``tokens``
    tokens each (1: decode), continuing from stored states unless ``fresh``."""
    from types import SimpleNamespace

    from hybridkv.integrations.fastdeploy import tensors as tensors_
    from hybridkv.integrations.fastdeploy.layers import gated_delta_rule, gdn_conv, lightning_attention
    from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches, attach_worker
    from hybridkv.models.presets import preset
    from hybridkv.planner.layout import plan

    model = preset(model_name, "bfloat16", tp)
    probe = plan(model, 1 << 30, block_size=64)
    layout = plan(model, (batch * sum(probe.blocks_per_state) + 64) * probe.bytes_per_block, block_size=64)
    device = "cpu" if _RUN["smoke"] else "gpu:0"
    caches = allocate_caches(layout, framework=fw, device=device)
    tables = StateTables(layout, batch, framework=fw, device=device)
    lid = next(i for i, spec in enumerate(layout.model.layers) if hasattr(spec, "components"))
    spec = layout.model.layers[lid]
    ids = iter(range(1, layout.num_blocks))
    for i in range(batch):  # distinct state sets in every group
        tables.set_row(i, [[next(ids) for _ in range(w)] for w in layout.blocks_per_state], i)
    like = caches.segments[0][0]
    cu = tensors_.to_like(np.arange(batch + 1, dtype=np.int32) * tokens, like)
    dec = tensors_.to_like(np.full(batch, 0 if fresh else 7, np.int32), like)
    meta = SimpleNamespace(cu_seqlens_q=cu, seq_lens_decoder=dec)
    fm = attach_worker(meta, caches, tables)
    rng = np.random.default_rng(0)
    n = batch * tokens

    def rand(*shape):
        return tensors_.to_like((rng.standard_normal(shape) * 0.3).astype(np.float32), like)

    if spec.mixer == "lightning":
        h, dk, dv = spec.components[0].shape
        q, k, v, slopes = rand(n, h, dk), rand(n, h, dk), rand(n, h, dv), [0.1 + 0.01 * i for i in range(h)]
        return (lambda b: lightning_attention(q, k, v, slopes, fm, lid, backend=b)), spec.state_bytes
    hv, dk, dv = spec.component("ssm").shape
    dim, taps = spec.component("conv").shape
    hk = (dim - hv * dv) // (2 * dk)
    x, w, g, beta = rand(n, dim), rand(dim, taps + 1), rand(n, hv), rand(n, hv)
    q, k, v = rand(n, hk, dk), rand(n, hk, dk), rand(n, hv, dv)

    def gdn(b):
        return gdn_conv(x, w, fm, lid, backend=b), gated_delta_rule(q, k, v, g, beta, fm, lid, backend=b)

    return gdn, spec.state_bytes


CHECK_TOKENS = 40  # 2 chunks of 16 and a short one (launch.PREFILL_CHUNK)


def layers_case(copy_gbps: float, quick: bool, check: bool) -> list[dict[str, Any]]:
    """The layer API's Triton kernels (hybridkv.integrations.fastdeploy.kernels) over FastDeploy's
    per-segment caches, one launch per layer per step: MiniMax-M1 TP8 lightning and Qwen3-Next TP2
    GDN (conv window + gated delta rule), a decode step (B rows of 1 token) and a prefill step (4 rows
    of 512 tokens, fresh), on torch and on Paddle (when Paddle with CUDA is installed). Bytes: each
    row's state read and written once. Before timing, each kernel's output on 2 fresh rows of
    ``CHECK_TOKENS`` tokens (the lightning kernel's prefill chunks, the last one short) is compared with
    the numpy reference (relative tolerance 1e-3; the recurrences run in fp32)."""
    from hybridkv.integrations.fastdeploy import tensors as tensors_

    frameworks = ["torch"]
    try:
        import paddle

        if paddle.device.is_compiled_with_cuda() and not _RUN["smoke"]:
            frameworks.append("paddle")
    except ImportError:
        pass
    batch = 2 if _RUN["smoke"] else 8 if quick else 32
    prefill = 4 if _RUN["smoke"] else 512
    kernel = "naive" if _RUN["smoke"] else "triton"
    reps = 1 if _RUN["smoke"] else 20 if quick else 100
    records = []
    for fw in frameworks:
        if fw == "paddle":
            import paddle

            sync = paddle.device.synchronize
        else:
            sync = _sync
        for model_name, tp in (("minimax-m1", 8), ("qwen3-next-80b-a3b", 2)):
            if check:
                call, _ = _layer_step(model_name, tp, fw, 2, CHECK_TOKENS, fresh=True)
                want, got = (call(b) for b in ("naive", kernel))
                pairs = zip(*((x,) if not isinstance(x, tuple) else x for x in (want, got)), strict=True)
                err = max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
                          for a, b in ((tensors_.to_numpy(a), tensors_.to_numpy(b)) for a, b in pairs))  # fmt: skip
                _check(err < 1e-3, f"layer kernel {model_name} ({fw}): relative error {err:.1e}", "within 1e-3")
            for rows, tokens, fresh in ((batch, 1, False), (4, prefill, True)):
                call, nbytes = _layer_step(model_name, tp, fw, rows, tokens, fresh)
                step = "decode" if tokens == 1 else f"prefill {tokens}"
                name = f"{model_name} TP{tp} layer kernel, {step}, B={rows} ({nbytes // KiB} KiB states)"
                ms = _wall_ms(functools.partial(call, kernel), sync, reps)
                records.append(_record(name, "layer step", f"layer kernel ({fw})", ms, 2 * rows * nbytes, copy_gbps))
    return records


def print_table(copy: dict[str, Any], pinned: dict[str, float], records: list[dict[str, Any]]) -> None:
    print(f"device copy: {copy['gbps']:.0f} GB/s ({copy['ms']:.3f} ms for {copy['bytes'] / GiB:.1f} GiB r+w); "
          f"pinned: in {pinned['in_gbps']:.1f} GB/s, out {pinned['out_gbps']:.1f} GB/s")  # fmt: skip
    header = f"{'case':<62} {'op':<12} {'impl':<30} {'ms':>9} {'GB/s':>8} {'frac':>6} {'x torch':>8} pass"
    print(header)
    print("-" * len(header))
    for r in records:
        frac = r.get("fraction_of_copy", r.get("fraction_of_pinned", 0.0))
        speedup = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        verdict = {True: "yes", False: "NO"}.get(r.get("pass"), "")
        print(f"{r['case'][:62]:<62} {r['op']:<12} {r['impl'][:30]:<30} {r['ms']:>9.3f} {r['gbps']:>8.0f} "
              f"{frac:>6.0%} {speedup:>8} {verdict}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU benchmark of hybridkv.ops (see docs/bench.md)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer cases (a smoke run)")
    parser.add_argument("--no-check", action="store_true", help="skip the Triton-vs-reference check before timing")
    parser.add_argument("--no-save", action="store_true", help="print only, do not write the JSON")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every case on the CPU with tiny sizes (checks the script; no JSON)",
    )
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_ops_gpu: torch is not installed; nothing to measure", file=sys.stderr)
        return 0
    info = versions()
    print(f"driver {info['driver']} (CUDA driver API {info['cuda_driver_api']}), CUDA runtime "
          f"{info['cuda_runtime']}, Triton {info['triton']}, torch {info['torch']}, GPU {info.get('gpu')}",
          flush=True)  # fmt: skip
    if args.cpu_smoke:
        _RUN.update(device="cpu", smoke=True)
        args.quick, args.no_save = True, True
        print(
            "CPU SMOKE RUN: checks that every case runs; the figures below are NOT measurements "
            "(a CPU, tiny sizes, one call each; 'NO' in the target columns means nothing)",
            flush=True,
        )
    elif not torch.cuda.is_available():
        print("bench_ops_gpu: no CUDA device here; this benchmark measures GPU ops, nothing to do", file=sys.stderr)
        return 0
    from benchmarks._common import save

    copy = copy_rate(args.quick)
    pinned = pinned_rates(_size(1024, 256, 16, args.quick) * MiB, args.quick)
    models = _models()
    cases = [("minimax-m1", b) for b in ((1,) if _RUN["smoke"] else (1, 8) if args.quick else (1, 8, 32))]
    cases += [("mamba2-ssm", _size(64, 16, 1, args.quick)), ("mamba2-conv", _size(64, 64, 4, args.quick))]
    records = []
    for model_name, batch in cases:
        records += state_case(models[model_name], batch, copy["gbps"], args.quick, check=not args.no_check)
    records += blocks_and_swap_case(copy["gbps"], pinned, args.quick, check=not args.no_check)
    records += segments_case(copy["gbps"], args.quick, check=not args.no_check)
    records += layers_case(copy["gbps"], args.quick, check=not args.no_check)
    print_table(copy, pinned, records)
    payload = {
        "quick": args.quick,
        "checked_bit_exact": not args.no_check,
        "versions": info,
        "copy": copy,
        "pinned": pinned,
        "targets": TARGETS,
        "cases": records,
        "all_targets_met": all(r["pass"] for r in records if "pass" in r),
    }
    if not args.no_save:
        print(f"saved {save('ops_gpu', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

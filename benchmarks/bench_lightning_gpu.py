"""GPU benchmark of the paged in-place lightning decode (docs/bench.md), MiniMax-M1 TP8 shapes.

One lightning layer's decode step, state ``[8, 128, 128]`` fp32 (512 KiB) per request, B = 1, 8, 64,
three ways:

- ``paged``: :func:`hybridkv.ops.lightning.lightning_decode` in place through the state table, states
  in the paged pool of ``plan(minimax-m1 TP8, block 64)`` (a state spans 16 blocks of 32 KiB), block
  ids in random order;
- ``contiguous``: the same Triton kernel on a vLLM-style ``[num_slots, H, D, D]`` pool (one state per
  slot, slot ids in random order: the kernel's addressing with one block per state);
- ``gather_decode_scatter``: ``gather_states`` of the layer's state group (10 layers, one launch)
  into contiguous buffers, the kernel on the buffers, ``scatter_states``; reported per layer
  (the group's time / 10, the decode itself once per layer).

Targets (docs/bench.md): paged at least as fast as contiguous, and >= 2x faster than gather -> decode ->
scatter. Bandwidth counts the state bytes read + written. ``triton.testing.do_bench`` medians; the
device copy rate measured in the same process is the denominator.

    python benchmarks/bench_lightning_gpu.py            # on a CUDA device; JSON in benchmarks/results/
    python benchmarks/bench_lightning_gpu.py --quick
    TRITON_INTERPRET=1 python benchmarks/bench_lightning_gpu.py --cpu-smoke   # tiny sizes; checks the script

Without a CUDA device (and without --cpu-smoke) it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = "paged >= contiguous speed (ms_paged <= ms_contiguous) and >= 2x faster than gather -> decode -> scatter"
_RUN = {"device": "cuda", "smoke": False}


def _bench(fn: Callable[[], Any], quick: bool) -> float:
    if _RUN["smoke"]:  # one timed call: checks the case runs; the figure means nothing
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median"))


def copy_rate(quick: bool) -> dict[str, float]:
    import torch

    nbytes = (64 if _RUN["smoke"] else 512 if quick else 2048) * 2**20 // (1024 if _RUN["smoke"] else 1)
    x = torch.empty(nbytes, dtype=torch.uint8, device=_RUN["device"])
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x), quick)
    return {"ms": ms, "bytes": 2 * nbytes, "gbps": 2 * nbytes / ms / 1e6}


def _layout():
    from hybridkv.models.presets import preset
    from hybridkv.ops.testing import small_layout
    from hybridkv.planner.layout import plan

    if _RUN["smoke"]:  # 2 heads of [16, 16] fp32 over 4 blocks
        return small_layout(components=(("kv", (2, 16, 16), "float32"),), pattern="RRAR", kv_heads=1, head_dim=16,
                            kv_dtype="float32", block_size=4, num_blocks=400)  # fmt: skip
    return plan(preset("minimax-m1", "float32", tp_size=8), 1 << 40, block_size=64)


def run_case(batch: int, copy_gbps: float, quick: bool, check: bool = True) -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, scatter_states
    from hybridkv.ops.lightning import decay_factors, kernel, lightning_decode, lightning_layer, lightning_slopes

    dev = _RUN["device"]
    probe = _layout()
    group, slot = 0, 0
    while probe.state_layer(group, slot) is None:
        slot += 1
    bps = probe.blocks_per_state[group]
    num_blocks = 2 * probe.num_state_groups * batch * bps + 1  # ids for every group's table, in random order
    pools = allocate_pools(probe, dev, num_blocks=num_blocks)
    layer = lightning_layer(pools, group, slot)
    h, dk, dv = layer.num_heads, layer.dk, layer.dv
    rng = np.random.default_rng(batch)
    ids = rng.permutation(np.arange(1, num_blocks))[: probe.num_state_groups * batch * bps]
    table_np = ids.reshape(probe.num_state_groups, batch, bps).astype(np.int32)
    table = torch.from_numpy(table_np).to(dev)
    pools.torch_data.random_(0, 60)  # finite fp32 values (top byte < 0x3c)
    pools.torch_data[:, :, 0] = 0  # the null block
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, h, d, generator=gen).to(dev) * 0.1 for d in (dk, dk, dv))
    slopes = lightning_slopes(h, 3, 80)

    # contiguous [num_slots, H, D, D] pool, the same kernel (one "block" per state)
    num_slots = max(4 * batch, 8)
    contig = torch.randn(num_slots, h, dk, dv, generator=gen).to(dev)
    slot_ids = torch.from_numpy(rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)).to(dev)[:, None]
    decay = decay_factors(slopes).to(dev)
    init = torch.ones(batch, dtype=torch.int8, device=dev)
    out = torch.empty(batch, h, dv, device=dev)
    state_elems = h * dk * dv

    contig_flat = contig.view(-1)

    def contiguous():
        kernel.launch_decode(contig_flat, slot_ids, slot_ids, init, q, k, v, out, decay, 0, 0, state_elems,
                             state_elems, num_slots)  # fmt: skip

    def paged():
        lightning_decode(pools, table, group, slot, q, k, v, slopes, validate=False, backend="triton")

    bufs = allocate_state_buffers(probe, batch, group=group, device=dev)
    layers = [s for s in range(probe.group_size) if probe.state_layer(group, s) is not None]
    buf_layer = bufs.layer(group, slot)["kv"]  # [B, H, D, D] view of the gathered buffer
    identity = torch.arange(batch, dtype=torch.int32, device=dev)[:, None]

    rows = identity + 1  # "block" b + 1 of a base shifted back by one state: row b of the buffer (0 is padding)

    def gather_decode_scatter():
        gather_states(pools, table[group], group, bufs, validate=False, backend="triton")
        for _ in layers:  # each layer's decode on its contiguous [B, H, D, D] buffer
            kernel.launch_decode(buf_layer.view(-1), rows, rows, init, q, k, v, out, decay, -state_elems, 0,
                                 state_elems, state_elems, batch + 1)  # fmt: skip
        scatter_states(pools, table[group], group, bufs, validate=False, backend="triton")

    if check:  # before timing: the kernel equals the reference on the same states, in the paged pool
        before = pools.torch_data.clone()
        o_ref = lightning_decode(pools, table, group, slot, q, k, v, slopes, backend="naive", validate=False)
        after_ref = pools.torch_data.clone()
        pools.torch_data.copy_(before)
        o = lightning_decode(pools, table, group, slot, q, k, v, slopes, backend="triton", validate=False)
        got = pools.torch_data.view(-1).view(torch.float32)
        assert torch.allclose(o, o_ref, rtol=1e-4, atol=1e-5), "paged decode output differs from the reference"
        assert torch.allclose(got, after_ref.view(-1).view(torch.float32), rtol=1e-4, atol=1e-5, equal_nan=True)
        pools.torch_data.copy_(before)
        del before, after_ref

    nbytes = 2 * batch * state_elems * 4
    records = []
    ms = {}
    for impl, fn, per in (("paged", paged, 1), ("contiguous", contiguous, 1),
                          ("gather_decode_scatter", gather_decode_scatter, len(layers))):  # fmt: skip
        ms[impl] = _bench(fn, quick) / per
        records.append({"case": f"lightning decode [{h}, {dk}, {dv}] fp32, B={batch}", "impl": impl, "ms": ms[impl],
                        "bytes": nbytes, "gbps": nbytes / ms[impl] / 1e6,
                        "fraction_of_copy": nbytes / ms[impl] / 1e6 / copy_gbps})  # fmt: skip
    verdict = ms["paged"] <= ms["contiguous"] and 2 * ms["paged"] <= ms["gather_decode_scatter"]
    for r in records:
        r |= {"batch": batch, "target": TARGET, "pass": verdict}
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU benchmark of the paged lightning decode (docs/bench.md)")
    parser.add_argument("--quick", action="store_true", help="shorter timing")
    parser.add_argument("--no-check", action="store_true", help="skip the kernel-vs-reference check before timing")
    parser.add_argument("--no-save", action="store_true", help="print only, do not write the JSON")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1); no JSON")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_lightning_gpu: torch is not installed; nothing to measure", file=sys.stderr)
        return 0
    if args.cpu_smoke:
        _RUN.update(device="cpu", smoke=True)
        args.quick, args.no_save = True, True
    elif not torch.cuda.is_available():
        print("bench_lightning_gpu: no CUDA device here; this benchmark measures a GPU kernel", file=sys.stderr)
        return 0
    import triton

    from benchmarks._common import save

    copy = copy_rate(args.quick)
    records = []
    for batch in (1, 3) if _RUN["smoke"] else (1, 8, 64):
        records += run_case(batch, copy["gbps"], args.quick, check=not args.no_check)
    print(f"device copy: {copy['gbps']:.0f} GB/s")
    print(f"{'case':<44} {'impl':<22} {'ms':>9} {'GB/s':>8} {'frac':>6} pass")
    for r in records:
        print(f"{r['case']:<44} {r['impl']:<22} {r['ms']:>9.4f} {r['gbps']:>8.0f} {r['fraction_of_copy']:>6.0%} "
              f"{'yes' if r['pass'] else 'NO'}")  # fmt: skip
    payload = {
        "quick": args.quick,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "copy": copy,
        "target": TARGET,
        "cases": records,
        "all_targets_met": all(r["pass"] for r in records),
    }
    if not args.no_save:
        print(f"saved {save('lightning_gpu', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quantization error of a recurrent state per dtype, scale granularity and rounding, measured on
three recurrences driven by random inputs (not trained models): the state is stored and loaded
through hybridkv's quantizer (:mod:`hybridkv.ops.states.quant`, the arithmetic scatter_states and
gather_states use) after every step, as an engine does between decode steps, and compared with the
same run kept in float32.

- ``gdn``: gated delta rule (Qwen3-Next), state ``[H, d_k, d_v]``, L2-normalised keys;
- ``mamba2``: ``h = exp(dt A) h + dt x B^T``, state ``[H, head_dim, d_state]`` (Nemotron-H, Mamba2);
- ``lightning``: ``S = lambda S + k v^T`` with MiniMax's per-head decays, state ``[H, d, d]``.

Input channels get log-normal magnitudes (sigma 1), so rows of a state differ in scale as they do in
real models. Reported per configuration: the relative error of the final state stored once (the
granularity alone), and over ``--steps`` steps of store / load the median and worst relative error
of the layer's outputs and the final state's relative error. Run:

    PYTHONPATH=. python benchmarks/state_quant_error.py --steps 512
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import save  # noqa: E402
from hybridkv.models.dtypes import DType  # noqa: E402
from hybridkv.ops.states import quant  # noqa: E402

CONFIGS = [("bfloat16", None, False), ("float16", None, False), ("float16", None, True)] + [
    (dtype, scales, sr) for dtype in ("int8", "fp8") for scales in ("row", "head", "tensor") for sr in (False, True)
]


def _store(state: torch.Tensor, dtype: str, scales: str | None, sr: bool, step: int, salt: int) -> torch.Tensor:
    """``state`` after a store / load through the quantizer (float32 in, float32 out)."""
    if dtype == "bfloat16":
        return state.to(torch.bfloat16).to(torch.float32)
    d = DType.parse(dtype, quantized=True)
    flat = state.reshape(1, -1)
    group = {"row": state.shape[-1], "head": flat.shape[1] // state.shape[0], "tensor": flat.shape[1], None: 1}[scales]
    u = quant.uniforms(torch.from_numpy(quant.rounding_seeds([0], [step])), salt, flat.shape[1]) if sr else 0.5
    return quant.decode(quant.encode(flat, d, group, u), d, flat.shape[1], group).view(state.shape)


class Recurrence:
    def __init__(self, kind: str, steps: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kind = kind
        shape = {"gdn": (4, 128, 128), "mamba2": (8, 64, 128), "lightning": (4, 128, 128)}[kind]
        self.shape = shape
        H, a, b = shape
        chan_a = torch.exp(torch.randn(H, a, generator=g))  # per-channel magnitudes
        chan_b = torch.exp(torch.randn(H, b, generator=g))
        self.inputs = []
        for _ in range(steps):
            x = torch.randn(H, a, generator=g) * chan_a
            y = torch.randn(H, b, generator=g) * chan_b
            q = torch.randn(H, b if kind == "mamba2" else a, generator=g)
            gate = torch.rand(H, generator=g)
            self.inputs.append((x, y, q, gate))
        if kind == "mamba2":
            self.A = -torch.exp(torch.rand(H, generator=g) * math.log(16))
        if kind == "lightning":
            self.decay = torch.exp(-(2.0 ** (-8.0 * torch.arange(1, H + 1) / H)))

    def step(self, s: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, q, gate = self.inputs[t]
        if self.kind == "gdn":
            k = x / x.norm(dim=1, keepdim=True)
            decay = torch.exp(-0.05 * gate)[:, None, None]
            beta = torch.sigmoid(gate * 4 - 2)[:, None]
            s = s * decay
            err = y - torch.einsum("hk,hkv->hv", k, s)
            s = s + torch.einsum("hk,hv->hkv", k, beta * err)
            return s, torch.einsum("hk,hkv->hv", q / math.sqrt(q.shape[1]), s)
        if self.kind == "mamba2":
            dt = torch.nn.functional.softplus(gate * 4 - 4)[:, None, None]
            s = torch.exp(dt * self.A[:, None, None]) * s + dt * torch.einsum(
                "hp,hn->hpn", x, y / y.norm(dim=1, keepdim=True)
            )
            return s, torch.einsum("hpn,hn->hp", s, q)
        k = x / math.sqrt(x.shape[1])
        s = self.decay[:, None, None] * s + torch.einsum("hk,hv->hkv", k, y)
        return s, torch.einsum("hk,hkv->hv", q / math.sqrt(q.shape[1]), s)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(kind: str, steps: int, seed: int) -> list[dict]:
    rec = Recurrence(kind, steps, seed)
    ref_s = torch.zeros(rec.shape)
    ref_out = []
    for t in range(steps):
        ref_s, o = rec.step(ref_s, t)
        ref_out.append(o)
    rows = []
    for dtype, scales, sr in CONFIGS:
        s = torch.zeros(rec.shape)
        errs = []
        for t in range(steps):
            s, o = rec.step(s, t)
            s = _store(s, dtype, scales, sr, t, 12345)
            errs.append(rel(o, ref_out[t]))
        d = DType.parse(dtype, quantized=True) if dtype != "bfloat16" else None
        stored_bytes = ref_s.numel() * (d.itemsize if d else 2)
        groups = {"row": ref_s.numel() // ref_s.shape[-1], "head": ref_s.shape[0], "tensor": 1, None: 0}[scales]
        rows.append(
            {
                "recurrence": kind,
                "state_shape": list(rec.shape),
                "dtype": dtype,
                "scales": scales,
                "rounding": "stochastic" if sr else "nearest",
                "bytes": stored_bytes + 4 * groups,
                "once_state_rel_error": rel(_store(ref_s, dtype, scales, sr, steps, 1), ref_s),
                "output_rel_error_median": statistics.median(errs),
                "output_rel_error_worst": max(errs),
                "final_state_rel_error": rel(s, ref_s),
            }
        )
        r = rows[-1]
        print(
            f"{kind:9s} {dtype:8s} {scales or '-':6s} {'SR' if sr else 'RN'}  once {r['once_state_rel_error']:.2e}"
            f"  out median {rows[-1]['output_rel_error_median']:.2e} worst {rows[-1]['output_rel_error_worst']:.2e}"
            f"  final {rows[-1]['final_state_rel_error']:.2e}",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recurrences", default="gdn,mamba2,lightning")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rows = [r for kind in args.recurrences.split(",") for r in measure(kind, args.steps, args.seed)]
    path = save(
        "state_quant_error",
        {
            "steps": args.steps,
            "seed": args.seed,
            "inputs": "random (log-normal channel magnitudes, sigma 1); no trained weights",
            "rows": rows,
        },
    )
    print(path)


if __name__ == "__main__":
    main()

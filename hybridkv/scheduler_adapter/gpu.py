"""A GPU's figures and what preempting a request costs on it: swap a victim to host memory and
back, or drop it and recompute it.

Both costs are seconds on one tensor-parallel rank (the layout and the model spec describe one rank):

- swap: the victim's device blocks (KV + live state sets) go to the host and come back, so
  ``2 * num_blocks * bytes_per_block / host_link_bytes_per_s``;
- recompute: a prefill over the victim's computed tokens, ``flops / (flops_per_s * efficiency)``
  with ``2 * params_active / tp_size`` FLOPs per token for the weights, causal attention over the
  context for attention layers (``2 * n^2 * q_heads * head_dim`` per layer: ``QK^T`` and ``PV``,
  half of each under the causal mask) and ``4 * state elements`` per token for recurrent layers
  (decay + ``k^T v`` into the state, ``q S`` out of it).

The simulator's roofline step time (:mod:`hybridkv.sim.cost`) uses the same :class:`GpuSpec`, so the
preemption choice and the simulated clock share one set of GPU figures, which a measured JSON can
replace (:func:`calibrate`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from hybridkv.models.flops import prefill_flops
from hybridkv.models.spec import ModelSpec
from hybridkv.planner.layout import Layout


class PreemptionMode(enum.Enum):
    """How a victim gives its device blocks back."""

    RECOMPUTE = "recompute"  # free everything; the request prefills prompt + outputs again later
    SWAP = "swap"  # copy KV and state to the host pool; copy back and resume where it was
    AUTO = "auto"  # per victim, the cheaper of the two by :func:`preemption_cost`


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """What the cost model needs of a GPU: dense bf16 FLOP/s, an efficiency, the host link rate."""

    name: str
    flops_per_s: float  # dense bf16 tensor-core peak
    host_link_bytes_per_s: float  # device <-> pinned host, one direction
    hbm_bytes_per_s: float
    flops_efficiency: float = 0.5  # fraction of peak a prefill reaches
    hbm_efficiency: float = 0.8  # fraction of HBM peak a forward's streaming reads reach (step time only)

    def __post_init__(self) -> None:
        if self.flops_per_s <= 0 or self.host_link_bytes_per_s <= 0 or self.hbm_bytes_per_s <= 0:
            raise ValueError(f"GPU {self.name!r}: rates must be positive")
        for what, value in (("flops_efficiency", self.flops_efficiency), ("hbm_efficiency", self.hbm_efficiency)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"GPU {self.name!r}: {what} must be in (0, 1], got {value}")

    @property
    def effective_flops_per_s(self) -> float:
        return self.flops_per_s * self.flops_efficiency

    @property
    def effective_hbm_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency


# H200: host link measured here (docs/bench.md: 55.3 GB/s pinned, both directions);
# H100 SXM has the same PCIe 5 link; A100 SXM sits on PCIe 4 (about half).
H200 = GpuSpec("H200", 989e12, 55.3e9, 4.8e12)
H100 = GpuSpec("H100", 989e12, 55.3e9, 3.35e12)
A100 = GpuSpec("A100", 312e12, 25e9, 2.0e12)
GPU_PRESETS: dict[str, GpuSpec] = {g.name.lower(): g for g in (H200, H100, A100)}


def gpu_preset(name: str) -> GpuSpec:
    """``h200``, ``h100`` or ``a100``; raises ``ValueError`` naming the choices otherwise."""
    key = name.strip().lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def recompute_flops(model: ModelSpec, num_tokens: int) -> float:
    """FLOPs one rank spends to prefill ``num_tokens`` tokens from scratch (see the module docstring).

    Raises ``ValueError`` when the spec has no ``params_active`` (the cost model needs it).
    """
    if model.params_active is None:
        raise ValueError(f"model {model.name!r} has no params_active: set it in the spec to use preemption 'auto'")
    return prefill_flops(model, num_tokens)


class PreemptionCost(NamedTuple):
    """Seconds either way for one victim, and the choice."""

    swap_bytes: int  # one direction
    swap_s: float  # out and back in
    recompute_flops: float
    recompute_s: float
    mode: PreemptionMode  # SWAP or RECOMPUTE, whichever is cheaper (ties: recompute, it needs no host blocks)


def preemption_cost(layout: Layout, gpu: GpuSpec, num_blocks: int, num_computed_tokens: int) -> PreemptionCost:
    """Cost of preempting a request holding ``num_blocks`` device blocks (KV + live state sets)
    with ``num_computed_tokens`` tokens of context."""
    swap_bytes = num_blocks * layout.bytes_per_block
    swap_s = 2.0 * swap_bytes / gpu.host_link_bytes_per_s
    flops = recompute_flops(layout.model, num_computed_tokens)
    recompute_s = flops / gpu.effective_flops_per_s
    mode = PreemptionMode.SWAP if swap_s < recompute_s else PreemptionMode.RECOMPUTE
    return PreemptionCost(swap_bytes, swap_s, flops, recompute_s, mode)


# ---- GPU figures from files and measurements ------------------------------------------------------
_GPU_FIELDS = ("flops_per_s", "host_link_bytes_per_s", "hbm_bytes_per_s", "flops_efficiency", "hbm_efficiency")


def calibrate(gpu: GpuSpec, measured: Mapping[str, Any]) -> tuple[GpuSpec, tuple[str, ...]]:
    """Replace the figures of ``gpu`` that a measured JSON covers; returns the new spec and the
    fields replaced.

    Two forms: flat fields of :class:`GpuSpec` (``hbm_bytes_per_s``, ``host_link_bytes_per_s``, ...),
    or the GPU ops benchmark's JSON (``benchmarks/bench_ops_gpu.py``): its device copy rate
    (``copy.gbps``, read + write bytes) becomes ``hbm_bytes_per_s`` at efficiency 1 (it is measured),
    and the slower direction of its pinned host copies (``pinned.in_gbps`` / ``out_gbps``) becomes
    ``host_link_bytes_per_s``. Raises ``ValueError`` when nothing is covered or the benchmark ran
    without a GPU.
    """
    changes: dict[str, float] = {}
    if "copy" in measured or "pinned" in measured:
        if measured.get("gpu") is None and "gpu" in measured:
            raise ValueError("calibration JSON was measured without a GPU (CPU smoke run): measure on the GPU")
        copy = measured.get("copy") or {}
        if "gbps" in copy:
            changes |= {"hbm_bytes_per_s": float(copy["gbps"]) * 1e9, "hbm_efficiency": 1.0}
        pinned = measured.get("pinned") or {}
        rates = [float(pinned[k]) for k in ("in_gbps", "out_gbps") if k in pinned]
        if rates:
            changes["host_link_bytes_per_s"] = min(rates) * 1e9
    else:
        changes = {k: float(measured[k]) for k in _GPU_FIELDS if k in measured}
    if not changes:
        raise ValueError(
            f"calibration JSON covers none of {', '.join(_GPU_FIELDS)} (nor the ops benchmark's copy / pinned rates)"
        )
    return replace(gpu, **changes), tuple(changes)


def load_gpu(name_or_path: str, calibration: str | Path | None = None) -> GpuSpec:
    """A preset (``h200``, ``h100``, ``a100``) or a JSON file with ``name`` and the :class:`GpuSpec`
    rates; then ``calibration`` (a measured JSON, see :func:`calibrate`) replaces what it covers.
    Raises ``ValueError`` naming the problem."""
    p = Path(name_or_path)
    if name_or_path.lower() in GPU_PRESETS or not p.suffix:
        gpu = gpu_preset(name_or_path)
    else:
        data = _read_json(p)
        missing = [k for k in ("flops_per_s", "host_link_bytes_per_s", "hbm_bytes_per_s") if k not in data]
        if missing:
            raise ValueError(f"GPU file {p}: missing {', '.join(missing)} (bytes and FLOPs per second)")
        gpu = GpuSpec(str(data.get("name", p.stem)), **{k: float(data[k]) for k in _GPU_FIELDS if k in data})
    if calibration is not None:
        gpu, _ = calibrate(gpu, _read_json(Path(calibration)))
    return gpu


def _read_json(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return data

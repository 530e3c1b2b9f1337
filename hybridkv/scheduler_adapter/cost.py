"""Preemption cost model: swap a victim to host memory and back, or drop it and recompute it.

Both costs are seconds on one tensor-parallel rank (the layout and the model spec describe one rank):

- swap: the victim's device blocks (KV + live state sets) go to the host and come back, so
  ``2 * num_blocks * bytes_per_block / host_link_bytes_per_s``;
- recompute: a prefill over the victim's computed tokens, ``flops / (flops_per_s * efficiency)``
  with ``2 * params_active / tp_size`` FLOPs per token for the weights, causal attention over the
  context for attention layers (``2 * n^2 * q_heads * head_dim`` per layer: ``QK^T`` and ``PV``,
  half of each under the causal mask) and ``4 * state elements`` per token for recurrent layers
  (decay + ``k^T v`` into the state, ``q S`` out of it).

The same module holds the simulator's roofline step time (:class:`StepCostModel`, :func:`step_time`):
one forward's FLOPs against the GPU's compute and its bytes (weights, KV reads and writes, state
reads and writes, device block copies) against HBM, with swap transfers on the host link. The
preemption choice and the simulated clock therefore use one set of GPU figures, which a measured
JSON can replace (:func:`calibrate`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from hybridkv.models.flops import flop_coefficients, prefill_flops
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


# ---- roofline step time -----------------------------------------------------------------------------
class StepWork(NamedTuple):
    """What one step moves and computes on one tensor-parallel rank."""

    flops: float
    weight_bytes: float  # the weights, read once per forward
    kv_read_bytes: float  # each row reads its whole context's K/V once
    kv_write_bytes: float  # K/V of the new tokens
    state_read_bytes: float  # each row reads its live state once ...
    state_write_bytes: float  # ... and writes it once, plus one speculative set per draft
    copy_bytes: float  # device block copies (checkpoints, copy-on-write, prefix hits): read + write
    swap_out_bytes: int  # device -> host
    swap_in_bytes: int  # host -> device

    @property
    def hbm_bytes(self) -> float:
        return (
            self.weight_bytes
            + self.kv_read_bytes
            + self.kv_write_bytes
            + self.state_read_bytes
            + self.state_write_bytes
            + self.copy_bytes
        )


class StepTime(NamedTuple):
    """Seconds of one step: ``total_s = swap_in_s + max(forward_s, swap_out_s)``."""

    compute_s: float  # FLOPs at the effective FLOP rate
    memory_s: float  # HBM bytes at the effective HBM rate
    forward_s: float  # roofline: the larger of the two
    swap_out_s: float
    swap_in_s: float
    total_s: float


class StepCostModel:
    """Roofline step time of a model's layout on a GPU (one rank).

    Per row running tokens ``[start, start + n + drafts)``: FLOPs by
    :func:`~hybridkv.models.flops.prefill_flops` (weights, causal attention, recurrent updates);
    HBM bytes: the weights once per step (``params_active / tp * weight_bytes_per_param``; an MoE
    forward with many rows reads more experts than that, so decode steps of large batches are
    optimistic), the row's context K/V read and its new K/V written, its live state read and
    written once, ``drafts`` speculative sets written, and block copies read and written.
    Swap transfers use the host link: swap-ins are on the critical path (the resumed rows run in
    this step); swap-outs overlap the forward, on the assumption that an engine drains victims on
    a copy stream while the forward runs (the host link is full duplex), so a step takes at least
    as long as its swap-outs but not their sum with the forward.
    """

    def __init__(self, layout: Layout, gpu: GpuSpec, weight_bytes_per_param: float = 2.0) -> None:
        model = layout.model
        self.layout = layout
        self.gpu = gpu
        self.coefficients = flop_coefficients(model)
        self.weight_bytes = (model.params_active or 0.0) / model.tp_size * weight_bytes_per_param
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.state_bytes = model.state_bytes
        self.bytes_per_block = layout.bytes_per_block

    def work(
        self,
        rows: Iterable[tuple[int, int, int]],
        num_copy_blocks: int = 0,
        num_swap_out_blocks: int = 0,
        num_swap_in_blocks: int = 0,
    ) -> StepWork:
        """``rows``: ``(start, num_tokens, num_drafts)`` per scheduled row (a :class:`ScheduledRequest`'s
        ``num_computed_tokens, num_scheduled_tokens, num_drafts``)."""
        linear, quadratic = self.coefficients
        flops = kv_read = tokens = drafts = 0.0
        num_rows = 0
        for start, n, d in rows:
            end = start + n + d
            flops += linear * (end - start) + quadratic * (float(end) * end - float(start) * start)
            kv_read += end
            tokens += n + d
            drafts += d
            num_rows += 1
        weights = self.weight_bytes if num_rows else 0.0
        return StepWork(
            flops,
            weights,
            kv_read * self.kv_bytes_per_token,
            tokens * self.kv_bytes_per_token,
            num_rows * self.state_bytes,
            (num_rows + drafts) * self.state_bytes,
            2.0 * num_copy_blocks * self.bytes_per_block,
            num_swap_out_blocks * self.bytes_per_block,
            num_swap_in_blocks * self.bytes_per_block,
        )

    def time(self, work: StepWork) -> StepTime:
        g = self.gpu
        compute = work.flops / g.effective_flops_per_s
        memory = work.hbm_bytes / g.effective_hbm_bytes_per_s
        forward = max(compute, memory)
        out = work.swap_out_bytes / g.host_link_bytes_per_s
        swap_in = work.swap_in_bytes / g.host_link_bytes_per_s
        return StepTime(compute, memory, forward, out, swap_in, swap_in + max(forward, out))


def step_time(layout: Layout, gpu: GpuSpec, rows: Iterable[tuple[int, int, int]], **blocks: int) -> StepTime:
    """One-off :meth:`StepCostModel.time` of :meth:`StepCostModel.work` (loops should keep a model)."""
    model = StepCostModel(layout, gpu)
    return model.time(model.work(rows, **blocks))

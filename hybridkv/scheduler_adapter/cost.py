"""Preemption cost model: swap a victim to host memory and back, or drop it and recompute it.

Both costs are seconds on one tensor-parallel rank (the layout and the model spec describe one rank):

- swap: the victim's device blocks (KV + live state sets) go to the host and come back, so
  ``2 * num_blocks * bytes_per_block / host_link_bytes_per_s``;
- recompute: a prefill over the victim's computed tokens, ``flops / (flops_per_s * efficiency)``
  with ``2 * params_active / tp_size`` FLOPs per token for the weights, causal attention over the
  context for attention layers (``2 * n^2 * q_heads * head_dim`` per layer: ``QK^T`` and ``PV``,
  half of each under the causal mask) and ``4 * state elements`` per token for recurrent layers
  (decay + ``k^T v`` into the state, ``q S`` out of it).

These are estimates for a choice between two options, not predictions of step time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.blockmgr.flops import prefill_flops
from hybridkv.blockmgr.layout import Layout
from hybridkv.blockmgr.spec import ModelSpec


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

    def __post_init__(self) -> None:
        if self.flops_per_s <= 0 or self.host_link_bytes_per_s <= 0 or self.hbm_bytes_per_s <= 0:
            raise ValueError(f"GPU {self.name!r}: rates must be positive")
        if not 0.0 < self.flops_efficiency <= 1.0:
            raise ValueError(f"GPU {self.name!r}: flops_efficiency must be in (0, 1], got {self.flops_efficiency}")

    @property
    def effective_flops_per_s(self) -> float:
        return self.flops_per_s * self.flops_efficiency


# H200: host link measured here (shared/BENCH.md: 55.3 GB/s pinned, both directions);
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

"""Old path of the GPU figures and the cost models: the GPU and preemption names live in
:mod:`hybridkv.scheduler_adapter.gpu`, the simulator's roofline step time in :mod:`hybridkv.sim.cost`
(resolved here on first use, so this module imports nothing above the scheduler)."""

from typing import Any

from hybridkv.scheduler_adapter.gpu import (
    A100,
    GPU_PRESETS,
    H100,
    H200,
    GpuSpec,
    PreemptionCost,
    PreemptionMode,
    calibrate,
    gpu_preset,
    load_gpu,
    preemption_cost,
    recompute_flops,
)

__all__ = [
    "A100",
    "GPU_PRESETS",
    "H100",
    "H200",
    "GpuSpec",
    "PreemptionCost",
    "PreemptionMode",
    "calibrate",
    "gpu_preset",
    "load_gpu",
    "preemption_cost",
    "recompute_flops",
]

_MOVED = {"StepCostModel", "StepTime", "StepWork", "step_time"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # moved to hybridkv.sim.cost (issue 39); resolved lazily, no upward import
        import hybridkv.sim.cost as cost

        return getattr(cost, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

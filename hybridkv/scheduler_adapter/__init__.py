"""Continuous-batching scheduler over the hybrid block manager, step metadata, disaggregation roles.

Imports numpy only. The FastDeploy pieces live in :mod:`hybridkv.integrations.fastdeploy`; the names
this package used to export for them (``FastDeployBlockManager``, ``StateLayerSlot``, ``attach``,
``kv_cache_list``) still resolve here, on first use, for code written against the old path.
"""

from typing import Any

from hybridkv.scheduler_adapter.gpu import (
    A100,
    H100,
    H200,
    GpuSpec,
    PreemptionCost,
    PreemptionMode,
    gpu_preset,
    preemption_cost,
    recompute_flops,
)
from hybridkv.scheduler_adapter.metadata import StepMetadata, build_step_metadata
from hybridkv.scheduler_adapter.preemption import Preemptor, SwapExecutor
from hybridkv.scheduler_adapter.requests import (
    AdmissionPolicy,
    Preemption,
    RequestState,
    SchedRequest,
    ScheduledRequest,
    StateExport,
    StepOutputs,
    StepPlan,
    StepResult,
)
from hybridkv.scheduler_adapter.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "A100",
    "AdmissionPolicy",
    "H100",
    "H200",
    "GpuSpec",
    "Preemption",
    "PreemptionCost",
    "PreemptionMode",
    "Preemptor",
    "RequestState",
    "SchedRequest",
    "ScheduledRequest",
    "StateExport",
    "Scheduler",
    "SchedulerConfig",
    "StepMetadata",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "SwapExecutor",
    "build_step_metadata",
    "gpu_preset",
    "preemption_cost",
    "recompute_flops",
]


_MOVED = {"FastDeployBlockManager", "StateLayerSlot", "attach", "kv_cache_list"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # moved to hybridkv.integrations.fastdeploy (issue 42); resolved lazily, no upward import
        import hybridkv.integrations.fastdeploy as fastdeploy

        return getattr(fastdeploy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

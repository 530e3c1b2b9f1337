"""Continuous-batching scheduler over the hybrid block manager, step metadata, engine facades.

Imports numpy only; torch / paddle are imported lazily by :mod:`.fastdeploy` when it meets tensors.
"""

from hybridkv.scheduler_adapter.cost import (
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
from hybridkv.scheduler_adapter.fastdeploy import FastDeployBlockManager, StateLayerSlot, attach, kv_cache_list
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
    "FastDeployBlockManager",
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
    "StateLayerSlot",
    "StepMetadata",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "SwapExecutor",
    "attach",
    "build_step_metadata",
    "gpu_preset",
    "kv_cache_list",
    "preemption_cost",
    "recompute_flops",
]

"""One simulated serving configuration: model, GPU, memory budget, layout and scheduler policies.

:class:`SimConfig` holds only plain values (strings, numbers) so that it pickles into worker
processes and prints into reports; :func:`build` turns it into the real objects: a
:class:`~hybridkv.planner.layout.Layout`, a :class:`~hybridkv.blockmgr.manager.HybridBlockManager`
(with a host pool and a prefix cache as asked) and a :class:`~hybridkv.scheduler_adapter.Scheduler`.
"""

from __future__ import annotations

from typing import NamedTuple

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.models.spec_file import resolve_model
from hybridkv.planner.layout import Layout, LayoutKind, plan
from hybridkv.scheduler_adapter.gpu import GpuSpec, PreemptionMode, load_gpu
from hybridkv.scheduler_adapter.scheduler import AdmissionPolicy, Scheduler, SchedulerConfig
from hybridkv.sim.cost import StepCostModel
from hybridkv.sim.engines import engine_config
from hybridkv.sim.settings import SimConfig  # (defined there; imported from here by callers)
from hybridkv.units import parse_bytes


class Built(NamedTuple):
    layout: Layout
    manager: HybridBlockManager
    scheduler: Scheduler
    gpu: GpuSpec
    cost: StepCostModel


def build_layout(cfg: SimConfig) -> Layout:
    cfg = engine_config(cfg)
    model = resolve_model(cfg.model, cfg.state_dtype, cfg.tp)
    return plan(model, parse_bytes(cfg.gpu_memory), cfg.block_size, LayoutKind(cfg.layout))


def build(cfg: SimConfig) -> Built:
    """The real layout, manager and scheduler of ``cfg`` (its engine's policies applied first, see
    :func:`~hybridkv.sim.engines.engine_config`). Raises ``ValueError`` / ``HybridKVError``
    subclasses for bad values (one line each)."""
    cfg = engine_config(cfg)
    layout = build_layout(cfg)
    gpu = load_gpu(cfg.gpu, cfg.gpu_calibration)
    host_blocks = parse_bytes(cfg.host_memory) // layout.bytes_per_block if cfg.host_memory not in ("0", "") else 0
    tier_blocks = parse_bytes(cfg.host_cache) // layout.bytes_per_block if cfg.host_cache not in ("0", "") else 0
    host_blocks += tier_blocks if cfg.prefix != "none" else 0
    prefix = None
    if cfg.prefix != "none":
        policy = CheckpointPolicy(cfg.checkpoint)
        # vllm_align emulates vLLM's block pool too: plain LRU, a released request's blocks queued
        # tail first (no demoted tails), one block evicted per block taken
        vllm = policy is CheckpointPolicy.VLLM_ALIGN
        prefix = PrefixCacheConfig(
            checkpoint=policy,
            eviction=EvictionPolicy(cfg.prefix),
            export_alignment=cfg.checkpoint_export or None,
            **({"demote_tail": False, "evict_batch_fraction": 0.0} if vllm else {}),
            in_place_state=vllm and not host_blocks and not cfg.speculative,
            host_tier=tier_blocks > 0,
        )
    manager = HybridBlockManager(layout, num_host_blocks=host_blocks, watermark=cfg.watermark, prefix_cache=prefix)
    sched_cfg = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_speculative_tokens=cfg.speculative,
        preemption_mode=PreemptionMode(cfg.preemption),
        gpu=gpu,
        admission=AdmissionPolicy(cfg.admission),
    )
    return Built(layout, manager, Scheduler(manager, sched_cfg), gpu, StepCostModel(layout, gpu))

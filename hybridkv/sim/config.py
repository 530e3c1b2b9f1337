"""One simulated serving configuration: model, GPU, memory budget, layout and scheduler policies.

:class:`SimConfig` holds only plain values (strings, numbers) so that it pickles into worker
processes and prints into reports; :func:`build` turns it into the real objects: a
:class:`~hybridkv.planner.layout.Layout`, a :class:`~hybridkv.blockmgr.manager.HybridBlockManager`
(with a host pool and a prefix cache as asked) and a :class:`~hybridkv.scheduler_adapter.Scheduler`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.models.spec_file import resolve_model
from hybridkv.planner.layout import Layout, LayoutKind, plan
from hybridkv.scheduler_adapter.cost import GpuSpec, PreemptionMode, StepCostModel, load_gpu
from hybridkv.scheduler_adapter.scheduler import AdmissionPolicy, Scheduler, SchedulerConfig
from hybridkv.sim.engines import ENGINES, VLLM_LABEL, engine_config
from hybridkv.units import parse_bytes

PREFIX_POLICIES = ("none", "lru", "flop_aware")

# The embedded default: MiniMax-M1 TP8 on H200s. `hybridkv plan --gpu h200` gives a 20.2 GiB cache
# budget (0.9 x 140.4 GiB less 106.2 GiB of bf16 weights per GPU, nothing reserved); the simulator
# keeps about 6 GiB of that for activations and CUDA graphs (an 8,192-token MiniMax-M1 prefill
# chunk needs several GiB): 14 GiB of cache per GPU.
DEFAULT_MODEL, DEFAULT_TP, DEFAULT_GPU, DEFAULT_BUDGET = "minimax-m1", 8, "h200", "14GiB"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that varies between simulated configurations (sizes as strings: ``14GiB``)."""

    model: str = DEFAULT_MODEL
    tp: int = DEFAULT_TP
    state_dtype: str | None = None
    gpu: str = DEFAULT_GPU  # preset or GPU JSON file
    gpu_calibration: str | None = None  # measured JSON (see cost.calibrate)
    gpu_memory: str = DEFAULT_BUDGET  # cache budget per GPU
    host_memory: str = "256GiB"  # host swap pool per GPU ("0" = no swap)
    block_size: int | None = None  # tokens per KV block (default 64; padded: minimum)
    layout: str = "paged"
    preemption: str = "auto"
    prefix: str = "lru"  # none | lru | flop_aware (the library's default eviction: lru)
    checkpoint: str = "branch_spaced"  # checkpoint policy with a prefix cache (the library's default)
    checkpoint_export: int = 0  # vllm_align: the prefill kernel's checkpoint grid in tokens (0: none)
    speculative: int = 0  # draft tokens per decode step
    accept_rate: float = 0.7
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    watermark: float = 0.01
    admission: str = "reserved"  # reserved | full_prompt | first_chunk (scheduler_adapter.AdmissionPolicy)
    engine: str = "hybridkv"  # hybridkv | vllm: vLLM 0.33's policies on its layout (hybridkv.sim.engines)
    integrity_every: int = 500  # steps between check_integrity() calls (and one at the end)
    seed: int = 0  # speculative acceptance draws
    label: str = ""

    def __post_init__(self) -> None:
        LayoutKind(self.layout)
        PreemptionMode(self.preemption)
        AdmissionPolicy(self.admission)
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        CheckpointPolicy(self.checkpoint)
        if self.prefix not in PREFIX_POLICIES:
            raise ValueError(f"prefix policy {self.prefix!r}: use one of {', '.join(PREFIX_POLICIES)}")
        if not 0.0 <= self.accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {self.accept_rate}")
        if self.integrity_every < 1:
            raise ValueError("integrity_every must be >= 1")
        if not self.label:
            object.__setattr__(self, "label", self.default_label())

    def default_label(self) -> str:
        if self.engine == "vllm":
            return f"{VLLM_LABEL} {self.model} TP{self.tp} {self.gpu_memory}"
        parts = [self.layout, self.preemption, f"prefix={self.prefix}"]
        if self.admission != "reserved":
            parts.append(f"admission={self.admission}")
        if self.block_size:
            parts.append(f"bs={self.block_size}")
        if self.speculative:
            parts.append(f"k={self.speculative}")
        return f"{self.model} TP{self.tp} " + " ".join(parts) + f" {self.gpu_memory}"

    def with_changes(self, **changes: Any) -> SimConfig:
        """A copy with ``changes``; the label is derived again unless given."""
        return replace(self, **({"label": ""} | changes))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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

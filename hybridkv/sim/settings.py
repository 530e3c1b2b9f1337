"""A simulated configuration's plain values (:class:`SimConfig`) and the names they are checked
against; :mod:`hybridkv.sim.config` builds the real objects from it, :mod:`hybridkv.sim.engines`
applies an engine's policies to it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from hybridkv.blockmgr.prefix import CheckpointPolicy
from hybridkv.planner.layout import LayoutKind
from hybridkv.scheduler_adapter.gpu import PreemptionMode
from hybridkv.scheduler_adapter.requests import AdmissionPolicy

ENGINES = ("hybridkv", "vllm")
VLLM_LABEL = "vLLM 0.33 (emulated)"
PREFIX_POLICIES = ("none", "lru", "flop_aware")

# The embedded default: MiniMax-M1 TP8 on H200s, 14 GiB of cache per GPU: the rule of
# hybridkv.planner.budget (0.9 x 140.4 GiB - 106.2 GiB of bf16 weights - 6 GiB for activations and
# CUDA graphs, rounded down to whole GiB), the budget `hybridkv plan` gives too.
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
    # the prefix cache's host tier per GPU ("0" = none): added to the host pool, which swaps and
    # the tier share (swaps win); evicted cached blocks and checkpoints stay matchable there
    host_cache: str = "0"
    block_size: int | None = None  # tokens per KV block (default 64; padded: minimum)
    layout: str = "paged"
    preemption: str = "auto"
    prefix: str = "lru"  # none | lru | flop_aware (the library's default eviction: lru)
    checkpoint: str = "branch_spaced"  # checkpoint policy with a prefix cache (the library's default)
    # the recurrent prefill kernel writes states inside a chunk on this grid (0: cannot; -1: what the
    # engine's kernels do, sim.engines.engine_config)
    checkpoint_export: int = -1
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
        if self.checkpoint_export < -1:
            raise ValueError(f"checkpoint_export must be a grid in tokens, 0 or -1, got {self.checkpoint_export}")
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
        if self.host_cache not in ("0", ""):
            parts.append(f"host-cache={self.host_cache}")
        return f"{self.model} TP{self.tp} " + " ".join(parts) + f" {self.gpu_memory}"

    def with_changes(self, **changes: Any) -> SimConfig:
        """A copy with ``changes``; the label is derived again unless given."""
        return replace(self, **({"label": ""} | changes))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

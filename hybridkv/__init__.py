"""hybridkv: one paged memory manager for attention KV cache and recurrent (linear-attention / SSM) state.

A model's attention KV blocks and its recurrent states live in the same pool of block ids, so an
engine's free-block count, admission, preemption, swap, prefix caching and speculative decoding
cover both. The pieces, each usable alone::

    import hybridkv as hk

    model = hk.preset("qwen3-next-80b-a3b", tp_size=2)      # or hk.load_spec("path/to/config.json")
    layout = hk.plan(model, 16 * 2**30)                       # one block pool of 16 GiB per GPU
    manager = hk.HybridBlockManager(layout, prefix_cache=hk.PrefixCacheConfig())
    sched = hk.Scheduler(manager, hk.SchedulerConfig(max_num_seqs=8))
    sched.add_request("r1", list(range(1000)), max_new_tokens=3)
    while sched.has_unfinished:
        step = sched.step()                                   # block tables, copies to run, rows
        sampled = {s.request_id: [7] for s in step.scheduled if s.samples}   # your forward here
        sched.update(hk.StepOutputs(sampled))

Names (imported on first use, so ``import hybridkv`` needs numpy only):

- models: :func:`preset`, ``PRESET_NAMES``, :func:`load_spec`, :func:`spec_from_hf_config`,
  :class:`ModelSpec`, :class:`DType`
- layout: :func:`plan`, :class:`Layout`, :class:`LayoutKind`
- block manager: :class:`HybridBlockManager`, :class:`PrefixCacheConfig`, :class:`CheckpointPolicy`,
  :class:`EvictionPolicy`
- scheduler: :class:`Scheduler`, :class:`SchedulerConfig`, :class:`StepOutputs`, :class:`StepPlan`,
  :class:`PreemptionMode`, :class:`AdmissionPolicy`, :func:`build_step_metadata`
- ops (need torch or paddle): :func:`allocate_pools`, :func:`gather_states`, :func:`scatter_states`,
  :func:`copy_blocks`, :func:`swap_blocks`
- errors: :class:`HybridKVError` (every error raised on purpose), :class:`SpecError`,
  :class:`LayoutError`, :class:`AllocationError`, :class:`NoFreeBlocksError`

Command line: ``hybridkv plan --help`` (also ``python -m hybridkv``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily by __getattr__)
_LAZY: dict[str, str] = {
    **dict.fromkeys(("preset", "PRESET_NAMES"), "hybridkv.models.presets"),
    **dict.fromkeys(("load_spec", "resolve_model"), "hybridkv.models.spec_file"),
    "spec_from_hf_config": "hybridkv.models.hf",
    **dict.fromkeys(
        (
            "ModelSpec",
            "DType",
            "AttentionLayerSpec",
            "RecurrentLayerSpec",
            "HybridLayerSpec",
            "NoCacheLayerSpec",
            "StateComponent",
        ),
        "hybridkv.models.spec",
    ),
    **dict.fromkeys(("plan", "Layout", "LayoutKind"), "hybridkv.planner.layout"),
    "HybridBlockManager": "hybridkv.blockmgr.manager",
    **dict.fromkeys(("PrefixCacheConfig", "CheckpointPolicy", "EvictionPolicy"), "hybridkv.blockmgr.prefix"),
    **dict.fromkeys(
        ("HybridKVError", "SpecError", "LayoutError", "AllocationError", "NoFreeBlocksError"),
        "hybridkv.errors",
    ),
    **dict.fromkeys(
        (
            "Scheduler",
            "SchedulerConfig",
            "StepOutputs",
            "StepPlan",
            "PreemptionMode",
            "AdmissionPolicy",
            "build_step_metadata",
        ),
        "hybridkv.scheduler_adapter",
    ),
}
_OPS = ("allocate_pools", "gather_states", "scatter_states", "copy_blocks", "swap_blocks")

# the ops names are listed only where torch or paddle is installed, so `from hybridkv import *` and
# help(hybridkv) work on a numpy-only install; hybridkv.gather_states there raises an ImportError that
# says what to install


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_HAS_FRAMEWORK = _has("torch") or _has("paddle")  # the ops run on torch or Paddle tensors
__all__ = ["__version__", *_LAZY, *(_OPS if _HAS_FRAMEWORK else ())]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: F401
    from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig  # noqa: F401
    from hybridkv.errors import AllocationError, HybridKVError, LayoutError, NoFreeBlocksError, SpecError  # noqa: F401
    from hybridkv.models.hf import spec_from_hf_config  # noqa: F401
    from hybridkv.models.presets import PRESET_NAMES, preset  # noqa: F401
    from hybridkv.models.spec import DType, ModelSpec  # noqa: F401
    from hybridkv.models.spec_file import load_spec, resolve_model  # noqa: F401
    from hybridkv.ops import allocate_pools, copy_blocks, gather_states, scatter_states, swap_blocks  # noqa: F401
    from hybridkv.planner.layout import Layout, LayoutKind, plan  # noqa: F401
    from hybridkv.scheduler_adapter import (  # noqa: F401
        AdmissionPolicy,
        PreemptionMode,
        Scheduler,
        SchedulerConfig,
        StepOutputs,
        StepPlan,
        build_step_metadata,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _OPS:
        if not _HAS_FRAMEWORK:
            raise ImportError(
                f"hybridkv.{name} needs a tensor framework: pip install torch (see the README for the CPU wheel) "
                "or paddlepaddle"
            )
        value = getattr(importlib.import_module("hybridkv.ops"), name)
    else:
        raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*(k for k in globals() if not k.startswith("_")), "__version__", *__all__})

"""Serve HuggingFace transformers hybrid models through hybridkv (``pip install 'hybridkv[hf]'``).

:class:`LLM` (five lines, see :mod:`.llm`) over :class:`HFEngine` (the engine loop, :mod:`.engine`);
:mod:`.paged_cache` moves K/V and states between hybridkv's pools and transformers' cache objects;
:mod:`.lightning` runs MiniMax's lightning layers on hybridkv's paged in-place kernels. See docs/hf.md.
"""

from hybridkv.integrations.transformers.engine import EngineConfig, Events, HFEngine, StepStats, model_spec
from hybridkv.integrations.transformers.families import FAMILIES, UnsupportedModelError, family_of
from hybridkv.integrations.transformers.llm import LLM
from hybridkv.integrations.transformers.sampling import ModelDrafter, NgramDrafter, SamplingParams

__all__ = [
    "FAMILIES",
    "EngineConfig",
    "Events",
    "HFEngine",
    "LLM",
    "ModelDrafter",
    "NgramDrafter",
    "SamplingParams",
    "StepStats",
    "UnsupportedModelError",
    "family_of",
    "model_spec",
]

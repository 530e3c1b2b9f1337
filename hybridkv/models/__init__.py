"""Model descriptions: what each layer of a model keeps per request (KV, recurrent state: shapes,
dtypes, tensor-parallel splits), the presets of published models, readers of hybridkv spec files
and of HuggingFace ``config.json`` files (one module per family in :mod:`hybridkv.models.hf`), and
the FLOPs a cached prefix saves. Imports nothing of the planner or the allocator above it.
"""

"""Layer and model specs, now :mod:`hybridkv.models.spec` (this name keeps working)."""

from hybridkv.models.spec import (  # noqa: F401
    KV_CACHE_DTYPES,
    AttentionLayerSpec,
    DType,
    LayerSpec,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    StateComponent,
    with_kv_dtype,
)

"""hybridkv in FastDeploy: the engine's cache-manager facade and the worker's data plane.

- :mod:`.facade` (with :mod:`.contract`, :mod:`.prefix`, :mod:`.splitwise`, :mod:`.types`): the
  cache-manager surface ``ResourceManagerV1`` calls, legacy and v1, both splitwise roles.
- :mod:`.worker`: FastDeploy's ``caches`` (one allocation per tensor) and the persistent state
  tables; :mod:`.state`: a recurrent layer's state bytes in those allocations; :mod:`.host_tier`:
  the host tier's pool and copies (W6); :mod:`.gdn`: PR #7074's GDN pool calls over paged state;
  :mod:`.layers`: what a model layer calls (``lightning_attention``, W4; ``gdn_conv`` /
  ``gated_delta_rule``, W5).

The worker side runs with Paddle alone (no torch; ``tensors`` keeps each move in the framework of
its tensors). The patch series and what each file of FastDeploy changes: docs/fastdeploy.md.
"""

from hybridkv.integrations.fastdeploy.facade import (
    ALLOCATE_FORMS,
    HYBRID_TASK_FIELDS,
    PATCH_SERIES,
    TIER_COPIES_FIELD,
    EnginePatchError,
    FastDeployBlockManager,
    HitMetrics,
    MatchResult,
    attach,
)
from hybridkv.integrations.fastdeploy.gdn import HybridGDNStatePool, attach_gdn
from hybridkv.integrations.fastdeploy.host_tier import (
    FastDeployHostCaches,
    allocate_host_caches,
    run_step_tier_copies,
    run_tier_copies,
)
from hybridkv.integrations.fastdeploy.layers import gated_delta_rule, gdn_conv, lightning_attention
from hybridkv.integrations.fastdeploy.worker import (
    BatchSlotError,
    BlockIdError,
    FastDeployCaches,
    StateLayerSlot,
    StateTables,
    allocate_caches,
    attach_worker,
    copy_blocks,
    kv_cache_list,
    state_layer_slots,
)

__all__ = [
    "ALLOCATE_FORMS",
    "HYBRID_TASK_FIELDS",
    "PATCH_SERIES",
    "TIER_COPIES_FIELD",
    "BatchSlotError",
    "BlockIdError",
    "EnginePatchError",
    "FastDeployBlockManager",
    "FastDeployCaches",
    "FastDeployHostCaches",
    "HitMetrics",
    "HybridGDNStatePool",
    "MatchResult",
    "StateLayerSlot",
    "StateTables",
    "allocate_caches",
    "allocate_host_caches",
    "attach",
    "attach_gdn",
    "attach_worker",
    "copy_blocks",
    "gated_delta_rule",
    "gdn_conv",
    "kv_cache_list",
    "lightning_attention",
    "run_step_tier_copies",
    "run_tier_copies",
    "state_layer_slots",
]

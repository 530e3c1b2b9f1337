"""Prefix caching for hybrid models: a KV hash chain plus recurrent-state checkpoints.

- KV: every full block of a request's tokens is a **node** of a hash chain (key = the chain key of
  :mod:`~hybridkv.blockmgr.hashing`; token ids are compared on a hit). Blocks are shared by
  reference count; a block whose count drops to zero stays cached (evictable) until evicted.
- State: a **checkpoint** is a state set per state group frozen at a block-aligned position and
  owned by the cache. A hit is the longest prefix ``p`` whose KV blocks are all cached **and** that
  has a checkpoint at exactly ``p``; the request's live sets are then filled by a copy.
- Checkpoint policies (:class:`CheckpointPolicy`) choose the positions; eviction policies
  (:class:`EvictionPolicy`) choose what to drop when the pool runs short.

Data layout: nodes live in numpy arrays indexed by a **slot** (key, position, KV block, checkpoint,
the block's token ids); one map takes chain keys to slots (a dict, or with the compiled kernels a
:class:`~hybridkv.blockmgr.prefix.slotmap.SlotMap`, into which a prefill chunk's blocks register in one
compiled call). Free slots are a stack (an array). Per-block state (evictable, tick, LRU
order, FLOPs per byte) lives in arrays indexed by block id, per-checkpoint state in arrays indexed by
the checkpoint's first block id. Matching, registration, release and eviction work on whole
requests at once: no Python object per cached block.

The cache holds no tensors; the manager runs it (``HybridBlockManager(..., prefix_cache=...)``).

The package's parts, each one subject, each standing on the one below (no import back up):

- :mod:`.config`: policies, :class:`PrefixCacheConfig`, :class:`PrefixHit`, :class:`NodeView`;
- :mod:`.index`: the books (every array) and the chain index: slots, key -> slot map, chain memo;
- :mod:`.placement` (rules in :mod:`.placement_rules`; vLLM 0.33's align mode's in a module of its
  own, picked by :mod:`.config`): where the policy wants checkpoints;
- :mod:`.eviction` (kernels in :mod:`.kernels`): the LRU queue, ``lru`` and ``flop_aware`` victims;
- :mod:`.registration`: computed blocks and checkpoints entering the cache, releases;
- :mod:`.cache`: :class:`PrefixCache`: matching, taking a hit, pins, the integrity check.

The manager owns a :class:`PrefixCache` and hands it a :class:`CacheHost` (itself: the pool, the
per-block use bytes, the layout, the pin epoch); the cache never imports the manager.
"""

from hybridkv.blockmgr.hashing import ROOT_KEY, chain_keys
from hybridkv.blockmgr.prefix.cache import PrefixCache
from hybridkv.blockmgr.prefix.config import CheckpointPolicy, EvictionPolicy, NodeView, PrefixCacheConfig, PrefixHit
from hybridkv.blockmgr.prefix.index import CacheHost

__all__ = [
    "ROOT_KEY",
    "CacheHost",
    "CheckpointPolicy",
    "EvictionPolicy",
    "NodeView",
    "PrefixCache",
    "PrefixCacheConfig",
    "PrefixHit",
    "chain_keys",
]

"""The transfer room: a request's KV blocks and state sets between machines (issue 16, docs/transfer.md).

``regions`` describes a pool's registered memory and the layout signature peers compare;
``descriptors`` turns a layout, the pools' base addresses and a request's block ids into paired,
coalesced ``(region, offset, length)`` descriptors; ``loopback`` is the in-process reference copy;
``engine`` is the interface the NIXL (and Mooncake) adapters implement; ``handoff`` drives a
request from a prefill instance to a decode instance with the manager's transfer plans;
``prefix_handoff`` pulls a cached prefix from a peer's device pool and host tier (docs/transfer.md
"Host-resident blocks"). Everything here but the adapters is numpy only; the adapters import their
engine lazily (extra ``[transfer]``).
"""

from hybridkv.transfer.descriptors import (
    DescriptorPairs,
    Descriptors,
    MemoryKind,
    PoolRegions,
    Region,
    TieredPairs,
    check_compatible,
    check_request_blocks,
    layout_signature,
    pair_descriptors,
    pair_tiered_descriptors,
    request_descriptors,
)
from hybridkv.transfer.errors import TransferError, TransferTimeoutError, TransferUnavailableError

__all__ = [
    "DescriptorPairs",
    "Descriptors",
    "MemoryKind",
    "PoolRegions",
    "Region",
    "TieredPairs",
    "TransferError",
    "TransferTimeoutError",
    "TransferUnavailableError",
    "check_compatible",
    "check_request_blocks",
    "layout_signature",
    "pair_descriptors",
    "pair_tiered_descriptors",
    "request_descriptors",
]

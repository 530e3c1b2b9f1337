"""Records and results of the hybrid block manager: per-request records, swap plans, usage."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybridkv.blockmgr.hashing import TokenArray

RequestId = Hashable
_EMPTY = np.empty(0, dtype=np.int32)


class BlockUse(enum.IntEnum):
    """What a device block holds; one byte per block in the manager."""

    FREE = 0
    KV = 1  # referenced KV (live requests, possibly shared)
    STATE = 2  # a live state set
    SPECULATIVE = 3  # a speculative state set
    CACHED_KV = 4  # unreferenced KV kept by the prefix cache (evictable)
    CHECKPOINT = 5  # a state set owned by the prefix cache (evictable)
    NULL = 6
    PENDING_FREE = 7  # given back while a copy handed out earlier still reads or writes it: free once it ran


class RequestStatus(enum.Enum):
    RUNNING = "running"  # blocks on the device
    SWAPPED = "swapped"  # blocks on the host


class BlockCopies(NamedTuple):
    """Device block copies for ``ops.copy_blocks`` to run before the next forward: ``src[i] -> dst[i]``."""

    src: np.ndarray
    dst: np.ndarray

    @staticmethod
    def empty() -> BlockCopies:
        return BlockCopies(_EMPTY, _EMPTY)

    def __len__(self) -> int:  # type: ignore[override]
        return int(self.src.size)

    def concat(self, other: BlockCopies) -> BlockCopies:
        if not len(other):
            return self
        if not len(self):
            return other
        return BlockCopies(np.concatenate((self.src, other.src)), np.concatenate((self.dst, other.dst)))


class AdmissionPlan(NamedTuple):
    """What an ``allocate`` would take now: blocks out of the available count, tokens from the cache."""

    num_blocks: int
    num_cached_tokens: int


class Allocation(NamedTuple):
    """Result of ``allocate``: tokens served from the prefix cache and state copies to run."""

    num_cached_tokens: int
    copies: BlockCopies


@dataclass(slots=True)
class RequestRecord:
    """Everything the manager holds for one request.

    ``kv`` views the request's row of the manager's KV matrix; its first ``num_kv_blocks`` entries
    are the KV block table, the rest null. ``state`` views its live sets
    ``[num_state_groups, blocks_per_state]`` the same way; ``spec`` (owned by the record) is
    ``[K, num_state_groups, blocks_per_state]`` (speculative sets). While swapped, device arrays are
    empty and ``host_blocks`` holds the host copies (KV first, then the live state sets).
    """

    request_id: RequestId
    num_tokens: int
    kv: np.ndarray
    num_kv_blocks: int
    state: np.ndarray
    spec: np.ndarray
    status: RequestStatus = RequestStatus.RUNNING
    host_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    num_drafted: int = 0
    pending: SwapPlan | None = None
    row: int = -1  # row in the manager's RowTables while running
    # [start, end): every block the request holds, when they are one private id run (freed as a
    # slice); None once the set changes (append, fork, speculation, swap)
    run: tuple[int, int] | None = None
    # a fork shared its partly filled last KV block: appends must check for copy-on-write
    tail_shared: bool = False
    # prefix caching: the input's token ids (then any appended), hash-chain keys of its full blocks,
    # and where it left the cached prefixes at admission
    token_ids: TokenArray | None = None
    block_keys: list[int] = field(default_factory=list)
    branch_tokens: int = 0

    @property
    def kv_blocks(self) -> np.ndarray:
        return self.kv[: self.num_kv_blocks]


class SwapDirection(enum.Enum):
    OUT = "out"  # device -> host
    IN = "in"  # host -> device


@dataclass(slots=True, eq=False)
class SwapPlan:
    """Block copies for one swap of one request: ``device_blocks[i] <-> host_blocks[i]``.

    The executor copies (``ops.swap_blocks``), then calls :meth:`commit`; or :meth:`abort`, which
    leaves the request exactly as before the plan was made. Blocks reserved for the target side are
    held by the plan until then. A plan is settled once.
    """

    request_id: RequestId
    direction: SwapDirection
    device_blocks: np.ndarray
    host_blocks: np.ndarray
    _commit: Callable[[SwapPlan], None]
    _abort: Callable[[SwapPlan], None]
    settled: bool = False

    def __len__(self) -> int:
        return int(self.device_blocks.size)

    def commit(self) -> None:
        self._commit(self)

    def abort(self) -> None:
        self._abort(self)


class TierCopies(NamedTuple):
    """Copies between the device pool and the host pool for the prefix cache's host tier:
    ``device_blocks[i] <-> host_blocks[i]``, direction ``OUT`` (device -> host: an offload of an
    evicted cached block) or ``IN`` (host -> device: a host hit). Shaped like a :class:`SwapPlan`
    (``ops.swap_blocks`` takes it as a plan); nothing to commit: the manager's books already say
    the copy happened, the pins (docs/contract.md) keep its blocks until it ran."""

    device_blocks: np.ndarray  # int32
    host_blocks: np.ndarray  # int32
    direction: SwapDirection

    def __len__(self) -> int:  # type: ignore[override]
        return int(self.device_blocks.size)


class TierPlan(NamedTuple):
    """The host tier's copies handed out since the last ``take_tier_copies()``: ``offload``
    (device -> host) runs first, before every other copy of the plan; ``onload`` (host -> device)
    after the plan's swaps and before its other copies and the forward (docs/contract.md)."""

    offload: TierCopies
    onload: TierCopies

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.offload) + len(self.onload)


class Usage(NamedTuple):
    """Device blocks by category (they add up to ``total``), host blocks, and bytes per block.

    ``host_used``: host blocks held by swapped requests and swap plans; ``host_cached``: host
    blocks the prefix cache's host tier holds (evictable: a swap-out takes them first)."""

    total: int
    free: int
    kv_live: int
    state_live: int
    state_speculative: int
    kv_cached: int
    checkpoints: int
    null: int
    host_total: int
    host_used: int
    bytes_per_block: int
    pending_free: int = 0  # given back, free once the copies that touch them ran (``release_pins``)
    host_cached: int = 0  # host blocks of the prefix cache's host tier (KV blocks and checkpoints)

    @property
    def used(self) -> int:
        """Blocks held: by requests, and by copies the executor has not run yet."""
        return self.kv_live + self.state_live + self.state_speculative + self.pending_free

    @property
    def evictable(self) -> int:
        return self.kv_cached + self.checkpoints

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return self.free + self.evictable

    def bytes(self, category: str) -> int:
        return int(getattr(self, category)) * self.bytes_per_block

"""The prefix cache's vocabulary: its policies, its configuration, what a hit is, and a node's view."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridkv.blockmgr.prefix.placement_rules import (
    DEFAULT_ALIGN_TOKENS,
    DEFAULT_GAP_FRACTION,
    DEFAULT_RULES,
    CheckpointRules,
)
from hybridkv.blockmgr.prefix.vllm_align import ALIGN_RULES
from hybridkv.units import as_choice, as_count, as_flag, as_real, is_integer

_EMPTY = np.empty(0, dtype=np.int32)


class CheckpointPolicy(enum.Enum):
    NONE = "none"  # KV only: hits need a checkpoint, so hybrid models never hit
    EVERY_N_BLOCKS = "every_n_blocks"  # at every n-th block boundary of the input
    BRANCH_AND_LAST = "branch_and_last"  # where a request leaves the cached prefixes, and at its input's end
    BRANCH_LAST_ALIGNED = "branch_last_aligned"  # branch, finished request's end, input end on coarse grids
    BRANCH_SPACED = "branch_spaced"  # branch, finished request's end, grid back-offs, a minimum gap apart
    # vLLM 0.33's mamba cache mode "align": every block boundary a forward ends on (chunks end on
    # block boundaries), the prompt's last block boundary and the branch point stop a chunk
    VLLM_ALIGN = "vllm_align"


def checkpoint_rules(policy: CheckpointPolicy) -> CheckpointRules:
    """The rules the core asks ``policy`` (stops, retention, twins, queue order, exports): vLLM's
    align mode has its own (:mod:`.vllm_align`); hybridkv's policies share the defaults."""
    return ALIGN_RULES if policy is CheckpointPolicy.VLLM_ALIGN else DEFAULT_RULES


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    FLOP_AWARE = "flop_aware"  # alpha * normalized FLOPs saved per byte + normalized recency


@dataclass(frozen=True, slots=True)
class PrefixCacheConfig:
    """``every_n``: block interval of ``every_n_blocks``. ``alpha``: weight of FLOP efficiency.
    ``evict_batch_fraction``: each eviction frees at least this fraction of the pool (both
    policies), so ranking the candidates is paid rarely."""

    checkpoint: CheckpointPolicy = CheckpointPolicy.BRANCH_SPACED
    eviction: EvictionPolicy = EvictionPolicy.LRU
    every_n: int = 8
    alpha: float = 1.0
    evict_batch_fraction: float = 0.01
    align_tokens: tuple[int, ...] = DEFAULT_ALIGN_TOKENS  # branch_last_aligned: back-off grids, finest first
    # branch_spaced: back-off grids; None: 512 and the checkpoint's bytes in KV tokens (the model's
    # state bytes / KV bytes per token) rounded up to a power of two (see checkpoint_policy.spaced_grids)
    spaced_align_tokens: tuple[int, ...] | None = None
    # branch_spaced: minimum tokens between checkpoints on one chain; None: ``gap_fraction`` of the
    # checkpoint's bytes in KV tokens (times device / (device + host tier) blocks with host_tier)
    min_gap_tokens: int | None = None
    gap_fraction: float = DEFAULT_GAP_FRACTION
    # hybrid models: a released request's cached KV past the deepest checkpoint on its chain can only
    # mark a branch, never serve a hit: it goes to the front of the LRU queue (evicted first)
    demote_tail: bool = True
    # a capability of the recurrent layers' prefill kernel: it writes the state at positions inside a
    # chunk (multiples of this many tokens) into sets reserved with the chunk, so no chunk ends early
    # for a checkpoint on that grid; None: it cannot (chunks end at every checkpoint position).
    # A policy may export only one position per chunk (CheckpointRules.exports_all; vLLM's
    # ``prefill_checkpoint_alignment``; FlashInfer's GDN prefill: 64)
    export_alignment: int | None = None
    # the host tier (docs/blockmgr.md): cached KV blocks and checkpoints evicted from the device are
    # offloaded to the manager's host pool (shared with swap preemption, which wins: the tier gives
    # its least recently used units back) and stay matchable; needs num_host_blocks > 0
    host_tier: bool = False
    # in-place checkpoints (any policy): the state a forward ends on at a block boundary where the
    # policy keeps one stays in the request's live sets where they are (the checkpoint there, or held
    # unmatchable) and the request's next append takes new live sets and copies the state over, so
    # no blocks are taken after the forward (an engine that can re-point a request's state rows
    # between steps); a checkpoint made after the forward is a copy into new sets otherwise. Not with
    # a host pool or speculative decoding (the manager refuses those on a request whose sets are lent).
    in_place_state: bool = False

    def __post_init__(self) -> None:
        """Every field checked, here only: a one-line ``TypeError`` (wrong type: a string or an int
        for a flag, a float or a bool for a count) or ``ValueError`` (out of range, nan, an unknown
        policy) naming the field, the value and what is allowed. Policies may be given by value
        (``"every_n_blocks"``), grids as one count or a sequence; numpy scalars become Python ones."""
        put = object.__setattr__  # (frozen: the checked values replace the given ones)
        put(self, "checkpoint", as_choice(self.checkpoint, CheckpointPolicy, "checkpoint"))
        put(self, "eviction", as_choice(self.eviction, EvictionPolicy, "eviction"))
        put(self, "every_n", as_count(self.every_n, "every_n", minimum=1))
        put(self, "alpha", as_real(self.alpha, "alpha", minimum=0.0))
        put(self, "evict_batch_fraction", as_real(self.evict_batch_fraction, "evict_batch_fraction", 0.0, 1.0))
        put(self, "align_tokens", _grid(self.align_tokens, "align_tokens"))
        if self.spaced_align_tokens is not None:
            put(self, "spaced_align_tokens", _grid(self.spaced_align_tokens, "spaced_align_tokens"))
        if self.min_gap_tokens is not None:
            put(self, "min_gap_tokens", as_count(self.min_gap_tokens, "min_gap_tokens"))
        put(self, "gap_fraction", as_real(self.gap_fraction, "gap_fraction", minimum=0.0))
        put(self, "demote_tail", as_flag(self.demote_tail, "demote_tail"))
        if self.export_alignment is not None:
            put(self, "export_alignment", as_count(self.export_alignment, "export_alignment", minimum=1))
        put(self, "host_tier", as_flag(self.host_tier, "host_tier"))
        put(self, "in_place_state", as_flag(self.in_place_state, "in_place_state"))


def _grid(value: object, what: str) -> tuple[int, ...]:
    """A grid of token counts: one positive integer or a non-empty sequence of them, as a tuple."""
    if is_integer(value) or isinstance(value, bool):
        values: tuple[object, ...] = (value,)
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be positive token counts (an integer or a sequence of them), got {value!r}")
    else:
        values = tuple(value)
    if not values:
        raise ValueError(f"{what} must be positive token counts, got none ({value!r})")
    out = []
    for v in values:
        if not is_integer(v):  # (bools, floats, strings: a bool would be read as a grid of 1 token)
            raise TypeError(
                f"{what} must be positive integer token counts, got {value!r} ({v!r} is a {type(v).__name__})"
            )
        if v < 1:
            raise ValueError(f"{what} must be positive token counts, got {value!r}")
        out.append(int(v))
    return tuple(out)


class NodeView(NamedTuple):
    """A copy of one chain node's books (for tests and inspection; the cache keeps arrays)."""

    key: int
    tokens: tuple[int, ...]
    position: int  # the node's block ends at this token position
    kv_block: int  # 0: no KV block cached for it
    checkpoint: np.ndarray | None  # flat block ids of the state sets at ``position``


class PrefixHit(NamedTuple):
    num_tokens: int  # tokens served from the cache (0 = miss)
    kv_blocks: np.ndarray  # int32 KV block ids of the hit, chain order (empty for state-only models)
    checkpoint_key: int | None  # chain key of the node holding the checkpoint at num_tokens
    num_matched_tokens: int  # tokens whose KV blocks are cached (>= num_tokens): the branch point
    keys: list[int]  # chain keys of the blocks below num_tokens
    checkpoint_ids: np.ndarray | None = None  # the checkpoint's flat block ids (read by the hit's copy)
    # host tier: positions (block indices below num_tokens) whose KV is on the host only, their host
    # blocks, and the checkpoint's host ids when it is on the host only (then checkpoint_key is None)
    host_index: np.ndarray = _EMPTY
    host_kv: np.ndarray = _EMPTY
    host_checkpoint: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        """KV blocks the hit shares (on the device: host-resident ones take new device blocks)."""
        return int(self.kv_blocks.size)

    @property
    def on_host(self) -> bool:
        """Whether the hit reads blocks of the host tier (host -> device copies)."""
        return bool(self.host_kv.size) or self.host_checkpoint is not None


def _miss(matched_tokens: int = 0) -> PrefixHit:
    return PrefixHit(0, _EMPTY, None, matched_tokens, [], None)


@dataclass(slots=True)
class _Counters:
    hit_tokens: int = 0
    hit_tokens_host: int = 0  # of hit_tokens, those whose KV came from the host tier
    checkpoints_made: int = 0
    checkpoints_evicted: int = 0
    kv_evicted: int = 0


_TWO64 = 1 << 64
_FEW = 16  # register() of up to this many blocks goes block by block (scalar path)

"""The FastDeploy-shaped values the facade (:mod:`hybridkv.integrations.fastdeploy.facade`) hands out
and keeps: ``MatchResult`` (v1 cache manager), the stand-in for ``gpu_free_block_list``, a pending
prefix match, and the names of the fields and call forms it documents."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from hybridkv.errors import RequestStateError


class _FreeCount(Protocol):
    @property
    def num_free_blocks(self) -> int: ...


PATCH_SERIES = "hybridkv-fastdeploy-7808a119/3"
"""The engine patch series this facade answers (docs/fastdeploy.md). The patched
``ResourceManagerV1.__init__`` passes it to :meth:`FastDeployBlockManager.bind_engine`; an engine
that does not (or passes another series) gets :class:`EnginePatchError` at its first call."""

SPLITWISE_ROLES = ("mixed", "prefill", "decode")


class EnginePatchError(RequestStateError):
    """FastDeploy called the facade without the engine patch the call needs; the message names the
    patch (E0 ``bind_engine``, E2 ``state_blocks_for``) and docs/fastdeploy.md. Nothing changed."""


TIER_COPIES_FIELD = "tier_copies"
"""The field patch E9 sets on the first task of a step's batch: the host tier's copies of the step
(:meth:`FastDeployBlockManager.take_tier_copies`), run by the worker before any other copy (W6).
:meth:`FastDeployBlockManager.task_fields` sets it to None on every task it prepares, so a
``Request`` (a prefill task object that lives across steps) never carries an earlier step's copies."""

HYBRID_TASK_FIELDS = ("state_block_tables", "state_copies", "checkpoint_copies", TIER_COPIES_FIELD)
"""Fields :meth:`FastDeployBlockManager.task_fields` adds to a prefill ``Request`` / ``ScheduledDecodeTask``."""

ALLOCATE_FORMS = (
    "allocate_gpu_blocks(num_blocks: int, req_id) (legacy PrefixCacheManager) or "
    "allocate_gpu_blocks(request, num_blocks: int) (v1 CacheManager; request has .request_id)"
)
"""The two call forms :meth:`FastDeployBlockManager.allocate_gpu_blocks` accepts (named in its TypeError)."""


class _FreeBlocks:
    """Stands in for ``gpu_free_block_list``: FastDeploy only takes its ``len``, the blocks that are
    free now. Like FastDeploy's own cache managers, evictable cached blocks are not free (they are
    used until evicted), and neither are state blocks nor hybridkv's null block 0."""

    __slots__ = ("_owner",)

    def __init__(self, owner: _FreeCount) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return self._owner.num_free_blocks


@dataclass(frozen=True)
class _Node:
    block_id: int


@dataclass
class MatchResult:
    """``fastdeploy.cache_manager.v1.metadata.MatchResult``'s fields, filled from a hybridkv hit.

    ``device_nodes``: the hit's device-resident KV blocks; ``host_nodes``: its host-resident ones
    (node ``block_id`` = the host block). ``table``: the request's block table through the hit,
    chain order, when a host hit was admitted at its match (the device blocks receiving the host
    blocks are known then and may sit between device-resident ones); None: the device nodes' ids.
    FastDeploy's engine reads ``device_block_ids`` as the block table and ``total_matched_blocks``
    as its length, so both include the host part here."""

    device_nodes: list[_Node] = field(default_factory=list)
    host_nodes: list[_Node] = field(default_factory=list)
    storage_nodes: list[Any] = field(default_factory=list)
    uncached_block_ids: list[int] = field(default_factory=list)
    table: list[int] | None = None

    @property
    def matched_device_nums(self) -> int:
        return len(self.device_nodes)

    @property
    def matched_host_nums(self) -> int:
        return len(self.host_nodes)

    @property
    def matched_storage_nums(self) -> int:
        return 0

    @property
    def total_matched_blocks(self) -> int:
        return len(self.device_nodes) + len(self.host_nodes)

    @property
    def device_block_ids(self) -> list[int]:
        if self.table is not None:
            return list(self.table)
        return [n.block_id for n in self.device_nodes]


class _Hit(NamedTuple):
    """What a match told FastDeploy: the block table through the hit (chain order), its tokens, and
    the split FastDeploy reports: device-resident blocks (``match_gpu_block_ids``) and the device
    blocks receiving host-resident ones (``gpu_recv_block_ids``, with their host blocks), plus the
    bytes the host -> device copies of the hit move (KV and a host checkpoint)."""

    table: list[int]
    num_cached_tokens: int
    device_ids: list[int]
    recv_ids: list[int]
    host_ids: list[int]
    onload_bytes: int
    num_input_tokens: int


@dataclass
class HitMetrics:
    """Prefix-hit counters of the facade, kept as FastDeploy's ``CacheMetrics`` keeps them for its
    ``PrefixCacheManager`` (fastdeploy/cache_manager/cache_metrics.py, read at 561a7ebc): one
    request per match, tokens split into device (``gpu``) and host (``cpu``) hits, ratios over
    the matched inputs' tokens."""

    req_count: int = 0
    hit_req_count: int = 0
    total_gpu_matched_token_num: int = 0
    total_cpu_matched_token_num: int = 0
    total_token_num: int = 0

    @property
    def matched_token_num(self) -> int:
        return self.total_gpu_matched_token_num + self.total_cpu_matched_token_num

    @property
    def hit_req_ratio(self) -> float:
        return self.hit_req_count / self.req_count if self.req_count else 0.0

    @property
    def hit_token_ratio(self) -> float:
        return self.matched_token_num / self.total_token_num if self.total_token_num else 0.0

    @property
    def gpu_hit_token_ratio(self) -> float:
        return self.total_gpu_matched_token_num / self.total_token_num if self.total_token_num else 0.0

    @property
    def cpu_hit_token_ratio(self) -> float:
        return self.total_cpu_matched_token_num / self.total_token_num if self.total_token_num else 0.0

    def add(self, gpu_tokens: int, cpu_tokens: int, input_tokens: int) -> None:
        self.req_count += 1
        self.hit_req_count += int(gpu_tokens + cpu_tokens > 0)
        self.total_gpu_matched_token_num += gpu_tokens
        self.total_cpu_matched_token_num += cpu_tokens
        self.total_token_num += input_tokens


@dataclass
class _Pending:
    """A prefix match handed to FastDeploy, not yet admitted: its input and the hit it was told.

    What it pins is not stored: ``block_ids`` and the checkpoint at ``checkpoint_key`` are counted
    when asked (:meth:`FastDeployBlockManager._pinned_by_matches`), as a union over all matches."""

    token_ids: list[int]
    num_cached_tokens: int
    block_ids: list[int]
    checkpoint_key: int | None = None  # the checkpoint the hit's copy reads (None: no hit)
    branch_tokens: int = 0  # where the input leaves the cached prefixes (checkpoint policy input)


def _token_ids(task: Any) -> list[int]:
    prompt = task.prompt_token_ids
    prompt = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
    return prompt + list(getattr(task, "output_token_ids", None) or [])

"""The one interface the scheduler talks to: every attribute and method
:class:`~hybridkv.scheduler_adapter.scheduler.Scheduler` and its
:class:`~hybridkv.scheduler_adapter.preemption.Preemptor` use of a block manager, and nothing else.

:class:`~hybridkv.blockmgr.manager.HybridBlockManager` satisfies it, and so do the engines'
adapters built on it (the disaggregation roles' managers in
:mod:`hybridkv.scheduler_adapter.disagg`). The scheduler discovers no feature by signature or
attribute probing: prefix caching is on when ``prefix_cache`` is not None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from hybridkv.blockmgr.pool import BlockPool
    from hybridkv.blockmgr.prefix import PrefixCache
    from hybridkv.blockmgr.records import (
        AdmissionPlan,
        Allocation,
        BlockCopies,
        RequestId,
        RequestRecord,
        SwapPlan,
        TierPlan,
    )
    from hybridkv.planner.layout import Layout


@runtime_checkable
class ManagerInterface(Protocol):
    """What a scheduler needs of a block manager (see :class:`~hybridkv.blockmgr.manager.HybridBlockManager`
    for each member's contract). Counts are in blocks; every mutation is atomic."""

    layout: Layout
    block_size: int
    num_state_blocks: int  # blocks of one request's live state sets (all groups)
    watermark_blocks: int
    host_pool: BlockPool | None  # None: no swap
    prefix_cache: PrefixCache | None  # None: no prefix caching (no checkpoints, no hits)
    requests: Mapping[RequestId, RequestRecord]  # read only: host blocks of a swapped request, KV blocks held

    @property
    def num_available_blocks(self) -> int: ...

    # pins (docs/contract.md): one epoch per step and per update
    def begin_pin_epoch(self) -> int: ...
    def release_pins(self, before: int | None = None, checkpoints_from: int = 0) -> None: ...
    def cancel_checkpoints(self, epoch: int) -> np.ndarray: ...

    # admission: the one count
    def check_fits(self, max_tokens: int, num_speculative: int = 0, extra_blocks: int = 0) -> None: ...
    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int: ...
    def plan_admission(
        self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None
    ) -> AdmissionPlan: ...
    def can_allocate(
        self, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None
    ) -> bool: ...
    def allocate(
        self, request_id: RequestId, num_tokens: int, num_speculative: int = 0, token_ids: Sequence[int] | None = None
    ) -> Allocation: ...

    # growth, forks, the end of a request
    def num_new_kv_blocks(self, request_id: RequestId, num_new_tokens: int) -> int: ...
    def append(
        self, request_id: RequestId, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> BlockCopies: ...
    def fork(self, parent_id: RequestId, child_id: RequestId) -> BlockCopies: ...
    def free(self, request_id: RequestId) -> None: ...
    def free_keeping_state(self, request_id: RequestId) -> bool: ...
    def take_tier_copies(self) -> TierPlan: ...
    def reclaim_lent(self, request_id: RequestId) -> bool: ...

    # speculative decoding
    def begin_speculation(self, request_id: RequestId, num_speculative: int) -> None: ...
    def commit_speculation(self, request_id: RequestId, num_accepted: int, num_drafted: int | None = None) -> None: ...

    # prefix-cache checkpoints
    def mark_computed(self, request_id: RequestId, num_computed_tokens: int) -> None: ...
    def checkpoint(
        self, request_id: RequestId, final: bool = False, exported: int | Sequence[int] | None = None
    ) -> BlockCopies: ...
    def next_checkpoint_position(self, request_id: RequestId, num_tokens: int | None = None) -> int | None: ...
    # exports (a prefill kernel that writes states inside a chunk: PrefixCacheConfig.export_alignment)
    def export_positions(self, request_id: RequestId, start: int, end: int) -> tuple[int, ...]: ...
    def prefill_stop(self, request_id: RequestId, start: int, end: int) -> int: ...
    def reserve_export(self, request_id: RequestId, position: int) -> np.ndarray | None: ...
    # vllm_align (scheduler_adapter/align.py): exported positions, checkpoints owed, branches raised
    def exported_checkpoint_position(self, request_id: RequestId, start: int, end: int) -> int | None: ...
    def checkpoint_blocks_due(self, request_id: RequestId) -> int: ...
    def raise_branch(self, request_id: RequestId, num_tokens: int) -> None: ...

    # swap
    def can_swap_out(self, request_id: RequestId) -> bool: ...
    def swap_out(self, request_id: RequestId) -> SwapPlan: ...
    def swap_in(self, request_id: RequestId) -> SwapPlan: ...

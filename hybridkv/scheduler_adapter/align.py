"""The scheduler's rules for the ``vllm_align`` checkpoint policy (vLLM 0.33's ``align`` prefix-caching
mode, which ``hybridkv simulate --engine vllm`` emulates): prefill chunks that end on block
boundaries, the branch point counting this step's rows, a state cached in this step. Each rule is the
identity (``n``, nothing, False) under every other policy. Numpy free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.blockmgr.records import RequestId
from hybridkv.scheduler_adapter.interface import ManagerInterface
from hybridkv.scheduler_adapter.requests import SchedRequest, ScheduledRequest
from hybridkv.scheduler_adapter.scheduler_config import SchedulerConfig


def aligned_chunk(manager: ManagerInterface, config: SchedulerConfig, req: SchedRequest, start: int, n: int) -> int:
    """``n`` prefill tokens from ``start``, floored so that the chunk ends on a block boundary
    when the checkpoint policy keeps state only where forwards end (``vllm_align``) and the
    chunk is not the prefill's last (vLLM's prefill end: the known tokens less the one a
    resumed request samples from); may be 0. Otherwise ``n``. A block wider than the step's token
    budget is worked through inside the block."""
    cache = manager.prefix_cache
    if cache is None or not cache.aligns_chunks or not config.chunked_prefill:
        return n
    known = req.num_prompt_tokens + len(req.output_token_ids)
    end = start + n
    if end >= max(req.num_prompt_tokens, known - 1):
        return n
    bs = manager.block_size
    aligned = end // bs * bs
    if aligned > start or bs <= config.max_num_batched_tokens:
        return max(aligned - start, 0)
    return n  # a block wider than any chunk: advance inside it (vLLM re-aligns at the next boundary)


def same_step_branch(
    manager: ManagerInterface,
    requests: Mapping[RequestId, SchedRequest],
    req: SchedRequest,
    ids: Sequence[int],
    scheduled: Sequence[ScheduledRequest],
) -> None:
    """``vllm_align``: the branch point of ``req`` (just admitted with token ids ``ids``) counts the
    full blocks this step's ``scheduled`` rows schedule (vLLM caches a block's hash when it
    schedules it, so a later request in the same step matches it); raises the manager's branch."""
    bs, best = manager.block_size, 0
    for row in scheduled:
        other = requests[row.request_id]
        if other.prompt_token_ids is None or other is req:
            continue
        end = min(row.num_computed_tokens + row.num_scheduled_tokens, len(ids) - 1) // bs * bs
        theirs = other.prompt_token_ids
        if end <= best or tuple(ids[:bs]) != theirs[:bs]:
            continue
        n = 0
        while n + bs <= end and tuple(ids[n : n + bs]) == theirs[n : n + bs]:
            n += bs
        best = max(best, n)
    if best > req.num_cached_tokens:
        manager.raise_branch(req.request_id, best)


def state_cached_this_step(
    manager: ManagerInterface,
    requests: Mapping[RequestId, SchedRequest],
    ids: Sequence[int],
    cached: int,
    scheduled: Sequence[ScheduledRequest],
) -> bool:
    """``vllm_align``: whether a waiting request with token ids ``ids`` and prefix hit ``cached``
    would hit deeper on a state that a row scheduled in this step keeps matchable (vLLM caches a
    block when it schedules it, so the request finds it, but it refuses a Mamba block cached in the
    same step, ``MambaManager.get_num_blocks_to_allocate``: the request waits for the next step and
    admission stops there). False under every other policy."""
    cache = manager.prefix_cache
    if cache is None or not cache.aligns_chunks or not scheduled:
        return False
    bs, limit = manager.block_size, len(ids) - 1
    for row in scheduled:
        other = requests[row.request_id]
        rec = manager.requests.get(row.request_id)
        theirs = other.prompt_token_ids
        if theirs is None or rec is None or rec.token_ids is None:
            continue
        start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
        for p in range((start // bs + 1) * bs, min(end, limit) + 1, bs):  # its blocks cached this step
            if p <= cached or not cache.retains_checkpoint(p, len(rec.token_ids), rec.branch_tokens):
                continue
            if tuple(ids[:p]) == tuple(rec.token_ids[:p]):
                return True
    return False


def branch_stop(manager: ManagerInterface, request_id: RequestId, start: int) -> int:
    """Where a prefill chunk from ``start`` stops at the request's branch point (vLLM's
    shared-prefix junction, floored to a block from ``start``), or 0 when the branch is not ahead."""
    branch = manager.requests[request_id].branch_tokens
    if branch <= start:
        return 0
    bs = manager.block_size
    return start + (branch - start) // bs * bs

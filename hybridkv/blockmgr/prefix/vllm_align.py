"""vLLM 0.33's Mamba prefix-cache mode ``align`` as a checkpoint policy (``CheckpointPolicy.VLLM_ALIGN``,
the engine's ``vllm_align``): its stops, its retention, its twins, its LRU queue order and its exported
checkpoint, given to the core as a :class:`~.placement_rules.CheckpointRules` (the one place in
``blockmgr/`` that knows this policy).

vLLM (``vllm/v1/core/sched/scheduler.py``, ``_mamba_block_aligned_split``; ``vllm/v1/core/
single_type_kv_cache_manager.py``, ``MambaManager``; vLLM 0.33) writes the state a prefill chunk
ends on into a block allocated for that chunk and caches it in place:

- stops (:func:`vllm_align_stops`): a chunk that is not the input's last ends on a block boundary, and
  at the branch point and the input's last block boundary before its last token;
- retention (:meth:`AlignRules.retains`): every block boundary a forward ends on holds its state (the
  request's own block until its next step) but only two stay matchable
  (``prefix_cache_retention_interval=0``): the replay boundary and the branch point;
- twins: a request's own KV copies of blocks another request cached meanwhile replace those
  evictable twins (vLLM caches a block when it is scheduled: two requests may each compute it);
- queue order: a checkpoint enters the LRU queue when vLLM frees its block (its request's next step
  or free), not when it is made; admission takes a hit or waits while other requests run;
- the exported checkpoint (:func:`vllm_exported_checkpoint`): with a prefill kernel that writes
  states inside a chunk (``PrefixCacheConfig.export_alignment``; FlashInfer's GDN prefill: 64), only
  the input's last block boundary is exported, from the chunk that reaches the input's end
  (``is_mamba_prefill_checkpoint_valid``).
"""

from __future__ import annotations

from hybridkv.blockmgr.prefix.placement_rules import CheckpointRules, aligned_end


def vllm_align_stops(num_tokens: int, input_len: int, branch: int, block_size: int) -> list[int]:
    """The positions past ``num_tokens`` where a prefill chunk must end so that the state there is
    kept, ascending: the next block boundary when ``num_tokens`` is mid-block, the branch point
    floored to a block (``branch``: where the request's cached KV prefix ended beyond its hit; vLLM's
    ``shared_prefix_boundary``), and the input's last block boundary before its last token (the
    state a later identical input resumes from: ``get_mamba_prefill_checkpoint_position``). Every
    other chunk end is floored to a block boundary by the scheduler, and the state is held at every
    block boundary a forward ends on (decode included), matchable only at the last two positions
    (:meth:`AlignRules.retains`)."""
    stops = set()
    if num_tokens % block_size:
        stops.add(aligned_end(num_tokens, block_size) + block_size)
    if branch > num_tokens:
        stops.add(num_tokens + aligned_end(branch - num_tokens, block_size))
    stops.add(aligned_end(max(input_len - 1, 0), block_size))
    return sorted(p for p in stops if num_tokens < p < input_len)


def vllm_exported_checkpoint(start: int, end: int, input_len: int, block_size: int, grid: int) -> int | None:
    """With a prefill kernel that exports a checkpoint from inside a chunk (vLLM's
    ``is_mamba_prefill_checkpoint_valid``; FlashInfer's GDN prefill, ``grid`` its alignment in
    tokens): the input's last block boundary before its last token, when the chunk
    ``[start, end)`` reaches the input's end, starts on a block boundary, and holds that position
    at least a block past ``start`` on the grid; else None (the chunk stops there instead)."""
    ckpt = aligned_end(max(input_len - 1, 0), block_size)
    valid = (
        end >= input_len
        and start % block_size == 0
        and start + block_size <= ckpt < end
        and -(-end // block_size) - 2 > (start - 1) // block_size
        and (ckpt - start) % grid == 0
    )
    return ckpt if valid else None


class AlignRules(CheckpointRules):
    """vLLM 0.33's ``align`` mode as the core's policy object (see the module doc)."""

    aligns_chunks = True
    holds_chunk_end_state = True
    keeps_second_copies = True
    queues_on_release = True
    waits_for_hit = True
    exports_all = False

    def stops(self, num_tokens: int, input_len: int, branch: int, block_size: int) -> list[int]:
        return vllm_align_stops(num_tokens, input_len, branch, block_size)

    def retains(self, position: int, input_len: int, branch: int, block_size: int) -> bool:
        """The input's last block boundary before its last token (the replay boundary) and the
        branch point floored to a block (the shared-prefix junction): vLLM 0.33's default
        ``prefix_cache_retention_interval=0``. The others are transient: their blocks are free
        again once the copy into them ran."""
        return position in (aligned_end(max(input_len - 1, 0), block_size), aligned_end(branch, block_size))

    def exported_checkpoint(self, start: int, end: int, input_len: int, block_size: int, grid: int) -> int | None:
        return vllm_exported_checkpoint(start, end, input_len, block_size, grid)


ALIGN_RULES = AlignRules()

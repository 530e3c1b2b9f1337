"""Step metadata: every array a forward needs for one :class:`StepPlan`, built once on the host (numpy).

Rows follow the plan's order, then padding rows up to ``batch_size`` (fixed shapes for CUDA
graphs): padding rows have zero lengths, no initial state, and tables full of the null block.
Names follow FastDeploy's ``ForwardMeta`` where it has one (``seq_lens_encoder``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import BlockCopies, RequestId
from hybridkv.planner.layout import Layout
from hybridkv.scheduler_adapter.requests import StepPlan


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Host arrays of one step. ``B`` = ``batch_size`` rows (real rows first), ``T`` = query tokens,
    ``G`` = state groups, ``K`` = speculative sets per row.

    - ``positions`` int64 ``[T]``: token position in its request; ``batch_id_per_token`` int32 ``[T]``.
    - ``seq_lens_encoder`` int32 ``[B]``: prefill tokens this step (0 for decode rows);
      ``seq_lens_decoder`` int32 ``[B]``: tokens already in the cache; ``seq_lens_this_time`` int32
      ``[B]``: tokens this step (decode: 1 + drafts).
    - ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``[B + 1]``: cumulative query / key lengths.
    - ``block_tables`` int32 ``[B, max_blocks_per_seq]``: KV block ids, null-padded.
    - ``state_tables`` int32 ``[G, B, blocks_per_state]``: live state sets (read, then written).
    - ``speculative_state_tables`` int32 ``[K, G, B, blocks_per_state]``: where the state after draft
      ``j`` goes (set ``j - 1``); null beyond a row's drafts.
    - ``num_drafts`` int32 ``[B]``; ``samples`` bool ``[B]``: the row's last token is sampled.
    - ``slot_mapping`` int64 ``[T]``: KV slot ``block * block_size + offset`` each new token writes
      (``[0]`` when the model has no attention).
    - ``has_initial_state`` bool ``[B]``: the live state holds earlier tokens (else kernels start at zero).
    """

    layout: Layout
    request_ids: tuple[RequestId, ...]
    batch_size: int
    num_tokens: int
    positions: np.ndarray
    batch_id_per_token: np.ndarray
    seq_lens_encoder: np.ndarray
    seq_lens_decoder: np.ndarray
    seq_lens_this_time: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    block_tables: np.ndarray
    state_tables: np.ndarray
    speculative_state_tables: np.ndarray
    num_drafts: np.ndarray
    samples: np.ndarray
    slot_mapping: np.ndarray
    has_initial_state: np.ndarray
    copies: BlockCopies

    @property
    def num_rows(self) -> int:
        """Real (non-padding) rows."""
        return len(self.request_ids)


def build_step_metadata(
    manager: HybridBlockManager,
    plan: StepPlan,
    batch_size: int | None = None,
    max_blocks_per_seq: int | None = None,
    num_speculative: int | None = None,
) -> StepMetadata:
    """Arrays for ``plan`` (call after the executor settled the plan's swaps; the scheduler does).

    ``batch_size``: rows incl. padding (default: the plan's rows); ``max_blocks_per_seq``: table
    width (default: the widest row); ``num_speculative``: ``K`` (default: the most drafts of a row).
    Raises ``ValueError`` if a fixed size is too small for the plan.
    """
    rows = plan.scheduled
    r = len(rows)
    b = r if batch_size is None else batch_size
    if b < r:
        raise ValueError(f"batch_size={b} is below the step's {r} rows: raise it (e.g. to max_num_seqs)")
    rids = tuple(row.request_id for row in rows)
    ctx = np.zeros(b, dtype=np.int32)
    q_len = np.zeros(b, dtype=np.int32)
    drafts = np.zeros(b, dtype=np.int32)
    prefill = np.zeros(b, dtype=bool)
    samples = np.zeros(b, dtype=bool)
    if r:
        _, computed, scheduled, num_drafts, is_prefill, sample = zip(*rows, strict=True)
        ctx[:r], drafts[:r] = computed, num_drafts
        q_len[:r] = scheduled
        q_len[:r] += drafts[:r]
        prefill[:r], samples[:r] = is_prefill, sample
    cu_q = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q_len, out=cu_q[1:])
    cu_k = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(ctx + q_len, out=cu_k[1:])
    t = int(cu_q[-1])
    token_row = np.repeat(np.arange(b, dtype=np.int32), q_len)
    positions = np.arange(t, dtype=np.int64) - np.repeat(cu_q[:-1], q_len) + np.repeat(ctx, q_len)

    bs = manager.block_size
    has_kv = manager.layout.kv_group is not None
    need_width = int(-(-(ctx + q_len).max(initial=0) // bs)) if has_kv else 0
    width = need_width if max_blocks_per_seq is None else max_blocks_per_seq
    if width < need_width:
        raise ValueError(f"max_blocks_per_seq={width} is below the {need_width} blocks a row of this step holds")
    block_tables = manager.block_table(rids, num_rows=b, width=width)
    slot_mapping = (
        block_tables[token_row, positions // bs].astype(np.int64) * bs + positions % bs
        if has_kv
        else np.zeros(0, dtype=np.int64)
    )
    state_tables = manager.state_table(rids, num_rows=b)
    k = int(drafts.max(initial=0)) if num_speculative is None else num_speculative
    if k < drafts.max(initial=0):
        raise ValueError(f"num_speculative={k} is below the {drafts.max()} drafts of a row of this step")
    g, bps = manager.num_state_groups, manager.blocks_per_state
    spec = np.zeros((k, g, b, bps), dtype=np.int32)
    for i in np.flatnonzero(drafts[:r]):
        d = int(drafts[i])
        spec[:d, :, i] = manager.speculative_table(rids[i])[:d]
    return StepMetadata(
        manager.layout,
        rids,
        b,
        t,
        positions,
        token_row,
        np.where(prefill, q_len, 0).astype(np.int32),
        ctx,
        q_len,
        cu_q,
        cu_k,
        block_tables,
        state_tables,
        spec,
        drafts,
        samples,
        slot_mapping,
        ctx > 0,
        plan.copies,
    )

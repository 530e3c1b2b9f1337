"""Records and results of the scheduler: one record per request, the step plan, the step outputs.

Token accounting (one rule for prefill, decode, chunks and recompute): a request's tokens are its
prompt followed by its outputs, ``num_tokens = num_prompt_tokens + len(output_token_ids)``;
``num_computed_tokens`` of them have KV and state written. A step runs ``num_scheduled_tokens``
of the uncomputed ones (plus ``num_drafts`` draft tokens when decoding speculatively); when the
step reaches ``num_tokens`` it samples. A decoding request therefore has
``num_computed_tokens == num_tokens - 1`` and runs 1 (+k) tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybridkv.blockmgr.records import BlockCopies, RequestId, SwapDirection, SwapPlan, TierCopies, TierPlan
from hybridkv.scheduler_adapter.gpu import PreemptionMode

_NONE = np.empty(0, dtype=np.int32)
NO_TIER_COPIES = TierPlan(TierCopies(_NONE, _NONE, SwapDirection.OUT), TierCopies(_NONE, _NONE, SwapDirection.IN))


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted by recompute
    RUNNING = "running"  # blocks on the device
    SWAPPED = "swapped"  # preempted by swap: blocks on the host
    FINISHED = "finished"  # produced max_new_tokens, or the engine reported a stop
    ABORTED = "aborted"


class AdmissionPolicy(enum.Enum):
    """When a waiting request may be admitted (its first chunk is what it allocates in every case).

    - ``RESERVED`` (default): its whole known tokens (prompt, and outputs after a recompute) and
      its next ``SchedulerConfig.decode_reserve_steps`` decode steps fit next to the blocks already
      promised to the running requests (the rest of the prompts still prefilling, and their own
      next decode steps), so a prefill never has to preempt another to finish and decode growth
      rarely does;
    - ``FULL_PROMPT``: its whole known tokens fit in the available blocks now (vLLM 0.33's
      ``scheduler_reserve_full_isl``, its default); prefills admitted in the same or earlier steps
      are not counted, so they can still run out mid-prefill;
    - ``FIRST_CHUNK``: its first chunk fits (the rule before this one; it admits the most and
      preempts mid-prefill when the rest does not fit).

    The manager's one count decides in every case (KV, live and speculative state sets, prefix
    hits, watermark).
    """

    RESERVED = "reserved"
    FULL_PROMPT = "full_prompt"
    FIRST_CHUNK = "first_chunk"


@dataclass(slots=True, eq=False)
class SchedRequest:
    """The scheduler's record of one request (the block manager holds its blocks)."""

    request_id: RequestId
    num_prompt_tokens: int
    max_new_tokens: int
    priority: int  # lower runs first; ties by arrival
    arrival: int  # submission order
    prompt_token_ids: tuple[int, ...] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_allocated_tokens: int = 0  # token slots the manager holds KV for (mirrors its record)
    num_spec_sets: int = 0  # speculative state sets the manager holds for it (mirrors its record)
    token_ids_given: int = 0  # token ids the manager has for it (prefix cache), 0 = none
    state: RequestState = RequestState.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # served from the prefix cache at the last admission

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Output tokens still to generate."""
        return self.max_new_tokens - len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Known tokens beyond the last sampled one are not computed yet (prompt, or outputs after a recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def token_ids(self) -> list[int] | None:
        """Prompt + output token ids, or None when the prompt ids were not given."""
        if self.prompt_token_ids is None:
            return None
        return [*self.prompt_token_ids, *self.output_token_ids]


class ScheduledRequest(NamedTuple):
    """One row of a step: ``num_scheduled_tokens`` tokens from position ``num_computed_tokens``,
    then ``num_drafts`` draft tokens (decode only). ``samples``: the step reaches the end of the
    request's known tokens and samples (a prefill chunk that stops short does not)."""

    request_id: RequestId
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_drafts: int
    is_prefill: bool
    samples: bool

    @property
    def num_query_tokens(self) -> int:
        return self.num_scheduled_tokens + self.num_drafts


class Preemption(NamedTuple):
    request_id: RequestId
    mode: PreemptionMode  # RECOMPUTE or SWAP (what AUTO chose)


class StateExport(NamedTuple):
    """A state the forward writes from inside a row's prefill chunk (``vllm_align`` with
    ``export_alignment``: FlashInfer's GDN prefill writes it as vLLM asks): the row's state after
    its first ``position`` tokens goes into ``sets`` ``[G, bps]`` (state-table shape, block ids the
    manager reserved). After the forward, ``update()`` makes them the prefix-cache checkpoint there."""

    request_id: RequestId
    position: int
    sets: np.ndarray


class StepPlan(NamedTuple):
    """What one step runs. Before the forward the executor runs, in this order:

    0. ``tier_copies.offload``: the prefix cache's host tier, device -> host (cached blocks evicted
       from the device since the last plan; their device blocks may be reused by what follows);
    1. ``checkpoint_copies``: live state -> prefix-cache checkpoint, taken after the previous
       forward (first: their sources may be freed and reused by this step's swaps);
    2. the copies of ``swap_out`` (device -> host), then of ``swap_in`` (host -> device):
       ``plan.device_blocks[j] <-> plan.host_blocks[j]``;
    3. ``tier_copies.onload`` (host hits, host -> device), then ``copies``: device block copies of
       this step (copy-on-write, prefix hits' checkpoint -> live).
    (docs/contract.md; the tier's copies are empty without ``PrefixCacheConfig.host_tier``.)
    The forward itself writes ``exports`` (empty without ``PrefixCacheConfig.export_alignment``).

    The swap plans are already settled with the manager; stream order makes that safe (blocks a
    swap-out frees are written only by later copies and the forward).
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Preemption, ...]
    resumed: tuple[RequestId, ...]  # swapped in this step (they run in it)
    admitted: tuple[RequestId, ...]  # allocated this step (new, or readmitted after recompute)
    swap_out: tuple[SwapPlan, ...]
    swap_in: tuple[SwapPlan, ...]
    checkpoint_copies: BlockCopies
    copies: BlockCopies
    num_batched_tokens: int
    tier_copies: TierPlan = NO_TIER_COPIES
    exports: tuple[StateExport, ...] = ()

    @property
    def request_ids(self) -> list[RequestId]:
        return [s.request_id for s in self.scheduled]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class StepOutputs(NamedTuple):
    """What the forward produced. ``sampled[rid]``: the tokens sampled for a row that samples
    (1 token; with drafts, the accepted drafts then the bonus token). ``finished``: rows that hit a
    stop condition. ``num_accepted[rid]``: accepted drafts (default: ``len(sampled[rid]) - 1``)."""

    sampled: Mapping[RequestId, Sequence[int]]
    finished: frozenset[RequestId] | set[RequestId] = frozenset()
    num_accepted: Mapping[RequestId, int] = {}


class StepResult(NamedTuple):
    """What :meth:`Scheduler.update` did: requests finished this step (with their output ids)."""

    finished: tuple[RequestId, ...]

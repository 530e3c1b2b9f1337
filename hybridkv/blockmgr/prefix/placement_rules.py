"""Checkpoint positions whose value does not hang on the layout's block size.

:class:`~hybridkv.blockmgr.prefix.PrefixCache` takes the positions of the policies of these names
from here (the branch point and :func:`back_off_points`; :func:`spaced_positions`);
:func:`branch_last_aligned` answers for one position. The older policies stay in ``prefix.py``. Pure
functions of token positions: no tensors, no state.

``branch_last_aligned`` keeps the state at

- the branch point (where a request left the cached prefixes: a second request diverged there, so
  a third one likely will; Marconi's rule);
- the last block boundary of a finished request's tokens, reply included (``final``: the next turn
  of a conversation repeats prompt and reply; the caller offers that decode position);
- the input's end rounded down to each of a few coarse token grids (``align_tokens``, default 512
  and 2,048), **not** to the block size. This is the back-off: a later request often shares a prompt
  only up to a few hundred tokens before its end (a sibling turn that rewrites the last message, a
  generation prompt the next turn does not repeat, stripped reasoning, a re-tokenized boundary). In
  the Mooncake trace, of the requests that share a prefix with the latest earlier prompt that has
  it, 12% share that prompt whole, 77% up to within 512 tokens of its end, 92% within 1,024, 99%
  within 2,048: a checkpoint at the input's exact end (``branch_and_last`` in a 64-token layout)
  serves almost none of them. Grid positions, not distances from the end, so that requests sharing
  a prefix land on the same positions and share the checkpoints.
- admission by expected reuse: a checkpoint costs the same bytes wherever it is, and a request
  that shared no cached prefix is far less likely to be shared itself (Mooncake trace: 18% of such
  requests are later shared, against 73% of those that did share one), so such a request gets
  only the coarsest grid's back-off point; the others get every grid's.

Its value does not depend on the layout's block size (positions are in tokens, rounded down to a
block boundary); in a 64-token paged layout its input positions include those ``branch_and_last``
places in a padded layout of 512 or 2,048-token blocks.

``branch_spaced`` (:func:`spaced_positions`) takes the same kinds of positions but keeps a
**minimum gap** between checkpoints on one chain, derived from bytes: a checkpoint takes the bytes
of ``state_bytes / kv_bytes_per_token`` tokens of KV (MiniMax-M1 TP8 fp32: 7,168; Qwen3-Next TP2:
1,608); the gap is a fraction of that (default 1/4: 1,792 and 402 tokens) and the back-off grids
are 512 tokens and that count rounded up to a power of two (8,192 and 2,048: :func:`spaced_grids`).
In a 64-token layout the branch point and the back-off points of one request are distinct
positions a few hundred tokens apart, each a full state's bytes; in a 1,024-token padded layout
they often round to one block. Without a gap the paged layout made 1.5x the padded layout's
checkpoints and lost 1.5 points of token hits to it (MiniMax-M1 TP8, 64 GiB, Mooncake trace: 2,638
vs 1,781 checkpoints, 51.4% vs 52.9%); with the gap both place about as many (1,447 vs 1,436) and
hit about the same (54.2% both). Positions and gap are in tokens, not blocks.
"""

from __future__ import annotations

DEFAULT_ALIGN_TOKENS: tuple[int, ...] = (512, 2048)
SPACED_FINE_GRID = 512  # branch_spaced's fine back-off grid, tokens
DEFAULT_GAP_FRACTION = 0.25  # branch_spaced's minimum gap, as a fraction of a checkpoint's bytes in KV tokens


def aligned_end(num_tokens: int, align: int) -> int:
    """``num_tokens`` rounded down to a multiple of ``align`` (``align`` > 0)."""
    return (num_tokens // align) * align


def branch_last_aligned(
    position: int, input_len: int, branch: int, block_size: int, align_tokens: tuple[int, ...]
) -> bool:
    """Whether ``branch_last_aligned`` checkpoints the input at ``position`` (block-aligned, > 0) of a
    request with ``input_len`` input tokens that left the cached prefixes at ``branch`` (the
    finished request's end is the caller's ``final`` flag, see ``PrefixCache.wants_checkpoint``)."""
    if position == branch:
        return True
    return position in back_off_points(input_len, branch, block_size, align_tokens)


def back_off_points(input_len: int, branch: int, block_size: int, align_tokens: tuple[int, ...]) -> set[int]:
    """The input positions ``branch_last_aligned`` backs off to: the input end rounded down to each
    grid, then to a block boundary (a grid need not be a multiple of ``block_size``), zeros dropped.

    Admission by expected reuse: a request that shared no cached prefix (``branch`` 0) gets only
    the coarsest nonzero point (one checkpoint), one that did gets all of them. An input shorter
    than every grid gets its block-aligned end instead (a short prompt is cheap to keep whole)."""
    points = [aligned_end(aligned_end(input_len, a), block_size) for a in align_tokens]
    points = [p for p in points if p > 0]
    if not points:
        end = aligned_end(input_len, block_size)
        return {end} if end > 0 else set()
    return set(points) if branch > 0 else {min(points)}


def spaced_grids(checkpoint_tokens: float, fine: int = SPACED_FINE_GRID) -> tuple[int, ...]:
    """``branch_spaced``'s default back-off grids: ``fine`` tokens, and a checkpoint's bytes in KV
    tokens (``checkpoint_tokens``: state bytes / KV bytes per token) rounded up to a power of two
    (MiniMax-M1 TP8 fp32: 7,168 -> 8,192; Qwen3-Next TP2: 1,608 -> 2,048), at least ``fine``. A
    request that shared nothing keeps only the coarse point: at most one checkpoint per as many
    bytes of its KV."""
    coarse = 1 << max(int(checkpoint_tokens) - 1, 1).bit_length()
    return (fine, max(coarse, fine))


def spaced_positions(
    input_len: int, branch: int, floor: int, block_size: int, align_tokens: tuple[int, ...], min_gap: int
) -> list[int]:
    """The input positions ``branch_spaced`` checkpoints (ascending, block-aligned, > ``floor``).

    Candidates are ``branch_last_aligned``'s: the branch point and :func:`back_off_points` on the
    grids ``align_tokens``. Taken from the shallowest up, a candidate is kept only if it lies at least
    ``min_gap`` tokens above the last kept one, the first above ``floor`` (the deepest checkpoint
    already on the request's chain below it: the hit, or 0). A checkpoint costs the same bytes
    wherever it is, and one ``d`` tokens above the nearest one below saves at most ``d`` tokens of
    recompute over it, so a closer one is not worth its bytes. Shallowest first keeps the branch
    point (Marconi's rule) over a back-off point close above it."""
    cands = back_off_points(input_len, branch, block_size, align_tokens)
    b = aligned_end(branch, block_size)
    if b > 0:
        cands.add(b)
    kept: list[int] = []
    last = floor
    for c in sorted(cands):
        if c - last >= min_gap and c > floor:
            kept.append(c)
            last = c
    return kept


class CheckpointRules:
    """What the core asks a checkpoint policy beyond the positions it wants (placement, the manager's
    checkpoints, admission, the LRU queue), with the answers of hybridkv's own policies; a policy
    with other rules subclasses it in a module of its own. Stateless: one
    shared instance per policy."""

    # prefill chunks that are not the input's last end on block boundaries (the state is kept
    # only where a forward ends)
    aligns_chunks = False
    # the state at every block boundary a forward ends on is taken (held until the request's next
    # chunk, matchable only where :meth:`retains` says); a request freed before it made a matchable
    # one it owes leaves its live sets as that checkpoint
    holds_chunk_end_state = False
    # the evictable copy a request's own copy replaced on its node (Registration.adopt_copies)
    # stays evictable where it is in the LRU queue, as vLLM's hash table keeps every copy (False:
    # nothing can match it, it is freed at once)
    keeps_second_copies = False
    # a checkpoint enters the LRU queue when its pin is released (its block is the request's until
    # then), not when it is made
    queues_on_release = False
    # admission takes a prefix hit or waits while other requests run (no fallback to a miss when
    # the hit pins more than it saves)
    waits_for_hit = False

    def stops(self, num_tokens: int, input_len: int, branch: int, block_size: int) -> list[int] | None:
        """The positions past ``num_tokens`` where a prefill chunk must end for the state there,
        ascending, or None: the policy's wanted positions (:meth:`CheckpointPlacement.next_checkpoint`)."""
        return None

    def retains(self, position: int, input_len: int, branch: int, block_size: int) -> bool:
        """Whether a checkpoint taken at ``position`` stays matchable once its forward ran (every one)."""
        return True

    def exported_checkpoint(self, start: int, end: int, input_len: int, block_size: int, grid: int) -> int | None:
        """The one position inside the chunk ``[start, end)`` whose state a kernel exporting on
        ``grid`` writes, when the policy exports only there; None: none such (see :meth:`exports_all`)."""
        return None

    # the kernel exports every wanted position on its grid inside a chunk (False: only the one of
    # :meth:`exported_checkpoint`)
    exports_all = True


DEFAULT_RULES = CheckpointRules()

"""Checkpoint positions whose value does not hang on the layout's block size.

:class:`~hybridkv.blockmgr.prefix.PrefixCache` asks :func:`branch_last_aligned` for the policy of
that name (the older policies stay in ``prefix.py``). Pure functions of token positions: no
tensors, no state.

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
"""

from __future__ import annotations

DEFAULT_ALIGN_TOKENS: tuple[int, ...] = (512, 2048)


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

"""Block sizes and state grouping for the layout planner (:mod:`hybridkv.planner.layout`): the default
paged block size that keeps state tails small, the block bytes of state-only models, the regrouping
of states of several sizes, and the head-tile notes. Pure arithmetic on a :class:`ModelSpec`.
"""

from __future__ import annotations

from hybridkv.models.spec import ModelSpec, RecurrentLayerSpec
from hybridkv.units import cdiv, format_bytes

DEFAULT_BLOCK_SIZE = 64
STATE_ONLY_BLOCK_BYTES_CHOICES = tuple(2**k * 1024 for k in range(8, 1, -1))  # 256 KiB .. 4 KiB
MAX_STATE_TAIL_FRACTION = 0.01
MAX_STATE_TAIL_SHARE = 0.10  # paged with attention: default block sizes keep state tails within this share
BLOCK_SIZE_CHOICES = tuple(sorted(range(16, 129, 16), key=lambda b: (abs(b - DEFAULT_BLOCK_SIZE), b)))
"""Default block sizes tried in order (64, 48, 80, 32, 96, 16, 112, 128) until state tails fit."""
FINE_BLOCK_SIZE_CHOICES = tuple(sorted(range(24, 257, 16), key=lambda b: (abs(b - DEFAULT_BLOCK_SIZE), b)))
"""Tried next when no multiple of 16 keeps the tails within the limit: odd multiples of 8 from 24
to 248 (paged attention in FlashInfer and Triton takes them; FlashAttention's needs multiples of 16)."""


def _state_group_size(model: ModelSpec, rec: list[int]) -> int:
    """Group size of a model without attention: all its layers in one group unless its states come in
    several sizes, then the size (all layers, or the layer count of one state size) whose groups
    hold the fewest state bytes per request, every slot counted at its group's largest state
    (``rec`` sorted by state size; ties: the larger group, fewer block tables)."""
    sizes = [model.layers[i].state_bytes for i in rec]  # type: ignore[union-attr]
    candidates = {len(rec), *(sizes.count(b) for b in set(sizes))}

    def held(gs: int) -> int:
        return sum(gs * max(sizes[start : start + gs]) for start in range(0, len(sizes), gs))

    return min(candidates, key=lambda gs: (held(gs), -gs))


def _regroup_states(
    model: ModelSpec, chunks: list[list[int | None]], group_size: int, block_bytes: int
) -> list[list[int | None]]:
    """Paged: the state groups that take the fewest blocks per request. ``chunks`` (layers sorted by
    state size, cut every ``group_size``) gives each slot of a group its largest state's blocks, so
    a group that mixes a few small states with large ones pads the small ones to the large size
    (RecurrentGemma: RG-LRU states beside K/V windows). Any partition into groups of at most
    ``group_size`` layers, contiguous in size order (optimal for a sum of maxima), is tried by
    dynamic programming; it replaces ``chunks`` only when it needs strictly fewer blocks (a model
    whose states are one size keeps its groups), fewest groups among equals."""
    ids = [i for c in chunks for i in c if i is not None]
    sizes = [cdiv(model.layers[i].state_bytes, block_bytes) for i in ids]  # type: ignore[union-attr]
    current = sum(max(sizes[ids.index(i)] for i in c if i is not None) for c in chunks)
    best: list[tuple[int, int]] = [(0, 0)] + [(0, 0)] * len(ids)
    cut = [0] * (len(ids) + 1)
    for end in range(1, len(ids) + 1):
        options = []
        for start in range(max(0, end - group_size), end):
            blocks, groups = best[start]
            options.append((blocks + sizes[end - 1], groups + 1, start))  # sizes ascend: the last is the largest
        blocks, groups, start = min(options)
        best[end], cut[end] = (blocks, groups), start
    if best[len(ids)][0] >= current:
        return chunks
    out: list[list[int | None]] = []
    end = len(ids)
    while end:
        part: list[int | None] = list(ids[cut[end] : end])
        out.append(part + [None] * (group_size - len(part)))
        end = cut[end]
    return out[::-1]


def _head_tile_notes(model: ModelSpec, block_bytes: int, segment_bytes: int) -> list[str]:
    notes = []
    for i in model.recurrent_layer_ids:
        layer = model.layers[i]
        assert isinstance(layer, RecurrentLayerSpec)
        c = max(layer.components, key=lambda comp: comp.nbytes)
        tile = c.nbytes // c.shape[0]
        fits = all(tile % b == 0 or b % tile == 0 for b in (block_bytes, segment_bytes))
        verdict = (
            "divide one another: head tiles never straddle a block"
            if fits
            else (
                "do not divide one another: in-place kernels will see head tiles straddle segments; "
                "prefer a block size whose bytes are a power-of-two multiple or fraction of the tile"
            )
        )
        notes.append(
            f"per-head '{c.name}' tile {format_bytes(tile)}, block {format_bytes(block_bytes)} per slot "
            f"(segment {format_bytes(segment_bytes)}): {verdict}"
        )
        break  # all recurrent layers of a preset share one shape; the first speaks for them
    return notes


def _state_only_block_bytes(state_bytes: int) -> int:
    """Largest power-of-two block (256 KiB .. 4 KiB) whose tail waste stays under 1% of a state."""

    def tail(b: int) -> float:
        return (cdiv(state_bytes, b) * b - state_bytes) / state_bytes

    fits = [b for b in STATE_ONLY_BLOCK_BYTES_CHOICES if tail(b) <= MAX_STATE_TAIL_FRACTION]
    return fits[0] if fits else min(STATE_ONLY_BLOCK_BYTES_CHOICES, key=tail)


def _state_bytes_max(model: ModelSpec) -> int:
    return max((l.state_bytes for l in model.layers if isinstance(l, RecurrentLayerSpec)), default=0)


def _tail_share(model: ModelSpec, block_bytes: int) -> float:
    states = [l.state_bytes for l in model.layers if isinstance(l, RecurrentLayerSpec)]
    if not states:
        return 0.0
    return sum(cdiv(b, block_bytes) * block_bytes - b for b in states) / sum(states)


def _kv_block_size(model: ModelSpec, token_bytes: int) -> tuple[int, list[str]]:
    """The default paged block size: 64 tokens unless state tails would pass MAX_STATE_TAIL_SHARE,
    then the nearest multiple of 16 that keeps them within it (the smallest tail if none does)."""
    shares = {b: _tail_share(model, b * token_bytes) for b in BLOCK_SIZE_CHOICES}
    fits = [b for b in BLOCK_SIZE_CHOICES if shares[b] <= MAX_STATE_TAIL_SHARE]
    size = fits[0] if fits else min(BLOCK_SIZE_CHOICES, key=lambda b: (shares[b], abs(b - DEFAULT_BLOCK_SIZE)))
    if size == DEFAULT_BLOCK_SIZE:
        return size, []
    if not fits:
        fine = {b: _tail_share(model, b * token_bytes) for b in FINE_BLOCK_SIZE_CHOICES}
        fine_fits = [b for b in FINE_BLOCK_SIZE_CHOICES if fine[b] <= MAX_STATE_TAIL_SHARE]
        if fine_fits:
            pick = fine_fits[0]
            return pick, [
                f"block size {pick} tokens: no multiple of 16 from 16 to 128 keeps the states' last-block tails "
                f"within {MAX_STATE_TAIL_SHARE:.0%} of the state bytes (at {DEFAULT_BLOCK_SIZE}: "
                f"{shares[DEFAULT_BLOCK_SIZE]:.1%}, at best {shares[size]:.1%} at {size}); at {pick} "
                f"{fine[pick]:.1%}. A multiple of 8, not 16: FlashInfer's and Triton's paged attention take it, "
                f"FlashAttention's does not (--block-size {size} for that)"
            ]
        return size, [
            f"block size {size} tokens: no block size from 16 to 248 keeps the states' last-block tails within "
            f"{MAX_STATE_TAIL_SHARE:.0%} of the state bytes (these states are smaller than a block); {size} wastes "
            f"the least, {shares[size]:.1%} (--block-size to choose)"
        ]
    return size, [
        f"block size {size} tokens, not {DEFAULT_BLOCK_SIZE}: at {DEFAULT_BLOCK_SIZE} the states' last blocks "
        f"would waste {shares[DEFAULT_BLOCK_SIZE]:.1%} of the state bytes, at {size} {shares[size]:.1%} "
        f"(limit {MAX_STATE_TAIL_SHARE:.0%}; --block-size to choose)"
    ]

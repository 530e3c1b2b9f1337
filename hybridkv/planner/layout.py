"""The layout planner: one block pool for attention KV and recurrent state (DESIGN.md "Layouts").

Layers are arranged in **groups** of ``group_size`` layers; attention layers form the KV group,
recurrent layers form state groups, and layer ``i`` of every group lives in **layer slot** ``i``.
Each layer slot is one tensor ``[num_segments, num_blocks, segment_bytes]``; a block id names
``block_bytes = num_segments * segment_bytes`` bytes in every slot, owned by one group at a time.

Two layouts:

- ``paged`` (default): the block size is what attention wants (16-64 tokens); a state spans
  ``ceil(state_bytes / block_bytes)`` blocks. Waste is only each state's unused tail.
- ``padded``: vLLM v1's rule (docs/models.md): one state per block, the attention block size raised
  (in steps of 16 tokens) until one attention page holds one layer's state.

Tail waste (paged): a state of ``S`` bytes takes ``ceil(S / block_bytes)`` blocks. Without a block
size from the caller the planner keeps 64 tokens when the tails stay within
:data:`MAX_STATE_TAIL_SHARE` (10%) of the state bytes, else takes the multiple of 16 tokens nearest to
64 (16-128) that does (Jamba-1.5-Mini: a 560 KiB state in 256 KiB blocks wastes 37% at 64 tokens,
2.9% at 48), else the odd multiple of 8 nearest to 64 (24-248) that does, with a note that
FlashAttention's paged kernels need multiples of 16 (Zamba2-7B: 1.79 MiB states in 28 KiB-per-token
slots waste 22% at 80 tokens, the best multiple of 16, and 9.8% at 72). The other remedy, packing
the tails of several layers' states into shared blocks, would
give a block several owners inside one layer slot, which the allocator, the ops and the transfer
descriptors do not model; a block size keeps every block one owner's. States of several sizes are
grouped so that a group's slots do not all pay for its largest state when grouping by size takes
fewer blocks (:func:`_regroup_states`).

A model with hybrid layers (K/V and a state in one decoder layer) is planned on its
:meth:`~hybridkv.models.spec.ModelSpec.cache_view`: the attention part joins the KV group, the state
part a state group; ``Layout.model`` is that view. K and V of different widths (MLA: 512 + 64) are
laid out as ``key_segments + value_segments`` segments of their greatest common width.

Per-token side tensors of attention layers (DeepSeek-sparse indexer keys: GLM-5 Next, Qwen4-exp;
:class:`~hybridkv.models.spec.SideTensor`) take ``side_segments`` more segments of the KV layer
slot, after V: they are allocated, swapped and transferred with the layer's K/V blocks, with no
change to the allocator, the pools or the transfer descriptors (which see ``num_segments``). The
segment width is then the greatest common width of K, V and the side run (in columns of
``kv_heads x itemsize`` bytes), so a side run that shares no large width with K cuts K into many
narrow segments (GLM-5 Next: 1 column). Attention layers whose side tensors differ (GLM-5 Next's
``shared`` indexer layers keep none; Qwen4-exp keeps the positions on its first indexed layer only)
all get the largest side run; the unused part is counted as ``Waste.side_slack_bytes``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from hybridkv.errors import LayoutError
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec
from hybridkv.planner.sizing import (  # noqa: F401  (constants re-exported from here)
    BLOCK_SIZE_CHOICES,
    DEFAULT_BLOCK_SIZE,
    FINE_BLOCK_SIZE_CHOICES,
    MAX_STATE_TAIL_FRACTION,
    MAX_STATE_TAIL_SHARE,
    STATE_ONLY_BLOCK_BYTES_CHOICES,
    _head_tile_notes,
    _kv_block_size,
    _regroup_states,
    _state_bytes_max,
    _state_group_size,
    _state_only_block_bytes,
)
from hybridkv.units import cdiv, format_bytes, round_up

NULL_BLOCK = 0
"""Block id 0: zero-filled, never allocated; padding rows of a batch point at it."""

PADDED_BLOCK_ALIGN = 16  # vLLM rounds the inflated attention block size up to 16 tokens


class LayoutKind(enum.Enum):
    PAGED = "paged"
    PADDED = "padded"


class GroupKind(enum.Enum):
    KV = "kv"
    STATE = "state"


@dataclass(frozen=True, slots=True)
class Group:
    """Layers that move together. ``layer_ids[s]`` is the model layer in slot ``s`` (None = padding)."""

    index: int
    kind: GroupKind
    layer_ids: tuple[int | None, ...]
    blocks_per_state: int = 0  # state groups: blocks in one state set; 0 for the KV group

    @property
    def num_padding_layers(self) -> int:
        return sum(1 for l in self.layer_ids if l is None)


class Waste(NamedTuple):
    """Bytes allocated but holding no cache data, by cause."""

    state_tail_bytes: int  # paged: unused tail of each state's last block
    padded_slack_bytes: int  # padded: page minus state bytes (one state per page)
    padding_layer_bytes: int  # slots of a group with no layer (counts that do not divide)
    kv_tail_bytes: int  # unused token slots of the last, partial KV block
    side_slack_bytes: int = 0  # KV blocks: side segments a layer does not fill (smaller or no side tensors)

    @property
    def total_bytes(self) -> int:
        return sum(self)


class RequestFootprint(NamedTuple):
    """What one request of ``num_tokens`` tokens takes from the pool."""

    num_tokens: int
    num_kv_blocks: int
    num_state_blocks: int
    num_blocks: int
    kv_bytes: int  # useful K/V bytes
    state_bytes: int  # useful state bytes
    allocated_bytes: int  # num_blocks * block_bytes * group_size
    waste: Waste


class Capacity(NamedTuple):
    """How many requests of one context length fit in the pool, and where every byte goes."""

    context_tokens: int
    max_requests: int
    footprint: RequestFootprint
    free_blocks: int  # usable blocks left over at max_requests
    null_block_bytes: int
    remainder_bytes: int  # budget not large enough for one more block


@dataclass(frozen=True, slots=True)
class Layout:
    """A concrete layout of one model (one TP rank) in one block pool. Immutable; made by :func:`plan`."""

    model: ModelSpec
    kind: LayoutKind
    block_size: int  # tokens per KV block (also the checkpoint granularity)
    group_size: int
    groups: tuple[Group, ...]
    num_segments: int
    segment_bytes: int
    num_blocks: int  # including the null block
    budget_bytes: int
    notes: tuple[str, ...] = ()
    # block_wise_fp8 KV: bytes of one block's K scales (and as many of V scales) per layer slot, kept
    # in their own tensors beside the segments; state blocks leave them unused
    scale_segment_bytes: int = 0
    # K takes segments [0, key_segments), V the next value_segments (1 and 1 unless K and V widths differ)
    key_segments: int = 1
    value_segments: int = 1
    # per-token side tensors (indexer keys) take the next side_segments segments (0 without them)
    side_segments: int = 0

    # ---- shape facts -------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes one block id names in one layer slot."""
        return self.num_segments * self.segment_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id names across all layer slots (KV scales included)."""
        return (self.block_bytes + 2 * self.scale_segment_bytes) * self.group_size

    @property
    def num_layer_slots(self) -> int:
        return self.group_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_decoder_layers(self) -> int:
        """Decoder layers of the model (an engine's ``num_hidden_layers``): ``model`` is the cache view,
        where a hybrid layer (K/V and a state in one decoder layer) is two cache layers."""
        ids = self.model.decoder_layer_ids
        return len(self.model.layers) if ids is None else max(ids) + 1

    def kv_segment_runs(self, spec: AttentionLayerSpec) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(first segment, segments, width)`` of K and of V of attention layer ``spec`` in a layer slot:
        K ``(0, key_segments, head_dim)``, V ``(key_segments, value_segments, value_head_dim)``."""
        k, v = self.key_segments, self.value_segments
        return (0, k, spec.head_dim), (k, v, spec.value_head_dim)

    @property
    def side_segment_bytes_per_token(self) -> int:
        """Bytes of one token in one segment of the KV layer slot (``segment_bytes / block_size``)."""
        return self.segment_bytes // self.block_size if self.kv_group is not None else 0

    def side_segment_run(self, spec: AttentionLayerSpec) -> tuple[int, int, dict[str, int]]:
        """``(first segment, segments, byte offset of each side tensor)`` of attention layer ``spec``'s
        side tensors in a layer slot. A token's side bytes are its side tensors back to back (in
        ``spec.side`` order, offsets as returned), cut into ``segments`` columns of
        :attr:`side_segment_bytes_per_token` bytes: column ``j`` of token ``t`` of a block lies in
        segment ``first + j`` of that block, at ``t * side_segment_bytes_per_token``."""
        offsets, pos = {}, 0
        for t in spec.side:
            offsets[t.name] = pos
            pos += t.bytes_per_token
        return self.key_segments + self.value_segments, self.side_segments, offsets

    def decoder_layer_id(self, cache_layer_id: int) -> int:
        """The decoder layer that cache layer ``cache_layer_id`` of ``model`` belongs to
        (``model.decoder_layer_ids``; itself when the model has no hybrid layer)."""
        ids = self.model.decoder_layer_ids
        return cache_layer_id if ids is None else ids[cache_layer_id]

    @property
    def kv_group(self) -> Group | None:
        return next((g for g in self.groups if g.kind is GroupKind.KV), None)

    @property
    def state_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.STATE)

    @property
    def num_state_groups(self) -> int:
        return len(self.state_groups)

    @property
    def blocks_per_state(self) -> tuple[int, ...]:
        """Blocks of one state set, per state group (in state-group order)."""
        return tuple(g.blocks_per_state for g in self.state_groups)

    @property
    def num_state_blocks_per_request(self) -> int:
        return sum(self.blocks_per_state)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def state_tail_bytes(self) -> int:
        """Bytes of one request's state sets that hold no state (the last blocks' unused tails)."""
        return sum(
            g.blocks_per_state * self.block_bytes - self.model.layers[l].state_bytes  # type: ignore[union-attr]
            for g in self.state_groups
            for l in g.layer_ids
            if l is not None
        )

    @property
    def state_tail_fraction(self) -> float:
        """:attr:`state_tail_bytes` as a share of the state bytes (0 without state)."""
        return self.state_tail_bytes / self.model.state_bytes if self.model.state_bytes else 0.0

    def state_layer(self, state_group: int, slot: int) -> tuple[int, RecurrentLayerSpec] | None:
        """(model layer id, spec) held by state group ``state_group`` (0-based) in ``slot``, or None."""
        layer_id = self.state_groups[state_group].layer_ids[slot]
        if layer_id is None:
            return None
        layer = self.model.layers[layer_id]
        assert isinstance(layer, RecurrentLayerSpec)
        return layer_id, layer

    # ---- per-request accounting ----------------------------------------------------------------
    def num_kv_blocks(self, num_tokens: int) -> int:
        """KV blocks holding ``num_tokens`` tokens (0 for models without attention)."""
        return cdiv(num_tokens, self.block_size) if self.kv_group is not None else 0

    def footprint(self, num_tokens: int) -> RequestFootprint:
        """Blocks and bytes one request of ``num_tokens`` tokens holds, with the waste by cause."""
        if num_tokens < 0:
            raise LayoutError(f"num_tokens must be >= 0, got {num_tokens}")
        kv_blocks = self.num_kv_blocks(num_tokens)
        state_blocks = self.num_state_blocks_per_request
        kv_bytes = num_tokens * self.kv_bytes_per_token
        state_bytes = self.model.state_bytes
        kv_tail = (kv_blocks * self.block_size - num_tokens) * self.kv_bytes_per_token
        side_slack = 0
        if self.side_segments and self.kv_group is not None:
            run = self.side_segments * self.side_segment_bytes_per_token
            for layer_id in self.kv_group.layer_ids:
                if layer_id is not None:
                    attn = self.model.layers[layer_id]
                    assert isinstance(attn, AttentionLayerSpec)
                    side_slack += kv_blocks * self.block_size * (run - attn.side_bytes_per_token)
        state_waste = 0
        padding = 0
        for g in self.groups:
            used = kv_blocks if g.kind is GroupKind.KV else g.blocks_per_state
            padding += g.num_padding_layers * used * (self.block_bytes + 2 * self.scale_segment_bytes)
            if g.kind is GroupKind.STATE:
                for layer_id in g.layer_ids:
                    if layer_id is not None:
                        layer = self.model.layers[layer_id]
                        assert isinstance(layer, RecurrentLayerSpec)
                        state_waste += g.blocks_per_state * self.block_bytes - layer.state_bytes
                        state_waste += g.blocks_per_state * 2 * self.scale_segment_bytes  # scales unused
        paged = self.kind is LayoutKind.PAGED
        waste = Waste(state_waste if paged else 0, 0 if paged else state_waste, padding, kv_tail, side_slack)
        num_blocks = kv_blocks + state_blocks
        return RequestFootprint(
            num_tokens,
            kv_blocks,
            state_blocks,
            num_blocks,
            kv_bytes,
            state_bytes,
            num_blocks * self.bytes_per_block,
            waste,
        )

    def capacity(self, context_tokens: int) -> Capacity:
        """Maximum concurrent requests of ``context_tokens`` tokens each."""
        fp = self.footprint(context_tokens)
        max_requests = self.num_usable_blocks // fp.num_blocks if fp.num_blocks else 0
        return Capacity(
            context_tokens,
            max_requests,
            fp,
            self.num_usable_blocks - max_requests * fp.num_blocks,
            self.bytes_per_block,
            self.budget_bytes - self.pool_bytes,
        )

    def describe(self) -> str:
        state = ", ".join(str(b) for b in self.blocks_per_state) or "-"
        return (
            f"{self.model.name} TP{self.model.tp_size} {self.kind.value}: {self.num_layer_slots} layer slots, "
            f"{len(self.groups)} groups ({self.num_state_groups} state), block {self.block_size} tokens = "
            f"{format_bytes(self.block_bytes)} per slot, blocks per state {state}, {self.num_blocks} blocks"
        )


# ---- vLLM's block size ---------------------------------------------------------------------------
VLLM_KERNEL_BLOCK_ALIGN = 16
"""Smallest kernel block of vLLM's default attention backend on an H200 (FlashAttention: any
multiple of 16 tokens); also vLLM's default ``--block-size``."""


def vllm_block_size(
    model: ModelSpec,
    prefix_caching: bool = False,
    checkpoint_alignment: int | None = None,
    kernel_alignment: int = VLLM_KERNEL_BLOCK_ALIGN,
) -> int:
    """The attention block vLLM 0.33 gives a hybrid ``model`` (one TP rank), as its start-up code
    aligns it (``Platform._align_hybrid_block_size``, ``vllm/platforms/interface.py``): the smallest
    multiple of ``kernel_alignment`` tokens whose attention page (one layer's K and V) holds the
    largest recurrent layer's state; with prefix caching (Mamba cache mode ``align``) the multiple is
    of ``lcm(kernel_alignment, checkpoint_alignment)``: the recurrent layers' prefill checkpoint
    alignment (FlashInfer's GDN prefill on Hopper exports checkpoints every 64 tokens, so
    Qwen3-Next's 544-token blocks become 576; None: layers that export none, as MiniMax-M1's
    lightning layers). Without recurrent layers: ``kernel_alignment``. Raises :class:`LayoutError`
    for a model without attention (vLLM has no attention block to align then)."""
    model = model.cache_view()
    attn = _attention_shape(model)
    if attn is None:
        raise LayoutError(f"model {model.name!r} has no attention layer: vLLM's hybrid block size does not apply")
    align = kernel_alignment
    if prefix_caching and checkpoint_alignment:
        align = math.lcm(align, checkpoint_alignment)
    state = _state_bytes_max(model)
    if not state:
        return kernel_alignment
    per_token = attn.kv_bytes_per_token
    return max(kernel_alignment, align * cdiv(state, align * per_token))


# ---- the planner -------------------------------------------------------------------------------
def _attention_shape(model: ModelSpec) -> AttentionLayerSpec | None:
    """The one K/V shape of the model's attention layers, with the largest side tensors any of them
    keeps (side tensors may differ between layers: the smaller ones leave side segments unused)."""
    layers = [model.layers[i] for i in model.attention_layer_ids]
    specs = {replace(a, side=()) for a in layers}  # type: ignore[type-var]
    if len(specs) > 1:
        raise LayoutError(
            f"model {model.name!r} has attention layers of different KV shapes {sorted(map(str, specs))}: "
            "one KV group needs equal shapes; describe the model with one attention shape"
        )
    return max(layers, key=lambda a: a.side_bytes_per_token, default=None)  # type: ignore[union-attr]


def _segment_widths(attn: AttentionLayerSpec) -> tuple[int, int, int, int]:
    """``(width, key_segments, value_segments, side_segments)``: K, V and the side run cut into
    segments of their greatest common width (columns of ``kv_heads x itemsize`` bytes; a side run
    that is not a whole number of columns is padded up to one)."""
    column = attn.num_kv_heads * attn.dtype.itemsize
    side = cdiv(attn.side_bytes_per_token, column)
    width = math.gcd(attn.head_dim, attn.value_head_dim, side)
    return width, attn.head_dim // width, attn.value_head_dim // width, side // width


def _build_groups(
    model: ModelSpec, group_size: int | None
) -> tuple[int, list[list[int | None]], list[list[int | None]]]:
    attn, rec = list(model.attention_layer_ids), list(model.recurrent_layer_ids)
    # a state group gives every slot its largest state's blocks: group states of one size together
    # (stable: a model whose states are all one size keeps its layer order)
    rec.sort(key=lambda i: model.layers[i].state_bytes)  # type: ignore[union-attr]
    if group_size is None:
        # One KV group holding every attention layer keeps one block table per request (what
        # FastDeploy and vLLM attention kernels take); recurrent layers fill groups of that size.
        group_size = len(attn) if attn else _state_group_size(model, rec)
    if group_size <= 0:
        raise LayoutError(f"group_size must be positive, got {group_size}")
    if attn and group_size < len(attn):
        raise LayoutError(
            f"group_size={group_size} is below the model's {len(attn)} attention layers: "
            f"use group_size >= {len(attn)} so that all attention layers share one KV group"
        )

    def chunk(ids: list[int]) -> list[list[int | None]]:
        out: list[list[int | None]] = []
        for start in range(0, len(ids), group_size):
            part: list[int | None] = list(ids[start : start + group_size])
            out.append(part + [None] * (group_size - len(part)))
        return out

    return group_size, chunk(attn), chunk(rec)


def plan(
    model: ModelSpec,
    budget_bytes: int,
    block_size: int | None = None,
    layout: LayoutKind | str = LayoutKind.PAGED,
    group_size: int | None = None,
    state_block_bytes: int | None = None,
) -> Layout:
    """Plan a block pool of at most ``budget_bytes`` for ``model`` (already sharded for one TP rank).

    ``block_size``: tokens per KV block (default 64 for paged; for padded the minimum before
    inflation). ``state_block_bytes``: block bytes per slot for models without attention (default:
    the largest power of two from 256 KiB down whose state tail stays under 1%; padded: one state
    per block). Raises :class:`LayoutError` when the budget cannot
    hold two blocks (the null block and one more) or the sizes are invalid.
    """
    kind = LayoutKind(layout) if isinstance(layout, str) else layout
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise LayoutError(f"block_size must be a positive number of tokens, got {block_size!r}")
    if budget_bytes <= 0:
        raise LayoutError(f"budget must be positive, got {budget_bytes} bytes")
    model = model.cache_view()  # hybrid layers -> an attention and a recurrent cache layer each
    attn = _attention_shape(model)
    group_size, kv_chunks, state_chunks = _build_groups(model, group_size)
    notes: list[str] = list(n for n in model.notes if n.startswith("hybrid layers"))
    state_max = _state_bytes_max(model)

    scale_segment_bytes = 0
    key_segments = value_segments = 1
    side_segments = 0
    if attn is not None:
        width, key_segments, value_segments, side_segments = _segment_widths(attn)
        per_token_segment = attn.num_kv_heads * width * attn.dtype.itemsize
        num_segments = key_segments + value_segments + side_segments
        if side_segments:
            names = ", ".join(f"{t.name} [{t.width}] {t.dtype.value}" for t in attn.side)
            notes.append(
                f"per-token side tensors ({names}; {attn.side_bytes_per_token} B per token) take "
                f"{side_segments} segment(s) after V; K {key_segments}, V {value_segments}, each {width} "
                f"column(s) wide ({per_token_segment} B per token)"
            )
        elif num_segments != 2:
            notes.append(
                f"K and V widths differ ({attn.head_dim} and {attn.value_head_dim}): K takes {key_segments} "
                f"segments, V {value_segments}, each {width} wide"
            )
        if kind is LayoutKind.PADDED:
            size = block_size or PADDED_BLOCK_ALIGN
            needed = cdiv(state_max, num_segments * per_token_segment)
            if needed > size:
                size = round_up(needed, PADDED_BLOCK_ALIGN)
                notes.append(
                    f"padded: attention block raised to {size} tokens so one page holds one layer's "
                    f"state ({format_bytes(state_max)})"
                )
            block_size = size
        elif block_size is None:
            block_size, why = _kv_block_size(model, num_segments * per_token_segment)
            notes.extend(why)
        segment_bytes = block_size * per_token_segment
        scale_segment_bytes = block_size * attn.scale_bytes_per_token // 2
    else:
        num_segments = 1
        block_size = block_size or DEFAULT_BLOCK_SIZE
        if kind is LayoutKind.PADDED:
            segment_bytes = state_max
        else:
            segment_bytes = state_block_bytes or _state_only_block_bytes(state_max)
    if segment_bytes <= 0:
        raise LayoutError(f"block bytes must be positive, got {segment_bytes}")
    block_bytes = num_segments * segment_bytes
    if kind is LayoutKind.PAGED and state_chunks:
        state_chunks = _regroup_states(model, state_chunks, group_size, block_bytes)

    groups: list[Group] = [Group(0, GroupKind.KV, tuple(c)) for c in kv_chunks]
    for chunk in state_chunks:
        largest = max(model.layers[i].state_bytes for i in chunk if i is not None)  # type: ignore[union-attr]
        bps = 1 if kind is LayoutKind.PADDED else cdiv(largest, block_bytes)
        groups.append(Group(len(groups), GroupKind.STATE, tuple(chunk), bps))
    if state_chunks:
        notes.extend(_head_tile_notes(model, block_bytes, segment_bytes))
        if kind is LayoutKind.PAGED:
            tail = sum(g.blocks_per_state * block_bytes for g in groups[len(kv_chunks) :] for _ in g.layer_ids)
            tail -= sum(model.layers[i].state_bytes for c in state_chunks for i in c if i is not None)  # type: ignore[union-attr]
            tail -= sum(g.num_padding_layers * g.blocks_per_state * block_bytes for g in groups[len(kv_chunks) :])
            notes.append(
                f"state tail waste: {format_bytes(tail)} per request, {tail / model.state_bytes:.1%} of the "
                f"{format_bytes(model.state_bytes)} of state (the unused end of each state's last block)"
            )

    bytes_per_block = (block_bytes + 2 * scale_segment_bytes) * group_size
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise LayoutError(
            f"budget {format_bytes(budget_bytes)} holds {num_blocks} block(s) of {format_bytes(bytes_per_block)} "
            f"(the null block needs one): raise the memory budget or lower the block size"
        )
    return Layout(
        model,
        kind,
        block_size,
        group_size,
        tuple(groups),
        num_segments,
        segment_bytes,
        num_blocks,
        budget_bytes,
        tuple(notes),
        scale_segment_bytes,
        key_segments,
        value_segments,
        side_segments,
    )

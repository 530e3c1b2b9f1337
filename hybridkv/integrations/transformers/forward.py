"""The forwards of one step: rows cut into pieces, pieces batched into as few HF forwards as is exact.

A row is cut into *pieces* that run in rounds: a prefill chunk is one piece (one token per piece
for a family whose multi-token forward cannot continue a state), and a decode with drafts is
``1 + d`` one-token pieces: token ``j`` reads the state after token ``j - 1`` and writes speculative
set ``j - 1`` (token 0 the live set), so the manager's ``commit_speculation`` rolls rejected drafts
back by exchanging block-id lists.

Batching, as ``generate`` batches: in a round, the pieces that start a state (fresh prompts, or
chunks of a model without state) run in one forward whatever their lengths (or in a few, by length,
where the padding saved is worth a forward: :func:`_padding_groups`), **left padded** to the
longest: the pads' queries see only themselves, no real query sees a pad (the additive 4-D mask
for attention layers), and the recurrent layers get transformers' own 2-D padding mask, which
zeroes the pads' inputs, so a state that starts at zero stays zero through them. A piece that
continues a state is never padded (a pad before it would move its state): those run one forward
per length, so all decodes of a step are one forward; when such chunks come in many lengths (the
tails of prompts the scheduler cut at a checkpoint), each is cut into its binary parts and a round
runs every part of one length: ``k`` lengths below ``2**m`` in at most ``m`` forwards. A family
with a mixer hook (MiniMax on hybridkv's lightning kernels) is batched by length only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch

from hybridkv.integrations.transformers.paged_cache import attention_mask
from hybridkv.scheduler_adapter import StepMetadata, StepPlan

# what one more forward costs, in padded tokens: a forward of a tiny model on one CPU thread costs
# about as much as 40-60 more tokens in a batch (benchmarks/bench_hf.py); fresh prompts are split
# into another left-padded forward only where that saves more padding than this
FORWARD_COST_TOKENS = 128


class Piece(NamedTuple):
    row: int  # row of the plan
    start: int  # first query token of the row this piece runs
    length: int
    src: np.ndarray | None  # [G, bps] the state set read (None: no initial state)
    dst: np.ndarray  # [G, bps] the state set written


class Forwards:
    """The forward half of :class:`~.engine.HFEngine` (a mixin: it uses the engine's model, cache,
    family, events and mixer hook)."""

    model: torch.nn.Module
    cache: Any
    family: Any
    events: Any
    mixer_hook: Any
    _kwarg: str
    _mask_kinds: dict[str, Any]
    _has_state: bool
    config: Any

    def pieces(self, plan: StepPlan, meta: StepMetadata) -> list[list[Piece | None]]:
        """Each row's pieces in the order they must run, by round (None: the row sits a round out;
        see the module docstring)."""
        out: list[list[Piece | None]] = []
        for b, row in enumerate(plan.scheduled):
            live = meta.state_tables[:, b]
            init = bool(meta.has_initial_state[b])
            n, d = row.num_scheduled_tokens, row.num_drafts
            if d:  # a decode with drafts: token j writes the state after it to speculative set j - 1
                spec = meta.speculative_state_tables[:, :, b]
                ps = [Piece(b, 0, 1, live, live)]
                ps += [Piece(b, j, 1, live if j == 1 else spec[j - 2], spec[j - 1]) for j in range(1, d + 1)]
            elif init and n > 1 and not self.family.continues_multi_token:
                ps = [Piece(b, j, 1, live, live) for j in range(n)]
            else:
                ps = [Piece(b, 0, n, live if init else None, live)]
            out.append(ps)  # type: ignore[arg-type]
        return _binary_continuations(out)

    def forward(self, plan: StepPlan, meta: StepMetadata, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Each row's logits: of all its query tokens (scheduled tokens, then drafts: ``[len(inputs[b]),
        vocab]``) with ``record_logits``; else of the last scheduled token and the drafts only
        (``[1 + drafts, vocab]``: the positions sampled; the LM head runs on nothing else)."""
        pieces = self.pieces(plan, meta)
        pad, every = self.mixer_hook is None, self.config.record_logits
        results: list[list[torch.Tensor]] = [[] for _ in pieces]
        for r in range(max(len(p) for p in pieces)):
            groups: dict[tuple[int, bool], list[Piece]] = defaultdict(list)
            for ps in pieces:
                p = ps[r] if r < len(ps) else None
                if p is not None:
                    init = p.src is not None
                    groups[(0 if pad and not init else p.length, init)].append(p)
            for (_, init), group in groups.items():
                for part in _padding_groups(group) if not init else (group,):
                    out = self.forward_pieces(meta, inputs, part, init, every)
                    for p, lg in zip(part, out, strict=True):
                        results[p.row].append(lg)  # (a row's pieces run in its order: rounds ascend)
        if every:
            return [torch.cat(rs) for rs in results]
        return [torch.cat(rs)[-1 - row.num_drafts :] for rs, row in zip(results, plan.scheduled, strict=True)]

    def forward_pieces(
        self, meta: StepMetadata, inputs: list[list[int]], group: list[Piece], init: bool, every: bool = True
    ) -> list[torch.Tensor]:
        """One batched HF forward of ``group``, left padded to its longest piece (pieces that continue
        a state all have one length); returns each piece's logits ``[length, vocab]`` (``every``), or
        of its last token only ``[1, vocab]`` (the model's ``logits_to_keep=1``: left padding puts
        every piece's last token last)."""
        lengths = np.array([p.length for p in group])
        b, t = len(group), int(lengths.max())
        pads = t - lengths
        past = [int(meta.seq_lens_decoder[p.row]) + p.start for p in group]
        ids = np.zeros((b, t), dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        cu = meta.cu_seqlens_q
        take = []  # the rows' tokens in the step's flat order (their slots)
        for i, p in enumerate(group):
            ids[i, pads[i] :] = inputs[p.row][p.start : p.start + p.length]
            pos[i, pads[i] :] = np.arange(past[i], past[i] + p.length)
            take.append(np.arange(cu[p.row] + p.start, cu[p.row] + p.start + p.length))
        slots = meta.slot_mapping[np.concatenate(take)] if meta.slot_mapping.size else meta.slot_mapping
        real = torch.from_numpy(np.arange(t)[None, :] >= pads[:, None]) if pads.any() else None  # [B, T]
        src = np.stack([p.src for p in group], axis=1) if init else None  # [G, B, bps]
        dst = np.stack([p.dst for p in group], axis=1)
        src, dst = self.state_tables_for(src, dst)
        cache = self.cache.build(meta.block_tables[[p.row for p in group]], past, src, init, dst)
        kwargs = {self._kwarg: cache}
        mask = self._mask(past, t, pads, real)
        call = dict(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(pos), attention_mask=mask)
        if not every:
            call["logits_to_keep"] = 1
        if self.mixer_hook is not None:
            with self.mixer_hook(self, group, meta, past, src, dst, init):
                out = self.model(**call, use_cache=True, **kwargs)
        else:
            out = self.model(**call, use_cache=True, **kwargs)
        self.events.forwards += 1
        self.cache.store(cache, past, slots, dst, real=real)
        logits = out.logits if out.logits.dtype == torch.float64 else out.logits.float()
        return [logits[i, pads[i] :] for i in range(b)] if every else list(logits[:, -1:])

    def _mask(self, past: list[int], t: int, pads: np.ndarray, real: torch.Tensor | None) -> Any:
        """What the model's ``attention_mask`` takes: a dict by kind of layer (the 4-D additive mask for
        attention, the 2-D padding mask or None for recurrent layers), the 4-D mask alone for a model
        without recurrent layers, the 2-D one alone for a model without attention."""
        dtype = next(self.model.parameters()).dtype
        padding = real.to(dtype) if real is not None and t > 1 else None  # [B, T] 1 real, 0 pad
        if not self.cache.kv:
            return padding
        m = attention_mask(past, t, dtype, pads.tolist() if real is not None else None, self.cache.past_valid)
        if not self._has_state:
            return m
        return dict.fromkeys(self._mask_kinds, padding) | {"full_attention": m, "sliding_attention": m}

    def state_tables_for(self, src: np.ndarray | None, dst: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The state tables a forward reads and writes (``[G, B, bps]``); an extension point."""
        return src, dst


def _binary_continuations(pieces: list[list[Piece | None]]) -> list[list[Piece | None]]:
    """Chunks that continue a state, of many lengths (the tails of prompts cut at a checkpoint, each
    its own length), cut into their binary parts when that takes fewer forwards: the part of
    ``2**r`` tokens runs in round ``r``, with every other row's part of that length (and round 0's
    one-token part with the step's decodes), so ``k`` distinct lengths below ``2**m`` take at most
    ``m`` forwards instead of ``k``. Exact: each part continues the state the one before left."""
    tails = [ps[0] for ps in pieces if len(ps) == 1 and ps[0] is not None and ps[0].src is not None]
    lengths = {p.length for p in tails if p.length > 1}
    bits = {r for n in lengths for r in range(n.bit_length()) if n >> r & 1}
    if len(bits) >= len(lengths):
        return pieces
    out = []
    for ps in pieces:
        p = ps[0] if len(ps) == 1 else None
        if p is None or p.src is None or p.length not in lengths:
            out.append(ps)
            continue
        parts: list[Piece | None] = []
        start = p.start
        for r in range(p.length.bit_length()):
            if p.length >> r & 1:
                parts.append(Piece(p.row, start, 1 << r, p.src, p.dst))
                start += 1 << r
            else:
                parts.append(None)
        out.append(parts)
    return out


def _padding_groups(group: list[Piece]) -> list[list[Piece]]:
    """Fresh pieces of many lengths in as few left-padded forwards as pays: sorted by length, cut where
    the padding saved is worth more than a forward (``FORWARD_COST_TOKENS``); the least total of
    ``rows x longest`` tokens plus that cost per forward, by dynamic programming over the sorted
    lengths (a group of a forward is a run of them)."""
    if len(group) < 2:
        return [group]
    ps = sorted(group, key=lambda p: p.length)
    n = len(ps)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            cost = best[j] + (i - j) * ps[i - 1].length + FORWARD_COST_TOKENS
            if cost < best[i]:
                best[i], cut[i] = cost, j
    out, i = [], n
    while i:
        out.append(ps[cut[i] : i])
        i = cut[i]
    return out[::-1]

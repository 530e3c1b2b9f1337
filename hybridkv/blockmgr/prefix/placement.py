"""Checkpoint placement: where the configured policy wants a request's state kept (the grids,
the gaps, the branch point), and the deepest checkpoint on a chain. The rules themselves are plain
functions in :mod:`~hybridkv.blockmgr.prefix.placement_rules`."""

from __future__ import annotations

import functools

import numpy as np

from hybridkv.blockmgr.prefix.config import CheckpointPolicy, checkpoint_rules
from hybridkv.blockmgr.prefix.index import ChainIndex
from hybridkv.blockmgr.prefix.placement_rules import (
    CheckpointRules,
    back_off_points,
    spaced_grids,
    spaced_positions,
)


class CheckpointPlacement(ChainIndex):
    """Where the checkpoint policy wants state kept."""

    @functools.cached_property
    def rules(self) -> CheckpointRules:
        """The policy's answers beyond its positions (stops, retention, twins, queue order, exports)."""
        return checkpoint_rules(self.config.checkpoint)

    @functools.cached_property
    def checkpoint_tokens(self) -> float:
        """A checkpoint's bytes in tokens of KV: the model's state bytes / its KV bytes per token
        (a property of the model, not of the layout's block size)."""
        model = self.host.layout.model
        return model.state_bytes / max(model.kv_bytes_per_token, 1)

    @functools.cached_property
    def min_gap(self) -> int:
        """``branch_spaced``'s minimum spacing in tokens (independent of the layout's block size):
        ``gap_fraction`` of a checkpoint's bytes in KV tokens, scaled by the device's share of the
        cache's capacity when a host tier holds evicted units too (a checkpoint's bytes are weighed
        against device and host blocks together: MiniMax-M1 TP8 64 GiB + 256 GiB of host spaces
        checkpoints 1/5 as far apart)."""
        cfg = self.config
        if cfg.min_gap_tokens is not None:
            return cfg.min_gap_tokens
        gap = cfg.gap_fraction * self.checkpoint_tokens
        if self.tier is not None:
            device = self.host.pool.num_usable
            gap *= device / (device + self.tier.pool.num_blocks)
        return int(gap)

    @functools.cached_property
    def spaced_grids(self) -> tuple[int, ...]:
        """``branch_spaced``'s back-off grids in tokens (configured, or derived from bytes)."""
        return self.config.spaced_align_tokens or spaced_grids(self.checkpoint_tokens)

    @property
    def spaces_checkpoints(self) -> bool:
        """Whether the policy needs the deepest checkpoint below a position (``below``)."""
        return self.config.checkpoint is CheckpointPolicy.BRANCH_SPACED

    @property
    def aligns_chunks(self) -> bool:
        """Whether prefill chunks must end on block boundaries (:attr:`CheckpointRules.aligns_chunks`:
        the state is kept only where a forward ends, so a chunk that is not the input's last ends on
        a boundary)."""
        return self.rules.aligns_chunks

    def exported_checkpoint(self, start: int, end: int, input_len: int) -> int | None:
        """A policy that exports one position per chunk, with ``export_alignment``: the position
        inside the chunk ``[start, end)`` whose state the prefill kernel exports, or None (always,
        for a policy that exports every wanted position on the grid: :meth:`export_positions`)."""
        grid = self.config.export_alignment
        if grid is None or not self.host.num_state_groups:
            return None
        return self.rules.exported_checkpoint(start, end, input_len, self.block_size, grid)

    def export_positions(self, start: int, end: int, input_len: int, branch: int, below: int = 0) -> tuple[int, ...]:
        """The positions strictly inside the chunk ``[start, end)`` whose states the prefill kernel
        writes into sets reserved with the chunk, ascending (empty when the layers' kernels export
        nothing: ``export_alignment`` None). A policy that exports one per chunk
        (:attr:`CheckpointRules.exports_all` False): the one of :meth:`exported_checkpoint`; the
        others: each position they want a checkpoint at on the kernel's grid, so a chunk
        ends early only at a wanted position off that grid (a prompt run whole loses those).
        ``below``: as for :meth:`wants_checkpoint` (each position found is the one below the next)."""
        grid = self.config.export_alignment
        if grid is None or not self.host.num_state_groups:
            return ()
        if not self.rules.exports_all:
            p = self.exported_checkpoint(start, end, input_len)
            return () if p is None else (p,)
        out: list[int] = []
        pos = self.next_checkpoint(start, input_len, branch, below)
        while pos is not None and pos < end:
            if pos % grid == 0:
                out.append(pos)
                below = pos
            # (off the grid: a chunked prefill ends there, :meth:`prefill_stop`; a prompt run whole
            # passes it, and the next position keeps its gap from the last one exported)
            pos = self.next_checkpoint(pos, input_len, branch, below)
        return tuple(out)

    def prefill_stop(self, start: int, end: int, input_len: int, branch: int, below: int = 0) -> int:
        """Where a prefill chunk ``[start, end)`` ends for a checkpoint: the first position inside it the
        policy wants a checkpoint at that :meth:`export_positions` does not write, else ``end``."""
        exported = self.export_positions(start, end, input_len, branch, below)
        pos = self.next_checkpoint(start, input_len, branch, below)
        while pos is not None and pos < end:
            if pos not in exported:
                return pos
            pos = self.next_checkpoint(pos, input_len, branch, pos)
        return end

    def planned_checkpoints(self, input_len: int, branch: int, below: int) -> list[int]:
        """``branch_spaced``: the input positions it checkpoints above ``below`` (the deepest
        checkpoint on the request's chain), ascending."""
        return spaced_positions(input_len, branch, below, self.block_size, self.spaced_grids, self.min_gap)

    def wants_checkpoint(self, position: int, input_len: int, branch: int, final: bool = False, below: int = 0) -> bool:
        """Whether the policy checkpoints at ``position`` of an input of ``input_len`` tokens that
        left the cached prefixes at ``branch`` (block-aligned positions only). ``final``: the
        position is the last block boundary of a finishing request's tokens, reply included (a later
        turn that repeats the conversation hits there): ``branch_and_last``, ``branch_last_aligned``
        and ``branch_spaced`` take it, ``every_n_blocks`` only on its grid. ``below``: the deepest
        checkpoint on the request's chain below ``position`` (``branch_spaced`` keeps its gap from it)."""
        cfg, bs = self.config, self.block_size
        if position <= 0 or position % bs or not self.host.num_state_groups:
            return False
        if cfg.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS:
            return (position // bs) % cfg.every_n == 0
        if self.rules.holds_chunk_end_state:
            return True  # every block boundary a forward ends on
        wanted = self._wanted_positions(input_len, branch, below)
        return wanted is not None and (final or position in wanted)

    def retains_checkpoint(self, position: int, input_len: int, branch: int) -> bool:
        """Whether a checkpoint the policy takes at ``position`` stays matchable once its forward
        ran (:meth:`CheckpointRules.retains`): hybridkv's policies keep what they take; a policy that
        holds the state of every block boundary a forward ends on may keep only some matchable (the
        others are transient: their blocks are free again once the copy into them ran)."""
        return self.rules.retains(position, input_len, branch, self.block_size)

    def _wanted_positions(self, input_len: int, branch: int, below: int) -> set[int] | None:
        """The input positions the policy checkpoints (None: ``none``, and ``every_n_blocks``, whose
        grid has no end): the one place each policy's positions are named."""
        cfg, bs = self.config, self.block_size
        if cfg.checkpoint is CheckpointPolicy.BRANCH_AND_LAST:
            return {branch, (input_len // bs) * bs}
        if cfg.checkpoint is CheckpointPolicy.BRANCH_LAST_ALIGNED:
            return {branch, *back_off_points(input_len, branch, bs, cfg.align_tokens)}
        if cfg.checkpoint is CheckpointPolicy.BRANCH_SPACED:
            return set(self.planned_checkpoints(input_len, branch, below))
        return None

    def next_checkpoint(self, num_tokens: int, input_len: int, branch: int, below: int = 0) -> int | None:
        """The first position ``p`` with ``num_tokens < p <= input_len`` (on the block grid past
        ``num_tokens``'s block) where :meth:`wants_checkpoint` is true, or None; computed from the
        policy's positions, not by asking at every block. ``below``: as for :meth:`wants_checkpoint`."""
        cfg, bs = self.config, self.block_size
        lo = (num_tokens // bs + 1) * bs
        if lo > input_len or not self.host.num_state_groups:
            return None
        if cfg.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS:
            step = cfg.every_n * bs
            p = -(-lo // step) * step
            return p if p <= input_len else None
        stops = self.rules.stops(num_tokens, input_len, branch, bs)
        if stops is not None:
            return stops[0] if stops else None
        wanted = self._wanted_positions(input_len, branch, below)
        if wanted is None:
            return None
        found = [p for p in wanted if lo <= p <= input_len and p % bs == 0]
        return min(found) if found else None

    def deepest_checkpoint(self, keys: list[int], end: int | None = None) -> int:
        """Token position of the deepest checkpoint among the chain ``keys[:end]`` (0: none)."""
        n = len(keys) if end is None else min(max(end, 0), len(keys))
        if not n or not self._ck_ids:
            return 0
        get, ck = self._slot.get, self._ck
        for i in range(n - 1, max(n - 5, -1), -1):  # the chain's end first (a request's own checkpoint)
            slot = get(keys[i])
            if slot is not None and ck[slot] >= 0:
                return (i + 1) * self.block_size
        n -= 4  # none in the last four blocks
        if n <= 0:
            return 0
        slots = self._chain_slots(keys)[:n]
        held = ((slots >= 0) & (self._ck[np.maximum(slots, 0)] >= 0)).nonzero()[0]
        return (int(held[-1]) + 1) * self.block_size if held.size else 0

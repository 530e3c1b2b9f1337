"""A shadow of the device and host pools that checks data, not counts.

Every KV slot holds the hash of the token prefix it was computed from (position ``p`` of a request
holds ``prefix_hash(tokens[: p + 1])``); every block of a state set holds the hash of the prefix its
state summarises, mixed with the set's group and the block's index in the set. Copies, swaps and
forwards move or write these tags exactly as the executor contract says (docs/contract.md); a
request reads its own bytes iff every tag it reads is the one its tokens predict. A copy list in
which a block is both a source and a destination, or a destination appears twice, or the null block
is written, is rejected (on a GPU those run in parallel and race).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr.records import BlockCopies, SwapDirection, SwapPlan

_MASK = (1 << 62) - 1
UNWRITTEN = -1
GARBAGE = -7


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """``h[p]`` = hash of ``tokens[:p]`` (``h[0] = 0``), one per prefix length."""
    out = [0]
    for t in tokens:
        out.append(hash((out[-1], int(t))) & _MASK)
    return out


def state_tag(prefix_hash: int, group: int, index: int) -> int:
    return hash((prefix_hash, group, index, "state")) & _MASK


class Shadow:
    """Tags of every device block (``kv[block, slot]``, ``state[block]``) and host block."""

    def __init__(self, manager) -> None:
        self.m = manager
        n, bs = manager.layout.num_blocks, manager.block_size
        self.kv = np.full((n, bs), UNWRITTEN, dtype=np.int64)
        self.state = np.full(n, UNWRITTEN, dtype=np.int64)
        nh = manager.host_pool.num_blocks if manager.host_pool is not None else 0
        self.host_kv = np.full((nh, bs), UNWRITTEN, dtype=np.int64)
        self.host_state = np.full(nh, UNWRITTEN, dtype=np.int64)

    # ---- moves --------------------------------------------------------------------------------
    def copy(self, copies: BlockCopies) -> None:
        src, dst = np.asarray(copies.src), np.asarray(copies.dst)
        assert src.size == dst.size
        if not src.size:
            return
        assert np.unique(dst).size == dst.size, f"a destination block appears twice: {dst.tolist()}"
        both = np.intersect1d(src, dst)
        assert not both.size, f"blocks {both.tolist()} are both source and destination of one copy list"
        assert not (dst == 0).any(), "a copy writes the null block"
        self.kv[dst] = self.kv[src]
        self.state[dst] = self.state[src]

    def swap(self, plan: SwapPlan) -> None:
        dev, host = plan.device_blocks, plan.host_blocks
        assert np.unique(dev).size == dev.size and np.unique(host).size == host.size
        if plan.direction is SwapDirection.OUT:
            self.host_kv[host] = self.kv[dev]
            self.host_state[host] = self.state[dev]
        else:
            self.kv[dev] = self.host_kv[host]
            self.state[dev] = self.host_state[host]

    def scribble(self, device_blocks: np.ndarray) -> None:
        """A transfer that failed half-way left garbage in its target blocks."""
        self.kv[device_blocks] = GARBAGE
        self.state[device_blocks] = GARBAGE

    # ---- forwards -----------------------------------------------------------------------------
    def _sets(self, sets: np.ndarray):
        mask = self.m._state_mask
        for g in range(sets.shape[0]):
            for j in range(sets.shape[1]):
                if mask[g, j]:
                    yield g, j, int(sets[g, j])

    def write_kv(self, blocks: np.ndarray, hashes: Sequence[int], start: int, end: int) -> None:
        """Positions ``[start, end)`` of a request with block table ``blocks``; ``hashes`` = prefix_hashes."""
        bs = self.m.block_size
        if not self.m._has_kv:
            return
        for p in range(start, end):
            block = int(blocks[p // bs])
            assert block != 0, f"position {p} maps to the null block"
            self.kv[block, p % bs] = hashes[p + 1]

    def write_state(self, sets: np.ndarray, prefix_hash: int) -> None:
        """A state set ``[G, bps]`` now holds the state after the prefix ``prefix_hash``."""
        for g, j, block in self._sets(sets):
            assert block != 0
            self.state[block] = state_tag(prefix_hash, g, j)

    # ---- reads ----------------------------------------------------------------------------------
    def check_kv(self, what: str, blocks: np.ndarray, hashes: Sequence[int], end: int) -> None:
        bs = self.m.block_size
        if not self.m._has_kv:
            return
        for p in range(end):
            got = self.kv[int(blocks[p // bs]), p % bs]
            assert got == hashes[p + 1], f"{what}: KV position {p} in block {int(blocks[p // bs])} holds {got}"

    def check_state(self, what: str, sets: np.ndarray, prefix_hash: int) -> None:
        for g, j, block in self._sets(sets):
            assert self.state[block] == state_tag(prefix_hash, g, j), (
                f"{what}: state group {g} block {j} (id {block}) holds another request's or position's state"
            )

    def check_host(self, what: str, host_blocks: np.ndarray, hashes: Sequence[int], end: int, prefix_hash: int):
        """A swapped request: KV blocks first, then its live sets in set order."""
        bs, nsb = self.m.block_size, self.m.num_state_blocks
        n_kv = host_blocks.size - nsb
        for p in range(end if self.m._has_kv else 0):
            got = self.host_kv[int(host_blocks[p // bs]), p % bs]
            assert got == hashes[p + 1], f"{what}: host KV position {p} holds {got}"
        flat = [
            (g, j)
            for g in range(self.m._state_mask.shape[0])
            for j in range(self.m._state_mask.shape[1])
            if self.m._state_mask[g, j]
        ]
        for i, (g, j) in enumerate(flat):
            assert self.host_state[int(host_blocks[n_kv + i])] == state_tag(prefix_hash, g, j), (
                f"{what}: host state group {g} block {j} differs"
            )

"""Prefix caching for hybrid models: a KV hash chain plus recurrent-state checkpoints.

- KV: every full block of a request's tokens is a :class:`Node` of a hash chain (key = hash of
  the parent key and the block's token ids; token ids are compared on a hit). Blocks are shared by
  reference count; a block whose count drops to zero stays cached (evictable) until evicted.
- State: a **checkpoint** is a state set per state group frozen at a block-aligned position and
  owned by the cache. A hit is the longest prefix ``p`` whose KV blocks are all cached **and** that
  has a checkpoint at exactly ``p``; the request's live sets are then filled by a copy.
- Checkpoint policies (:class:`CheckpointPolicy`) choose the positions; eviction policies
  (:class:`EvictionPolicy`) choose what to drop when the pool runs short.

The cache holds no tensors; the manager runs it (``HybridBlockManager(..., prefix_cache=...)``).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hybridkv.blockmgr.checkpoint_policy import DEFAULT_ALIGN_TOKENS, branch_last_aligned
from hybridkv.blockmgr.flops import flop_coefficients, prefill_flops
from hybridkv.blockmgr.records import BlockUse

if TYPE_CHECKING:
    from hybridkv.blockmgr.manager import HybridBlockManager

ROOT_KEY = 0


class CheckpointPolicy(enum.Enum):
    NONE = "none"  # KV only: hits need a checkpoint, so hybrid models never hit
    EVERY_N_BLOCKS = "every_n_blocks"  # at every n-th block boundary of the input
    BRANCH_AND_LAST = "branch_and_last"  # where a request leaves the cached prefixes, and at its input's end
    BRANCH_LAST_ALIGNED = "branch_last_aligned"  # branch, finished request's end, input end on coarse grids


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    FLOP_AWARE = "flop_aware"  # alpha * normalized FLOPs saved per byte + normalized recency


@dataclass(frozen=True, slots=True)
class PrefixCacheConfig:
    """``every_n``: block interval of ``every_n_blocks``. ``alpha``: weight of FLOP efficiency.
    ``evict_batch_fraction``: each eviction frees at least this fraction of the pool (both
    policies), so flop_aware's ranking of all candidates is paid rarely."""

    checkpoint: CheckpointPolicy = CheckpointPolicy.BRANCH_AND_LAST
    eviction: EvictionPolicy = EvictionPolicy.FLOP_AWARE
    every_n: int = 8
    alpha: float = 1.0
    evict_batch_fraction: float = 0.01
    align_tokens: tuple[int, ...] = DEFAULT_ALIGN_TOKENS  # branch_last_aligned: back-off grids, finest first

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", CheckpointPolicy(self.checkpoint))
        object.__setattr__(self, "eviction", EvictionPolicy(self.eviction))
        align = (self.align_tokens,) if isinstance(self.align_tokens, int) else tuple(self.align_tokens)
        if not align or any(not isinstance(a, int) or a <= 0 for a in align):
            raise ValueError(f"align_tokens must be positive numbers of tokens, got {self.align_tokens!r}")
        object.__setattr__(self, "align_tokens", align)
        if self.every_n <= 0:
            raise ValueError(f"every_n must be a positive number of blocks, got {self.every_n}")


@dataclass(slots=True, eq=False)
class Node:
    """One full block of a cached token sequence: ends at token ``position``."""

    key: int
    tokens: tuple[int, ...]
    position: int
    kv_block: int = 0  # 0: no KV block cached for it
    checkpoint: np.ndarray | None = None  # flat block ids of the state sets at ``position``
    kv_tick: int = 0
    ckpt_tick: int = 0
    ckpt_flops_per_byte: float = 0.0
    kv_flops_per_byte: float = 0.0


class PrefixHit(NamedTuple):
    num_tokens: int  # tokens served from the cache (0 = miss)
    nodes: list[Node]  # the chain of the hit, one node per block below num_tokens (KV models)
    checkpoint: Node | None  # node holding the checkpoint at num_tokens
    num_matched_tokens: int  # tokens whose KV blocks are cached (>= num_tokens): the branch point
    keys: list[int] = []  # chain keys of the blocks below num_tokens


def chain(
    token_ids: Sequence[int], block_size: int, start: int = 0, end: int | None = None, key: int = ROOT_KEY
) -> Iterator[tuple[int, tuple[int, ...], int]]:
    """``(block index, its token ids, chain key)`` of the full blocks ``[start, end)`` of ``token_ids``;
    ``key`` is the chain key of block ``start - 1``. The hash-chain rule (``PrefixCache.register``
    inlines the same rule for speed; ``test_prefix`` checks the two agree)."""
    end = len(token_ids) // block_size if end is None else end
    for j in range(start, end):
        tokens = tuple(token_ids[j * block_size : (j + 1) * block_size])
        key = hash((key, tokens))
        yield j, tokens, key


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hash-chain keys of all full blocks of ``token_ids``."""
    return [key for _, _, key in chain(token_ids, block_size)]


@dataclass(slots=True)
class _Counters:
    hit_tokens: int = 0
    checkpoints_made: int = 0
    checkpoints_evicted: int = 0
    kv_evicted: int = 0


class PrefixCache:
    """The cache's books; all block movements go through the manager's pool and ``use`` bytes."""

    def __init__(self, manager: HybridBlockManager, config: PrefixCacheConfig | None = None) -> None:
        self.m = manager
        self.config = config or PrefixCacheConfig()
        self.block_size = manager.block_size
        self.nodes: dict[int, Node] = {}
        self.block_node: dict[int, Node] = {}  # cached KV block id -> node
        self._evictable_kv: OrderedDict[int, Node] = OrderedDict()  # block id -> node, LRU order
        self._checkpoints: OrderedDict[int, Node] = OrderedDict()  # node key -> node, LRU order
        self._tick = 0
        self.stats = _Counters()
        # keys of checkpoints a pending copy reads (a hit) or writes (a new checkpoint), with the
        # manager's pin epoch: evicting one before the executor ran the copy would hand its blocks
        # to another writer
        self.pinned: dict[int, int] = {}
        # state-only models: chain nodes that hold nothing (they mark where cached prefixes go, for
        # branch points), least recently used first, at most _bare_cap of them
        self._bare: OrderedDict[int, Node] = OrderedDict()
        self._bare_cap = max(1024, 4 * manager.pool.num_usable)
        model, layout = manager.layout.model, manager.layout
        self._ckpt_bytes = manager.num_state_blocks * layout.bytes_per_block
        self._flops = flop_coefficients(model)
        # per-block mirrors of the evictable KV set, so flop_aware ranks candidates in numpy
        self._kv_evictable = np.zeros(layout.num_blocks, dtype=bool)
        self._kv_tick = np.zeros(layout.num_blocks, dtype=np.int64)
        self._kv_fpb = np.zeros(layout.num_blocks, dtype=np.float64)
        # the same for checkpoints, indexed by each checkpoint's first block id (its slot): tick and
        # FLOPs per byte of the live ones, so flop_aware ranks them without walking Python objects
        self._ck_live = np.zeros(layout.num_blocks, dtype=bool)
        self._ck_tick = np.zeros(layout.num_blocks, dtype=np.int64)
        self._ck_fpb = np.zeros(layout.num_blocks, dtype=np.float64)
        self._ck_node: dict[int, Node] = {}  # slot -> node
        self._bytes_per_block = layout.bytes_per_block

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        """Blocks eviction can free now (checkpoints pinned by this step's copies excluded)."""
        return len(self._evictable_kv) + (len(self._checkpoints) - len(self.pinned)) * self.m.num_state_blocks

    def cancel_checkpoints(self, epoch: int) -> np.ndarray:
        """Drop the checkpoints pinned in ``epoch`` (taken then, their copies not yet handed to an
        executor); returns their block ids (the caller frees them and drops the copies)."""
        keys = [k for k, e in self.pinned.items() if e == epoch]
        parts = []
        for key in keys:
            del self.pinned[key]
            parts.append(self._drop("ckpt", self.nodes[key]))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def release_pins(self, before: int | None = None) -> None:
        """The copies reading or writing checkpoints pinned in epochs ``< before`` (all: None) ran."""
        if before is None:
            self.pinned.clear()
        else:
            self.pinned = {k: e for k, e in self.pinned.items() if e >= before}

    def cached_kv_blocks(self) -> np.ndarray:
        return np.fromiter(self._evictable_kv, dtype=np.int32, count=len(self._evictable_kv))

    def checkpoint_blocks(self) -> np.ndarray:
        if not self._checkpoints:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([n.checkpoint for n in self._checkpoints.values()])  # type: ignore[misc]

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int) -> PrefixHit:
        """The longest hit within ``min(max_tokens, len(token_ids) - 1)`` tokens (one token is
        always left to compute, so the forward has logits to sample)."""
        limit = (len(token_ids) - 1) // self.block_size  # the chain over the whole input: branch point
        max_blocks = min(max(max_tokens, 0), len(token_ids) - 1) // self.block_size
        if not self.m._has_kv:
            return self._match_state_only(token_ids, limit, max_blocks)
        nodes: list[Node] = []
        for _, tokens, key in chain(token_ids, self.block_size, 0, limit):
            node = self.nodes.get(key)
            if node is None or node.tokens != tokens or not node.kv_block:
                break
            nodes.append(node)
        best = 0
        if self.m.num_state_groups == 0:
            best = min(len(nodes), max_blocks)
        else:
            for i in range(min(len(nodes), max_blocks), 0, -1):
                if nodes[i - 1].checkpoint is not None:
                    best = i
                    break
        ckpt = nodes[best - 1] if best and self.m.num_state_groups else None
        hit = nodes[:best]
        return PrefixHit(best * self.block_size, hit, ckpt, len(nodes) * self.block_size, [n.key for n in hit])

    def _match_state_only(self, token_ids: Sequence[int], limit: int, max_blocks: int) -> PrefixHit:
        """No KV: a hit needs only the deepest checkpoint on the request's chain (chain keys hash
        every earlier block, and that block's tokens are compared); the branch point is the deepest
        block any cached chain reached (bare nodes may have been trimmed: an estimate)."""
        keys, blocks = [], []
        for _, tokens, key in chain(token_ids, self.block_size, 0, limit):
            keys.append(key)
            blocks.append(tokens)
        best, matched, ckpt = 0, 0, None
        for i in range(len(keys), 0, -1):
            node = self.nodes.get(keys[i - 1])
            if node is None or node.tokens != blocks[i - 1]:
                continue
            matched = max(matched, i)
            if i <= max_blocks and node.checkpoint is not None:
                best, ckpt = i, node
                break
        return PrefixHit(best * self.block_size, [], ckpt, matched * self.block_size, keys[:best])

    def num_pinned(self, hit: PrefixHit) -> int:
        """Evictable blocks a hit holds on to: the cached KV blocks it takes back (it shares them)
        and, while its copy is made, the one checkpoint it reads (not the others on its chain).
        Admission counts them as taken."""
        ckpt = {hit.checkpoint.key} if hit.checkpoint is not None else set()
        return self.num_protected({n.key for n in hit.nodes}, ckpt)

    def take_hit(self, hit: PrefixHit) -> np.ndarray:
        """Reference the hit's KV blocks (reviving evictable ones); returns them in chain order."""
        now = self._now()
        ids = np.fromiter((n.kv_block for n in hit.nodes), dtype=np.int32, count=len(hit.nodes))
        if not self.m._has_kv:
            ids = ids[:0]
        for n in hit.nodes:
            n.kv_tick = now
            self._evictable_kv.pop(n.kv_block, None)
        self._kv_evictable[ids] = False
        if ids.size:
            self.m.pool.incref(ids)
            self.m.use[ids] = BlockUse.KV
        if hit.checkpoint is not None:
            hit.checkpoint.ckpt_tick = now
            self._ck_tick[hit.checkpoint.checkpoint[0]] = now  # type: ignore[index]
            self._checkpoints.move_to_end(hit.checkpoint.key)
            self.pinned[hit.checkpoint.key] = self.m.pin_epoch
        self.stats.hit_tokens += hit.num_tokens
        return ids

    # ---- registration ------------------------------------------------------------------------
    def register(self, token_ids: Sequence[int], keys: list[int], kv_blocks: np.ndarray, num_tokens: int) -> None:
        """Add the full blocks of ``token_ids[:num_tokens]`` beyond ``len(keys)`` to the chain.

        ``keys`` (the request's chain so far) is extended in place; ``kv_blocks`` are the request's
        KV blocks (empty for state-only models). A block whose node already has a KV block stays
        private to the request (two requests computed the same content).
        """
        start = len(keys)
        end = min(num_tokens, len(token_ids)) // self.block_size
        if start and end > start:
            self.ensure(token_ids, keys, kv_blocks, start - 1)  # a parent to hang the new blocks on
        if not self.m._has_kv:
            for j, tokens, key in chain(token_ids, self.block_size, start, end, keys[-1] if keys else ROOT_KEY):
                keys.append(key)
                self._place(key, tokens, j, kv_blocks)
            return
        # KV models: _place for a run of blocks, inlined (the decode and prefill hot path); the
        # chain rule is chain()'s, and the mirror of FLOPs per byte is written once at the end
        bs, nodes, block_node = self.block_size, self.nodes, self.block_node
        (lin, quad), bpb = self._flops, self._bytes_per_block
        blocks = kv_blocks[start:end].tolist()
        new_blocks: list[int] = []
        new_fpb: list[float] = []
        key = keys[-1] if keys else ROOT_KEY
        span = tuple(token_ids[start * bs : end * bs])  # one copy; slicing a tuple makes each block's in one step
        for j in range(start, end):
            tokens = span[(j - start) * bs : (j - start + 1) * bs]
            key = hash((key, tokens))
            keys.append(key)
            node = nodes.get(key)
            if node is None:
                pos = (j + 1) * bs
                fpb = (lin * bs + quad * (2 * pos - bs) * bs) / bpb
                node = nodes[key] = Node(key, tokens, pos, kv_flops_per_byte=fpb)
            if not node.kv_block:
                block = blocks[j - start]
                if block not in block_node:
                    node.kv_block = block
                    block_node[block] = node
                    new_blocks.append(block)
                    new_fpb.append(node.kv_flops_per_byte)
        if new_blocks:
            self._kv_fpb[new_blocks] = new_fpb

    def ensure(self, token_ids: Sequence[int], keys: list[int], kv_blocks: np.ndarray, j: int) -> Node:
        """The node of block ``j`` of a request's chain, re-created with any missing ancestors.

        A request whose block duplicated a cached one keeps a private copy; if the cached copy is
        later evicted, its node goes, and the request's own block takes its place here.
        """
        node = self.nodes.get(keys[j])
        if node is not None:
            return node
        i = j
        while i > 0 and self.m._has_kv and keys[i - 1] not in self.nodes:  # state-only: no chain needed
            i -= 1
        for t in range(i, j + 1):
            tokens = tuple(token_ids[t * self.block_size : (t + 1) * self.block_size])
            node = self._place(keys[t], tokens, t, kv_blocks)
        return node

    def _place(self, key: int, tokens: tuple[int, ...], j: int, kv_blocks: np.ndarray) -> Node:
        """Node ``key`` (created if new); block ``j`` of the request becomes its KV if it has none."""
        node = self.nodes.get(key)
        if node is None:
            node = Node(key, tokens, (j + 1) * self.block_size)
            (lin, quad), bs, pos = self._flops, self.block_size, node.position
            # FLOPs of this block's tokens, per byte of one block
            node.kv_flops_per_byte = (lin * bs + quad * (2 * pos - bs) * bs) / self._bytes_per_block
            self.nodes[key] = node
        if self.m._has_kv:
            if not node.kv_block and int(kv_blocks[j]) not in self.block_node:
                block = node.kv_block = int(kv_blocks[j])
                self.block_node[block] = node
                self._kv_fpb[block] = node.kv_flops_per_byte
        elif node.checkpoint is None:  # a bare node of a state-only model: bounded, LRU
            self._bare[key] = node
            self._bare.move_to_end(key)
            while len(self._bare) > self._bare_cap:
                old, _ = self._bare.popitem(last=False)
                del self.nodes[old]
        return node

    def release(self, ids: np.ndarray) -> np.ndarray:
        """KV blocks whose count reached zero: cached ones become evictable; returns the rest."""
        if not self.block_node or ids.size == 0:
            return ids
        now = self._now()
        keep = np.fromiter((i in self.block_node for i in ids.tolist()), dtype=bool, count=ids.size)
        kept = ids[keep]
        # a request's blocks come in chain order; queue the tail first, so that among blocks
        # released together LRU takes a chain's end before its root (which would orphan the rest)
        for i in kept[::-1].tolist():
            self._evictable_kv[i] = self.block_node[i]
            self.block_node[i].kv_tick = now
        self.m.use[kept] = BlockUse.CACHED_KV
        self._kv_evictable[kept] = True
        self._kv_tick[kept] = now
        return ids[~keep]

    def wants_checkpoint(self, position: int, input_len: int, branch: int, final: bool = False) -> bool:
        """Whether the policy checkpoints at ``position`` of an input of ``input_len`` tokens that
        left the cached prefixes at ``branch`` (block-aligned positions only). ``final``: the
        position is the last block boundary of a finishing request's tokens, reply included (a later
        turn that repeats the conversation hits there): ``branch_and_last`` and
        ``branch_last_aligned`` take it, ``every_n_blocks`` only on its grid."""
        cfg, bs = self.config, self.block_size
        if position <= 0 or position % bs or not self.m.num_state_groups:
            return False
        if cfg.checkpoint is CheckpointPolicy.EVERY_N_BLOCKS:
            return (position // bs) % cfg.every_n == 0
        if cfg.checkpoint is CheckpointPolicy.BRANCH_LAST_ALIGNED:
            return final or branch_last_aligned(position, input_len, branch, bs, cfg.align_tokens)
        if cfg.checkpoint is CheckpointPolicy.BRANCH_AND_LAST:
            return final or position == branch or position == (input_len // bs) * bs
        return False

    def has_checkpoint(self, key: int) -> bool:
        node = self.nodes.get(key)
        return node is not None and node.checkpoint is not None

    def add_checkpoint(self, node: Node, blocks: np.ndarray) -> None:
        assert node.checkpoint is None and self.nodes.get(node.key) is node
        key = node.key
        node.checkpoint = blocks
        node.ckpt_tick = self._now()
        node.ckpt_flops_per_byte = prefill_flops(self._flops, node.position) / self._ckpt_bytes
        self._checkpoints[key] = node
        slot = int(blocks[0])
        self._ck_live[slot] = True
        self._ck_tick[slot] = node.ckpt_tick
        self._ck_fpb[slot] = node.ckpt_flops_per_byte
        self._ck_node[slot] = node
        self._bare.pop(key, None)
        self.pinned[key] = self.m.pin_epoch
        self.m.use[blocks] = BlockUse.CHECKPOINT
        self.stats.checkpoints_made += 1

    def check(self) -> list[str]:
        """Problems with the cache's own books (mirrors, child counts); used by ``check_integrity``."""
        problems = []
        evictable = np.zeros_like(self._kv_evictable)
        evictable[self.cached_kv_blocks()] = True
        if not np.array_equal(evictable, self._kv_evictable):
            problems.append("the prefix cache's evictable-KV mirror differs from its evictable set")
        for node in self.nodes.values():
            if node.kv_block and self.block_node.get(node.kv_block) is not node:
                problems.append(f"cached KV block {node.kv_block} is not mapped to its node")
            if not node.kv_block and node.checkpoint is None and node.key not in self._bare:
                problems.append(f"chain node {node.key} holds nothing and is not bounded (leak)")
        if len(self._bare) > self._bare_cap or any(n.kv_block or n.checkpoint is not None for n in self._bare.values()):
            problems.append("bare chain nodes over their bound or holding blocks")
        if any(k not in self._checkpoints for k in self.pinned):
            problems.append("a pinned key has no checkpoint")
        slots = {int(n.checkpoint[0]): n for n in self._checkpoints.values()}  # type: ignore[index]
        live = np.zeros_like(self._ck_live)
        live[list(slots)] = True
        if slots != self._ck_node or not np.array_equal(live, self._ck_live):
            problems.append("the prefix cache's checkpoint mirror differs from its checkpoints")
        elif any(self._ck_tick[s] != n.ckpt_tick or self._ck_fpb[s] != n.ckpt_flops_per_byte for s, n in slots.items()):
            problems.append("the prefix cache's checkpoint mirror holds stale ticks or FLOPs")
        return problems

    # ---- eviction ----------------------------------------------------------------------------
    def evict(
        self,
        num_blocks: int,
        protect: set[int] = frozenset(),  # type: ignore[assignment]
        protect_ckpt: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> np.ndarray:
        """Evict units until at least ``num_blocks`` blocks are freed; returns the freed ids.

        ``protect``: node keys whose KV blocks stay (the hit being taken); ``protect_ckpt``: node
        keys whose checkpoints stay. The caller has checked that enough is evictable.
        """
        if num_blocks <= 0:
            return np.empty(0, dtype=np.int32)
        target = max(num_blocks, int(self.config.evict_batch_fraction * self.m.pool.num_usable))
        target = max(num_blocks, min(target, self.num_evictable - self.num_protected(protect, protect_ckpt)))
        if self.config.eviction is EvictionPolicy.LRU:
            victims = self._lru_victims(target, protect, protect_ckpt)
        else:
            victims = self._flop_aware_victims(target, protect, protect_ckpt)
        ids = self._drop_all(victims)
        self.m.pool.ref_counts[ids] = 0
        self.m.use[ids] = BlockUse.FREE
        return ids

    def _drop_all(self, victims: list[tuple[str, Node]]) -> np.ndarray:
        """:meth:`_drop` of every victim, the per-block work on KV blocks batched; the freed ids."""
        kv: list[int] = []
        parts: list[np.ndarray] = []
        evictable, block_node, nodes, bare = self._evictable_kv, self.block_node, self.nodes, self._bare
        for kind, node in victims:
            if kind == "kv":
                block = node.kv_block
                del evictable[block]
                del block_node[block]
                node.kv_block = 0
                kv.append(block)
            else:
                parts.append(self._drop(kind, node))
                continue  # _drop dropped the node if it holds nothing now
            if node.checkpoint is None:
                nodes.pop(node.key, None)
                if bare:
                    bare.pop(node.key, None)
        self._kv_evictable[kv] = False
        self.stats.kv_evicted += len(kv)
        return np.concatenate([np.array(kv, dtype=np.int32), *parts])

    def _drop(self, kind: str, node: Node) -> np.ndarray:
        if kind == "kv":
            block = node.kv_block
            del self._evictable_kv[block]
            del self.block_node[block]
            self._kv_evictable[block] = False
            node.kv_block = 0
            self.stats.kv_evicted += 1
            ids = np.array([block], dtype=np.int32)
        else:
            del self._checkpoints[node.key]
            ids, node.checkpoint = node.checkpoint, None  # type: ignore[assignment]
            slot = int(ids[0])
            self._ck_live[slot] = False
            del self._ck_node[slot]
            self.stats.checkpoints_evicted += 1
        if not node.kv_block and node.checkpoint is None:
            self.nodes.pop(node.key, None)
            self._bare.pop(node.key, None)
        return ids

    def _lru_victims(self, num_blocks: int, protect: set[int], protect_ckpt: set[int]) -> list[tuple[str, Node]]:
        kv_iter = iter(self._evictable_kv.values())  # oldest first; nothing changes while we look
        ck_iter = iter(self._checkpoints.values())
        kv_next, ck_next = next(kv_iter, None), next(ck_iter, None)
        victims: list[tuple[str, Node]] = []
        got = 0
        while got < num_blocks and (kv_next is not None or ck_next is not None):
            take_kv = ck_next is None or (kv_next is not None and kv_next.kv_tick <= ck_next.ckpt_tick)
            if take_kv:
                node, kv_next = kv_next, next(kv_iter, None)
                if node.key not in protect:
                    victims.append(("kv", node))
                    got += 1
            else:
                node, ck_next = ck_next, next(ck_iter, None)
                if node.key not in protect_ckpt and node.key not in self.pinned:
                    victims.append(("ckpt", node))
                    got += self.m.num_state_blocks
        return victims

    def num_protected(self, protect: set[int], protect_ckpt: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Evictable blocks that ``evict(..., protect, protect_ckpt)`` may not take."""
        n = 0
        for key in protect:
            node = self.nodes.get(key)
            if node is not None:
                n += node.kv_block in self._evictable_kv
        for key in protect_ckpt:
            node = self.nodes.get(key)
            if node is not None and node.checkpoint is not None and key not in self.pinned:
                n += self.m.num_state_blocks
        return n

    def _flop_aware_victims(self, target: int, protect: set[int], protect_ckpt: set[int]) -> list[tuple[str, Node]]:
        """Lowest utility first: ``alpha * norm(log1p(FLOPs saved per byte)) + norm(recency)`` over
        all candidates. A checkpoint saves the FLOPs of the prefix it ends, a KV block those of its
        own tokens; FLOPs per byte spans orders of magnitude, so it is compared on a log scale."""
        mask = self._kv_evictable
        kept = [n.kv_block for k in protect if (n := self.nodes.get(k)) is not None and n.kv_block]
        if kept:
            mask = mask.copy()
            mask[kept] = False
        kv_ids = np.flatnonzero(mask)
        # checkpoints in LRU order (ascending tick: both ways of moving one to the end set a new tick)
        held = [n.checkpoint[0] for k in (*protect_ckpt, *self.pinned) if (n := self.nodes.get(k)) is not None
                and n.checkpoint is not None]  # fmt: skip
        if held:
            ck_mask = self._ck_live.copy()
            ck_mask[held] = False
            slots = np.flatnonzero(ck_mask)
        else:
            slots = np.flatnonzero(self._ck_live)
        slots = slots[np.argsort(self._ck_tick[slots], kind="stable")]
        fpb = np.concatenate((self._kv_fpb[kv_ids], self._ck_fpb[slots]))
        if not fpb.size:
            return []
        tick = np.concatenate((self._kv_tick[kv_ids], self._ck_tick[slots])).astype(np.float64)
        size = np.concatenate((np.ones(kv_ids.size, dtype=np.int64), np.full(slots.size, self.m.num_state_blocks)))

        def norm(x: np.ndarray) -> np.ndarray:
            span = x.max() - x.min()
            return (x - x.min()) / span if span > 0 else np.zeros_like(x)

        utility = self.config.alpha * norm(np.log1p(fpb)) + norm(tick)
        # the victims are a prefix of the stable order by utility, at most ``target`` candidates
        # long (each frees >= 1 block): rank only the candidates at or below the target-th utility
        # (ties included, in index order), which is that prefix exactly
        k = min(utility.size, target)
        if k < utility.size:
            near = np.flatnonzero(utility <= np.partition(utility, k - 1)[k - 1])
            order = near[np.argsort(utility[near], kind="stable")]
        else:
            order = np.argsort(utility, kind="stable")
        count = int(np.searchsorted(np.cumsum(size[order]), target)) + 1
        chosen, n_kv = order[:count], kv_ids.size
        block_node, ck_node = self.block_node, self._ck_node
        kv = [("kv", block_node[b]) for b in kv_ids[chosen[chosen < n_kv]].tolist()]
        ck = [("ckpt", ck_node[s]) for s in slots[chosen[chosen >= n_kv] - n_kv].tolist()]
        return kv + ck

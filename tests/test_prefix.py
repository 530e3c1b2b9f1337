"""Prefix caching: KV hash chain + state checkpoints, scenarios and a property test."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig, chain_keys
from hybridkv.models.flops import prefill_flops
from hybridkv.planner.layout import plan

from .manager_fixtures import tiny_model


def cached_manager(num_blocks=80, checkpoint="every_n_blocks", every_n=1, eviction="lru"):
    layout = plan(tiny_model(), num_blocks * 256, block_size=4)
    config = PrefixCacheConfig(CheckpointPolicy(checkpoint), EvictionPolicy(eviction), every_n=every_n)
    return HybridBlockManager(layout, num_host_blocks=20, prefix_cache=config)


def prefill(m, rid, tokens, num_tokens=None, mark=False):
    """Admit and 'compute' a request block by block, checkpointing where the policy wants
    (``mark``: :meth:`mark_computed` registers the blocks first, as an engine without checkpoints may)."""
    alloc = m.allocate(rid, num_tokens or alloc_tokens(m, tokens), token_ids=tokens)
    if mark:
        m.mark_computed(rid, m.requests[rid].num_tokens)
    m.checkpoint(rid)
    while m.requests[rid].num_tokens < len(tokens):
        m.release_pins()  # the forward ran the step's copies
        step = min(4, len(tokens) - m.requests[rid].num_tokens)
        m.append(rid, step)
        if mark:
            m.mark_computed(rid, m.requests[rid].num_tokens)
        m.checkpoint(rid)
    m.release_pins()
    return alloc


def alloc_tokens(m, tokens):
    hit = m.match_prefix(tokens)
    return hit + min(4, len(tokens) - hit)


PREFIX = list(range(100, 112))  # 3 blocks of 4 tokens
_EMPTY_IDS = np.empty(0, dtype=np.int32)


def test_shared_three_blocks_hit_at_three_blocks_with_a_checkpoint():
    m = cached_manager()  # checkpoint at every block
    prefill(m, "a", PREFIX + [1, 2, 3, 4, 5])
    m.free("a")
    m.check_integrity()
    tokens_b = PREFIX + [7, 8, 9]
    assert m.match_prefix(tokens_b) == 12
    alloc = m.allocate("b", 14, token_ids=tokens_b)
    assert alloc.num_cached_tokens == 12
    assert len(alloc.copies) == m.num_state_blocks  # checkpoint -> live set
    assert set(alloc.copies.dst.tolist()) == set(m.state_table(["b"]).ravel().tolist())
    kv_b = m.block_table(["b"])[0]
    assert m.usage().kv_cached > 0
    m.check_integrity()
    m.free("b")
    # the three shared KV blocks are the ones a cached
    m.allocate("c", 13, token_ids=PREFIX + [0, 0])
    assert m.block_table(["c"])[0][:3].tolist() == kv_b[:3].tolist()


def test_hit_falls_back_to_the_nearest_lower_checkpoint():
    m = cached_manager(every_n=2)  # checkpoints at 8 and 16 tokens only
    prefill(m, "a", PREFIX + [1, 2, 3, 4, 5])
    m.free("a")
    alloc = m.allocate("b", 14, token_ids=PREFIX + [7, 8, 9])
    assert alloc.num_cached_tokens == 8  # 3 blocks of KV cached, the checkpoint sits at 2 blocks
    assert m.requests["b"].num_kv_blocks == 4  # 2 shared + 2 new
    m.check_integrity()


def test_no_checkpoint_policy_never_hits_a_hybrid_model():
    m = cached_manager(checkpoint="none")
    prefill(m, "a", PREFIX + [1])
    m.free("a")
    assert m.match_prefix(PREFIX + [2]) == 0
    assert m.usage().checkpoints == 0 and m.usage().kv_cached == 3


def test_a_prompt_shorter_than_one_block_never_hits():
    m = cached_manager()
    prefill(m, "a", [5, 6, 7])
    m.free("a")
    assert m.match_prefix([5, 6, 7]) == 0
    prefill(m, "b", [5, 6, 7, 8])  # exactly one block: one token must stay to compute
    m.free("b")
    assert m.match_prefix([5, 6, 7, 8]) == 0
    assert m.match_prefix([5, 6, 7, 8, 9]) == 4


def test_two_hits_on_one_checkpoint_get_private_live_sets():
    m = cached_manager()
    prefill(m, "a", PREFIX + [1])
    m.free("a")
    a1 = m.allocate("b", 13, token_ids=PREFIX + [2])
    a2 = m.allocate("c", 13, token_ids=PREFIX + [3])
    assert a1.copies.src.tolist() == a2.copies.src.tolist()  # one checkpoint read twice
    live_b, live_c = set(m.state_table(["b"]).ravel()), set(m.state_table(["c"]).ravel())
    assert not live_b & live_c and not live_b & set(a1.copies.src.tolist())
    kv_b, kv_c = m.block_table(["b"])[0], m.block_table(["c"])[0]
    assert kv_b[:3].tolist() == kv_c[:3].tolist() and kv_b[3] != kv_c[3]  # writes go to private blocks
    fork_copies = m.fork("b", "d")
    assert not set(fork_copies.dst.tolist()) & live_b
    m.check_integrity()


def test_eviction_frees_cached_blocks_for_new_requests():
    m = cached_manager(num_blocks=40)
    prefill(m, "a", PREFIX + [1, 2, 3, 4, 5])
    m.free("a")
    u = m.usage()
    assert u.kv_cached == 4 and u.checkpoints == 4 * 6 and u.free == 39 - 28
    assert m.can_allocate(40)  # 10 KV + 6 state = 16 > 11 free, but 28 are evictable
    m.allocate("big", 40, token_ids=list(range(40)))
    m.check_integrity()
    assert m.prefix_cache.stats.checkpoints_evicted >= 1


def test_lru_cuts_a_released_chain_from_its_end():
    """Evicting the first block of a cached chain would orphan the rest: LRU takes the deepest first
    among blocks released together."""
    m = cached_manager(num_blocks=40, checkpoint="none", eviction="lru")
    prefill(m, "a", PREFIX + [1])
    chain = m.block_table(["a"])[0][:3].tolist()
    m.free("a")
    assert m.usage().kv_cached == 3
    freed = m.prefix_cache.evict(1)
    m.pool.free(freed)
    assert freed.tolist() == [chain[2]]
    # policy none: no hit, but the KV chain above the evicted leaf is intact
    assert m.prefix_cache.match(PREFIX[:8] + [0], 9).num_matched_tokens == 8
    m.check_integrity()


@pytest.mark.parametrize("mark", [False, True], ids=["checkpoint", "mark_computed"])
def test_a_recomputed_prefix_keeps_its_root_as_recent_as_its_new_checkpoints(mark):
    """Request b matches a's cached first block but no checkpoint there, so it computes that block
    again into a block of its own and leaves checkpoints above it. Its copy replaces a's evictable
    one on the chain's node: evicting a's units (the oldest) must not take b's root and orphan b's
    fresh checkpoints (it did when a's copy stayed on the node at its old place in the LRU queue)."""
    m = cached_manager(num_blocks=80, checkpoint="branch_and_last", eviction="lru")
    x = list(range(100, 108))  # 2 blocks of 4 tokens
    prefill(m, "a", x + [1])  # checkpoint at 8 (its last block boundary)
    m.free("a")
    prefill(m, "c", list(range(500, 509)))  # released between a and b
    m.free("c")
    b = x[:4] + [7] * 5
    assert m.match_prefix(b) == 0  # a's block 0 is cached, but a checkpoint only at 8
    prefill(m, "b", b, mark=mark)  # checkpoints at its branch (4) and its last boundary (8)
    m.free("b")
    d = b[:8] + [9]
    assert m.match_prefix(d) == 8
    m.pool.free(m.prefix_cache.evict(8))  # a's two KV blocks and its checkpoint (6 blocks)
    m.check_integrity()
    assert m.match_prefix(d) == 8


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
@pytest.mark.parametrize("checkpoint", ["every_n_blocks", "branch_and_last"])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_shared_prefixes_keep_integrity_and_exact_checkpoints(eviction, checkpoint, data):
    """Fake compute: each live-set block holds hash(tokens so far); checkpoints must match exactly."""
    m = cached_manager(num_blocks=data.draw(st.integers(30, 90)), checkpoint=checkpoint, every_n=2, eviction=eviction)
    content = np.zeros(m.layout.num_blocks, dtype=object)  # fake block contents

    def write_state(rid):
        rec = m.requests[rid]
        content[m.state_table([rid]).ravel()] = hash(tuple(rec.token_ids[: rec.num_tokens]))

    # copies of the current step, in the executor's two batches (StepPlan): checkpoints taken after
    # the last forward first, then this step's copies (prefix hits, copy-on-write)
    checkpoints, pending = [], []

    def run(copies, batch=pending):
        batch.append(copies)

    def flush():
        """Run each batch as one unordered launch: no block written twice, none read and written."""
        for batch in (checkpoints, pending):
            if batch:
                src = np.concatenate([c.src for c in batch])
                dst = np.concatenate([c.dst for c in batch])
                assert np.unique(dst).size == dst.size, "a block is written twice in one batch"
                assert not set(src.tolist()) & set(dst.tolist()), "a block is read and written in one batch"
                content[dst] = content[src]
                batch.clear()
        m.release_pins()
        for node in m.prefix_cache.nodes.values():  # every checkpoint holds exactly its prefix
            if node.checkpoint is not None:
                assert set(content[node.checkpoint]) == {hash(prefixes[node.key])}

    prefixes = {}  # chain key -> the token prefix it names
    stems = [[s * 10 + i for i in range(data.draw(st.integers(2, 14)))] for s in range(3)]
    running = []
    for step in range(data.draw(st.integers(3, 14))):
        if running and data.draw(st.booleans()):
            m.free(running.pop(data.draw(st.integers(0, len(running) - 1))))
            m.check_integrity()
            continue
        stem = stems[data.draw(st.integers(0, 2))]
        tokens = stem + data.draw(st.lists(st.integers(0, 3), max_size=10))
        first = alloc_tokens(m, tokens)
        if not m.can_allocate(first, token_ids=tokens):
            continue
        rid = f"r{step}"
        for j, key in enumerate(chain_keys(tokens, 4)):
            prefixes[key] = tuple(tokens[: (j + 1) * 4])
        alloc = m.allocate(rid, first, token_ids=tokens)  # copies of the last step may still be pending
        running.append(rid)
        run(alloc.copies)
        flush()
        if alloc.num_cached_tokens:
            expected = hash(tuple(tokens[: alloc.num_cached_tokens]))
            assert set(content[m.state_table([rid]).ravel()]) == {expected}
        write_state(rid)
        run(m.checkpoint(rid), checkpoints)
        m.check_integrity()
        while m.requests[rid].num_tokens < len(tokens):
            n = min(4 - m.requests[rid].num_tokens % 4, len(tokens) - m.requests[rid].num_tokens)
            if not m.can_append(rid, n):
                break
            run(m.append(rid, n))
            flush()
            write_state(rid)
            run(m.checkpoint(rid), checkpoints)
            m.check_integrity()
    flush()
    for rid in running:
        m.free(rid)
    m.check_integrity()
    u = m.usage()
    assert u.kv_live == u.state_live == 0 and u.free + u.evictable + 1 == u.total


def test_a_hit_that_pins_more_than_it_saves_is_admitted_as_a_miss():
    m = cached_manager(num_blocks=40)
    prefill(m, "a", PREFIX + [1])  # caches 3 KV blocks and checkpoints at 4, 8 and 12 tokens
    m.free("a")
    tokens = PREFIX + list(range(1000, 1108))  # 120 tokens: 30 KV blocks + 6 state = 36 of 39
    assert m.match_prefix(tokens) == 12
    assert m.blocks_to_admit(120, token_ids=tokens) == 36  # the hit would pin 36 - 3 + 3 + 6 = 42
    assert m.can_allocate(120, token_ids=tokens)
    alloc = m.allocate("big", 120, token_ids=tokens)
    assert alloc.num_cached_tokens == 0 and len(alloc.copies) == 0
    m.check_integrity()


def test_a_request_keeps_its_chain_when_the_cached_twin_of_its_block_is_evicted():
    """Regression: request 5 computed a block that was cached already (private twin); evicting the
    cached twin removed the node, and later blocks and checkpoints of request 5 hung on nothing."""
    from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent

    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))
    layout = plan(ModelSpec("tiny", (attn, rec, rec)), 20 * 128, block_size=4)
    m = HybridBlockManager(layout, prefix_cache=PrefixCacheConfig(CheckpointPolicy.NONE, EvictionPolicy.LRU))
    long = list(range(16))
    calls = [
        ("allocate", (0, 0), {"token_ids": [10000]}), ("append", (0, 1), {}),
        ("allocate", (1, 0), {"token_ids": [20000]}), ("append", (1, 1), {}),
        ("free", (0,), {}), ("free", (1,), {}),
        ("allocate", (2, 0), {"token_ids": [30000]}), ("append", (2, 1), {}),
        ("allocate", (4, 0), {"token_ids": long + [50000]}), ("append", (4, 5), {}),
        ("free", (2,), {}), ("append", (4, 6), {}), ("append", (4, 6), {}), ("free", (4,), {}),
        ("allocate", (5, 0), {"token_ids": long + [60000]}), ("append", (5, 6), {}), ("append", (5, 6), {}),
        ("append", (5, 5), {}),
        ("allocate", (3, 0), {"token_ids": long + [40000]}), ("append", (3, 1), {}),
        ("append", (5, 1), {"token_ids": [6000]}), ("append", (3, 5), {}),
        ("append", (5, 1), {"token_ids": [7000]}), ("append", (3, 5), {}),
        ("append", (5, 1), {"token_ids": [8000]}), ("append", (3, 5), {}),
    ]  # fmt: skip
    for name, args, kwargs in calls:
        getattr(m, name)(*args, **kwargs)
        m.check_integrity()
        for r in m.requests:
            m.checkpoint(r)
            m.check_integrity()


def test_checkpoints_with_pending_copies_are_not_evicted_until_released():
    """A checkpoint written (or read by a hit) this step must keep its blocks until the executor
    ran the step's copies, or another writer could get them in the same batch."""
    m = cached_manager(num_blocks=40)
    m.allocate("a", 4, token_ids=PREFIX[:4] + [1])
    copies = m.checkpoint("a")  # live -> checkpoint: pending until the next forward
    assert len(copies) == 6
    m.free("a")
    u = m.usage()
    assert (u.free, u.kv_cached, u.checkpoints) == (32, 1, 6)
    assert m.num_available_blocks == 33  # the pinned checkpoint is not available
    assert not m.can_allocate(120)  # 30 KV + 6 state
    m.release_pins()
    assert m.num_available_blocks == 39 and m.can_allocate(120)
    m.allocate("big", 120)
    assert m.usage().checkpoints == 0
    m.check_integrity()


def test_registered_chain_keys_are_chain_keys():
    """register() inlines the hash-chain rule: its keys must be chain_keys' (a hit depends on it)."""
    m = cached_manager(checkpoint="branch_and_last")
    tokens = list(range(300, 323))  # 5 full blocks and 3 tokens
    prefill(m, "a", tokens)
    keys = chain_keys(tokens, 4)
    assert m.requests["a"].block_keys == keys
    assert all(m.prefix_cache.nodes[k].tokens == tuple(tokens[4 * j : 4 * j + 4]) for j, k in enumerate(keys))
    m.free("a")
    m.check_integrity()


def test_cache_books_are_checked():
    """check() catches a checkpoint or a cached KV block whose node disagrees with it."""
    m = cached_manager()
    prefill(m, "a", PREFIX + [1])
    m.free("a")
    cache = m.prefix_cache
    assert cache.check() == []
    node = next(n for n in cache.nodes.values() if n.checkpoint is not None)
    slot = int(node.checkpoint[0])
    cache._ck_live[slot] = False
    assert any("checkpoints and the nodes" in p for p in cache.check())
    cache._ck_live[slot] = True
    block = int(cache.cached_kv_blocks()[0])
    held = int(cache._node_of[block])
    cache._node_of[block] = -1
    assert any("cached KV blocks" in p for p in cache.check())
    cache._node_of[block] = held
    cache._n_evictable += 1
    assert any("evictable" in p for p in cache.check())
    cache._n_evictable -= 1
    assert cache.check() == []


def reference_flop_aware(cache, target, protect=(), protect_ckpt=frozenset()):
    """The ranking as first written: every candidate in Python, a full stable argsort."""
    kv = sorted(set(cache.cached_kv_blocks().tolist()) - set(protect))  # candidates in block id order
    ck = [k for k in cache.checkpoint_keys() if k not in protect_ckpt and k not in cache.pinned]
    ck_slot = [int(cache.node(k).checkpoint[0]) for k in ck]
    # FLOPs per byte from the positions: a KV block's own tokens, a checkpoint's whole prefix
    fpb = np.array([cache._fpb(int(cache._pos[cache._node_of[b]])) for b in kv]
                   + [prefill_flops(cache._flops, cache.node(k).position) / cache._ckpt_bytes for k in ck])
    if not fpb.size:
        return set()
    tick = np.array([cache._ticks[b] for b in kv] + [cache._ticks[s] for s in ck_slot], dtype=np.float64)
    size = np.array([1] * len(kv) + [cache.host.num_state_blocks] * len(ck))

    def norm(x):
        span = x.max() - x.min()
        return (x - x.min()) / span if span > 0 else np.zeros_like(x)

    order = np.argsort(cache.config.alpha * norm(np.log1p(fpb)) + norm(tick), kind="stable")
    count = int(np.searchsorted(np.cumsum(size[order]), target)) + 1
    return {("kv", kv[i]) if i < len(kv) else ("ckpt", ck[i - len(kv)]) for i in order[:count].tolist()}


def _random_cache(data, eviction, max_requests, alpha=1.0):
    """A cache filled by a few random prompts over 3 token values (shared prefixes, checkpoints
    every 2 blocks), and a random subset of its cached KV blocks to protect."""
    config = PrefixCacheConfig(CheckpointPolicy("every_n_blocks"), EvictionPolicy(eviction), every_n=2, alpha=alpha)
    m = HybridBlockManager(plan(tiny_model(), 200 * 256, block_size=4), prefix_cache=config)
    for r in range(data.draw(st.integers(1, max_requests))):
        tokens = [data.draw(st.integers(0, 2)) for _ in range(data.draw(st.integers(4, 30)))]
        if not m.can_allocate(len(tokens), token_ids=tokens):
            break
        m.allocate(r, len(tokens), token_ids=tokens)
        m.checkpoint(r)
        m.release_pins()
        m.free(r)
    cached = m.prefix_cache.cached_kv_blocks().tolist()
    return m.prefix_cache, np.array([b for b in cached if data.draw(st.booleans())], dtype=np.int32)


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.skipif(kernels.numba is None, reason="numba"))],
                ids=["numpy", "jit"])
def ranking_path(request, monkeypatch):
    """flop_aware's ranking both ways: numpy, and the compiled kernel (when numba is installed)."""
    monkeypatch.setattr(kernels, "ENABLED", request.param)
    return request.param


@pytest.mark.parametrize("alpha", [1.0, 0.0])  # alpha 0: recency only, many ties (blocks released together)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flop_aware_victims_match_a_full_ranking(alpha, data, ranking_path):
    cache, protect = _random_cache(data, "flop_aware", 6, alpha=alpha)
    for target in (1, 2, 7, cache.num_evictable):
        kv, ck = cache._flop_aware_victims(target, protect, set())
        keys = {int(cache._key[cache._ck_node[s]]) for s in ck.tolist()}
        got = {("kv", b) for b in kv.tolist()} | {("ckpt", k) for k in keys}
        assert got == reference_flop_aware(cache, target, protect.tolist())


def test_flop_aware_ties_go_to_kv_blocks_by_id_then_to_checkpoints_by_recency(ranking_path):
    """Equal utilities: KV blocks first (lowest id first), then checkpoints, least recently used
    first, whatever their block ids (the ranking sorts by block id internally)."""
    m = cached_manager(num_blocks=120, eviction="flop_aware")
    prefill(m, "a", list(range(100, 124)))
    m.free("a")
    cache = m.prefix_cache
    kv = sorted(cache.cached_kv_blocks().tolist())
    slots = sorted(int(cache.node(k).checkpoint[0]) for k in cache.checkpoint_keys())
    assert len(kv) >= 3 and len(slots) >= 2
    # utilities by hand: lfpb and ticks normalized over [0, 4] (anchors A and B), alpha 1
    z, a, b = kv[-1], kv[0], kv[1]  # z: the highest KV id, above both checkpoints' ids below
    x, y = slots[0], slots[1]  # x has the lower block id but is the more recent one
    assert z > x
    cache._lfpb[kv], cache._ticks[kv] = 4.0, 4.0  # utility 2: last
    cache._lfpb[slots], cache._ticks[slots] = 4.0, 4.0
    for block, lfpb, tick in ((a, 0.0, 4.0), (b, 4.0, 0.0), (z, 3.0, 0.0), (x, 1.0, 2.0), (y, 2.0, 1.0)):
        cache._lfpb[block], cache._ticks[block] = lfpb, tick  # a, b: 1.0; z, x, y: 0.75
    victims, ckpts = cache._flop_aware_victims(1, _EMPTY_IDS, set())
    assert victims.tolist() == [z] and ckpts.size == 0
    victims, ckpts = cache._flop_aware_victims(2, _EMPTY_IDS, set())
    assert victims.tolist() == [z] and ckpts.tolist() == [y]  # y was used before x
    victims, ckpts = cache._flop_aware_victims(3 + 2 * m.num_state_blocks, _EMPTY_IDS, set())
    assert victims.tolist() == [z, a, b] and ckpts.tolist() == [y, x]


def test_flop_aware_orders_many_ties_the_same_way(ranking_path):
    """Every candidate at utility 1.0 (many checkpoints among them, the whole-order path): KV
    blocks by id, then checkpoints by recency."""
    m = cached_manager(num_blocks=200, eviction="flop_aware")
    for rid in ("a", "b"):
        prefill(m, rid, list(range(100 if rid == "a" else 300, 124 if rid == "a" else 324)))
        m.free(rid)
    cache = m.prefix_cache
    kv = sorted(cache.cached_kv_blocks().tolist())
    slots = sorted(int(cache.node(k).checkpoint[0]) for k in cache.checkpoint_keys())
    assert len(slots) >= 9
    # normalized lfpb + normalized tick = 1 for all (values k/8 over [0, 8], exact); checkpoint
    # ticks distinct and scrambled against their ids
    perm = list(range(len(slots)))
    random.Random(0).shuffle(perm)
    ck_ticks = [p / 8 for p in perm]  # distinct, in [0, 8) (fewer than 64 checkpoints)
    assert len(kv) >= 9 and len(slots) < 64
    for i, b in enumerate(kv):  # KV blocks span [0, 8] in both
        cache._ticks[b] = i % 9
        cache._lfpb[b] = 8 - i % 9
    for s, t in zip(slots, ck_ticks, strict=True):
        cache._ticks[s], cache._lfpb[s] = t, 8 - t
    by_id = sorted([(b, False) for b in kv] + [(s, True) for s in slots])
    assert sum(1 for x, y in zip(by_id, by_id[1:], strict=False) if x[1] or y[1]) > 8  # the many-ties path
    victims, ckpts = cache._flop_aware_victims(3, _EMPTY_IDS, set())
    assert victims.tolist() == kv[:3] and ckpts.size == 0
    victims, ckpts = cache._flop_aware_victims(len(kv) + 2 * m.num_state_blocks, _EMPTY_IDS, set())
    by_tick = [s for _, s in sorted(zip(ck_ticks, slots, strict=True))]
    assert victims.tolist() == kv and ckpts.tolist() == by_tick[:2]


@pytest.mark.skipif(kernels.numba is None, reason="numba")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_ranking_gives_the_numpy_victims_in_the_same_order(data):
    """The kernel against the numpy path on arbitrary candidate sets: utilities from a few values
    (ties everywhere, within and across kinds) or any, protected candidates, several targets."""
    alpha = data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    config = PrefixCacheConfig(CheckpointPolicy("every_n_blocks"), EvictionPolicy("flop_aware"), alpha=alpha)
    m = HybridBlockManager(plan(tiny_model(), 120 * 256, block_size=4), prefix_cache=config)
    cache, nb = m.prefix_cache, m.pool.num_blocks
    kinds = data.draw(st.lists(st.sampled_from("-kc"), min_size=nb, max_size=nb))  # none, KV, checkpoint
    values = st.integers(0, 4).map(float) if data.draw(st.booleans()) else st.floats(0, 10, allow_nan=False)
    for b, kind in enumerate(kinds):
        cache._kv_evictable[b], cache._ck_live[b] = kind == "k", kind == "c"
        cache._ticks[b], cache._lfpb[b] = data.draw(values), data.draw(values)
    protect = _EMPTY_IDS
    if data.draw(st.booleans()):
        protect = np.array([b for b, kind in enumerate(kinds) if kind == "k" and data.draw(st.booleans())],
                           dtype=np.int32)
    n_cand = kinds.count("k") + kinds.count("c")
    for target in sorted({1, 2, data.draw(st.integers(1, max(n_cand, 1) * m.num_state_blocks))}):
        got, was = [], kernels.ENABLED
        for enabled in (False, True):
            kernels.ENABLED = enabled
            try:
                got.append(cache._flop_aware_victims(target, protect, set()))
            finally:
                kernels.ENABLED = was
        (kv0, ck0), (kv1, ck1) = got
        assert kv1.tolist() == kv0.tolist() and ck1.tolist() == ck0.tolist()


@pytest.mark.skipif(kernels.numba is None, reason="numba")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_lru_scan_gives_the_numpy_victims_and_queue(data):
    """LRU eviction compiled and in numpy, from the same cache (KV blocks and checkpoints queued
    by a random workload, some released together, demoted tails, protected KV blocks and
    checkpoints): the same victims in the same order, and the same queue afterwards."""
    cache, protect = _random_cache(data, "lru", 8)
    protect_ckpt = {k for k in cache.checkpoint_keys() if data.draw(st.booleans())}
    for target in sorted({1, 2, data.draw(st.integers(1, max(cache.num_evictable, 1)))}):
        state = (cache._fifo.copy(), cache._fifo_ord.copy(), cache._head, cache._tail)
        got, was = [], kernels.ENABLED
        for enabled in (False, True):
            cache._fifo, cache._fifo_ord, cache._head, cache._tail = (state[0].copy(), state[1].copy(), *state[2:])
            kernels.ENABLED = enabled
            try:
                kv, ck = cache._lru_victims(target, protect, protect_ckpt)
            finally:
                kernels.ENABLED = was
            assert not cache._passed.any()
            queue = slice(cache._head, cache._tail)
            got.append((kv.tolist(), ck.tolist(), cache._head, cache._fifo[queue].tolist(),
                        cache._fifo_ord[queue].tolist()))
        assert got[0] == got[1]
        cache._fifo, cache._fifo_ord, cache._head, cache._tail = state


def test_a_repeated_match_reuses_hashes_but_never_serves_changed_tokens():
    """The cache keeps the tokens it last matched and reuses their block hashes for a match of
    the same tokens; a list changed in place between two asks (same object, same length) must
    get the answer for its new content, and a first block that misses is found without hashing
    the rest."""
    m = cached_manager()
    prefill(m, "a", PREFIX + [1, 2, 3, 4, 5])
    m.free("a")
    asked = PREFIX + [7, 8, 9]
    assert m.match_prefix(asked) == 12
    cache = m.prefix_cache
    memo = cache._recent
    assert memo is not None and memo.tolist() == asked
    assert m.match_prefix(asked) == 12 and cache._recent is memo  # reused, not rebuilt
    asked[0] = 999  # the same list object, changed in place: the first block now misses
    assert m.match_prefix(asked) == 0 and cache._recent is memo  # (no array made for a miss)
    asked[0] = PREFIX[0]
    asked[5] = 999  # the second block differs: a hit at the first block's checkpoint only
    assert m.match_prefix(asked) == 4 and cache._recent is not memo
    second = cache._recent
    alloc = m.allocate("b", 8, token_ids=asked)  # the record's array adopts the hashes (same tokens)
    assert alloc.num_cached_tokens == 4
    rec = m.requests["b"]
    assert rec.token_ids is not second and rec.token_ids._hashes is second._hashes
    assert cache._recent is rec.token_ids
    m.check_integrity()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_block_whose_key_matches_but_whose_tokens_differ_is_not_a_hit(compiled, monkeypatch):
    """Equal chain keys are not trusted alone: a cached block whose token ids differ from the
    request's anywhere (here its last token: a forged hash collision) ends the hit before it, with
    the numpy comparison and the compiled one."""
    if compiled and kernels.numba is None:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "ENABLED", compiled)
    m = cached_manager()  # a checkpoint at every block
    prefill(m, "a", PREFIX + [1, 2, 3, 4, 5])
    m.free("a")
    asked = PREFIX + [7, 8, 9]
    assert m.match_prefix(asked) == 12
    cache = m.prefix_cache
    keys = chain_keys(PREFIX, 4)
    for j, pos in ((1, 3), (2, 0)):  # block 1's last token, block 2's first
        slot = cache._slot[keys[j]]
        was = int(cache._tok[slot, pos])
        cache._tok[slot, pos] = was + 1000
        cache._recent = None  # (no memo of the earlier answer's hashes: they are right anyway)
        assert m.match_prefix(asked) == 4 * j
        cache._tok[slot, pos] = was
    assert m.match_prefix(asked) == 12

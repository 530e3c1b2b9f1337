"""The prefix cache's host tier (docs/blockmgr.md "Host tier"): cached KV blocks and checkpoints
evicted from the device go to the host pool and come back through host hits, checked byte by byte
with the shadow (tests/shadow.py); admission counts, swap-outs winning the host pool, pins, failed
calls changing nothing, and the integrity check of the tier's books."""

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.blockmgr.records import SwapDirection
from hybridkv.errors import AllocationError, HostPoolExhaustedError, IntegrityError, NoFreeBlocksError
from hybridkv.models.spec import DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan

from .manager_fixtures import tiny_model
from .shadow import Shadow, prefix_hashes
from .test_manager_atomic import snapshot

TIER = PrefixCacheConfig(CheckpointPolicy.EVERY_N_BLOCKS, every_n=2, host_tier=True)


class Rig:
    """A manager with the host tier and an eager executor over a shadow of both pools."""

    def __init__(self, num_blocks=40, num_host_blocks=80, config=TIER, model=None, block_size=4):
        model = model or tiny_model()
        probe = plan(model, 1 << 30, block_size=block_size)
        layout = plan(model, num_blocks * probe.bytes_per_block, block_size=block_size)
        self.m = HybridBlockManager(layout, num_host_blocks=num_host_blocks, prefix_cache=config)
        self.sh = Shadow(self.m)
        self.tier = self.m.prefix_cache.tier

    def run_tier(self):
        """Stage 0 of the executor: offloads, then onloads."""
        t = self.m.take_tier_copies()
        assert t.offload.direction is SwapDirection.OUT and t.onload.direction is SwapDirection.IN
        self.sh.swap(t.offload)
        self.sh.swap(t.onload)
        return t

    def forward(self, rid, tokens, start, end):
        rec = self.m.requests[rid]
        h = prefix_hashes(tokens)
        self.sh.write_kv(rec.kv_blocks, h, start, end)
        self.sh.write_state(rec.state, h[end])

    def run(self, rid, tokens, chunk=8):
        """Admit with the whole input, prefill it chunk by chunk (a checkpoint after each forward),
        check what the request reads; returns the tokens it got from the cache."""
        m, n = self.m, len(tokens)
        first = min(n, m.match_prefix(tokens) + chunk)
        alloc = m.allocate(rid, first, token_ids=tokens)
        self.run_tier()
        self.sh.copy(alloc.copies)
        c = alloc.num_cached_tokens
        self.check(rid, tokens, c)
        done = c
        while True:
            end = m.requests[rid].num_tokens
            self.forward(rid, tokens, done, end)
            done = end
            copies = m.checkpoint(rid)
            self.run_tier()
            self.sh.copy(copies)
            m.release_pins()
            if done == n:
                return c
            grow = m.append(rid, min(chunk, n - done))
            self.run_tier()
            self.sh.copy(grow)

    def check(self, rid, tokens, upto):
        rec, h = self.m.requests[rid], prefix_hashes(tokens)
        self.sh.check_kv(f"{rid}", rec.kv_blocks, h, upto)
        if upto:
            self.sh.check_state(f"{rid}", rec.state, h[upto])

    def flood(self, tag, n=3, length=72):
        """Requests with their own tokens that fill the device and leave their blocks cached."""
        for i in range(n):
            toks = [10_000 * (i + 1) + 100 * len(tag) + j for j in range(length)]
            self.run((tag, i), toks, chunk=length)
            self.m.free((tag, i))
            self.m.release_pins()
            self.m.check_integrity()


A = list(range(100, 124))  # 6 blocks of 4 tokens



def offloaded_a() -> Rig:
    """A rig whose request "a" ran A, finished, and had its cached blocks pushed to the host tier by
    a flood of other requests."""
    r = Rig()
    r.run("a", A)
    r.m.free("a")
    r.m.release_pins()
    r.flood("b")
    return r

def test_evicted_kv_and_checkpoints_come_back_from_the_host():
    r = Rig()
    assert r.run("a", A) == 0
    r.m.free("a")
    r.m.release_pins()
    r.flood("b")
    st = r.tier.stats
    assert st.offloaded_kv > 0 and st.offloaded_checkpoints > 0 and r.m.usage().host_cached == r.tier.num_blocks
    hit = r.m.prefix_cache.match(A, len(A))
    assert hit.num_tokens == 16 and hit.on_host  # the deepest checkpoint below the input (every 2 blocks)
    before = (st.onloaded_kv, st.onloaded_checkpoints)
    assert r.run("a2", A) == 16  # run() checks every KV slot and state block the hit serves
    assert st.onloaded_kv > before[0] or st.onloaded_checkpoints > before[1]
    assert r.m.prefix_cache.stats.hit_tokens_host > 0
    r.m.check_integrity()


def test_a_host_hit_takes_exactly_the_blocks_admission_counts():
    r = offloaded_a()
    m = r.m
    hit = m.prefix_cache.match(A, len(A))
    assert hit.on_host and hit.host_index.size
    taken = m.blocks_to_admit(len(A), 0, A)
    kv = -(-len(A) // m.block_size)
    assert taken == kv - hit.num_blocks + m.num_state_blocks + m.prefix_cache.num_pinned(hit)
    avail = m.num_available_blocks
    assert m.can_allocate(len(A), 0, A)
    alloc = m.allocate("a2", len(A), token_ids=A)
    assert m.num_available_blocks == avail - taken and alloc.num_cached_tokens == hit.num_tokens
    t = r.run_tier()
    assert len(t.onload) == hit.host_index.size + (m.num_state_blocks if hit.host_checkpoint is not None else 0)
    r.sh.copy(alloc.copies)
    r.check("a2", A, alloc.num_cached_tokens)
    m.check_integrity()


def test_host_lru_drops_the_oldest_units_when_the_host_is_small():
    r = Rig(num_host_blocks=12)
    r.run("a", A)
    r.m.free("a")
    r.m.release_pins()
    r.flood("b", n=4)
    st = r.tier.stats
    assert st.evicted_kv + st.evicted_checkpoints > 0 and r.tier.num_blocks <= 12
    r.m.check_integrity()
    # whatever is left serves correct bytes
    for i in range(4):
        toks = [10_000 * (i + 1) + 100 + j for j in range(72)]
        r.run(("again", i), toks, chunk=72)
        r.m.free(("again", i))
        r.m.release_pins()
    r.m.check_integrity()


def _tier_full_of_units():
    """A host pool of 20 blocks, all held by the tier; a running request 'x' of 2 blocks + state."""
    r = Rig(num_host_blocks=20)
    for i in range(6):
        r.run(("a", i), [1000 * (i + 1) + j for j in range(24)])
        r.m.free(("a", i))
        r.m.release_pins()
    r.flood("b", n=2)
    r.m.allocate("x", 8)
    r.run_tier()
    assert r.m.host_pool.num_free < 8 <= r.m.host_pool.num_free + r.tier.num_evictable
    return r


def test_a_swap_out_wins_host_blocks_from_the_tier():
    r = _tier_full_of_units()
    m = r.m
    assert m.can_swap_out("x")
    cached = r.tier.num_blocks
    plan_ = m.swap_out("x")
    assert len(plan_) == 2 + m.num_state_blocks and r.tier.num_blocks < cached
    assert r.tier.stats.given_to_swaps >= len(plan_) - (20 - cached)
    plan_.commit()
    u = m.usage()
    assert u.host_used == len(plan_) and u.host_cached == r.tier.num_blocks
    m.check_integrity()


def test_units_a_pending_copy_touches_do_not_give_way():
    """With pins on, a host hit's units stay on the host until release_pins says its copies ran:
    a swap-out that needs them fails and changes nothing; after the release it takes them."""
    r = Rig(num_host_blocks=30)
    m = r.m
    r.run("a", A)
    m.free("a")
    m.release_pins()
    m.allocate("big", (m.num_available_blocks - m.num_state_blocks) * 4)  # evicts (offloads) all of a
    r.run_tier()
    m.free("big")
    assert m.prefix_cache.num_cached_kv == 0 and r.tier.num_blocks == 6 + 3 * m.num_state_blocks
    m.begin_pin_epoch()
    alloc = m.allocate("a2", len(A), token_ids=A)
    t = m.take_tier_copies()
    assert alloc.num_cached_tokens == 16 and len(t.onload) == 4 + m.num_state_blocks
    held = r.tier.num_blocks - r.tier.num_evictable
    assert held == len(t.onload)
    room = m.host_pool.num_free + r.tier.num_evictable
    m.allocate("x", (room + 1 - m.num_state_blocks) * 4)  # needs one host block more than can be had
    assert not len(m.take_tier_copies())
    before = snapshot(m), r.tier.num_blocks, dict(r.tier.kv)
    assert not m.can_swap_out("x")
    with pytest.raises(HostPoolExhaustedError):
        m.swap_out("x")
    assert (snapshot(m), r.tier.num_blocks, dict(r.tier.kv)) == before
    m.release_pins()  # the executor ran the onloads
    assert m.can_swap_out("x")
    m.swap_out("x").commit()
    m.check_integrity()


def test_a_failed_allocate_on_a_host_hit_changes_nothing():
    r = offloaded_a()
    m = r.m
    assert m.prefix_cache.match(A, len(A)).on_host
    m.allocate("big", (m.num_available_blocks - 6) * 4)  # leaves too little for a2
    r.run_tier()
    before = snapshot(m), dict(r.tier.kv), {k: v.tolist() for k, v in r.tier.ck.items()}, list(r.tier._lru)
    assert not m.can_allocate(len(A), 0, A)
    with pytest.raises(NoFreeBlocksError):
        m.allocate("a2", len(A), token_ids=A)
    after = snapshot(m), dict(r.tier.kv), {k: v.tolist() for k, v in r.tier.ck.items()}, list(r.tier._lru)
    assert after == before and not len(m.take_tier_copies())
    m.check_integrity()


def test_the_host_tier_needs_a_host_pool():
    layout = plan(tiny_model(), 40 * 256, block_size=4)
    with pytest.raises(ValueError, match="num_host_blocks"):
        HybridBlockManager(layout, num_host_blocks=0, prefix_cache=TIER)


def test_integrity_counts_the_tier_host_blocks():
    r = offloaded_a()
    r.m.check_integrity()
    hb = next(iter(r.tier.kv.values()))
    r.m.host_pool.ref_counts[hb] = 0  # a tier block the pool thinks free
    with pytest.raises(IntegrityError, match="host"):
        r.m.check_integrity()


def test_a_state_only_model_keeps_checkpoints_on_the_host():
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", (40,), DType.FLOAT32),))
    model = ModelSpec("states", (rec, rec))
    r = Rig(num_blocks=12, num_host_blocks=30, model=model, block_size=4)
    m = r.m
    r.run("a", A)
    m.free("a")
    m.release_pins()
    for i in range(6):
        r.run(("b", i), [50_000 + 100 * i + j for j in range(24)])
        m.free(("b", i))
        m.release_pins()
    assert r.tier.stats.offloaded_checkpoints > 0
    hit = m.prefix_cache.match(A, len(A))
    assert hit.num_tokens and hit.host_checkpoint is not None
    assert r.run("a2", A) == hit.num_tokens  # the state the host checkpoint holds, copied into the live sets
    m.check_integrity()


def test_usage_and_stats_after_offload():
    r = offloaded_a()
    u = r.m.usage()
    assert u.host_used == 0 and u.host_cached == r.tier.num_blocks > 0
    ids = np.concatenate(r.tier.host_ids())
    assert np.all(r.m.host_pool.ref_counts[ids] == 1)


def test_direct_callers_without_a_host_tier_get_no_tier_copies():
    layout = plan(tiny_model(), 40 * 256, block_size=4)
    m = HybridBlockManager(layout, num_host_blocks=10, prefix_cache=PrefixCacheConfig())
    m.allocate("a", 8, token_ids=list(range(8)))
    t = m.take_tier_copies()
    assert not len(t) and m.prefix_cache.tier is None
    with pytest.raises(AllocationError):
        m.allocate("b", 10_000)

"""A decode instance pulls a cached prefix from a peer whose prefix cache offloaded it (wholly or
partly) to its host tier: the bytes come straight from the peer's host pool (block-major DRAM) and
device pool through the loopback engine (docs/transfer.md "Host-resident blocks").

Both instances run real byte pools: numpy device pools ``[group_size, num_segments, num_blocks,
segment_bytes]`` and host pools ``[num_host_blocks, group_size, num_segments, segment_bytes]``, with
an eager executor that runs every copy the manager hands out (tier offloads and onloads, checkpoint
copies). What a request's forward wrote is recorded at each chunk end, read by the layout's rule
(``reference_bytes``), and compared with what the puller's request holds after the READs."""

from __future__ import annotations

import hashlib
import json
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.blockmgr.transfer_host import PrefixNotCachedError, export_prefix, exportable_tokens
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.errors import RequestStateError
from hybridkv.models.spec import with_state_dtype
from hybridkv.transfer import MemoryKind, PoolRegions, TransferError, pair_tiered_descriptors
from hybridkv.transfer.loopback import (
    LoopbackEngine,
    LoopbackHub,
    connect_pair,
    copy_pairs,
    host_pool_array,
    regions_of_array,
    regions_of_host_array,
)
from hybridkv.transfer.prefix_handoff import finish_prefix_export, offer_prefix, parse_prefix_offer, pull_prefix
from hybridkv.transfer.testing import mini_layout, mini_mamba2, mini_minimax, reference_bytes, seeded_pool

from .test_manager_atomic import snapshot
from .test_transfer_descriptors import STATE_DTYPES, _same_states, quantized_states

TIER = PrefixCacheConfig(CheckpointPolicy.EVERY_N_BLOCKS, every_n=2, host_tier=True)
A = list(range(100, 124))  # 6 blocks of 4 tokens: checkpoints at 8 and 16 (every 2 blocks)


class Instance:
    """One serving instance: a manager with the host tier over numpy device and host pools, and an
    eager executor that runs every copy right after the call that handed it out."""

    def __init__(self, num_blocks=160, num_host_blocks=240, seed=1, model=mini_minimax, config=TIER):
        self.layout = mini_layout(model(), num_blocks)
        self.m = HybridBlockManager(self.layout, num_host_blocks=num_host_blocks, prefix_cache=config)
        self.dev = seeded_pool(self.layout, seed)
        self.host = host_pool_array(self.layout, num_host_blocks, fill=0xAB)
        self.expected: dict[tuple[int, ...], bytes] = {}  # tokens -> a request's bytes after them (KV + live state)

    def truth(self, tokens, num_tokens) -> bytes:
        """What any request of ``tokens`` holds after its first ``num_tokens`` were computed."""
        return self.expected[tuple(tokens[:num_tokens])]

    @property
    def regions(self) -> PoolRegions:
        return regions_of_array(self.layout, self.dev)

    @property
    def host_regions(self) -> PoolRegions:
        return regions_of_host_array(self.layout, self.host)

    def run_tier(self):
        t = self.m.take_tier_copies()
        out, inn = t.offload, t.onload
        if len(out):  # device [G, S, N, B] -> host [N, G, S, B]
            self.host[out.host_blocks] = self.dev[:, :, out.device_blocks].transpose(2, 0, 1, 3)
        if len(inn):
            self.dev[:, :, inn.device_blocks] = self.host[inn.host_blocks].transpose(1, 2, 0, 3)

    def copy(self, copies):
        if len(copies):
            self.dev[:, :, copies.dst] = self.dev[:, :, copies.src]

    def prefill(self, rid, tokens, chunk=8):
        """Admit and compute ``tokens`` chunk by chunk; a checkpoint follows each forward. A forward
        is a model in miniature: each KV block it writes gets bytes drawn from the tokens up to the
        block's end, the live state sets bytes drawn from all tokens so far, so every computation of
        the same tokens writes the same bytes, whoever computes them."""
        m, n, bs = self.m, len(tokens), self.layout.block_size
        first = min(n, m.match_prefix(tokens) + chunk)
        alloc = m.allocate(rid, first, token_ids=tokens)
        self.run_tier()
        self.copy(alloc.copies)
        done = alloc.num_cached_tokens
        while True:
            rec = m.requests[rid]
            end = rec.num_tokens
            for j in range(done // bs, -(-end // bs)):
                block = rec.kv_blocks[j]
                self.dev[:, :, block] = _drawn(tokens[: min(end, (j + 1) * bs)], self.dev[:, :, block].shape)
            live = rec.state[m._state_mask]
            self.dev[:, :, live] = _drawn([*tokens[:end], -1], self.dev[:, :, live].shape)
            sets = tuple(rec.state[g, :k].copy() for g, k in enumerate(self.layout.blocks_per_state))
            if end % bs == 0:
                self.expected[tuple(tokens[:end])] = reference_bytes(
                    self.dev, self.layout, RequestBlocks(end, rec.kv_blocks.copy(), sets))
            done = end
            copies = m.checkpoint(rid)
            self.run_tier()
            self.copy(copies)
            m.release_pins()
            if done == n:
                return
            grow = m.append(rid, min(chunk, n - done))
            self.run_tier()
            self.copy(grow)

    def evict(self, num_blocks):
        """A request of ``num_blocks`` KV blocks (plus its state) that makes room by evicting (so
        offloading) cached blocks, then finishes."""
        self.m.allocate("flood", num_blocks * self.layout.block_size)
        self.run_tier()
        self.m.free("flood")
        self.m.release_pins()


def _drawn(tokens, shape) -> np.ndarray:
    """Bytes of ``shape`` drawn from a seed that is a hash of ``tokens``."""
    seed = int.from_bytes(hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def offloaded(evict_all=True) -> Instance:
    """The prefill instance: A computed and finished, then its cached blocks pushed to the host tier
    by a large request (all of them, or only the least recently used part)."""
    p = Instance()
    p.prefill("a", A)
    p.m.free("a")
    p.m.release_pins()
    free = p.m.pool.num_free
    p.evict(p.m.num_available_blocks - p.m.num_state_blocks if evict_all else free + 60)  # KV 2, 3 and the checkpoint
    p.m.check_integrity()
    return p


def decoder(num_blocks=120, seed=2, model=mini_minimax) -> Instance:
    d = Instance(num_blocks=num_blocks, num_host_blocks=20, seed=seed, model=model)
    d.m.allocate("resident", 10)  # the prefix lands on other ids than the source's
    return d


def wire(p: Instance, d: Instance):
    hub = LoopbackHub()
    ep = LoopbackEngine("P", p.regions, hub, host_pool=p.host_regions)
    ed = LoopbackEngine("D", d.regions, hub)
    connect_pair(ep, ed)
    return ep, ed


def tier_state(p: Instance):
    t = p.m.prefix_cache.tier
    return t.num_blocks, t.num_evictable, dict(t.kv), {k: v.tolist() for k, v in t.ck.items()}, list(t._lru)


# ---- the pull ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("evict_all", [True, False], ids=["all-on-host", "device-and-host"])
def test_a_decoder_pulls_a_prefix_from_the_peers_host_tier(evict_all):
    p, d = offloaded(evict_all), decoder()
    hit = p.m.prefix_cache.match(A, len(A))
    assert hit.num_tokens == 16 and hit.on_host
    assert (hit.kv_blocks.size == 0) == evict_all  # partly on the device unless all was offloaded
    before_p = snapshot(p.m), tier_state(p)
    ep, ed = wire(p, d)
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    assert export.num_tokens == 16 and export.num_host_blocks > 0
    assert export.state_on_host == (hit.host_checkpoint is not None)
    plan = pull_prefix(d.m, ed, "P", offer, 1.0)
    finish_prefix_export(ep, "D", export, "r", 1.0)
    # the decoder's request holds exactly the bytes the prefill forward wrote (KV and state at 16)
    assert reference_bytes(d.dev, d.layout, plan.blocks) == p.truth(A, 16)
    assert (snapshot(p.m), tier_state(p)) == before_p  # holds dropped; the cache keeps its entries
    d.m.check_integrity()
    p.m.check_integrity()
    d.m.append("r", len(A) - 16)  # the request runs on here from token 16
    d.m.check_integrity()


def test_the_host_part_is_read_from_host_memory_in_host_block_pieces():
    p, d = offloaded(), decoder()
    export = export_prefix(p.m, A)
    dst = d.m.import_request("r", export.num_tokens)
    pairs = pair_tiered_descriptors(p.regions, p.host_regions, export.blocks, export.on_host(), d.regions, dst.blocks)
    assert len(pairs.device) == 0 and pairs.num_bytes == pairs.host.num_bytes
    # host descriptors stay inside one host block each (the planes interleave in a block-major pool)
    stride = p.layout.group_size * p.layout.num_segments * p.layout.segment_bytes
    start, end = pairs.host.src.offset, pairs.host.src.offset + pairs.host.src.length
    assert ((start // stride) == ((end - 1) // stride)).all()
    copy_pairs([p.host.reshape(-1)], [d.dev.reshape(-1)], pairs.host)
    assert reference_bytes(d.dev, d.layout, dst.blocks) == p.truth(A, 16)
    dst.commit()
    export.commit()
    p.m.check_integrity()


def test_a_state_only_model_pulls_a_host_checkpoint():
    p = Instance(num_blocks=12, num_host_blocks=30, model=mini_mamba2)
    p.prefill("a", A)
    p.m.free("a")
    p.m.release_pins()
    p.evict(p.m.num_available_blocks - p.m.num_state_blocks)
    d = decoder(num_blocks=30, model=mini_mamba2)
    ep, ed = wire(p, d)
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    assert export.state_on_host
    plan = pull_prefix(d.m, ed, "P", offer, 1.0)
    finish_prefix_export(ep, "D", export, "r", 1.0)
    assert reference_bytes(d.dev, d.layout, plan.blocks) == p.truth(A, export.num_tokens)
    p.m.check_integrity()
    d.m.check_integrity()


# ---- holds --------------------------------------------------------------------------------------------
def test_held_units_survive_host_eviction_swaps_and_device_eviction_until_settled():
    """Between the offer and the READ the source floods its device (offloads that need host room)
    and swaps a request out: nothing the export holds is evicted, the READ still gets the bytes."""
    p, d = offloaded(evict_all=False), decoder()
    tier = p.m.prefix_cache.tier
    ep, ed = wire(p, d)
    evictable = tier.num_evictable
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    held = export.num_host_blocks
    assert tier.num_evictable == evictable - held
    n_dev = int((~export.kv_on_host).sum())
    assert n_dev > 0  # device KV blocks held too: out of the evictable count
    # fill the host pool with other units, then flood the device: the tier's LRU must pass the held ones
    for i in range(4):
        toks = [5000 * (i + 1) + j for j in range(24)]
        p.prefill(("x", i), toks)
        p.m.free(("x", i))
        p.m.release_pins()
    p.evict(p.m.num_available_blocks - p.m.num_state_blocks)
    assert tier.stats.evicted_kv + tier.stats.evicted_checkpoints > 0  # the host LRU did evict
    # a swap-out may take every unheld host block (make_room, what swap_out asks), never a held one
    u = p.m.usage()
    room = p.m.host_pool.num_free + tier.num_evictable
    assert room == u.host_total - u.host_used - held
    tier.make_room(room)
    assert tier.num_blocks == held and set(export._host_units) <= set(tier._unit)
    p.m.check_integrity()
    plan = pull_prefix(d.m, ed, "P", offer, 1.0)
    assert reference_bytes(d.dev, d.layout, plan.blocks) == p.truth(A, 16)
    finish_prefix_export(ep, "D", export, "r", 1.0)
    assert tier.num_evictable == tier.num_blocks  # released: evictable again
    p.m.check_integrity()


def test_abort_and_a_timeout_release_the_holds():
    p = offloaded(evict_all=False)
    before = snapshot(p.m), tier_state(p)
    export = export_prefix(p.m, A)
    assert snapshot(p.m) != before[0]  # device KV referenced
    export.abort()
    assert (snapshot(p.m), tier_state(p)) == before
    with pytest.raises(RequestStateError):
        export.commit()
    d = decoder()
    ep, _ = wire(p, d)
    export, _ = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    with pytest.raises(TransferError):  # the decoder never READs: no notification
        finish_prefix_export(ep, "D", export, "r", 0.0)
    assert export.settled and (snapshot(p.m), tier_state(p)) == before
    p.m.check_integrity()


def test_two_exports_of_one_prefix_hold_it_until_both_settle():
    p = offloaded(evict_all=False)
    tier = p.m.prefix_cache.tier
    before = snapshot(p.m), tier_state(p)
    e1, e2 = export_prefix(p.m, A), export_prefix(p.m, A)
    p.m.check_integrity()
    e1.commit()
    assert tier.num_evictable == before[1][1] - e2.num_host_blocks  # still held by e2
    e2.abort()
    assert (snapshot(p.m), tier_state(p)) == before


def test_refusals_change_nothing():
    p = offloaded()
    before = snapshot(p.m), tier_state(p)
    with pytest.raises(PrefixNotCachedError):
        export_prefix(p.m, [7] * 24)
    assert exportable_tokens(p.m, [7] * 24) == 0 and exportable_tokens(p.m, A) == 16
    with pytest.raises(TypeError):
        export_prefix(p.m, ["a"] * 24)
    with pytest.raises(TransferError, match="host pool"):  # the prefix is on the host: its regions are needed
        offer_prefix(p.m, p.regions, None, "r", A)
    with pytest.raises(TypeError):
        offer_prefix(p.m, p.regions, p.host_regions, ("r", 1), A)
    with pytest.raises(TransferError, match="host_pool has"):  # the device pool's regions passed as the host's
        offer_prefix(p.m, p.regions, p.regions, "r", A)
    with pytest.raises(TransferError, match="device_pool has"):
        offer_prefix(p.m, p.host_regions, p.host_regions, "r", A)
    with pytest.raises(TransferError, match="layout differs"):
        offer_prefix(p.m, decoder(model=mini_mamba2).regions, p.host_regions, "r", A)
    # a host hit whose onload copies are queued: the export waits for them
    p.m.begin_pin_epoch()
    p.m.allocate("local", len(A), token_ids=A)
    with pytest.raises(RequestStateError, match="not yet run"):
        export_prefix(p.m, A)
    p.run_tier()
    p.m.free("local")
    p.m.release_pins()
    after = snapshot(p.m)
    export_prefix(p.m, A).abort()
    assert snapshot(p.m) == after
    with pytest.raises(ValueError, match="prefix cache"):
        export_prefix(HybridBlockManager(p.layout), A)
    assert before[1][0] == p.m.prefix_cache.tier.num_blocks
    p.m.check_integrity()


# ---- failures on the pulling side ----------------------------------------------------------------------
def _tampered(offer: bytes, edit) -> bytes:
    msg = json.loads(offer)
    edit(msg)
    return json.dumps(msg).encode()


def test_bad_offers_and_a_layout_mismatch_reserve_nothing():
    p, d = offloaded(evict_all=False), decoder()
    ep, ed = wire(p, d)
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    before = snapshot(d.m)
    bad = [
        _tampered(offer, lambda m: m["blocks"]["kv_blocks"].__setitem__(0, 10_000)),  # outside its pool
        _tampered(offer, lambda m: m.__setitem__("on_host", m["on_host"][:-1])),
        _tampered(offer, lambda m: m.__setitem__("on_host", [1] * len(m["on_host"]))),
        _tampered(offer, lambda m: m.__setitem__("host_pool", None)),
        _tampered(offer, lambda m: m["host_pool"].__setitem__("null_block", "no")),
        _tampered(offer, lambda m: m["host_pool"].__setitem__("block_stride", 1)),
    ]
    msg = json.loads(offer)
    kv = msg["blocks"]["kv_blocks"]
    host_pos = [i for i, h in enumerate(msg["on_host"][-len(kv) :]) if h]
    assert len(host_pos) >= 2

    def twice(m):  # one host block named for two positions
        m["blocks"]["kv_blocks"][host_pos[1]] = m["blocks"]["kv_blocks"][host_pos[0]]

    bad.append(_tampered(offer, twice))
    for b in bad:
        with pytest.raises(TransferError):
            pull_prefix(d.m, ed, "P", b, 1.0)
        assert snapshot(d.m) == before
    other = decoder(model=mini_mamba2)  # another model: its layout differs
    with pytest.raises(TransferError, match="layout differs"):
        parse_prefix_offer(other.layout, offer)
    export.abort()
    d.m.check_integrity()


def test_a_failed_read_aborts_the_import():
    p, d = offloaded(evict_all=False), decoder()
    ep, ed = wire(p, d)
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    before = snapshot(d.m)
    reads = []

    def flaky_read(peer, pairs, remote, notification, timeout_s):
        reads.append(remote.null_block)
        if len(reads) == 2:  # the device part moved, the host part fails
            raise RuntimeError("link down")
        LoopbackEngine.read(ed, peer, pairs, remote, notification, timeout_s)

    ed.read = flaky_read
    with pytest.raises(RuntimeError, match="link down"):
        pull_prefix(d.m, ed, "P", offer, 1.0)
    assert reads == [True, False]  # device pool first, then the host pool
    assert snapshot(d.m) == before and "r" not in d.m.requests
    with pytest.raises(TransferError):
        finish_prefix_export(ep, "D", export, "r", 0.0)  # no notification: the holds go
    p.m.check_integrity()
    d.m.check_integrity()


def test_a_peer_that_did_not_register_its_host_pool_is_refused():
    p, d = offloaded(), decoder()
    hub = LoopbackHub()
    ep = LoopbackEngine("P", p.regions, hub)  # no host_pool: its host memory is not readable
    ed = LoopbackEngine("D", d.regions, hub)
    connect_pair(ep, ed)
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    before = snapshot(d.m)
    with pytest.raises(TransferError, match="did not register"):
        pull_prefix(d.m, ed, "P", offer, 1.0)
    assert snapshot(d.m) == before
    export.abort()


# ---- regions of host pools -----------------------------------------------------------------------------
def test_block_major_regions_address_the_ops_host_pool():
    torch = pytest.importorskip("torch")
    from hybridkv.ops.pools import allocate_host_pools
    from hybridkv.transfer.loopback import regions_of_pools

    layout = mini_layout(mini_minimax(), 20)
    pools = allocate_host_pools(layout, 7, pin_memory=False)
    pools.torch_data.copy_(torch.randint(0, 256, pools.torch_data.shape, dtype=torch.uint8))
    r = regions_of_pools(pools)
    assert r.null_block is False and r.first_block == 0 and r.regions[0].kind is MemoryKind.DRAM
    assert r.block_stride == layout.group_size * layout.num_segments * layout.segment_bytes
    flat = pools.torch_data.numpy().reshape(-1)
    data = pools.torch_data.numpy()
    for b, slot, seg in ((0, 0, 0), (6, layout.group_size - 1, layout.num_segments - 1), (3, 1, 0)):
        at = int(r.plane_offset[slot, seg]) + b * r.block_stride
        assert np.array_equal(flat[at : at + layout.segment_bytes], data[b, slot, seg])
    back = PoolRegions.from_wire(layout, json.loads(json.dumps(r.to_wire())))
    assert back.block_stride == r.block_stride and back.null_block is False
    assert np.array_equal(back.plane_offset, r.plane_offset)
    with pytest.raises(TransferError, match="does not fit"):
        PoolRegions(layout, 8, r.regions, r.plane_region, r.plane_offset, None, r.block_stride, False)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_split_between_device_and_host_moves_the_same_bytes(data):
    """A request's ids drawn at random, each in the device pool or in the host pool (holding the same
    bytes as the device block would): the tiered pairs move what one pool's pairs would, for any state
    dtype (an int8 / fp8 state's values and float32 scales checked on their own too)."""
    model = data.draw(st.sampled_from([mini_minimax, mini_mamba2]))()
    layout = mini_layout(with_state_dtype(model, data.draw(st.sampled_from(STATE_DTYPES))), 40)
    src, dst = seeded_pool(layout, 3), seeded_pool(layout, 4)
    host = host_pool_array(layout, 40)
    n_tok = data.draw(st.integers(1, 24))
    n = layout.num_kv_blocks(n_tok) + sum(layout.blocks_per_state)
    ids = np.array(data.draw(st.permutations(range(1, 40)))[:n], dtype=np.int32)
    on_host = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    hid = np.array(data.draw(st.permutations(range(40)))[:n], dtype=np.int32)
    host[hid[on_host]] = src[:, :, ids[on_host]].transpose(2, 0, 1, 3)  # the host copies of those blocks
    bps = np.cumsum((0, *layout.blocks_per_state))

    def blocks(x):
        return RequestBlocks(n_tok, x[bps[-1] :], tuple(x[bps[g] : bps[g + 1]] for g in range(len(bps) - 1)))

    src_ids = np.where(on_host, hid, ids)
    dst_ids = np.array(data.draw(st.permutations(range(1, 40)))[:n], dtype=np.int32)
    r_dev, r_host = regions_of_array(layout, src), regions_of_host_array(layout, host)
    r_dst = regions_of_array(layout, dst)
    pairs = pair_tiered_descriptors(r_dev, r_host, blocks(src_ids), on_host, r_dst, blocks(dst_ids))
    copy_pairs([src.reshape(-1)], [dst.reshape(-1)], pairs.device)
    copy_pairs([host.reshape(-1)], [dst.reshape(-1)], pairs.host)
    assert reference_bytes(dst, layout, blocks(dst_ids)) == reference_bytes(src, layout, blocks(ids))
    assert _same_states(quantized_states(dst, layout, blocks(dst_ids)), quantized_states(src, layout, blocks(ids)))
    with pytest.raises(TransferError):
        pair_tiered_descriptors(r_dev, r_host, blocks(src_ids), on_host[:-1], r_dst, blocks(dst_ids))


# ---- the adapters register the host pool with its memory kind ------------------------------------------------
def test_nixl_registers_the_host_pool_as_dram(monkeypatch):
    """A stand-in for ``nixl._api`` records the adapter's calls: the device pool and the host pool
    are registered by separate calls, each with its own memory type, and a READ from the peer's host
    pool prepares the remote list as DRAM with the host descriptors' addresses."""
    calls = []

    class Agent:
        def __init__(self, name, config):
            self.name = name

        def register_memory(self, regs, mem):
            calls.append(("register", mem, regs))
            return len(calls)

        def prep_xfer_dlist(self, who, addrs, mem):
            calls.append(("prep", who, mem, np.asarray(addrs).tolist()))
            return len(calls)

        def make_prepped_xfer(self, op, lh, li, rh, ri, note):
            return "x"

        def transfer(self, xfer):
            return "DONE"

        def release_xfer_handle(self, xfer):
            pass

        def release_dlist_handle(self, h):
            pass

        def deregister_memory(self, reg):
            calls.append(("deregister", reg))

        def add_remote_agent(self, meta):
            return b"P"

        def get_agent_metadata(self):
            return b"meta"

    fake = types.ModuleType("nixl._api")
    fake.nixl_agent, fake.nixl_agent_config = Agent, lambda backends: backends
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", fake)
    from hybridkv.transfer.nixl_engine import NixlEngine

    p, d = offloaded(), decoder()
    vram = PoolRegions.contiguous(p.layout, p.regions.regions[0].address, p.layout.num_blocks, 3, "VRAM")
    src = NixlEngine("P", vram, host_pool=p.host_regions)
    assert [(c[1], c[2][0][2]) for c in calls if c[0] == "register"] == [("VRAM", 3), ("DRAM", 0)]
    export, offer = offer_prefix(p.m, vram, p.host_regions, "r", A)
    dst = NixlEngine("D", d.regions)
    dst.connect(lambda meta: b"meta")
    calls.clear()
    plan = pull_prefix(d.m, dst, "P", offer, 1.0)
    (local, remote), = [(a, b) for a, b in zip(calls[::2], calls[1::2], strict=True)]
    assert local[1:3] == ("NIXL_INIT_AGENT", "DRAM") and remote[1:3] == ("P", "DRAM")
    pairs = pair_tiered_descriptors(vram, p.host_regions, export.blocks, export.on_host(), d.regions, plan.blocks)
    assert remote[3] == pairs.host.src.addresses(p.host_regions).tolist()
    src.close()
    dst.close()
    assert [c[0] for c in calls].count("deregister") == 3
    export.abort()


def test_mooncake_registers_both_pools(monkeypatch):
    """A stand-in for ``mooncake.engine``: the host pool's regions are registered with the device
    pool's (Mooncake finds each address's location itself), and a READ posts the host descriptors'
    addresses."""
    posted, registered = [], []

    class Engine:
        def initialize(self, host, mode, protocol, device):
            return 0

        def get_rpc_port(self):
            return 1234

        def batch_register_memory(self, addresses, lengths):
            registered.append((addresses, lengths))
            return 0

        def unregister_memory(self, address):
            pass

        def batch_transfer_async_read(self, session, mine, theirs, lengths):
            posted.append(theirs)
            return 1

        def get_batch_transfer_status(self, batches):
            return 0

        def batch_transfer_sync(self, session, mine, theirs, lengths, opcode, note):
            posted.append(theirs)
            return 0

    fake = types.ModuleType("mooncake.engine")
    fake.TransferEngine = Engine
    fake.TransferNotify = lambda name, msg: (name, msg)
    fake.TransferOpcode = types.SimpleNamespace(Read="r", Write="w")
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", fake)
    from hybridkv.transfer.mooncake_engine import MooncakeEngine

    p, d = offloaded(), decoder()
    src = MooncakeEngine("P", p.regions, host_pool=p.host_regions)
    assert registered == [([r.address for r in (*p.regions.regions, *p.host_regions.regions)],
                           [r.length for r in (*p.regions.regions, *p.host_regions.regions)])]
    export, offer = offer_prefix(p.m, p.regions, p.host_regions, "r", A)
    dst = MooncakeEngine("D", d.regions)
    dst.connect(lambda meta: json.dumps({"name": "P", "session": src.session}).encode())
    plan = pull_prefix(d.m, dst, "P", offer, 5.0)
    pairs = pair_tiered_descriptors(p.regions, p.host_regions, export.blocks, export.on_host(), d.regions, plan.blocks)
    assert [a for batch in posted for a in batch] == pairs.host.src.addresses(p.host_regions)[:, 0].tolist()
    src.close()
    dst.close()
    export.abort()


def test_minimax_m1_tp8_32k_from_the_host_counts():
    """The figures docs/transfer.md quotes: a 32k prefix of MiniMax-M1 TP8 wholly in the host tier
    (one host id run) into one device id run: one descriptor per plane and block, as a scattered
    request on the device (the host pool interleaves its planes block by block)."""
    from hybridkv.models.presets import preset
    from hybridkv.planner.layout import plan

    counts = {}
    for kind in ("paged", "padded"):
        layout = plan(preset("minimax-m1", state_dtype="float32", tp_size=8), 8 << 30, layout=kind)
        n = layout.footprint(32768).num_blocks
        dev, host = PoolRegions.contiguous(layout, 1 << 40), PoolRegions.block_major(layout, 1 << 41, n)
        bps = np.cumsum((0, *layout.blocks_per_state))

        def blocks(ids, bps=bps, layout=layout):
            ids = np.asarray(ids, dtype=np.int32)
            sets = tuple(ids[bps[g] : bps[g + 1]] for g in range(layout.num_state_groups))
            return RequestBlocks(32768, ids[bps[-1] :], sets)

        on_host = np.ones(n, dtype=bool)
        pairs = pair_tiered_descriptors(dev, host, blocks(range(n)), on_host, dev, blocks(range(1, n + 1)))
        counts[kind] = (n, len(pairs.device), len(pairs.host), int(pairs.host.src.length.max()), pairs.num_bytes)
    assert counts == {"paged": (624, 0, 12480, 16384, 204472320), "padded": (39, 0, 780, 262144, 204472320)}


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["export", "pull", "abort", "flood", "host_room", "local_hit"]), max_size=12))
def test_pending_exports_survive_whatever_the_source_does(program):
    """Random programs on the source while exports are pending: new exports, pulls (each checked
    byte for byte against what the forward wrote), aborts, device floods (evictions, offloads, host
    LRU), a swap-out's ``make_room`` of all the host room, local hits on the prefix. The books
    balance after every step; at the end every hold is gone."""
    p = offloaded(evict_all=False)
    tier = p.m.prefix_cache.tier
    pending = []
    for i, op in enumerate(program):
        if op == "export" and exportable_tokens(p.m, A):
            pending.append(export_prefix(p.m, A))
        elif op == "pull" and pending:
            export = pending.pop(0)
            d = decoder()
            dst = d.m.import_request("r", export.num_tokens)
            pairs = pair_tiered_descriptors(p.regions, p.host_regions, export.blocks, export.on_host(), d.regions,
                                            dst.blocks)
            copy_pairs([p.dev.reshape(-1)], [d.dev.reshape(-1)], pairs.device)
            copy_pairs([p.host.reshape(-1)], [d.dev.reshape(-1)], pairs.host)
            assert reference_bytes(d.dev, d.layout, dst.blocks) == p.truth(A, export.num_tokens)
            export.commit()
        elif op == "abort" and pending:
            pending.pop().abort()
        elif op == "flood":
            p.prefill(("f", i), [9000 + 100 * i + j for j in range(24)])
            p.m.free(("f", i))
            p.m.release_pins()
            p.evict(p.m.num_available_blocks - p.m.num_state_blocks)
        elif op == "host_room":
            tier.make_room(p.m.host_pool.num_free + tier.num_evictable)
        elif op == "local_hit" and p.m.match_prefix(A):
            p.prefill(("l", i), A)
            p.m.free(("l", i))
            p.m.release_pins()
        p.m.check_integrity()
    for export in pending:
        export.abort()
    assert not tier._holds and not p.m._export_kv and tier.num_evictable == tier.num_blocks
    assert p.m.prefix_cache.num_evictable == p.m.usage().evictable
    p.m.check_integrity()

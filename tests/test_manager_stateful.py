"""Hypothesis stateful test: random operation sequences on random small layouts, checking data.

Layouts mix attention with state groups of different sizes (``blocks_per_state`` differs between
groups) or have no attention at all. Operations: allocate (with a prefix cache: long shared prompts,
prefix hits whose checkpoint is copied into the live sets), append (copy-on-write of a shared tail),
forwards (after which the request's blocks enter the prefix cache: ``checkpoint`` or
``mark_computed``), the prefix cache's host tier (evicted cached blocks and checkpoints offloaded to
the host pool the swaps use, host hits copied back, host eviction, swap-outs taking host blocks from
the tier; its copies are taken after every call and queued before the call's own), later turns
of freed requests (``allocate_again``: device hits, host hits or misses), free (also before the
forward), fork (also in the middle of a verify step), swap plans left open while other requests
change and settled later (commit, or abort after a transfer that scribbled over its target), verify
steps opened and committed later, checkpoints cancelled, pin epochs opened and released as a scheduler does.

The executor is LAZY (``mode="lazy"`` or ``"tight"``): every copy and swap the manager hands out is
queued (:class:`~tests.shadow.Ledger`) and runs later, in hand-out order: when the executor catches
up (all or part of the queue), or when a forward needs it (a forward waits only for queued copies
that write a block it reads or writes, or read a block it writes). ``"lazy"`` says which copies ran
(``release_pins(before=...)``) only when it catches up, ``"tight"`` after every call (then only the
queued copies hold pins). When an op runs its source must still hold the bytes of hand-out, and no block a queued copy
touches, nor one of a copy whose pin epoch was not released, may be handed to a new holder (HOLDER).
So a copy-on-write whose source is a cached block (a fork in the middle of a verify step, the
parent's rejected drafts cut back into the shared block) is queued while the other holder fills the
cache and leaves, and the next allocation must not evict that source. ``mode="eager"`` runs every
copy before the next call (no pins); ``"pins"`` too, with pins on and released late.

After every step ``check_integrity()`` holds, every request reads exactly its own KV and state as the
manager means it (every op applied at hand-out) and, where nothing queued touches it, as the executor
ran it; every held block agrees between the two. At the end every op ran, no pins are left, every
cached KV block and checkpoint holds its node's bytes, a second user's prefix hits read them, and
every block is back.

``MANAGER_STATEFUL_EXAMPLES`` sets the number of examples (CI runs the default).
"""

import dataclasses
import os
import random
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.blockmgr.errors import AllocationError, LayoutError
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.records import RequestStatus, SwapDirection
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.blockmgr.units import cdiv
from hybridkv.errors import RequestStateError
from hybridkv.models.spec import SideTensor
from tests.shadow import Ledger, prefix_hashes


def _recurrent(elems: int, dtype: DType = DType.FLOAT32) -> RecurrentLayerSpec:
    """int8 / fp8: ``elems`` values then one float32 scale, all in the state set."""
    return RecurrentLayerSpec("gla", (StateComponent("kv", (elems,), dtype),))


def _own_exports(cfg: PrefixCacheConfig) -> PrefixCacheConfig:
    """Exports (a prefill kernel writing states inside a chunk) under hybridkv's own policies."""
    return dataclasses.replace(cfg, export_alignment=None) if cfg.checkpoint is CheckpointPolicy.VLLM_ALIGN else cfg


prefix_on = st.builds(
    PrefixCacheConfig,
    st.sampled_from(CheckpointPolicy),
    st.sampled_from(EvictionPolicy),
    st.integers(1, 3),
    evict_batch_fraction=st.sampled_from([0.01, 0.3]),
    demote_tail=st.booleans(),
    export_alignment=st.sampled_from([None, 1, 1, 4]),
    in_place_state=st.sampled_from([False, False, True]),  # in-place checkpoints (no host pool, no drafts then)
).map(_own_exports)


# the draws of ManagerMachine.setup (a subclass that also draws at the start extends them)
SETUP_DRAWS = dict(
    num_attention=st.integers(0, 3),
    state_sizes=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    layers_per_size=st.integers(1, 3),
    block_size=st.integers(1, 8),
    num_blocks=st.integers(8, 80),
    num_host_blocks=st.integers(0, 40),
    watermark=st.sampled_from([0.0, 0.05]),
    mode=st.sampled_from(["lazy", "lazy", "tight", "tight", "pins", "eager"]),
    prefix=st.one_of(st.none(), prefix_on, prefix_on.map(lambda c: c), prefix_on.filter(lambda c: True)),
    templates=st.lists(st.integers(4, 48), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    host_tier=st.booleans(),
    side=st.booleans(),
    state_dtype=st.sampled_from([DType.FLOAT32, DType.FLOAT32, DType.INT8, DType.FLOAT8_E4M3]),
)


class ManagerMachine(RuleBasedStateMachine):
    TIER_ONLY = False  # a subclass sets it: every example with the host tier on
    IN_PLACE_ONLY = False  # a subclass sets it: in-place checkpoints and exports (_in_place_setup) in every example
    @initialize(**SETUP_DRAWS)
    def setup(
        self,
        num_attention,
        state_sizes,
        layers_per_size,
        block_size,
        num_blocks,
        num_host_blocks,
        watermark,
        mode,
        prefix,
        templates,
        seed,
        host_tier,
        side=False,
        state_dtype=DType.FLOAT32,
    ):
        attn = AttentionLayerSpec(1, 4, DType.FLOAT16)
        if side:  # MLA-shaped (K only) with per-token side tensors after it in the slot
            attn = AttentionLayerSpec(1, 4, DType.FLOAT16, v_head_dim=0, side=(SideTensor("idx", 4, DType.FLOAT16),))
        layers = (attn,) * num_attention
        for elems in state_sizes:  # several sizes: state groups with different blocks_per_state
            layers += (_recurrent(elems, state_dtype),) * layers_per_size
        model = ModelSpec("random", layers)
        probe = plan(model, 1 << 30, block_size=block_size)
        try:
            layout = plan(model, num_blocks * probe.bytes_per_block, block_size=block_size)
        except LayoutError:
            layout = plan(model, 8 * probe.bytes_per_block, block_size=block_size)
        if self.TIER_ONLY:  # (tests/test_host_tier_stateful.py) the tier on, with checkpoints that occur
            policy = CheckpointPolicy.BRANCH_AND_LAST if seed % 3 == 0 else CheckpointPolicy.EVERY_N_BLOCKS
            base = prefix or PrefixCacheConfig()
            prefix = dataclasses.replace(base, checkpoint=policy, every_n=1 + seed % 2)
            num_host_blocks = max(num_host_blocks, 2)
            host_tier = True
        if self.IN_PLACE_ONLY:  # (tests/test_manager_stateful_inplace.py) its config, room for a few requests
            prefix, layout = self._in_place_setup(prefix or PrefixCacheConfig(), seed, model, layout)
        if prefix is not None and prefix.in_place_state:  # (the manager refuses a host pool with it)
            num_host_blocks = 0
        if prefix is not None and host_tier and num_host_blocks:  # the host tier shares the swap pool
            prefix = dataclasses.replace(prefix, host_tier=True)
        self.m = HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark, prefix_cache=prefix)
        self.mode = mode
        self.pins = mode != "eager"
        if self.pins:
            self.m.begin_pin_epoch()
        self.ledger = Ledger(self.m)
        self.shadow = self.ledger.real
        self.rng = random.Random(seed)
        self.templates = [[1_000_000 * (t + 1) + j for j in range(n)] for t, n in enumerate(templates)]
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # each request's token ids (its KV content)
        self.given: dict[int, int] = {}  # token ids the manager has (prefix cache), per request given them
        self.kv_done: dict[int, int] = {}  # KV positions written
        self.state_pos: dict[int, int] = {}  # the prefix length its live state summarises
        self.fwd: dict[int, tuple[int, int]] = {}  # forwards handed out (allocate, append) not yet run
        self.exports: dict[int, list] = {}  # (position, sets) the forward handed out writes inside its chunk
        self.verify: dict[int, tuple[int, int]] = {}  # open verify steps: (tokens before, drafts)
        self.plans: dict[int, object] = {}  # open swap plans
        self.history: list[list[int]] = []  # token lists of requests freed after a forward

    # ---- helpers ---------------------------------------------------------------------------------
    def _running(self):
        """Running requests with nothing open: no swap plan, no verify step, no forward not yet run."""
        return [
            r
            for r, rec in self.m.requests.items()
            if rec.status is RequestStatus.RUNNING
            and rec.pending is None
            and r not in self.verify
            and r not in self.fwd
        ]

    def _swapped(self):
        return [r for r, rec in self.m.requests.items() if rec.status is RequestStatus.SWAPPED and rec.pending is None]

    def _new_tokens(self, n):
        return [self.rng.randrange(1000) for _ in range(n)]

    def _blocks(self, r):
        return self.m.requests[r].kv_blocks

    def _live_ids(self, r) -> list[int]:
        return self.m.requests[r].state[self.m._state_mask].tolist()

    def _wait_for(self, r, start, end, spec=0):
        """The queued copies the forward of ``r`` over ``[start, end)`` must wait for run first."""
        bs, kv = self.m.block_size, self._blocks(r)
        live = self._live_ids(r)
        reads = set(kv[: cdiv(end, bs)].tolist()) | set(live) if self.m._has_kv else set(live)
        writes = set(kv[start // bs : cdiv(end, bs)].tolist()) if self.m._has_kv and end > start else set()
        writes |= set(live)
        for sets in self.m.speculative_table(r)[:spec]:
            writes |= set(sets[self.m._state_mask].tolist())
        for _, sets in self.exports.get(r, ()):  # (an offload its reservation's eviction handed out reads them)
            writes |= set(sets[self.m._state_mask].tolist())
        self.ledger.flush_for(reads | writes, writes, f"forward of {r}")

    def _register(self, r, data):
        """After a forward: the request's computed blocks enter the prefix cache, with a checkpoint
        if the policy wants one (its copy is queued) or without."""
        exported = [pos for pos, _ in self.exports.pop(r, ())]
        if self.m.prefix_cache is None or r not in self.given:
            return
        if exported:  # they become checkpoints where the policy keeps one (else given back)
            self.m.checkpoint(r, final=data.draw(st.booleans()), exported=exported)
        elif self.TIER_ONLY or self.IN_PLACE_ONLY or data.draw(st.booleans()):
            self.m.checkpoint(r, final=data.draw(st.booleans()))
        else:
            self.m.mark_computed(r, self.m.requests[r].num_tokens)

    def _end_of_rule(self):
        if self.mode in ("pins", "eager"):  # run every copy before the next call
            self.ledger.run_all("eager executor")
        elif self.mode == "tight":  # say at once which copies ran: only the queued ones stay pinned
            self._release()

    def _release(self):
        """The executor says which copies ran: every epoch before the oldest one still queued."""
        if self.pins:
            newest = self.m.begin_pin_epoch()
            oldest = self.ledger.oldest_queued_epoch()
            self.m.release_pins(before=newest if oldest is None else oldest)

    # ---- rules -----------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        own=st.integers(0, 20),
        template=st.integers(0, 2),
        shared=st.integers(0, 48),
        k=st.integers(0, 2),
        with_ids=st.booleans(),
    )
    def allocate(self, data, own, template, shared, k, with_ids):
        t = self.templates[template % len(self.templates)]
        tokens = t[:shared] + self._new_tokens(own)
        n = len(tokens)
        ids = tokens if n and (with_ids or self.TIER_ONLY or data.draw(st.booleans())) else None
        self._admit(data, tokens, ids, k)

    def _admit(self, data, tokens, ids, k, exact=False):
        """Allocate a new request of ``tokens`` (with token ids ``ids`` or none); ``exact``: check
        that the available count drops by exactly what ``blocks_to_admit`` says."""
        if self.m.prefix_cache is not None and self.m.prefix_cache.config.in_place_state:
            k = 0  # (an engine with in-place checkpoints runs no drafts: speculative sets stop the lending)
        n = len(tokens)
        ok = self.m.can_allocate(n, k, ids)
        avail = self.m.num_available_blocks
        taken = self.m.blocks_to_admit(n, k, ids) if exact else 0
        r = self.next_id = self.next_id + 1
        try:
            alloc = self.m.allocate(r, n, k, token_ids=ids)
        except AllocationError:
            assert not ok
            return
        assert ok and (not exact or self.m.num_available_blocks == avail - taken)  # the one count
        c = alloc.num_cached_tokens
        self.tokens[r] = list(tokens)
        if ids is not None and self.m.prefix_cache is not None:
            self.given[r] = n
        self.kv_done[r] = self.state_pos[r] = c
        self.fwd[r] = (c, n)
        self._reserve_exports(r, c, n)
        if data.draw(st.booleans()):
            self.forward(data, r)
        self._end_of_rule()

    @precondition(lambda self: self.history and self.m.prefix_cache is not None)
    @rule(data=st.data(), own=st.integers(0, 6), k=st.integers(0, 1))
    def allocate_again(self, data, own, k):
        """A later turn: a freed request's computed tokens again (and a few more), after other
        requests may have evicted them: a hit on the device, on the host tier, or a miss."""
        tokens = data.draw(st.sampled_from(self.history[-6:])) + self._new_tokens(own)
        if not tokens:
            return
        self._admit(data, tokens, tokens, k, exact=True)  # (host hits included in the one count)

    @rule(data=st.data(), k=st.integers(0, 1), short=st.integers(0, 2))
    def allocate_all(self, data, k, short):
        """A long prompt that takes (nearly) every available block: eviction of whatever is cached."""
        m = self.m
        spare = m.num_available_blocks - m.watermark_blocks - (1 + k) * m.num_state_blocks - short
        if spare < 0 or not m._has_kv:
            return
        n = max(spare * m.block_size, 1)
        if not m.can_allocate(n, k):
            return
        r = self.next_id = self.next_id + 1
        m.allocate(r, n, k)
        self.tokens[r] = self._new_tokens(n)
        self.kv_done[r] = self.state_pos[r] = 0
        self.fwd[r] = (0, n)
        if data.draw(st.booleans()):
            self.forward(data, r)
        self._end_of_rule()

    @precondition(lambda self: self.fwd)
    @rule(data=st.data())
    def forward(self, data, r=None):
        """Run a forward handed out earlier: check what it reads, write KV and the state after it."""
        if r is None:
            r = data.draw(st.sampled_from(sorted(self.fwd)))
        start, end = self.fwd.pop(r)
        self._wait_for(r, start, end)
        h = prefix_hashes(self.tokens[r])
        self.ledger.note_prefixes(self.tokens[r], h)
        self.shadow.check_kv(f"forward of {r} reads", self._blocks(r), h, start)
        if self.state_pos[r]:
            self.shadow.check_state(f"forward of {r} reads", self._live_ids_sets(r), h[self.state_pos[r]])
        self.ledger.write_kv(self._blocks(r), h, start, end)
        self.ledger.write_state(self._live_ids_sets(r), h[end])
        for pos, sets in self.exports.get(r, ()):  # the kernel's exports from inside the chunk
            assert start < pos < end
            self.ledger.write_state(sets, h[pos])
        self.kv_done[r] = self.state_pos[r] = end
        self._register(r, data)
        self._end_of_rule()

    def _live_ids_sets(self, r):
        return self.m.requests[r].state

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(0, 20))
    def append(self, data, n):
        self._append(data, data.draw(st.sampled_from(self._running())), n, None)

    def _append(self, data, r, n, run_forward) -> bool:
        ok = self.m.can_append(r, n)
        before = self.m.requests[r].num_tokens
        if before + n > len(self.tokens[r]):
            extra = self._new_tokens(before + n - len(self.tokens[r]))
        else:
            extra = []
        lent = self.m.num_state_blocks if r in self.m._lent and n else 0  # (in place: new live sets, copied)
        try:
            given = self.given.get(r)
            copies = self.m.append(r, n, token_ids=self._peek_give(r, before + n, extra))
        except AllocationError:
            assert not ok and self.m.requests[r].num_tokens == before
            if given is not None:
                self.given[r] = given
            return False
        assert ok and self.m.requests[r].num_tokens == before + n and len(copies) <= 1 + lent
        if lent:
            event("in-place: an append took new live sets")
        self.tokens[r] += extra
        self.fwd[r] = (before, before + n)
        self._reserve_exports(r, before, before + n)
        if data.draw(st.booleans()) if run_forward is None else run_forward:
            self.forward(data, r)
        self._end_of_rule()
        return True

    def _reserve_exports(self, r, start, end):
        """Sets for the states the prefill kernel exports inside the forward ``[start, end)``."""
        if end - start < 2 or r not in self.given:
            return
        for pos in self.m.export_positions(r, start, end):
            sets = self.m.reserve_export(r, pos)
            if sets is None:
                break
            self.exports.setdefault(r, []).append((pos, sets))
            event("prefill kernel exports")

    def _peek_give(self, r, end, extra):
        if r not in self.given:
            return None
        known = self.tokens[r] + extra
        if self.given[r] >= end:
            return None
        ids = known[self.given[r] : end]
        self.given[r] = end
        return ids

    @rule(n=st.integers(1, 40), fill=st.booleans(), commit=st.booleans())
    def pull(self, n, fill, commit):
        """A request pulled from a peer (disaggregated decode, a prefix handoff): ``import_request``
        takes blocks as ``allocate`` does (evicting cached blocks, whose offloads the host tier
        queues) and the peer's READ lands in them at once, before any queued copy runs; then the
        plan commits (the request runs on) or aborts (its blocks go back, bytes undefined).
        ``fill``: it takes (nearly) every available block, evicting what is cached."""
        m = self.m
        if fill and m._has_kv:
            n = max((m.num_available_blocks - m.watermark_blocks - m.num_state_blocks) * m.block_size - n % 3, 1)
        if not m.can_allocate(n):
            return
        # a pull comes between steps: the copies handed out so far ran (the last plan's stage 0 and
        # forward); what the import's own evictions queue in the tier runs only in the next plan
        self.ledger.run_all("executor, before a pull")
        self._release()
        r = self.next_id = self.next_id + 1
        try:
            plan = m.import_request(r, n)
        except AllocationError:  # (a queued onload reads a block it would get: retry later)
            return
        rec = m.requests[r]
        tokens = self._new_tokens(n)
        h = prefix_hashes(tokens)
        self.ledger.note_prefixes(tokens, h)
        self.ledger.write_kv(rec.kv_blocks, h, 0, n)
        self.ledger.write_state(rec.state, h[n])
        if commit:
            plan.commit()
            self.tokens[r] = tokens
            self.kv_done[r] = self.state_pos[r] = n
        else:
            plan.abort()
        self._end_of_rule()

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def free(self, data, r=None):
        """Also before the forward handed out for it ran (an abort: the forward never runs)."""
        if r is None:
            r = data.draw(st.sampled_from(sorted(self.m.requests)))
        if self.m.requests[r].pending is None:
            if r not in self.fwd and r not in self.verify and self.m.requests[r].status is RequestStatus.RUNNING:
                self.history.append(self.tokens[r][: self.kv_done[r]])
            self.m.free(r)
            self.verify.pop(r, None)
            self.fwd.pop(r, None)
            self.exports.pop(r, None)
        self._end_of_rule()

    @precondition(
        lambda self: [
            r
            for r in self.m.requests
            if self.m.requests[r].pending is None
            and self.m.requests[r].status is RequestStatus.RUNNING
            and r not in self.fwd
        ]
    )
    @rule(data=st.data())
    def fork(self, data, parent=None):
        """Also in the middle of a verify step: the child takes the drafts' KV and the live state."""
        if parent is None:
            live = [
                r
                for r, rec in self.m.requests.items()
                if rec.pending is None and rec.status is RequestStatus.RUNNING and r not in self.fwd
            ]
            parent = data.draw(st.sampled_from(sorted(live)))
        child = self.next_id = self.next_id + 1
        try:
            copies = self.m.fork(parent, child)
        except AllocationError:
            return
        assert len(copies) == self.m.num_state_blocks
        self.tokens[child] = list(self.tokens[parent])
        self.state_pos[child] = self.state_pos[parent]
        self.kv_done[child] = len(self.tokens[parent])
        if parent in self.given:
            self.given[child] = self.given[parent]
        self._end_of_rule()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), settle_now=st.booleans())
    def swap_out(self, data, settle_now):
        r = data.draw(st.sampled_from(self._running()))
        try:
            self.plans[r] = self.m.swap_out(r)
        except AllocationError:
            return
        if settle_now:
            self.settle(data, r)
        self._end_of_rule()

    @precondition(lambda self: self._swapped())
    @rule(data=st.data(), settle_now=st.booleans())
    def swap_in(self, data, settle_now):
        r = data.draw(st.sampled_from(self._swapped()))
        ok = self.m.can_swap_in(r)
        try:
            self.plans[r] = self.m.swap_in(r)
        except AllocationError:
            assert not ok
            return
        assert ok
        if settle_now:
            self.settle(data, r)
        self._end_of_rule()

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def settle(self, data, r=None):
        """Run an open plan's copies now (late: other requests changed meanwhile; everything handed
        out before it runs first), then commit; or fail half-way and abort."""
        if r is None:
            r = data.draw(st.sampled_from(sorted(self.plans)))
        swap = self.plans.pop(r)
        led = self.ledger
        i = next((i for i, op in enumerate(led.queue) if op.plan is swap), None)
        if i is not None:
            led.run_first(i + 1, f"settle of {r}'s swap")
        if data.draw(st.booleans()):
            swap.commit()
        else:
            if swap.direction is SwapDirection.IN:
                led.scribble(swap.device_blocks)
            swap.abort()
        self._end_of_rule()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), k=st.integers(1, 3))
    def begin_verify(self, data, k):
        """Speculation: the last sampled token plus k drafts run; the live set gets the state after
        the sampled token, speculative set j - 1 the state after draft j."""
        self._begin_verify(data, k, data.draw(st.sampled_from(self._running())))

    def _begin_verify(self, data, k, r) -> bool:
        before = self.m.requests[r].num_tokens
        new = self._new_tokens(1 + k)
        given = self.given.get(r)
        if r in self.m._lent:  # lent live sets do not follow speculative sets (refused)
            event("in-place: a lent request refuses drafts")
            with pytest.raises(RequestStateError, match="speculative"):
                self.m.begin_speculation(r, k)
            return False
        try:
            self.m.begin_speculation(r, k)
            self.m.append(r, 1 + k, token_ids=self._peek_give(r, before + 1, self.tokens[r][before:] + new))
        except AllocationError:
            if given is not None:
                self.given[r] = given
            return False
        del self.tokens[r][before:]
        self.tokens[r] += new
        self._wait_for(r, before, before + 1 + k, spec=k)
        h = prefix_hashes(self.tokens[r])
        self.ledger.note_prefixes(self.tokens[r], h)
        self.shadow.check_kv(f"verify of {r} reads", self._blocks(r), h, before)
        self.shadow.check_state(f"verify of {r} reads", self.m.requests[r].state, h[self.state_pos[r]])
        self.ledger.write_kv(self._blocks(r), h, before, before + 1 + k)
        self.ledger.write_state(self.m.requests[r].state, h[before + 1])
        self.state_pos[r] = before + 1
        self.kv_done[r] = before + 1 + k
        for j, sets in enumerate(self.m.speculative_table(r)[:k]):
            self.ledger.write_state(sets, h[before + 2 + j])
        self.verify[r] = (before, k)
        self._end_of_rule()
        return True

    @precondition(lambda self: self.verify)
    @rule(data=st.data())
    def commit_verify(self, data, r=None):
        if r is None:
            r = data.draw(st.sampled_from(sorted(self.verify)))
        before, k = self.verify.pop(r)
        accepted = data.draw(st.integers(0, k))
        self.m.commit_speculation(r, accepted, k)
        assert self.m.requests[r].num_tokens == before + 1 + accepted
        del self.tokens[r][before + 1 + accepted :]
        self.state_pos[r] = self.kv_done[r] = before + 1 + accepted
        self._register(r, data)
        if data.draw(st.booleans()):
            self.m.end_speculation(r)
        self._end_of_rule()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), k=st.integers(1, 3))
    def fork_in_verify(self, data, k):
        """A verify step, a fork of it (the child keeps the drafts), its commit: with rejected drafts
        the parent's tail is again a partly filled block the child shares, and the child's tokens
        (drafts kept) can fill it and put it in the prefix cache while the parent's copy-on-write of
        it is still queued."""
        r = data.draw(st.sampled_from(self._running()))
        if self._begin_verify(data, k, r):
            self.fork(data, r)
            self.commit_verify(data, r)

    @precondition(lambda self: self._running())
    @rule(
        data=st.data(),
        in_verify=st.booleans(),
        child_writes=st.booleans(),
        writer_forward=st.booleans(),
        writer_leaves=st.booleans(),
        n=st.integers(1, 9),
    )
    def branch_and_leave(self, data, in_verify, child_writes, writer_forward, writer_leaves, n, m=None):
        """Parallel sampling where one branch ends at once: a fork (in a verify step or not), one
        branch writes (its copy-on-write of the shared tail is handed out; its forward runs or
        waits), and one of them leaves after a forward that put its blocks in the prefix cache. The
        block copied on write (source or destination) may now be cached and evictable while its copy
        is queued or its pin not released: the next allocations must not take it."""
        parent = data.draw(st.sampled_from(self._running()))
        before = self.next_id
        if in_verify and self._begin_verify(data, data.draw(st.integers(1, 3)), parent):
            self.fork(data, parent)
            self.commit_verify(data, parent)
        else:
            self.fork(data, parent)
        if self.next_id == before or self.next_id not in self.m.requests:
            return  # the fork did not fit
        child = self.next_id
        writer, other = (child, parent) if child_writes else (parent, child)
        if not self._append(data, writer, n, writer_forward):
            return
        leaver = writer if writer_leaves else other
        if leaver == other:
            self._append(data, other, data.draw(st.integers(1, 9)) if m is None else m, True)
        if leaver not in self.fwd and self.m.requests[leaver].pending is None:
            self.free(data, leaver)
        if data.draw(st.booleans()):  # and a new request takes what is left
            self.allocate_all(data, 0, data.draw(st.integers(0, 2)))

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(1, 4), m=st.integers(1, 9))
    def verify_branch_leaves(self, data, n, m):
        """A fork in a verify step, the parent's drafts rejected (cut back into the block the child
        keeps whole), the parent's next tokens (its copy-on-write of that block queued, its forward
        not run), the child's next tokens and forward (the block enters the prefix cache), the child
        leaves, and a long prompt arrives: the source of the queued copy must not be evicted."""
        self.branch_and_leave(data, True, False, False, False, n, m)

    @precondition(lambda self: self.pins and self.m.prefix_cache is not None)
    @rule()
    def cancel_checkpoints(self):
        """A scheduler's way out of a full pool: drop this epoch's checkpoints (their copies leave the queue)."""
        self.m.cancel_checkpoints(self.m.pin_epoch)

    @precondition(lambda self: self.pins)
    @rule()
    def new_epoch(self):
        self.m.begin_pin_epoch()

    @precondition(lambda self: self.ledger.queue)
    @rule(n=st.integers(1, 4))
    def executor_runs_some(self, n):
        self.ledger.run_first(n, "executor")
        self._release()

    @rule()
    def executor_caught_up(self):
        self.ledger.run_all("executor")
        self._release()

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def books_balance_and_data_follow_requests(self):
        if not hasattr(self, "m"):
            return
        m, led = self.m, self.ledger
        m.check_integrity()
        queued = led.queued_blocks()
        for r, rec in m.requests.items():
            if rec.pending is not None and rec.pending.direction is SwapDirection.IN:
                continue  # its host copy is checked when the plan settles
            h = prefix_hashes(self.tokens[r])
            if rec.status is RequestStatus.SWAPPED:
                self.shadow.check_host(f"swapped {r}", rec.host_blocks, h, rec.num_tokens, h[self.state_pos[r]])
                continue
            assert len(self.tokens[r]) == rec.num_tokens
            pos = self.state_pos[r]
            # as the manager means it (every op applied at hand-out) ...
            led.intent.check_kv(f"request {r} (intent)", rec.kv_blocks, h, self.kv_done[r])
            if pos or r not in self.fwd:
                led.intent.check_state(f"request {r} (intent)", rec.state, h[pos])
            # ... and as the executor ran it, where no queued op writes it
            if r not in self.fwd and not queued.intersection(rec.kv_blocks.tolist() + self._live_ids(r)):
                self.shadow.check_kv(f"request {r}", rec.kv_blocks, h, self.kv_done[r])
                self.shadow.check_state(f"request {r}", rec.state, h[pos])  # pending swap-outs too
        led.check_agree("after the step")
        led.check_host_cache_bytes("after the step")
        running = [r for r, rec in m.requests.items() if rec.status is RequestStatus.RUNNING and rec.pending is None]
        owned = np.concatenate([m.state_table(running).ravel()] + [m.speculative_table(r).ravel() for r in running])
        owned = owned[owned != 0]
        assert np.unique(owned).size == owned.size, "a state block is owned twice"
        u = m.usage()
        assert u.free + u.used + u.evictable + u.null == u.total

    def teardown(self):
        if not hasattr(self, "m") or sys.exc_info()[0] is not None:
            return  # (a step failed: its error is the one to report, not what it left behind)
        m, led = self.m, self.ledger
        for open_plan in getattr(self, "plans", {}).values():
            led.queue = [op for op in led.queue if op.plan is not open_plan]  # never runs
            open_plan.abort()
        led.run_all("executor at the end")
        for r in list(m.requests):
            m.free(r)
        m.release_pins()
        led.check_idle("idle at the end")
        # a second user: prefix hits on what the requests computed read their bytes
        for i, tokens in enumerate(self.history[-8:] + [t for t in self.templates]):
            if m.prefix_cache is None or not tokens or not m.can_allocate(len(tokens), 0, tokens):
                continue
            alloc = m.allocate(("probe", i), len(tokens), 0, token_ids=tokens)
            led.run_all("the probe's hit")
            c = alloc.num_cached_tokens
            h = prefix_hashes(tokens)
            self.shadow.check_kv(f"probe {i} (hit of {c} tokens)", m.requests[("probe", i)].kv_blocks, h, c)
            if c:
                self.shadow.check_state(f"probe {i} (hit of {c} tokens)", m.requests[("probe", i)].state, h[c])
            m.free(("probe", i))
            m.release_pins()
            led.check_idle(f"idle after probe {i}")
        u = m.usage()
        assert u.used == 0 and u.free + u.evictable == u.total - 1, u
        if m.prefix_cache is None:
            assert m.pool.free_extents() == [(1, m.layout.num_blocks)]
        if m.host_pool is not None:  # every host block is back, or cached by the host tier
            assert m.host_pool.num_free + u.host_cached == m.host_pool.num_usable, u


ManagerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("MANAGER_STATEFUL_EXAMPLES", "1000")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerStateful = ManagerMachine.TestCase

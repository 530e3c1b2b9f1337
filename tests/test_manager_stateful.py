"""Hypothesis stateful test: random operation sequences on random small layouts, checking data.

Layouts mix attention with state groups of different sizes (``blocks_per_state`` differs between
groups) or have no attention at all. Operations: allocate, append, free, fork (also in the middle
of a verify step), swap plans left open while other requests change and settled later (commit, or
abort after a transfer that scribbled over its target), verify steps opened and committed later.
A :class:`~tests.shadow.Shadow` plays the executor: it applies every copy and swap the manager hands
out and writes each forward's KV and state. After every step ``check_integrity()`` holds and every
request reads exactly its own KV and state (device or host); at the end every block is back.

``MANAGER_STATEFUL_EXAMPLES`` sets the number of examples (CI runs the default).
"""

import os
import random

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.blockmgr.errors import AllocationError, LayoutError
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestStatus, SwapDirection
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from tests.shadow import Shadow, prefix_hashes


def _recurrent(elems: int) -> RecurrentLayerSpec:
    return RecurrentLayerSpec("gla", (StateComponent("kv", (elems,), DType.FLOAT32),))


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_attention=st.integers(0, 3),
        state_sizes=st.lists(st.integers(1, 200), min_size=1, max_size=3),
        layers_per_size=st.integers(1, 3),
        block_size=st.integers(1, 8),
        num_blocks=st.integers(8, 80),
        num_host_blocks=st.integers(0, 40),
        watermark=st.sampled_from([0.0, 0.05]),
        pins=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        num_attention,
        state_sizes,
        layers_per_size,
        block_size,
        num_blocks,
        num_host_blocks,
        watermark,
        pins,
        seed,
    ):
        attn = AttentionLayerSpec(1, 4, DType.FLOAT16)
        layers = (attn,) * num_attention
        for elems in state_sizes:  # several sizes: state groups with different blocks_per_state
            layers += (_recurrent(elems),) * layers_per_size
        model = ModelSpec("random", layers)
        probe = plan(model, 1 << 30, block_size=block_size)
        try:
            layout = plan(model, num_blocks * probe.bytes_per_block, block_size=block_size)
        except LayoutError:
            layout = plan(model, 8 * probe.bytes_per_block, block_size=block_size)
        self.m = HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark)
        self.pins = pins and hasattr(self.m, "begin_pin_epoch")  # (so the test also runs on older managers)
        if self.pins:
            self.m.begin_pin_epoch()
        self.shadow = Shadow(self.m)
        self.rng = random.Random(seed)
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # each request's token ids (its KV content)
        self.state_pos: dict[int, int] = {}  # the prefix length its live state summarises
        self.verify: dict[int, tuple[int, int]] = {}  # open verify steps: (tokens before, drafts)
        self.plans: dict[int, object] = {}  # open swap plans

    # ---- helpers ---------------------------------------------------------------------------------
    def _running(self):
        return [
            r
            for r, rec in self.m.requests.items()
            if rec.status is RequestStatus.RUNNING and rec.pending is None and r not in self.verify
        ]

    def _swapped(self):
        return [r for r, rec in self.m.requests.items() if rec.status is RequestStatus.SWAPPED and rec.pending is None]

    def _new_tokens(self, n):
        return [self.rng.randrange(1000) for _ in range(n)]

    def _blocks(self, r):
        return self.m.requests[r].kv_blocks

    def _forward(self, r, start, end):
        """Write KV for positions [start, end) and the live state after ``end`` tokens."""
        h = prefix_hashes(self.tokens[r])
        self.shadow.write_kv(self._blocks(r), h, start, end)
        self.shadow.write_state(self.m.state_table([r])[:, 0, :], h[end])
        self.state_pos[r] = end

    def _release(self):
        if self.pins:  # the executor ran every copy handed out so far
            self.m.release_pins(before=self.m.begin_pin_epoch())

    # ---- rules -----------------------------------------------------------------------------------
    @rule(tokens=st.integers(0, 60), k=st.integers(0, 2))
    def allocate(self, tokens, k):
        ok = self.m.can_allocate(tokens, k)
        r = self.next_id = self.next_id + 1
        try:
            self.m.allocate(r, tokens, k)
        except AllocationError:
            assert not ok
            return
        assert ok
        self.tokens[r] = self._new_tokens(tokens)
        self._forward(r, 0, tokens)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(0, 20))
    def append(self, data, n):
        r = data.draw(st.sampled_from(self._running()))
        ok = self.m.can_append(r, n)
        before = self.m.requests[r].num_tokens
        try:
            copies = self.m.append(r, n)
        except AllocationError:
            assert not ok and self.m.requests[r].num_tokens == before
            return
        assert ok and self.m.requests[r].num_tokens == before + n and len(copies) <= 1
        self.shadow.copy(copies)
        self.tokens[r] += self._new_tokens(n)
        self._forward(r, before, before + n)

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(sorted(self.m.requests)))
        if self.m.requests[r].pending is None:
            self.m.free(r)
            self.verify.pop(r, None)

    @precondition(
        lambda self: [
            r
            for r in self.m.requests
            if self.m.requests[r].pending is None and self.m.requests[r].status is RequestStatus.RUNNING
        ]
    )
    @rule(data=st.data())
    def fork(self, data):
        """Also in the middle of a verify step: the child takes the drafts' KV and the live state."""
        live = [r for r, rec in self.m.requests.items() if rec.pending is None and rec.status is RequestStatus.RUNNING]
        parent = data.draw(st.sampled_from(sorted(live)))
        child = self.next_id = self.next_id + 1
        try:
            copies = self.m.fork(parent, child)
        except AllocationError:
            return
        assert len(copies) == self.m.num_state_blocks
        self.shadow.copy(copies)
        self.tokens[child] = list(self.tokens[parent])
        self.state_pos[child] = self.state_pos[parent]

    @precondition(lambda self: self._running())
    @rule(data=st.data(), settle_now=st.booleans())
    def swap_out(self, data, settle_now):
        r = data.draw(st.sampled_from(self._running()))
        try:
            self.plans[r] = self.m.swap_out(r)
        except AllocationError:
            return
        if settle_now:
            self.settle(data)

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
            self.settle(data)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def settle(self, data):
        """Run an open plan's copies now (late: other requests changed meanwhile), then commit; or
        fail half-way and abort."""
        r = data.draw(st.sampled_from(sorted(self.plans)))
        plan = self.plans.pop(r)
        if data.draw(st.booleans()):
            self.shadow.swap(plan)
            plan.commit()
        else:
            if plan.direction is SwapDirection.IN:
                self.shadow.scribble(plan.device_blocks)
            plan.abort()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), k=st.integers(1, 3))
    def begin_verify(self, data, k):
        """Speculation: the last sampled token plus k drafts run; the live set gets the state after
        the sampled token, speculative set j - 1 the state after draft j."""
        r = data.draw(st.sampled_from(self._running()))
        before = self.m.requests[r].num_tokens
        try:
            self.m.begin_speculation(r, k)
            copies = self.m.append(r, 1 + k)
        except AllocationError:
            return
        self.shadow.copy(copies)
        self.tokens[r] += self._new_tokens(1 + k)
        h = prefix_hashes(self.tokens[r])
        self.shadow.write_kv(self._blocks(r), h, before, before + 1 + k)
        self.shadow.write_state(self.m.state_table([r])[:, 0, :], h[before + 1])
        self.state_pos[r] = before + 1
        for j, sets in enumerate(self.m.speculative_table(r)[:k]):
            self.shadow.write_state(sets, h[before + 2 + j])
        self.verify[r] = (before, k)

    @precondition(lambda self: self.verify)
    @rule(data=st.data())
    def commit_verify(self, data):
        r = data.draw(st.sampled_from(sorted(self.verify)))
        before, k = self.verify.pop(r)
        accepted = data.draw(st.integers(0, k))
        self.m.commit_speculation(r, accepted, k)
        assert self.m.requests[r].num_tokens == before + 1 + accepted
        del self.tokens[r][before + 1 + accepted :]
        self.state_pos[r] = before + 1 + accepted
        if data.draw(st.booleans()):
            self.m.end_speculation(r)

    @rule()
    def executor_caught_up(self):
        self._release()

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def books_balance_and_data_follow_requests(self):
        if not hasattr(self, "m"):
            return
        m = self.m
        m.check_integrity()
        for r, rec in m.requests.items():
            if rec.pending is not None and rec.pending.direction is SwapDirection.IN:
                continue  # its host copy is checked when the plan settles
            h = prefix_hashes(self.tokens[r])
            if rec.status is RequestStatus.SWAPPED:
                self.shadow.check_host(f"swapped {r}", rec.host_blocks, h, rec.num_tokens, h[self.state_pos[r]])
                continue
            assert len(self.tokens[r]) == rec.num_tokens
            self.shadow.check_kv(f"request {r}", rec.kv_blocks, h, rec.num_tokens)
            self.shadow.check_state(f"request {r}", rec.state, h[self.state_pos[r]])  # pending swap-outs too
        running = [r for r, rec in m.requests.items() if rec.status is RequestStatus.RUNNING and rec.pending is None]
        owned = np.concatenate([m.state_table(running).ravel()] + [m.speculative_table(r).ravel() for r in running])
        owned = owned[owned != 0]
        assert np.unique(owned).size == owned.size, "a state block is owned twice"
        u = m.usage()
        assert u.free + u.used + u.evictable + u.null == u.total

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for open_plan in getattr(self, "plans", {}).values():
            open_plan.abort()
        for r in list(self.m.requests):
            self.m.free(r)
        self.m.release_pins()
        self.m.check_integrity()
        assert self.m.pool.free_extents() == [(1, self.m.layout.num_blocks)]
        if self.m.host_pool is not None:
            assert self.m.host_pool.num_free == self.m.host_pool.num_usable


ManagerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("MANAGER_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerStateful = ManagerMachine.TestCase

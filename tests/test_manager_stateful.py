"""Hypothesis stateful test: random operation sequences on random small layouts.

After every step ``check_integrity()`` holds and no state block is owned by two live requests;
at the end every request is freed and every device and host block is back in its free pool.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.blockmgr.errors import AllocationError, LayoutError
from hybridkv.blockmgr.layout import plan
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestStatus
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_attention=st.integers(0, 3),
        num_recurrent=st.integers(1, 6),
        state_elems=st.integers(1, 200),
        block_size=st.integers(1, 8),
        num_blocks=st.integers(8, 80),
        num_host_blocks=st.integers(0, 40),
        watermark=st.sampled_from([0.0, 0.05]),
    )
    def setup(self, num_attention, num_recurrent, state_elems, block_size, num_blocks, num_host_blocks, watermark):
        attn = AttentionLayerSpec(1, 4, DType.FLOAT16)
        rec = RecurrentLayerSpec("gla", (StateComponent("kv", (state_elems,), DType.FLOAT32),))
        model = ModelSpec("random", (attn,) * num_attention + (rec,) * num_recurrent)
        probe = plan(model, 1 << 30, block_size=block_size)
        try:
            layout = plan(model, num_blocks * probe.bytes_per_block, block_size=block_size)
        except LayoutError:
            layout = plan(model, 8 * probe.bytes_per_block, block_size=block_size)
        self.m = HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark)
        self.next_id = 0

    def _running(self):
        return [r for r, rec in self.m.requests.items() if rec.status is RequestStatus.RUNNING and rec.pending is None]

    def _swapped(self):
        return [r for r, rec in self.m.requests.items() if rec.status is RequestStatus.SWAPPED]

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(tokens=st.integers(0, 60), k=st.integers(0, 2))
    def allocate(self, tokens, k):
        ok = self.m.can_allocate(tokens, k)
        try:
            self.m.allocate(self._new_id(), tokens, k)
            assert ok
        except AllocationError:
            assert not ok

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(0, 20))
    def append(self, data, n):
        r = data.draw(st.sampled_from(self._running()))
        ok = self.m.can_append(r, n)
        before = self.m.requests[r].num_tokens
        try:
            copies = self.m.append(r, n)
            assert ok and self.m.requests[r].num_tokens == before + n
            assert len(copies) <= 1
        except AllocationError:
            assert not ok and self.m.requests[r].num_tokens == before

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(sorted(self.m.requests)))
        if self.m.requests[r].pending is None:
            self.m.free(r)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._running()))
        try:
            copies = self.m.fork(parent, self._new_id())
            assert len(copies) == self.m.num_state_blocks
        except AllocationError:
            pass

    def _swap(self, make_plan, commit):
        try:
            plan = make_plan()
        except AllocationError:
            return
        self.m.check_integrity()  # the reservation is on the books while the plan is pending
        plan.commit() if commit else plan.abort()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), commit=st.booleans())
    def swap_out(self, data, commit):
        r = data.draw(st.sampled_from(self._running()))
        self._swap(lambda: self.m.swap_out(r), commit)

    @precondition(lambda self: self._swapped())
    @rule(data=st.data(), commit=st.booleans())
    def swap_in(self, data, commit):
        r = data.draw(st.sampled_from(self._swapped()))
        self._swap(lambda: self.m.swap_in(r), commit)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), k=st.integers(1, 3))
    def speculate(self, data, k):
        r = data.draw(st.sampled_from(self._running()))
        try:
            self.m.begin_speculation(r, k)
            self.m.append(r, 1 + k)
        except AllocationError:
            return
        before = self.m.requests[r].num_tokens
        accepted = data.draw(st.integers(0, k))
        self.m.commit_speculation(r, accepted)
        assert self.m.requests[r].num_tokens == before - (k - accepted)
        if data.draw(st.booleans()):
            self.m.end_speculation(r)

    @invariant()
    def books_balance(self):
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        running = self._running()
        owned = np.concatenate(
            [self.m.state_table(running).ravel()] + [self.m.speculative_table(r).ravel() for r in running]
        )
        owned = owned[owned != 0]
        assert np.unique(owned).size == owned.size, "a state block is owned twice"
        u = self.m.usage()
        assert u.free + u.used + u.evictable + u.null == u.total

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for r, rec in list(self.m.requests.items()):
            if rec.pending is not None:
                rec.pending.abort()
            self.m.free(r)
        self.m.check_integrity()
        assert self.m.pool.free_extents() == [(1, self.m.layout.num_blocks)]
        if self.m.host_pool is not None:
            assert self.m.host_pool.num_free == self.m.host_pool.num_usable


ManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerStateful = ManagerMachine.TestCase

"""The manager's data-checking stateful test (tests/test_manager_stateful.py) with in-place
checkpoints (``PrefixCacheConfig(in_place_state=True)``) and exports in every example, under
hybridkv's own checkpoint policies (vLLM's align mode has tests/test_vllm_in_place.py).

Every request is given its token ids and most prompts and appends end on a block boundary, so the
forward's checkpoint there is the request's live sets, lent where they are (``_lend`` with the
node's key, held until the request's next append takes new sets); prompts are prefixes of a few
shared templates, so later requests hit the lent checkpoints (while still lent, or once held or
evictable) and the ones a prefill kernel exported inside a chunk (``export_alignment`` 1 or 4:
``reserve_export``, ``checkpoint(exported=...)``). A request that lent its sets may reclaim them
(``reclaim_lent``: its checkpoint leaves the cache and it runs on in those sets). No drafts (an
engine with in-place checkpoints runs none) and no swaps (no host pool with them). Each hit's copy
is checked against the state after exactly the hit's prefix, as in the base test, and after every
step every cached checkpoint no queued copy touches holds the state after its node's prefix.

``IN_PLACE_STATEFUL_EXAMPLES`` sets the number of examples.
"""

import dataclasses
import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from hybridkv.blockmgr.layout import Layout, plan
from hybridkv.blockmgr.prefix import CheckpointPolicy, PrefixCacheConfig
from hybridkv.blockmgr.spec import ModelSpec
from tests.test_manager_stateful import SETUP_DRAWS, ManagerMachine

# hybridkv's own policies (every_n 1 or 2; branch_spaced with a gap of 0 to 2 blocks)
_POLICIES = (
    CheckpointPolicy.EVERY_N_BLOCKS,
    CheckpointPolicy.BRANCH_AND_LAST,
    CheckpointPolicy.BRANCH_LAST_ALIGNED,
    CheckpointPolicy.BRANCH_SPACED,
)


class InPlaceMachine(ManagerMachine):
    IN_PLACE_ONLY = True

    # no drafts (speculative sets stop the lending), no swaps (no host pool)
    begin_verify = fork_in_verify = swap_out = swap_in = settle = None

    @initialize(**SETUP_DRAWS, prime=st.data())
    def setup(self, prime, **drawn):
        super().setup(**drawn)
        self._prime(prime)

    def _prime(self, data):
        """Each example starts with two or three prompts on one template, each computed at once:
        where one ends on a block boundary the policy keeps a checkpoint at, its live sets are
        lent as that checkpoint; a longer one hits it (while it is lent), a shorter one branches
        off inside an earlier one's blocks and the kernel exports the state at the branch point
        inside its chunk."""
        t = self.templates[data.draw(st.integers(0, len(self.templates) - 1))]
        for _ in range(data.draw(st.integers(2, 3))):
            n, own = data.draw(st.integers(1, len(t))), data.draw(st.integers(0, 4))
            self._admit(data, t[:n] + self._new_tokens(own), None, 0)
            if self.next_id in self.fwd:
                self.forward(data, self.next_id)

    def _in_place_setup(
        self, base: PrefixCacheConfig, seed: int, model: ModelSpec, layout: Layout
    ) -> tuple[PrefixCacheConfig, Layout]:
        """The drawn config with in-place checkpoints, exports and one of hybridkv's own policies,
        and the drawn pool grown by four state sets (a few requests, their lent and held sets)."""
        bs = layout.block_size
        prefix = dataclasses.replace(
            base,
            checkpoint=_POLICIES[seed % len(_POLICIES)],
            every_n=1 + seed // 4 % 2,
            min_gap_tokens=bs * (seed // 8 % 3),
            export_alignment=base.export_alignment or 1,
            in_place_state=True,
            host_tier=False,
        )
        blocks = layout.num_blocks + 4 * layout.num_state_blocks_per_request
        return prefix, plan(model, blocks * layout.bytes_per_block, block_size=bs)

    def _begin_verify(self, data, k, r) -> bool:
        return False  # (branch_and_leave forks without a verify step)

    def _admit(self, data, tokens, ids, k, exact=False):
        """Every request gives its token ids; most prompts end on a block boundary (cut back to one:
        a shorter prefix of a template, so other requests share it whole)."""
        bs, n = self.m.block_size, len(tokens)
        if n % bs and data.draw(st.integers(0, 3)):
            tokens = tokens[: n - n % bs] if n > bs else tokens + self._new_tokens(bs - n)
        super()._admit(data, tokens, list(tokens), k, exact)

    def _append(self, data, r, n, run_forward) -> bool:
        """Most appends end on a block boundary (the forward's end state is lent there)."""
        total = self.m.requests[r].num_tokens + n
        if n and total % self.m.block_size and data.draw(st.integers(0, 3)):
            n += -total % self.m.block_size
        return super()._append(data, r, n, run_forward)

    @precondition(lambda self: any(r in self.m._lent for r in self._running()))
    @rule(data=st.data())
    def reclaim_lent(self, data):
        """A request that lent its live sets runs on in them (a scheduler's way out for a request
        running alone that cannot grow): a checkpoint there leaves the cache, the sets held from
        the boundary before go back, and its next append takes no new sets."""
        r = data.draw(st.sampled_from(sorted(r for r in self._running() if r in self.m._lent)))
        assert self.m.reclaim_lent(r)
        event("in-place: reclaim_lent")
        self._end_of_rule()

    @invariant()
    def cached_checkpoints_hold_their_bytes(self):
        """After every step (not only at the end): every cached KV block and checkpoint no queued
        copy touches holds its node's bytes; a lent checkpoint is the request's live sets, an
        exported one the sets the forward wrote inside its chunk."""
        if hasattr(self, "m"):
            self.ledger.check_cache_bytes("after the step")


InPlaceMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("IN_PLACE_STATEFUL_EXAMPLES", "400")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestInPlaceStateful = InPlaceMachine.TestCase

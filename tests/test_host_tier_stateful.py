"""The manager's data-checking stateful test (tests/test_manager_stateful.py) with the prefix cache's
host tier on in every example: checkpoints every block or two (or at branches and ends), tiny device
and host pools, so cached KV blocks and checkpoints are offloaded to the host pool, come back through
host hits, are evicted from the host and give way to swap-outs, while forks, speculation, aborts,
swaps and a lazy executor run as in the base test. Every byte every request reads is checked
against the shadow, and at the end every host-tier unit holds its own bytes.

``HOST_TIER_STATEFUL_EXAMPLES`` sets the number of examples.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.test_manager_stateful import ManagerMachine


class HostTierMachine(ManagerMachine):
    TIER_ONLY = True


HostTierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HOST_TIER_STATEFUL_EXAMPLES", "400")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHostTierStateful = HostTierMachine.TestCase


class _Draws:
    """A stand-in for hypothesis' ``data()`` that returns the values of a printed failing example in order."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        assert self.values, "the pinned example ran out of draws: the rules changed what they draw"
        return self.values.pop(0)  # (fixed code may draw fewer: a copy-on-write can leave a fork no room)


# Issue 43, defect 16 (seed 167349074218245811649097721207520603343, shrunk): a verify step forks a
# branch that keeps the drafts and fills the shared tail block, which enters the prefix cache; the
# parent rejects the drafts (its tail is a partly filled block again, now cached under the drafts'
# tokens, with the branch gone only the parent holds it) and writes its next tokens into that block
# without a copy: the cached node's bytes change (a later hit or a host offload reads the wrong
# tokens) and the branch's next registration of the same block leaves an empty chain node.
_D16 = [
    ("allocate", dict(k=0, own=0, shared=0, template=0, with_ids=False), [True]),
    ("allocate", dict(k=0, own=0, shared=2, template=0, with_ids=False), [True, False]),
    ("swap_out", dict(settle_now=False), [1]),
    ("fork_in_verify", dict(k=1), [2, 0, False, False]),
    ("verify_branch_leaves", dict(m=1, n=1), [3, 1, 0, False, False, False, False]),
    ("free", {}, [3]),
    ("branch_and_leave", dict(child_writes=False, in_verify=False, n=1, writer_forward=False, writer_leaves=False),
     [2, 1, False, False]),
]


@pytest.mark.parametrize(
    "num_blocks, tail",
    [
        (13, []),
        (14, []),
        (14, [("executor_caught_up", {}, []), ("allocate_all", dict(k=0, short=0), [True])]),
    ],
)
def test_seed_16_a_rejected_draft_tail_the_prefix_cache_holds_is_copied_before_it_is_written(num_blocks, tail):
    machine = HostTierMachine()
    machine.setup(
        num_attention=1, state_sizes=[1], layers_per_size=1, block_size=2, num_blocks=num_blocks,
        num_host_blocks=0, watermark=0.0, mode="lazy", prefix=None, templates=[4], seed=0, host_tier=False,
    )
    machine.books_balance_and_data_follow_requests()
    for name, kwargs, draws in _D16 + tail:
        data = _Draws(draws)
        getattr(machine, name)(**({} if name == "executor_caught_up" else {"data": data}), **kwargs)
        machine.books_balance_and_data_follow_requests()
    machine.teardown()

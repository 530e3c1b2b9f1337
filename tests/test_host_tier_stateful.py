"""The manager's data-checking stateful test (tests/test_manager_stateful.py) with the prefix cache's
host tier on in every example: checkpoints every block or two (or at branches and ends), tiny device
and host pools, so cached KV blocks and checkpoints are offloaded to the host pool, come back through
host hits, are evicted from the host and give way to swap-outs, while forks, speculation, aborts,
swaps and a lazy executor run as in the base test. Every byte every request reads is checked
against the shadow, and at the end every host-tier unit holds its own bytes.

``HOST_TIER_STATEFUL_EXAMPLES`` sets the number of examples.
"""

import os

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

"""The scheduler talks to its manager only through :class:`ManagerInterface`: a workload with every
feature on (prefix caching with each policy, swap and recompute preemption, speculation, forks,
aborts) runs through a proxy that lets the scheduler see nothing but the declared members."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig
from hybridkv.scheduler_adapter.interface import ManagerInterface
from hybridkv.scheduler_adapter.synthetic import SyntheticEngine
from tests.test_scheduler import tiny_manager
from tests.test_scheduler_property import play, prefix_configs, workload

EXAMPLES = int(os.environ.get("MANAGER_INTERFACE_EXAMPLES", "60"))
DECLARED = frozenset(
    name
    for name in (*vars(ManagerInterface), *ManagerInterface.__annotations__)
    if not name.startswith("_")
)


class InterfaceOnly:
    """Forwards the declared members to a real manager; anything else is an error."""

    def __init__(self, manager: HybridBlockManager) -> None:
        object.__setattr__(self, "_manager", manager)

    def __getattr__(self, name: str):
        if name not in DECLARED:
            raise AttributeError(f"the scheduler used {name!r}, which ManagerInterface does not declare")
        return getattr(object.__getattribute__(self, "_manager"), name)


def test_the_manager_and_its_subclasses_satisfy_the_interface():
    m = tiny_manager(30, 10, 0.0, None)
    assert isinstance(m, ManagerInterface)
    for name in DECLARED:
        assert hasattr(m, name), name


def test_a_proxy_refuses_what_the_interface_does_not_declare():
    proxy = InterfaceOnly(tiny_manager(30, 10, 0.0, None))
    try:
        proxy.check_integrity  # noqa: B018
    except AttributeError as e:
        assert "does not declare" in str(e)
    else:  # pragma: no cover
        raise AssertionError("the proxy let an undeclared member through")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=prefix_configs, **workload)
def test_the_scheduler_uses_only_the_declared_interface(
    actions, mode, k, num_blocks, num_host_blocks, watermark, max_num_seqs, max_tokens, prefix, accept_rate, seed
):
    m = tiny_manager(num_blocks, num_host_blocks, watermark, prefix)
    s = Scheduler(InterfaceOnly(m), SchedulerConfig(max_num_seqs, max_tokens, k, mode))
    engine = SyntheticEngine(accept_rate, seed)
    aborted: set = set()

    def one_step(abort_mid):
        plan = s.step()
        if abort_mid is not None and plan.scheduled:
            rid = plan.scheduled[abort_mid % len(plan.scheduled)].request_id
            if rid in s.requests:
                s.abort(rid)
                aborted.add(rid)
        s.update(engine.run(plan))
        m.check_integrity()

    play(s, actions, one_step, aborted, manager=m)

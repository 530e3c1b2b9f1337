"""Preemption policy: which running request gives its blocks back, and how (a small strategy object).

The scheduler owns the queues; :class:`Preemptor` talks to the manager: it picks the victim,
chooses recompute or swap (``AUTO``: per victim, by :func:`~hybridkv.scheduler_adapter.gpu.preemption_cost`),
and frees or swaps the victim's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.blockmgr.records import SwapPlan
from hybridkv.scheduler_adapter.gpu import GpuSpec, PreemptionCost, PreemptionMode, preemption_cost
from hybridkv.scheduler_adapter.interface import ManagerInterface
from hybridkv.scheduler_adapter.requests import SchedRequest

SwapExecutor = Callable[[SwapPlan], None]
"""Runs a plan's block copies synchronously; the plan is committed afterwards, or aborted if it raises."""


class Preemptor:
    """``mode``: RECOMPUTE, SWAP (recompute when the host pool has no room) or AUTO."""

    def __init__(
        self,
        manager: ManagerInterface,
        mode: PreemptionMode,
        gpu: GpuSpec,
        swap_executor: SwapExecutor | None = None,
    ) -> None:
        self.manager = manager
        self.mode = mode
        self.gpu = gpu
        self.swap_executor = swap_executor

    @staticmethod
    def choose_victim(running: Sequence[SchedRequest], requester: SchedRequest) -> SchedRequest:
        """The last of ``running`` (sorted by priority, then arrival) after ``requester``: the lowest
        priority, newest request not yet scheduled this step; ``requester`` itself when it is last."""
        i = running.index(requester)
        return running[-1] if i + 1 < len(running) else requester

    def cost(self, req: SchedRequest) -> PreemptionCost:
        """The cost model's view of preempting ``req`` (running) now."""
        rec = self.manager.requests[req.request_id]
        num_blocks = rec.num_kv_blocks + self.manager.num_state_blocks
        return preemption_cost(self.manager.layout, self.gpu, num_blocks, req.num_computed_tokens)

    def mode_for(self, req: SchedRequest) -> PreemptionMode:
        """RECOMPUTE or SWAP for this victim."""
        m = self.manager
        can_swap = m.host_pool is not None and m.can_swap_out(req.request_id)
        if not can_swap or self.mode is PreemptionMode.RECOMPUTE:
            return PreemptionMode.RECOMPUTE
        return self.cost(req).mode if self.mode is PreemptionMode.AUTO else PreemptionMode.SWAP

    def preempt(
        self, req: SchedRequest, allow_swap: bool = True, keep_state: bool = False
    ) -> tuple[PreemptionMode, SwapPlan | None]:
        """Give the victim's device blocks back: a settled swap-out plan, or everything freed
        (a failed swap copy falls back to recompute; ``allow_swap=False`` recomputes). Returns the
        mode used and the plan. ``keep_state``: a recomputed victim's live state becomes the
        checkpoint it owes at its position (``free_keeping_state``)."""
        if allow_swap and self.mode_for(req) is PreemptionMode.SWAP:
            plan = self.manager.swap_out(req.request_id)
            if self.settle(plan):
                return PreemptionMode.SWAP, plan
        if keep_state:
            self.manager.free_keeping_state(req.request_id)
        else:
            self.manager.free(req.request_id)
        return PreemptionMode.RECOMPUTE, None

    def settle(self, plan: SwapPlan) -> bool:
        """Run the copies (with a swap executor) and commit; False if the executor raised (aborted)."""
        if self.swap_executor is not None:
            try:
                self.swap_executor(plan)
            except Exception:
                plan.abort()
                return False
        plan.commit()
        return True

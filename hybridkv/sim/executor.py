"""A simulated executor: runs a :class:`StepPlan` on the clock, moving no data.

It honours the step plan contract of the scheduler (docs/scheduler.md "One step") and checks it:
swap plans arrive settled (committed), device copies name real blocks, copies run in the contract's
order (checkpoint copies, swap-outs, swap-ins, copies), and every swapped-in request runs in the
step that resumed it. What a real executor would move is counted in blocks and priced by the one
cost model (:class:`~hybridkv.sim.cost.StepCostModel`).

It also prices what memory pressure costs in a step: the seconds its swaps keep the host link
busy, and the tokens it computes a second time (a row starting below what its request had
computed before a recompute preemption) with their FLOPs at the cost model's effective rate, the
price ``preemption='auto'`` compares against a swap (:func:`~hybridkv.scheduler_adapter.gpu.preemption_cost`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import BlockCopies, RequestId, SwapDirection, SwapPlan
from hybridkv.errors import HybridKVError
from hybridkv.planner.layout import NULL_BLOCK
from hybridkv.scheduler_adapter.requests import StepPlan
from hybridkv.sim.cost import StepCostModel, StepTime, StepWork


class PlanContractError(HybridKVError, AssertionError):
    """A step plan broke the executor contract (a scheduler bug, not a user error)."""


class Executed(NamedTuple):
    """What one plan moved (blocks, in contract order) and what it cost.

    ``recomputed_tokens``: tokens of this step's rows that their request had computed before (lost
    to a recompute preemption, not served again by the prefix cache); ``recompute_s``: their FLOPs
    at the GPU's effective FLOP rate (seconds, one rank). ``time.swap_out_s + time.swap_in_s`` is the
    host link's busy time; ``time.total_s - time.forward_s`` what the swaps added to the step.
    """

    checkpoint_copy_blocks: int
    swap_out_blocks: int
    swap_in_blocks: int
    copy_blocks: int
    work: StepWork
    time: StepTime
    recomputed_tokens: int = 0
    recompute_s: float = 0.0
    tier_offload_blocks: int = 0  # the prefix cache's host tier: device -> host (priced as swap-outs)
    tier_onload_blocks: int = 0  # and host -> device (host hits, priced as swap-ins)


class SimExecutor:
    """Checks and prices plans for one manager; keeps running totals of every block it "moved"."""

    def __init__(self, manager: HybridBlockManager, cost: StepCostModel) -> None:
        self.manager = manager
        self.cost = cost
        self.totals = {"checkpoint_copy_blocks": 0, "swap_out_blocks": 0, "swap_in_blocks": 0, "copy_blocks": 0,
                       "tier_offload_blocks": 0, "tier_onload_blocks": 0}

    def run(self, plan: StepPlan, computed_before: Mapping[RequestId, int] | None = None) -> Executed:
        """Execute ``plan`` (before the forward, in contract order), then the forward; raises
        :class:`PlanContractError` when the plan breaks the contract.

        ``computed_before[request_id]``: the most tokens the request had computed in earlier steps
        (the caller's record); the part of a row below it is counted as recomputed."""
        tier = plan.tier_copies  # stage 0 (offloads) and 3b (onloads), on the host link like swaps
        offload, onload = len(tier.offload), len(tier.onload)
        ckpt = self._copies(plan.checkpoint_copies, "checkpoint_copies")
        out = sum(self._swap(p, SwapDirection.OUT) for p in plan.swap_out)
        rows = {r.request_id for r in plan.scheduled}
        for p in plan.swap_in:
            if p.request_id not in rows:
                raise PlanContractError(f"step {plan.step}: {p.request_id!r} was swapped in but does not run")
        swap_in = sum(self._swap(p, SwapDirection.IN) for p in plan.swap_in)
        copies = self._copies(plan.copies, "copies")
        t = self.totals
        t["checkpoint_copy_blocks"] += ckpt
        t["swap_out_blocks"] += out
        t["swap_in_blocks"] += swap_in
        t["copy_blocks"] += copies
        t["tier_offload_blocks"] += offload
        t["tier_onload_blocks"] += onload
        work = self.cost.work(
            [(r.num_computed_tokens, r.num_scheduled_tokens, r.num_drafts) for r in plan.scheduled],
            ckpt + copies,
            out + offload,
            swap_in + onload,
        )
        redo = 0
        recompute_s = 0.0
        if computed_before:
            again = []
            for r in plan.scheduled:
                end = min(r.num_computed_tokens + r.num_scheduled_tokens, computed_before.get(r.request_id, 0))
                if end > r.num_computed_tokens:
                    again.append((r.num_computed_tokens, end - r.num_computed_tokens, 0))
                    redo += end - r.num_computed_tokens
            if again:
                recompute_s = self.cost.work(again).flops / self.cost.gpu.effective_flops_per_s
        return Executed(ckpt, out, swap_in, copies, work, self.cost.time(work), redo, recompute_s, offload, onload)

    def _copies(self, copies: BlockCopies, what: str) -> int:
        n = len(copies)
        if not n:
            return 0
        if copies.src.shape != copies.dst.shape:
            raise PlanContractError(f"{what}: {copies.src.size} sources for {copies.dst.size} destinations")
        ids = np.concatenate((copies.src, copies.dst))
        if ids.min() <= NULL_BLOCK or ids.max() >= self.manager.layout.num_blocks:
            raise PlanContractError(f"{what}: block ids outside 1..{self.manager.layout.num_blocks - 1}")
        return n

    def _swap(self, plan: SwapPlan, direction: SwapDirection) -> int:
        if not plan.settled:
            raise PlanContractError(f"swap plan of {plan.request_id!r} reached the executor unsettled")
        if plan.direction is not direction:
            raise PlanContractError(
                f"swap plan of {plan.request_id!r} is {plan.direction.value}, listed as {direction}"
            )
        if plan.device_blocks.size != plan.host_blocks.size:
            raise PlanContractError(f"swap plan of {plan.request_id!r}: device and host block counts differ")
        return len(plan)

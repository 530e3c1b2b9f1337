"""The simulator's roofline step time (:class:`StepCostModel`, :func:`step_time`): one forward's
FLOPs against the GPU's compute and its bytes (weights, KV reads and writes, state reads and writes,
device block copies) against HBM, with swap transfers on the host link. The GPU figures are
:class:`~hybridkv.scheduler_adapter.gpu.GpuSpec`'s, the ones the scheduler weighs preemption with.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from hybridkv.models.flops import flop_coefficients
from hybridkv.planner.layout import Layout
from hybridkv.scheduler_adapter.gpu import GpuSpec


class StepWork(NamedTuple):
    """What one step moves and computes on one tensor-parallel rank."""

    flops: float
    weight_bytes: float  # the weights, read once per forward
    kv_read_bytes: float  # each row reads its whole context's K/V once
    kv_write_bytes: float  # K/V of the new tokens
    state_read_bytes: float  # each row reads its live state once ...
    state_write_bytes: float  # ... and writes it once, plus one speculative set per draft
    copy_bytes: float  # device block copies (checkpoints, copy-on-write, prefix hits): read + write
    swap_out_bytes: int  # device -> host
    swap_in_bytes: int  # host -> device

    @property
    def hbm_bytes(self) -> float:
        return (
            self.weight_bytes
            + self.kv_read_bytes
            + self.kv_write_bytes
            + self.state_read_bytes
            + self.state_write_bytes
            + self.copy_bytes
        )


class StepTime(NamedTuple):
    """Seconds of one step: ``total_s = swap_in_s + max(forward_s, swap_out_s)``."""

    compute_s: float  # FLOPs at the effective FLOP rate
    memory_s: float  # HBM bytes at the effective HBM rate
    forward_s: float  # roofline: the larger of the two
    swap_out_s: float
    swap_in_s: float
    total_s: float


class StepCostModel:
    """Roofline step time of a model's layout on a GPU (one rank).

    Per row running tokens ``[start, start + n + drafts)``: FLOPs by
    :func:`~hybridkv.models.flops.prefill_flops` (weights, causal attention, recurrent updates);
    HBM bytes: the weights once per step (``params_active / tp * weight_bytes_per_param``; an MoE
    forward with many rows reads more experts than that, so decode steps of large batches are
    optimistic), the row's context K/V read and its new K/V written, its live state read and
    written once, ``drafts`` speculative sets written, and block copies read and written.
    Swap transfers use the host link: swap-ins are on the critical path (the resumed rows run in
    this step); swap-outs overlap the forward, on the assumption that an engine drains victims on
    a copy stream while the forward runs (the host link is full duplex), so a step takes at least
    as long as its swap-outs but not their sum with the forward.
    """

    def __init__(self, layout: Layout, gpu: GpuSpec, weight_bytes_per_param: float = 2.0) -> None:
        model = layout.model
        self.layout = layout
        self.gpu = gpu
        self.coefficients = flop_coefficients(model)
        self.weight_bytes = (model.params_active or 0.0) / model.tp_size * weight_bytes_per_param
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.state_bytes = model.state_bytes
        self.bytes_per_block = layout.bytes_per_block

    def work(
        self,
        rows: Iterable[tuple[int, int, int]],
        num_copy_blocks: int = 0,
        num_swap_out_blocks: int = 0,
        num_swap_in_blocks: int = 0,
    ) -> StepWork:
        """``rows``: ``(start, num_tokens, num_drafts)`` per scheduled row (a :class:`ScheduledRequest`'s
        ``num_computed_tokens, num_scheduled_tokens, num_drafts``)."""
        linear, quadratic = self.coefficients
        flops = kv_read = tokens = drafts = 0.0
        num_rows = 0
        for start, n, d in rows:
            end = start + n + d
            flops += linear * (end - start) + quadratic * (float(end) * end - float(start) * start)
            kv_read += end
            tokens += n + d
            drafts += d
            num_rows += 1
        weights = self.weight_bytes if num_rows else 0.0
        return StepWork(
            flops,
            weights,
            kv_read * self.kv_bytes_per_token,
            tokens * self.kv_bytes_per_token,
            num_rows * self.state_bytes,
            (num_rows + drafts) * self.state_bytes,
            2.0 * num_copy_blocks * self.bytes_per_block,
            num_swap_out_blocks * self.bytes_per_block,
            num_swap_in_blocks * self.bytes_per_block,
        )

    def time(self, work: StepWork) -> StepTime:
        g = self.gpu
        compute = work.flops / g.effective_flops_per_s
        memory = work.hbm_bytes / g.effective_hbm_bytes_per_s
        forward = max(compute, memory)
        out = work.swap_out_bytes / g.host_link_bytes_per_s
        swap_in = work.swap_in_bytes / g.host_link_bytes_per_s
        return StepTime(compute, memory, forward, out, swap_in, swap_in + max(forward, out))


def step_time(layout: Layout, gpu: GpuSpec, rows: Iterable[tuple[int, int, int]], **blocks: int) -> StepTime:
    """One-off :meth:`StepCostModel.time` of :meth:`StepCostModel.work` (loops should keep a model)."""
    model = StepCostModel(layout, gpu)
    return model.time(model.work(rows, **blocks))

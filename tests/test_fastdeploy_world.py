"""FastDeploy's request and task objects and its worker, as the driver :class:`tests.test_fastdeploy_rmv1.RMv1`
sees them: the fields of ``Request`` the block calls read or write, the scheduled task kinds of
7808a119 (``ScheduledDecodeTask``, ``ScheduledPreemptTask``, ``ScheduledAbortTask``), the statuses
(``RUNNING_PREFILL`` set by the scheduler, ``RUNNING_DECODE`` by the token processor), a simulated
model runner and token processor, the per-step book check, and the tiny model of the unit tests."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy.facade import FastDeployBlockManager
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan

BLOCK_SIZE = 4  # tiny_layout's
STATE_BLOCKS = 4  # tiny_layout's: 2 state groups x 2 blocks


class RequestType(enum.Enum):  # FastDeploy's names
    PREFILL = 0
    DECODE = 1
    PREEMPTED = 2
    EXTEND = 3
    ABORT = 4


class RequestStatus(enum.Enum):
    WAITING = 0
    RUNNING_PREFILL = 1
    RUNNING_DECODE = 2
    PREEMPTED = 3
    FINISHED = 4


@dataclass
class Request:
    """The fields of FastDeploy's ``Request`` the block calls read or write."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    block_tables: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    need_prefill_tokens: int = 0
    num_cached_blocks: int = 0
    cached_block_num: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    idx: int | None = None
    task_type: RequestType = RequestType.PREFILL
    prefill_start_index: int = 0
    prefill_end_index: int = 0
    use_extend_tables: bool = False
    has_been_preempted_before: bool = False
    disaggregate_info: dict = field(default_factory=dict)
    metrics: SimpleNamespace = field(default_factory=SimpleNamespace)

    def __post_init__(self) -> None:
        self.need_prefill_tokens = len(self.prompt_token_ids)

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_token_ids_len(self) -> int:
        return len(self.prompt_token_ids)

    def get(self, key, default=None):
        return getattr(self, key, default)


@dataclass
class ScheduledDecodeTask:
    idx: int
    request_id: str
    block_tables: list[int]
    task_type: RequestType = RequestType.DECODE


@dataclass
class ScheduledPreemptTask:
    idx: int
    request_id: str
    task_type: RequestType = RequestType.PREEMPTED


@dataclass
class ScheduledAbortTask:
    idx: int
    request_id: str
    task_type: RequestType = RequestType.ABORT


# ---- the worker and the token processor, simulated ---------------------------------------------------------
def run_worker_step(rm: Any, tasks, rng: random.Random) -> list[str]:
    """What the model runner and the token processor do with a step's tasks: a prefill chunk that ends
    the prompt samples the first token (status ``RUNNING_DECODE``), requests in decode sample one
    token when their blocks hold the position, preempted ones come back to the queue, aborted ones
    are recycled. Returns the ids of requests that finished (``max_tokens`` reached)."""
    prefilled = {t.request_id for t in tasks if isinstance(t, Request)}
    for task in tasks:
        if isinstance(task, ScheduledPreemptTask):
            rm.reschedule_preempt_task(task.request_id)
        elif isinstance(task, ScheduledAbortTask):
            rm.recycle_abort_task(task.request_id)
    finished = []
    for request in list(rm.running):
        if request.request_id in prefilled:
            if request.prefill_end_index >= request.need_prefill_tokens:
                request.output_token_ids.append(rng.randrange(1000))
                request.status = RequestStatus.RUNNING_DECODE
        elif request.num_computed_tokens >= request.need_prefill_tokens and rm.splitwise_role != "prefill":
            if rm.allocated_slots(request) >= request.num_total_tokens:
                request.output_token_ids.append(rng.randrange(1000))
        if len(request.output_token_ids) >= request.max_tokens:
            finished.append(request.request_id)
    return finished


def check_books(rm: Any, fd: FastDeployBlockManager, swapped: tuple = ()) -> None:
    """After every step: the manager balances, and FastDeploy's view of every request agrees with it
    (``swapped``: ids on the host pool, which the manager holds but FastDeploy does not run)."""
    m = fd.manager
    m.check_integrity()
    for request in rm.running:
        rec = m.requests[request.request_id]
        assert request.block_tables == rec.kv_blocks.tolist(), request.request_id
    for request in rm.waiting:
        assert request.request_id not in m.requests
    held = {r.request_id for r in rm.running} | {r for r in rm.requests if rm.splitwise_role != "mixed"}
    assert set(m.requests) <= held | set(swapped)


def tiny_layout(num_blocks: int):
    """1 attention layer + 2 recurrent layers of 256 B: block_size 4, 128 B blocks, 4 state blocks a request."""
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),))
    layout = plan(ModelSpec("tiny", (attn, rec, rec)), num_blocks * 128, block_size=BLOCK_SIZE)
    assert layout.num_blocks == num_blocks and sum(layout.blocks_per_state) == STATE_BLOCKS
    return layout


def make_requests(rng: random.Random, n: int, shared_prefix: bool) -> list[Request]:
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(2)]
    out = []
    for i in range(n):
        head = prefixes[i % 2] if shared_prefix else []
        tail = [rng.randrange(1000) for _ in range(rng.randrange(3, 19))]
        out.append(Request(f"r{i}", head + tail, max_tokens=rng.randrange(2, 12)))
    return out


def test_the_driver_refuses_a_facade_that_was_never_bound():
    """The unpatched driver calls FastDeploy's text as it is: its first call that is not a count read
    raises the facade's typed error (the guard every scenario of the conformance test relies on)."""
    import pytest

    from hybridkv.integrations.fastdeploy.facade import EnginePatchError
    from tests.test_fastdeploy_rmv1 import RMv1

    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    rm = RMv1(fd, patched=False)
    assert rm.metrics == {} and rm.info() == "total_block_number: 17, available_block_num: 16"
    rm.add_request(Request("a", [1, 2, 3], max_tokens=2))
    with pytest.raises(EnginePatchError, match="can_allocate_gpu_blocks: no engine bound this facade"):
        rm.schedule()
    assert not fd.manager.requests

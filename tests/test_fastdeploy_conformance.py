"""The FastDeploy facade driven in the exact call order of FastDeploy's ``ResourceManagerV1``.

:class:`RMv1` below is a re-statement, written for this test, of the block-related control flow
of FastDeploy's ``ResourceManagerV1`` as read in its sources (nothing is copied; names and call
order follow them so a reader can hold the two side by side):

- ``fastdeploy/engine/sched/resource_manager_v1.py`` at commit
  0fe1d25fed63a7d3202a7ee027d8408ab9a517b3: ``schedule()`` (RUNNING loop: decode pre-allocation of
  ``enc_dec_block_num`` blocks when ``allocated_slots - num_total_tokens <= threshold``, prefill
  chunks by ``_get_num_new_tokens`` / ``get_new_block_nums``, ``_trigger_preempt`` on failure;
  WAITING loop only without preemptions, ``get_prefix_cached_blocks`` under prefix caching,
  ``_free_blocks`` on failure), the LIFO ``_trigger_preempt`` and ``get_new_block_nums``;
- the newer stored version of the same file (search index id 59166235010, commit not exposed by
  the index) for the calls that changed: ``allocate_gpu_blocks(n, request.request_id)``,
  ``_free_blocks`` (``release_block_ids`` then ``recycle_gpu_blocks(block_tables[num_cached_blocks:],
  request_id)`` under prefix caching), ``finish_requests`` (``write_cache_to_storage`` before
  ``_free_blocks``, errors swallowed), ``get_prefix_cached_blocks`` reading eight ``hit_info`` keys,
  ``update_metrics``;
- ``fastdeploy/cache_manager/prefix_cache_manager.py`` at baa8be6cea91d6d266466f39e742e5a4ff977541
  (signatures, ``update_cache_config``) and ``fastdeploy/cache_manager/v1/cache_manager.py`` at
  41980eea5a1dc1234dc8fae460902b192a62f713 for the v1 mode (``match_prefix(request)`` ->
  ``request.match_result``, ``allocate_gpu_blocks(request, n)`` returning ``[]`` on failure,
  ``request_finish``). ``ResourceManagerV1``'s own v1-mode branch was not in the stored sources;
  v1 mode here follows ``CacheManager``'s documented lifecycle (match -> allocate -> finish).

Patches applied, each the one documented in docs/fastdeploy.md: the WAITING branch adds
``cache_manager.num_state_blocks_per_request`` to ``get_new_block_nums`` (P2), ``_get_num_new_tokens``
ends a chunk at ``cache_manager.next_checkpoint_position`` (P3), ``schedule()`` starts with
``cache_manager.begin_step()`` (P4). Exceptions FastDeploy swallows are swallowed here too, so a
missing method shows as a request that never finishes or a block that never returns.
"""

from __future__ import annotations

import copy
import enum
import random
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.errors import RequestStateError
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter.fastdeploy import HYBRID_TASK_FIELDS, FastDeployBlockManager

BLOCK_SIZE = 4
STATE_BLOCKS = 4  # 2 state groups x 2 blocks


class RequestType(enum.Enum):  # FastDeploy's names
    PREFILL = 0
    DECODE = 1
    PREEMPTED = 2


class RequestStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


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
    skip_allocate: bool = False
    status: RequestStatus = RequestStatus.WAITING
    idx: int | None = None
    task_type: RequestType = RequestType.PREFILL
    prefill_start_index: int = 0
    prefill_end_index: int = 0
    use_extend_tables: bool = False
    metrics: SimpleNamespace = field(default_factory=SimpleNamespace)

    def __post_init__(self) -> None:
        self.need_prefill_tokens = len(self.prompt_token_ids)

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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


class RMv1:
    """``ResourceManagerV1``'s block-related control flow over ``cache_manager`` (see module docstring)."""

    def __init__(self, cache_manager, *, max_num_seqs=4, max_num_batched_tokens=16, v1_mode=False, prefix=False):
        self.cache_manager = cache_manager
        self.block_size = BLOCK_SIZE
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_cache_manager_v1 = v1_mode
        self.enable_prefix_caching = prefix
        self.enc_dec_block_num = 1
        self.prealloc_dec_block_slot_num_threshold = 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.tasks_list: list[Request | None] = [None] * max_num_seqs
        self.stop_flags = [True] * max_num_seqs
        self.to_be_rescheduled_request_id_set: set[str] = set()
        self.preemptions: dict[str, int] = {}
        self.zero_block_chunks = 0
        self.metrics: dict = {}

    # ---- ResourceManager ----------------------------------------------------------------------------
    def reset_cache_config(self, cfg):
        self.cache_manager.update_cache_config(cfg)

    def available_block_num(self):
        return len(self.cache_manager.gpu_free_block_list)

    def total_block_number(self):
        return self.cache_manager.num_gpu_blocks

    def get_gpu_cache_usage_perc(self):
        return 1.0 - self.cache_manager.available_gpu_resource

    def available_batch(self):
        return sum(self.stop_flags)

    def get_available_position(self):
        return self.stop_flags.index(True)

    # ---- ResourceManagerV1 ----------------------------------------------------------------------------
    def add_request(self, request):
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def allocated_slots(self, request):
        return len(request.block_tables) * self.block_size

    def get_new_block_nums(self, request, num_new_tokens):
        bs = self.block_size
        return (request.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(request.block_tables)

    def _get_num_new_tokens(self, request, token_budget):
        num_new_tokens = min(request.need_prefill_tokens - request.num_computed_tokens, token_budget)
        if self.enable_prefix_caching:  # patch P3: end the chunk where a checkpoint is due
            pos = self.cache_manager.next_checkpoint_position(request)
            if pos is not None and pos > request.num_computed_tokens:
                num_new_tokens = min(num_new_tokens, pos - request.num_computed_tokens)
        return num_new_tokens

    def _allocate_gpu_blocks(self, request, num_blocks):
        before = len(self.cache_manager.gpu_free_block_list)
        if self.enable_cache_manager_v1:
            ids = self.cache_manager.allocate_gpu_blocks(request, num_blocks)
        else:
            ids = self.cache_manager.allocate_gpu_blocks(num_blocks, request.request_id)
        # exact counting: an allocation of n blocks takes n blocks out of what FastDeploy sees as free
        assert before - len(self.cache_manager.gpu_free_block_list) == num_blocks, (request.request_id, num_blocks)
        return ids

    def _prepare_prefill_task(self, request, new_token_num):
        request.prefill_start_index = request.num_computed_tokens
        request.prefill_end_index = request.num_computed_tokens + new_token_num
        request.task_type = RequestType.PREFILL
        self._add_hybrid_fields(request, request)  # patch P5: state tables and copies travel in the task
        return request

    def _prepare_decode_task(self, request):
        task = ScheduledDecodeTask(idx=request.idx, request_id=request.request_id, block_tables=request.block_tables)
        self._add_hybrid_fields(request, task)
        return task

    def _add_hybrid_fields(self, request, task):
        for key, value in self.cache_manager.task_fields(request.request_id).items():
            setattr(task, key, value)

    def _prepare_preempt_task(self, request):
        return ScheduledPreemptTask(idx=request.idx, request_id=request.request_id)

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        can_schedule = False
        while any(not r.use_extend_tables for r in self.running):
            if not self.cache_manager.can_allocate_gpu_blocks(num_new_blocks):
                # forced: the pool (free + evictable, less pinned) truly lacks the blocks
                assert num_new_blocks > self.cache_manager.manager.num_available_blocks - self._pins()
                preempted_req = self.running.pop()
                preempted_req.status = RequestStatus.PREEMPTED
                preempted_req.num_computed_tokens = 0
                self._free_blocks(preempted_req)
                preempted_req.num_cached_blocks = preempted_req.cached_block_num = 0
                self.to_be_rescheduled_request_id_set.add(preempted_req.request_id)
                self.preemptions[preempted_req.request_id] = self.preemptions.get(preempted_req.request_id, 0) + 1
                preempted_reqs.append(preempted_req)
                scheduled_reqs.append(self._prepare_preempt_task(preempted_req))
                if preempted_req is request:
                    break
            else:
                can_schedule = True
                break
        return can_schedule

    def _pins(self):
        m = self.cache_manager.manager
        return m.num_available_blocks - len(self.cache_manager.gpu_free_block_list)

    def reschedule_preempt_task(self, request_id):
        if request_id in self.to_be_rescheduled_request_id_set and request_id in self.requests:
            self.waiting.appendleft(self.requests[request_id])
            self.to_be_rescheduled_request_id_set.remove(request_id)

    def schedule(self):
        if hasattr(self.cache_manager, "begin_step"):  # patch P4
            self.cache_manager.begin_step()
        scheduled_reqs, preempted_reqs = [], []
        token_budget = self.max_num_batched_tokens
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if request.num_computed_tokens >= request.need_prefill_tokens:  # to be decoding
                if request.num_total_tokens > request.need_prefill_tokens:
                    request.num_computed_tokens = request.num_total_tokens - 1
                if (
                    self.allocated_slots(request) - request.num_total_tokens
                    <= self.prealloc_dec_block_slot_num_threshold
                ):
                    if self.cache_manager.can_allocate_gpu_blocks(self.enc_dec_block_num):
                        request.block_tables.extend(self._allocate_gpu_blocks(request, self.enc_dec_block_num))
                        scheduled_reqs.append(self._prepare_decode_task(request))
                    else:
                        if not self._trigger_preempt(request, self.enc_dec_block_num, preempted_reqs, scheduled_reqs):
                            break
                        request.block_tables.extend(self._allocate_gpu_blocks(request, self.enc_dec_block_num))
                        scheduled_reqs.append(self._prepare_decode_task(request))
                token_budget -= 1
            else:  # need to prefill
                num_new_tokens = self._get_num_new_tokens(request, token_budget)
                num_new_block = self.get_new_block_nums(request, num_new_tokens)
                self.zero_block_chunks += num_new_block == 0
                if self.cache_manager.can_allocate_gpu_blocks(num_new_block):
                    request.block_tables.extend(self._allocate_gpu_blocks(request, num_new_block))
                    scheduled_reqs.append(self._prepare_prefill_task(request, num_new_tokens))
                else:
                    if not self._trigger_preempt(request, num_new_block, preempted_reqs, scheduled_reqs):
                        break
                    request.block_tables.extend(self._allocate_gpu_blocks(request, num_new_block))
                    scheduled_reqs.append(self._prepare_prefill_task(request, num_new_tokens))
                token_budget -= num_new_tokens
                request.num_computed_tokens += num_new_tokens
                if self.enable_prefix_caching:
                    self.cache_manager.update_cache_blocks(request, self.block_size, request.num_computed_tokens)
            req_index += 1
        if not preempted_reqs:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_seqs:
                    break
                request = self.waiting[0]
                was_waiting = request.status == RequestStatus.WAITING
                if request.status == RequestStatus.PREEMPTED:
                    request.need_prefill_tokens = request.num_total_tokens
                if self.enable_prefix_caching and not self.get_prefix_cached_blocks(request):
                    self._free_blocks(request)
                    break
                num_new_tokens = self._get_num_new_tokens(request, token_budget)
                num_new_block = self.get_new_block_nums(request, num_new_tokens)
                num_new_block += self.cache_manager.num_state_blocks_per_request  # patch P2
                if self.cache_manager.can_allocate_gpu_blocks(num_new_block):
                    if not request.get("skip_allocate", False):
                        request.block_tables.extend(self._allocate_gpu_blocks(request, num_new_block))
                    self.waiting.popleft()
                    self.running.append(request)
                    token_budget -= num_new_tokens
                    if was_waiting:  # splitwise_role == "mixed"
                        request.idx = self.get_available_position()
                        self.tasks_list[request.idx] = request
                        self.stop_flags[request.idx] = False
                    scheduled_reqs.append(self._prepare_prefill_task(request, num_new_tokens))
                    request.num_computed_tokens += num_new_tokens
                    if self.enable_prefix_caching:
                        self.cache_manager.update_cache_blocks(request, self.block_size, request.num_computed_tokens)
                    request.status = RequestStatus.RUNNING
                else:
                    if self.enable_prefix_caching:
                        self._free_blocks(request)
                    break
        self.update_metrics()
        return scheduled_reqs

    def get_prefix_cached_blocks(self, request):
        try:
            if self.enable_cache_manager_v1:
                self.cache_manager.match_prefix(request)
                result = request.match_result
                common_block_ids = [n.block_id for n in result.device_nodes]
                matched_token_num = result.matched_device_nums * self.block_size
                metrics = {"gpu_match_token_num": matched_token_num, "cpu_match_token_num": 0}
                metrics |= {"storage_match_token_num": 0, "cpu_cache_prepare_time": 0, "storage_cache_prepare_time": 0}
                metrics |= {"match_gpu_block_ids": common_block_ids, "gpu_recv_block_ids": []}
                metrics |= {"match_storage_block_ids": []}
            else:
                common_block_ids, matched_token_num, metrics = self.cache_manager.request_match_blocks(
                    request, self.block_size
                )
            no_cache_block_num = self.cache_manager.get_required_block_num(
                request.need_prefill_tokens - matched_token_num, self.block_size
            )
            request.cache_info = [len(common_block_ids), no_cache_block_num]
            request.block_tables = common_block_ids
            request.skip_allocate = False
            request.num_cached_tokens = matched_token_num
            if matched_token_num == request.need_prefill_tokens:
                request.num_computed_tokens = matched_token_num - self.block_size
                request.skip_allocate = True
            else:
                request.num_computed_tokens = matched_token_num
            if request.num_cached_tokens != request.num_computed_tokens:
                for block_id in common_block_ids[-1:]:
                    assert (
                        block_id
                        in metrics["match_gpu_block_ids"]
                        + metrics["gpu_recv_block_ids"]
                        + metrics["match_storage_block_ids"]
                    )
            request.metrics.gpu_cache_token_num = metrics["gpu_match_token_num"]
            request.metrics.cpu_cache_token_num = metrics["cpu_match_token_num"]
            request.metrics.storage_cache_token_num = metrics["storage_match_token_num"]
            request.metrics.cpu_cache_prepare_time = metrics["cpu_cache_prepare_time"]
            request.metrics.storage_cache_prepare_time = metrics["storage_cache_prepare_time"]
            return True
        except Exception:  # FastDeploy logs "prefix match blocks error" and waits for a reschedule
            return False

    def _free_blocks(self, request):
        if self.enable_cache_manager_v1:
            self.cache_manager.request_finish(request)
        elif self.enable_prefix_caching:
            self.cache_manager.release_block_ids(request)
            self.cache_manager.recycle_gpu_blocks(request.block_tables[request.num_cached_blocks :], request.request_id)
        else:
            self.cache_manager.recycle_gpu_blocks(request.block_tables, request.request_id)
        request.block_tables = []

    def finish_requests(self, request_ids):
        try:
            need_postprocess_reqs = []
            for req_id in request_ids:
                request = self.requests.get(req_id)
                if request is None or request in self.waiting:
                    continue
                if request in self.running:
                    self.running.remove(request)
                    request.status = RequestStatus.FINISHED
                    need_postprocess_reqs.append(request)
                self.to_be_rescheduled_request_id_set.discard(req_id)
                self.tasks_list[request.idx] = None
                self.stop_flags[request.idx] = True
                del self.requests[req_id]
            for req in need_postprocess_reqs:
                self.cache_manager.write_cache_to_storage(req)
            for req in need_postprocess_reqs:
                try:
                    self._free_blocks(req)
                except Exception:  # FastDeploy: "release block failed"
                    pass
        except Exception:  # FastDeploy: "finish_request err"
            pass
        finally:
            self.update_metrics()

    def update_metrics(self):
        used = set()
        for task in self.tasks_list:
            if task is not None:
                used.update(task.block_tables)
        self.metrics = {
            "available_gpu_block_num": self.total_block_number() - len(used),
            "gpu_cache_usage_perc": self.get_gpu_cache_usage_perc(),
            "batch_size": self.max_num_seqs - self.available_batch(),
            "free_blocks": self.available_block_num(),
        }


# ---- the worker, simulated ------------------------------------------------------------------------------
def run_worker_step(rm: RMv1, tasks, rng: random.Random) -> list[str]:
    """What the model runner does with a step's tasks: prefill chunks compute (a finished prompt
    samples its first token), requests in decode sample one token when their blocks hold the
    position, preempted ones stop. Returns the ids of requests that finished."""
    prefilled = {t.request_id for t in tasks if isinstance(t, Request)}
    for task in tasks:
        if isinstance(task, ScheduledPreemptTask):
            rm.reschedule_preempt_task(task.request_id)  # the worker reports the slot free
    finished = []
    for request in list(rm.running):
        if request.request_id in prefilled:
            if request.prefill_end_index >= request.need_prefill_tokens:
                request.output_token_ids.append(rng.randrange(1000))
        elif request.num_computed_tokens >= request.need_prefill_tokens:
            if rm.allocated_slots(request) >= request.num_total_tokens:
                request.output_token_ids.append(rng.randrange(1000))
        if len(request.output_token_ids) >= request.max_tokens:
            finished.append(request.request_id)
    return finished


def check_books(rm: RMv1, fd: FastDeployBlockManager, swapped: tuple = ()) -> None:
    """After every step: the manager balances, and FastDeploy's view of every request agrees with it
    (``swapped``: ids on the host pool, which the manager holds but FastDeploy does not run)."""
    m = fd.manager
    m.check_integrity()
    for request in rm.running:
        rec = m.requests[request.request_id]
        assert request.block_tables == rec.kv_blocks.tolist(), request.request_id
    for request in rm.waiting:
        assert request.request_id not in m.requests
    assert set(m.requests) <= {r.request_id for r in rm.running} | set(swapped)


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


def drive(num_blocks, *, v1_mode, prefix, n_requests=6, seed=0, max_steps=400, arrivals_per_step=2):
    prefix_cfg = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1) if prefix else None
    manager = HybridBlockManager(tiny_layout(num_blocks), prefix_cache=prefix_cfg)
    fd = FastDeployBlockManager(manager)
    rm = RMv1(fd, v1_mode=v1_mode, prefix=prefix, max_num_batched_tokens=7)  # odd: chunks end mid-block
    rm.reset_cache_config(SimpleNamespace(total_block_num=num_blocks))  # after the profiling run
    rng = random.Random(seed)
    pending = make_requests(rng, n_requests, shared_prefix=prefix)
    finished: list[str] = []
    all_tasks = []
    steps = 0
    for steps in range(1, max_steps + 1):  # noqa: B007 - the count is returned
        for _ in range(arrivals_per_step):
            if pending:
                rm.add_request(pending.pop(0))
        tasks = rm.schedule()
        check_books(rm, fd)
        all_tasks.extend(copy.deepcopy(tasks))  # as sent this step (requests are reused)
        done = run_worker_step(rm, tasks, rng)
        rm.finish_requests(done)
        finished += done
        check_books(rm, fd)
        if len(finished) == n_requests:
            break
    return rm, fd, finished, steps, all_tasks


SCENARIOS = [
    pytest.param(v1_mode, prefix, blocks, id=f"{('legacy', 'v1')[v1_mode]}-{('noprefix', 'prefix')[prefix]}-{b}")
    for v1_mode in (False, True)
    for prefix in (False, True)
    for blocks, b in ((64, "roomy"), (17, "tight"))
]


@pytest.mark.parametrize(("v1_mode", "prefix", "num_blocks"), SCENARIOS)
def test_every_request_finishes_and_every_block_returns(v1_mode, prefix, num_blocks):
    rm, fd, finished, steps, tasks = drive(num_blocks, v1_mode=v1_mode, prefix=prefix)
    assert sorted(finished) == [f"r{i}" for i in range(6)], f"finished {finished} in {steps} steps"
    m = fd.manager
    assert not m.requests and not rm.running and not rm.waiting
    usage = m.usage()
    assert usage.kv_live == usage.state_live == usage.state_speculative == 0
    assert m.num_available_blocks == m.pool.num_usable == len(fd.gpu_free_block_list)
    assert rm.metrics["gpu_cache_usage_perc"] == 0.0
    # no request preempted more than the pool forces: RMv1 asserts at each preemption that the pool
    # lacked the blocks, and at each allocation that n blocks took exactly n; a roomy pool never preempts
    if num_blocks == 64:
        assert not rm.preemptions
    else:
        assert rm.preemptions  # the tight pool forces some
    assert rm.zero_block_chunks > 0  # prefill chunks that end inside their last block occurred
    for task in tasks:
        if not isinstance(task, ScheduledPreemptTask):
            assert all(hasattr(task, f) for f in HYBRID_TASK_FIELDS)


def test_tight_pool_preempts_and_still_finishes():
    rm, fd, finished, steps, _ = drive(17, v1_mode=False, prefix=False, n_requests=6, seed=3)
    assert len(finished) == 6 and sum(rm.preemptions.values()) >= 1  # the pool forces preemption here


def test_prefix_hits_share_blocks_and_fill_hit_metrics():
    rm, fd, finished, _, tasks = drive(64, v1_mode=False, prefix=True, arrivals_per_step=1)
    hits = [t for t in tasks if isinstance(t, Request) and t.num_cached_tokens > 0]
    assert hits, "requests with a shared 12-token prefix must hit the prefix cache"
    for t in hits:
        assert t.metrics.gpu_cache_token_num == t.num_cached_tokens and t.num_cached_tokens % BLOCK_SIZE == 0
    copies = [t.state_copies for t in tasks if getattr(t, "state_copies", [[], []])[0]]
    assert copies, "a hit fills the live state sets from a checkpoint: the task carries that copy"
    checkpoints = [t.checkpoint_copies for t in tasks if getattr(t, "checkpoint_copies", [[], []])[0]]
    assert checkpoints, "chunks end at checkpoint positions and the task carries the live -> checkpoint copy"


def test_zero_block_chunks_are_scheduled_without_preemption():
    """A prefill chunk that needs no new block (it ends inside the last allocated block) is granted
    on a full pool: ``can_allocate_gpu_blocks(0)`` is True, so nothing is preempted for it."""
    manager = HybridBlockManager(tiny_layout(11))  # 10 usable: one request of 6 KV + 4 state fills it
    fd = FastDeployBlockManager(manager)
    rm = RMv1(fd, max_num_batched_tokens=3)
    rm.add_request(Request("a", list(range(23)), max_tokens=1))
    finished = []
    for _ in range(20):
        tasks = rm.schedule()
        check_books(rm, fd)
        finished += run_worker_step(rm, tasks, random.Random(0))
        rm.finish_requests(finished)
        if finished:
            break
    assert finished == ["a"] and rm.zero_block_chunks == 2 and not rm.preemptions  # chunks ending at 12 and 23


def test_counting_is_exact():
    manager = HybridBlockManager(tiny_layout(17))  # 16 usable
    fd = FastDeployBlockManager(manager)
    assert fd.num_state_blocks_per_request == STATE_BLOCKS and fd.num_gpu_blocks == 16
    assert fd.can_allocate_gpu_blocks(16) and not fd.can_allocate_gpu_blocks(17)
    ids = fd.allocate_gpu_blocks(6, "a")  # a new request: 4 state blocks + 2 KV blocks
    assert len(ids) == 2 and len(fd.gpu_free_block_list) == 10
    assert fd.can_allocate_gpu_blocks(10) and not fd.can_allocate_gpu_blocks(11)
    assert len(fd.allocate_gpu_blocks(10, "a")) == 10 and fd.can_allocate_gpu_blocks(0)
    fd.recycle_gpu_blocks(ids, "a")  # part of its blocks: nothing is freed yet
    assert "a" in manager.requests
    fd.recycle_gpu_blocks(manager.requests["a"].kv_blocks.tolist()[2:], "a")
    assert not manager.requests and len(fd.gpu_free_block_list) == 16
    with pytest.raises(Exception, match="num_state_blocks_per_request"):
        fd.allocate_gpu_blocks(3, "b")  # a first allocation without the state sets: the P2 patch is missing
    assert fd.allocate_gpu_blocks(SimpleNamespace(request_id="c"), 17) == []  # v1: [] on failure
    fd.update_cache_config(SimpleNamespace(total_block_num=99))  # the profiled size, while idle
    assert fd.num_gpu_blocks == 98 and fd.manager.layout.num_blocks == 99
    fd.allocate_gpu_blocks(5, "d")
    with pytest.raises(Exception, match="while requests hold blocks"):
        fd.update_cache_config(SimpleNamespace(total_block_num=50))


# ---- pending matches: each pinned block counted once, a defined lifetime ------------------------------
PREFIX = list(range(40))  # 10 blocks; its checkpoint at 40 holds 4 state blocks: a hit pins 14 blocks


def _facade_with_cached_prefix(num_blocks: int = 64) -> FastDeployBlockManager:
    """A facade whose prefix cache holds ``PREFIX`` (10 KV blocks and the checkpoint at its end), all
    evictable: the request that made them was released."""
    cfg = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1)
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(num_blocks), prefix_cache=cfg))
    seed = Request("seed", list(PREFIX), max_tokens=1)
    fd.request_match_blocks(seed, BLOCK_SIZE)
    fd.allocate_gpu_blocks(10 + STATE_BLOCKS, "seed")
    fd.update_cache_blocks(seed, BLOCK_SIZE, len(PREFIX))  # the checkpoint at 40
    fd.begin_step()
    fd.release_block_ids(seed)
    fd.begin_step()
    assert fd.num_free_device_blocks == fd.num_gpu_blocks  # everything cached is evictable
    return fd


def _follower(i: int) -> Request:
    return Request(f"b{i}", [*PREFIX, 900 + i], max_tokens=1)


def test_matches_of_one_cached_prefix_count_its_pinned_blocks_once():
    fd = _facade_with_cached_prefix()
    free = fd.num_free_device_blocks
    ids, hit, _ = fd.request_match_blocks(_follower(0), BLOCK_SIZE)
    assert hit == 40 and len(ids) == 10
    assert fd.num_free_device_blocks == free - 14  # the 10 KV blocks and the checkpoint's 4
    followers = [_follower(i) for i in range(5)]
    for r in followers:
        assert fd.request_match_blocks(r, BLOCK_SIZE)[1] == 40
    # 5 matches of the same hit pin the same 14 blocks: a union, not 70 (the sum went below 0)
    assert fd.num_free_device_blocks == free - 14 and len(fd.gpu_free_block_list) == free - 14
    assert fd.can_allocate_gpu_blocks(free - 14) and not fd.can_allocate_gpu_blocks(free - 13)
    for r in followers:  # each admission takes exactly what it asks (1 KV block + the state sets)
        before = fd.num_free_device_blocks
        assert fd.allocate_gpu_blocks(1 + STATE_BLOCKS, r.request_id)
        assert before - fd.num_free_device_blocks == 1 + STATE_BLOCKS, r.request_id
        assert fd.manager.requests[r.request_id].kv_blocks[:10].tolist() == ids
    fd.manager.check_integrity()


def test_an_abandoned_match_lapses_at_the_next_step_and_a_new_match_replaces_the_old():
    fd = _facade_with_cached_prefix()
    free = fd.num_free_device_blocks
    r = _follower(0)
    for _ in range(3):  # matched again and again in one step: the newest match replaces the older
        fd.request_match_blocks(r, BLOCK_SIZE)
    assert fd.num_free_device_blocks == free - 14
    other = Request("b0", [7] * 41, max_tokens=1)  # the same request, a miss now: it pins nothing
    fd.request_match_blocks(other, BLOCK_SIZE)
    assert fd.num_free_device_blocks == free
    fd.match_prefix(r)  # v1 match of the hit again, never allocated nor released
    assert fd.num_free_device_blocks == free - 14
    fd.begin_step()  # the next schedule(): the abandoned match lapses
    assert fd.num_free_device_blocks == free == len(fd.gpu_free_block_list)
    with pytest.raises(RequestStateError, match="lapsed at begin_step"):
        fd.allocate_gpu_blocks(1 + STATE_BLOCKS, "b0")  # its block_tables name the hit: refuse, not mix
    assert fd.allocate_gpu_blocks(r, 1 + STATE_BLOCKS) == []  # v1: [] on failure
    assert not fd.manager.requests and fd.num_free_device_blocks == free
    fd.match_prefix(r)  # matched again and allocated in the same step: exactly what it asks
    before = fd.num_free_device_blocks
    assert before == free - 14 and fd.allocate_gpu_blocks(r, 1 + STATE_BLOCKS)
    assert before - fd.num_free_device_blocks == 1 + STATE_BLOCKS
    fd.request_finish(r)
    fd.begin_step()
    assert fd.num_free_device_blocks == free
    fd.manager.check_integrity()


# ---- allocate_gpu_blocks: the form is chosen on exact types -----------------------------------------
@pytest.mark.parametrize("first", [2.5, 2.0, True, "3", None, [3], b"3"])
def test_allocate_gpu_blocks_refuses_a_first_argument_of_neither_form(first):
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    both_forms = r"allocate_gpu_blocks\(num_blocks: int, req_id\).*allocate_gpu_blocks\(request, num_blocks: int\)"
    with pytest.raises(TypeError, match=both_forms):
        fd.allocate_gpu_blocks(first, "B")
    assert not fd.manager.requests and fd.num_free_device_blocks == 16


@pytest.mark.parametrize("count", [2.5, 6.0, True, "6", None])
def test_allocate_gpu_blocks_refuses_a_count_that_is_not_an_integer_in_both_forms(count):
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    with pytest.raises(TypeError, match="num_blocks must be an integer"):
        fd.allocate_gpu_blocks(SimpleNamespace(request_id="c"), count)  # v1: a TypeError, not []
    with pytest.raises(TypeError):
        fd.can_allocate_gpu_blocks(count)
    assert not fd.manager.requests and fd.num_free_device_blocks == 16


def test_allocate_gpu_blocks_takes_both_forms_positionally_and_by_keyword():
    import numpy as np

    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    assert len(fd.allocate_gpu_blocks(np.int64(5), "a")) == 1
    assert len(fd.allocate_gpu_blocks(num_blocks=5, req_id="b")) == 1
    assert len(fd.allocate_gpu_blocks(SimpleNamespace(request_id="c"), num_blocks=5)) == 1
    assert len(fd.allocate_gpu_blocks(request=SimpleNamespace(request_id="a"), num_blocks=1)) == 1
    assert fd.num_free_device_blocks == 0
    for args, kwargs in (
        ((5, "d"), {"request": SimpleNamespace(request_id="d")}),
        ((SimpleNamespace(request_id="d"), 1), {"req_id": "d"}),
        ((1, "d", 3), {}),
        ((1,), {"req_id": "d", "blocks": 1}),
        ((SimpleNamespace(request_id="d"), 1), {"num_blocks": 1}),
        ((SimpleNamespace(request_id="d"),), {}),
    ):
        with pytest.raises(TypeError, match="allocate_gpu_blocks"):
            fd.allocate_gpu_blocks(*args, **kwargs)
    with pytest.raises(ValueError, match=">= 0"):
        fd.allocate_gpu_blocks(SimpleNamespace(request_id="a"), -1)
    assert sorted(fd.manager.requests) == ["a", "b", "c"]
    fd.manager.check_integrity()

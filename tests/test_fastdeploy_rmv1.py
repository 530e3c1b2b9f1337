"""FastDeploy's ``ResourceManagerV1`` block-related control flow, re-stated for the tests (the driver).

:class:`RMv1` is this project's transcription, in its own code, of the call order of FastDeploy's
``fastdeploy/engine/sched/resource_manager_v1.py`` at commit 7808a119d8ba1a1b889d8c5bc77f0262d7ae8372
(base class ``fastdeploy/engine/resource_manager.py`` at 029e4cf8b039288f02d9e8b9fea115a73e44a3f4).
Nothing is copied; names and order follow FastDeploy so the two can be read side by side. Line
numbers are those of the 7808a119 text:

- ``schedule()``: the RUNNING loop (decode pre-allocation of ``enc_dec_block_num`` blocks, preemption
  through ``_trigger_preempt`` / ``_select_preempt_candidate``, which takes only ``RUNNING_DECODE``
  requests, last first; aborts of ``add_abort_req_ids`` through ``_trigger_abort``; prefill chunks with
  ``_get_can_schedule_prefill_threshold_block``; ``update_cache_blocks`` unless v1, line 1040), the
  WAITING loop (the ``WAITING`` and ``PREEMPTED`` sub-branches, ``get_prefix_cached_blocks``,
  ``update_cache_blocks`` unless v1, lines 1138 and 1211, ``_free_blocks`` on refusal, status
  ``RUNNING_PREFILL``), ``update_metrics`` and, in v1 mode, ``issue_pending_backup_to_batch_request``
  (line 1254) and ``check_and_add_pending_backup`` (lines 1258-1259);
- ``_allocate_gpu_blocks`` (v1 form line 1390), ``_request_match_blocks`` (v1 branch line 1399),
  ``get_prefix_cached_blocks`` (exceptions swallowed: "prefix match blocks error"), ``_free_blocks``
  (``request_finish`` in v1, line 1665), ``finish_requests`` (``write_cache_to_storage_decode`` in
  the decode role, line 1734, ``write_cache_to_storage`` otherwise, then ``_free_blocks``, line 1742;
  errors swallowed, line 1747), ``update_metrics`` (``available_gpu_block_num``, line 1767);
- splitwise: ``preallocate_resource_in_p``, ``add_request_in_p``, ``preallocate_resource_in_d``,
  ``add_prefilled_request``, ``pre_recycle_resource``; and ``recycle_abort_task``,
  ``reschedule_preempt_task``.

``version`` picks the call order where the three FastDeploy versions differ (docs/fastdeploy.md, version
table): ``"c1b7c083"`` (develop) passes its int ``enable_cache_manager_v1`` to E0 and its
``get_new_block_nums`` has no ``max(block_num, 0)``; ``"7198b588"`` (release/2.6) has no v1 manager.
``patched=True`` applies the series of docs/fastdeploy.md: E0 ``bind_engine`` at the end of
``__init__``, E2 ``state_blocks_for`` in the WAITING/PREEMPTED branches and the two preallocations,
E3 the chunk cap and the v1 ``update_cache_blocks`` calls, E4 ``begin_step``, E5 the task fields,
E7 the metric lines, E9 the host tier's copies on the first task of the batch, S1-S3 the transfer
steps.

The prefix-hit reporting of ``get_prefix_cached_blocks`` and ``_request_match_blocks`` is kept: the
v1 metrics built from ``match_result`` (``matched_host_nums`` as ``cpu_match_token_num``), the
revert of a whole-input hit by block membership, ``request.metrics.{gpu,cpu}_cache_token_num`` /
``cpu_cache_prepare_time`` and the ``prefix_*_cache_token_num`` counters of
``main_process_metrics`` (here ``main_metrics``); and, in legacy mode with ``num_cpu_blocks > 0``,
the check before a match that the whole prompt fits ("to prevent block allocation for matching in
hierarchical cache", in the WAITING and the PREEMPTED branch). ``patched=False`` runs FastDeploy's text as it is over
the facade. Exceptions FastDeploy swallows are swallowed here too, and recorded in ``swallowed``.

The driver also checks, at every allocation, that ``allocate_gpu_blocks(n)`` took exactly ``n``
blocks of what ``can_allocate_gpu_blocks`` counts and returned ``n`` ids (``n - S`` for a first
allocation, its state sets being the other ``S``), and, at every prefill task, that the task covers
no more tokens than its block table has slots (``over_slots``).
"""

from __future__ import annotations

from collections import deque

from hybridkv.integrations.fastdeploy.facade import PATCH_SERIES
from tests.test_fastdeploy_world import (
    Request,
    RequestStatus,
    RequestType,
    ScheduledAbortTask,
    ScheduledDecodeTask,
    ScheduledPreemptTask,
)


class RMv1:
    """``ResourceManagerV1``'s block-related control flow over ``cache_manager`` (module docstring)."""

    def __init__(
        self, cache_manager, *, max_num_seqs=4, max_num_batched_tokens=16, v1_mode=False, prefix=False,
        patched=True, omit=frozenset(), version="7808a119", role="mixed", enc_dec_block_num=1, prealloc_threshold=1,
        reserve=(2, 1.0, 0),  # FD_RESERVE_OUTPUT_BLOCK_NUM_..._NEW_PREFILL init, decay, min (chosen here)
    ):  # fmt: skip
        self.cache_manager = cache_manager
        self.block_size = cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_cache_manager_v1 = v1_mode
        self.enable_prefix_caching = prefix
        self.patched = patched
        self.omit = frozenset(omit)  # patches a patched engine leaves out (a missing line must fail loudly)
        if version not in ("7808a119", "c1b7c083", "7198b588") or version == "7198b588" and v1_mode:
            raise ValueError(f"FastDeploy version {version!r} (release/2.6 7198b588 has no v1 cache manager)")
        self.version = version
        self.splitwise_role = role
        self.enc_dec_block_num = enc_dec_block_num
        self.prealloc_dec_block_slot_num_threshold = prealloc_threshold
        self.stop_flags = [True] * max_num_seqs
        self.tasks_list: list = [None] * max_num_seqs
        self.req_dict: dict = {}
        self.info()  # ResourceManager.__init__ logs info() before any subclass code runs (count reads only)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.to_be_rescheduled_request_id_set: set[str] = set()
        self.waiting_abort_req_id_set: set[str] = set()
        self.to_be_aborted_req_id_set: set[str] = set()
        self.init_reserve, self.decay_reserve, self.min_reserve = reserve
        self.current_reserve = self.init_reserve
        self.current_reserve_float = float(self.init_reserve)
        self.can_relax_prefill_strategy = True
        # what the tests read
        self.preemptions: dict[str, int] = {}
        self.zero_block_chunks = 0
        self.hit_tokens = 0
        self.over_slots: list = []
        self.swallowed: list[Exception] = []
        self.metrics: dict = {}
        self.main_metrics = {"prefix_cache_token_num": 0, "prefix_gpu_cache_token_num": 0,
                             "prefix_cpu_cache_token_num": 0}  # fmt: skip
        self.backup_calls = 0
        self.tickets: set[str] = set()  # requests whose next allocation includes their state sets (E2)
        if patched:  # E0
            v1_flag = int(v1_mode) if version == "c1b7c083" else v1_mode  # develop: the env value, 0 or 1
            cache_manager.bind_engine(PATCH_SERIES, cache_manager_v1=v1_flag, splitwise_role=role)

    # ---- ResourceManager (base) ----------------------------------------------------------------------
    def info(self):
        total, free = self.total_block_number(), self.available_block_num()
        return f"total_block_number: {total}, available_block_num: {free}"

    def reset_cache_config(self, cfg):
        self.cache_manager.update_cache_config(cfg)

    def total_block_number(self):
        return self.cache_manager.num_gpu_blocks

    def available_block_num(self):
        return len(self.cache_manager.gpu_free_block_list)

    def get_gpu_cache_usage_perc(self):
        total, free = self.total_block_number(), len(self.cache_manager.gpu_free_block_list)
        return 1.0 - free / total if total > 0 else 0.0

    def available_batch(self):
        return sum(self.stop_flags)

    def get_available_position(self):
        return self.stop_flags.index(True)

    # ---- ResourceManagerV1 -------------------------------------------------------------------------------
    def add_request(self, request):
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def add_abort_req_ids(self, req_ids):
        self.waiting_abort_req_id_set.update(req_ids if isinstance(req_ids, list) else [req_ids])

    def allocated_slots(self, request):
        return len(request.block_tables) * self.block_size

    def get_new_block_nums(self, request, num_new_tokens):
        bs = self.block_size
        need = (request.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(request.block_tables)
        return need if self.version == "c1b7c083" else max(need, 0)  # develop does not clamp

    def _is_decoding(self, request):
        return request.num_computed_tokens >= request.need_prefill_tokens

    def _get_num_new_tokens(self, request, token_budget):
        num_new_tokens = min(request.need_prefill_tokens - request.num_computed_tokens, token_budget)
        assert num_new_tokens > 0
        if self.patched and self.enable_prefix_caching:  # E3: end the chunk where a checkpoint is due
            pos = self.cache_manager.next_checkpoint_position(request)
            if pos is not None and pos > request.num_computed_tokens:
                num_new_tokens = min(num_new_tokens, pos - request.num_computed_tokens)
        return num_new_tokens

    def _state_blocks(self, request):  # E2: the ticket, where a new request's block need is computed
        n = self.cache_manager.state_blocks_for(request) if self.patched else 0
        if n:
            self.tickets.add(request.request_id)
        return n

    def _allocate_gpu_blocks(self, request, num_blocks):
        cm = self.cache_manager
        first = request.request_id in self.tickets  # the engine charged its state sets (E2)
        self.tickets.discard(request.request_id)
        before = cm.num_free_device_blocks
        if self.enable_cache_manager_v1:
            ids = cm.allocate_gpu_blocks(request, num_blocks)
        else:
            ids = cm.allocate_gpu_blocks(num_blocks, request.request_id)
        # can_allocate_gpu_blocks said yes just before: n blocks taken, n ids back (first: its S state
        # blocks); a negative n (develop's unclamped get_new_block_nums) takes none, as FastDeploy's managers
        n = max(num_blocks, 0)
        assert before - cm.num_free_device_blocks == n, (request.request_id, num_blocks)
        assert len(ids) == n - (cm.num_state_blocks_per_request if first else 0), (request.request_id, ids)
        return ids

    def _prepare_prefill_task(self, request, new_token_num):
        request.prefill_start_index = request.num_computed_tokens
        request.prefill_end_index = request.num_computed_tokens + new_token_num
        request.task_type = RequestType.PREFILL
        if request.prefill_end_index > self.allocated_slots(request):
            self.over_slots.append((request.request_id, request.prefill_end_index, self.allocated_slots(request)))
        self._add_hybrid_fields(request, request)
        return request

    def _prepare_decode_task(self, request):
        task = ScheduledDecodeTask(idx=request.idx, request_id=request.request_id, block_tables=request.block_tables)
        self._add_hybrid_fields(request, task)
        return task

    def _add_hybrid_fields(self, request, task):  # E5: state tables and copies travel in the task
        if self.patched:
            for key, value in self.cache_manager.task_fields(request.request_id).items():
                setattr(task, key, value)

    def _select_preempt_candidate(self):
        i = len(self.running) - 1
        while i >= 0:
            candidate = self.running[i]
            if candidate.status == RequestStatus.RUNNING_DECODE and not candidate.use_extend_tables:
                return candidate, i
            i -= 1
        return None, i

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, batch_request):
        while True:
            if self.cache_manager.can_allocate_gpu_blocks(num_new_blocks):
                return True
            preempted_req, preempted_idx = self._select_preempt_candidate()
            if preempted_req is None:  # "scheduler may be hung"
                return False
            self.running.pop(preempted_idx)
            preempted_req.status = RequestStatus.PREEMPTED
            preempted_req.num_computed_tokens = 0
            if self.splitwise_role == "decode":  # dropped: its prefill lived on the prefill instance
                self.tasks_list[preempted_req.idx] = None
                self.stop_flags[preempted_req.idx] = True
                self.requests.pop(preempted_req.request_id, None)
                self.req_dict.pop(preempted_req.request_id, None)
                self._free_blocks(preempted_req)
            else:
                self._free_blocks(preempted_req)
                preempted_req.num_cached_blocks = 0
                self.to_be_rescheduled_request_id_set.add(preempted_req.request_id)
            self.preemptions[preempted_req.request_id] = self.preemptions.get(preempted_req.request_id, 0) + 1
            preempted_reqs.append(preempted_req)
            batch_request.append(ScheduledPreemptTask(idx=preempted_req.idx, request_id=preempted_req.request_id))
            self._reset_reserve_on_preemption()
            if preempted_req is request:
                return False

    def _reset_reserve_on_preemption(self):
        self.current_reserve = self.init_reserve
        self.current_reserve_float = float(self.init_reserve)
        self.can_relax_prefill_strategy = False

    def _get_can_schedule_prefill_threshold_block(self, num_chunk_new_block):
        if self.splitwise_role != "mixed" or self.can_relax_prefill_strategy:
            return num_chunk_new_block
        return num_chunk_new_block + len(self.running) * self.current_reserve

    def _trigger_abort(self, request_id, batch_request):
        if request_id in self.requests:
            req = self.requests[request_id]
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self._free_blocks(req)
            req.cached_block_num = 0
            batch_request.append(ScheduledAbortTask(idx=req.idx, request_id=request_id))
            self.to_be_aborted_req_id_set.add(request_id)
            self.waiting_abort_req_id_set.discard(request_id)

    def recycle_abort_task(self, request_id):
        if request_id in self.to_be_aborted_req_id_set and request_id in self.requests:
            req = self.requests.pop(request_id)
            self.tasks_list[req.idx] = None
            self.stop_flags[req.idx] = True
            self.req_dict.pop(request_id, None)
            self.to_be_aborted_req_id_set.discard(request_id)
        self.update_metrics()

    def reschedule_preempt_task(self, request_id):
        if request_id in self.to_be_rescheduled_request_id_set and request_id in self.requests:
            request = self.requests[request_id]
            request.has_been_preempted_before = True
            self.waiting.appendleft(request)
            self.to_be_rescheduled_request_id_set.remove(request_id)

    def _update_cache_blocks(self, request):  # legacy always; v1 only with E3 (lines 1040, 1138, 1211)
        if self.enable_prefix_caching and (not self.enable_cache_manager_v1 or self.patched):
            self.cache_manager.update_cache_blocks(request, self.block_size, request.num_computed_tokens)

    def schedule(self):
        self.tickets.clear()  # (tickets lapse at begin_step)
        if self.patched:  # E4
            self.cache_manager.begin_step()
        preempted_reqs, error_reqs, need_abort_requests, batch_request = [], [], [], []
        num_running_decode_reqs = sum(1 for r in self.running if self._is_decoding(r))
        token_budget = self.max_num_batched_tokens - num_running_decode_reqs
        chunk_prefill_in_running_not_satisfied = False
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if self._is_decoding(request):
                if self.splitwise_role == "prefill":
                    req_index += 1
                    continue
                if request.num_total_tokens > request.need_prefill_tokens:
                    request.num_computed_tokens = request.num_total_tokens - 1
                if request.request_id in self.waiting_abort_req_id_set:
                    self._trigger_abort(request.request_id, batch_request)
                    req_index += 1
                    need_abort_requests.append(request)
                    continue
                if (
                    self.allocated_slots(request) - request.num_total_tokens
                    <= self.prealloc_dec_block_slot_num_threshold
                ):
                    if not self.cache_manager.can_allocate_gpu_blocks(self.enc_dec_block_num):
                        if not self._trigger_preempt(request, self.enc_dec_block_num, preempted_reqs, batch_request):
                            break
                    request.block_tables.extend(self._allocate_gpu_blocks(request, self.enc_dec_block_num))
                    batch_request.append(self._prepare_decode_task(request))
            else:
                num_new_tokens = self._get_num_new_tokens(request, token_budget)
                num_new_block = self.get_new_block_nums(request, num_new_tokens)
                self.zero_block_chunks += num_new_block == 0
                if self.cache_manager.can_allocate_gpu_blocks(
                    self._get_can_schedule_prefill_threshold_block(num_new_block)
                ):
                    request.block_tables.extend(self._allocate_gpu_blocks(request, num_new_block))
                    batch_request.append(self._prepare_prefill_task(request, num_new_tokens))
                else:
                    chunk_prefill_in_running_not_satisfied = True
                    break
                token_budget -= num_new_tokens
                request.num_computed_tokens += num_new_tokens
                if self.splitwise_role == "mixed":
                    self._update_cache_blocks(request)
            req_index += 1
        for request in need_abort_requests:
            self.running.remove(request)
        if not preempted_reqs and not chunk_prefill_in_running_not_satisfied:
            self._schedule_waiting(token_budget, batch_request)
        if batch_request:
            self.current_reserve_float -= self.decay_reserve
            self.current_reserve = max(int(self.current_reserve_float), self.min_reserve, 0)
            if self.current_reserve == 0:
                self.can_relax_prefill_strategy = True
        self.update_metrics()
        if self.patched and "E9" not in self.omit and batch_request:  # E9: the host-tier copies ride on task 0
            tier = self.cache_manager.take_tier_copies()
            if tier is not None:
                batch_request[0].tier_copies = tier
        if self.enable_cache_manager_v1 and batch_request:  # line 1254
            self.cache_manager.issue_pending_backup_to_batch_request()
        if self.enable_cache_manager_v1:  # lines 1258-1259
            self.cache_manager.check_and_add_pending_backup()
            self.backup_calls += 1
        return batch_request, error_reqs

    def _schedule_waiting(self, token_budget, batch_request):
        skip_requests = []
        while self.waiting and token_budget > 0:
            busy = len(self.running) + len(self.to_be_rescheduled_request_id_set) + len(self.to_be_aborted_req_id_set)
            if busy + sum(r.status == RequestStatus.PREEMPTED for r in self.waiting) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            was_waiting = request.status == RequestStatus.WAITING
            if request.status == RequestStatus.PREEMPTED:
                request.need_prefill_tokens = request.num_total_tokens
            if self.enable_prefix_caching and (was_waiting or self.splitwise_role != "decode"):
                if not self.enable_cache_manager_v1 and self.cache_manager.num_cpu_blocks > 0:  # hierarchical cache
                    whole = (request.need_prefill_tokens + self.block_size - 1) // self.block_size
                    if not self.cache_manager.can_allocate_gpu_blocks(
                        self._get_can_schedule_prefill_threshold_block(whole)
                    ):
                        break
                if not self.get_prefix_cached_blocks(request):
                    self._free_blocks(request)
                    break
            num_new_tokens = self._get_num_new_tokens(request, token_budget)
            num_new_block = self.get_new_block_nums(request, num_new_tokens) + self._state_blocks(request)  # E2
            self.zero_block_chunks += num_new_block == 0
            if self.cache_manager.can_allocate_gpu_blocks(
                self._get_can_schedule_prefill_threshold_block(num_new_block)
            ):
                if num_new_block > 0:
                    request.block_tables.extend(self._allocate_gpu_blocks(request, num_new_block))
                self.waiting.popleft()
                self.running.append(request)
                if was_waiting and self.splitwise_role == "mixed":
                    request.idx = self.get_available_position()
                    self.tasks_list[request.idx] = request
                    self.stop_flags[request.idx] = False
                    self.req_dict[request.request_id] = request.idx
                batch_request.append(self._prepare_prefill_task(request, num_new_tokens))
                self.hit_tokens += request.num_computed_tokens  # admitted: the tokens its prefix hit served
                token_budget -= num_new_tokens
                request.num_computed_tokens += num_new_tokens
                if self.splitwise_role != "decode":
                    self._update_cache_blocks(request)
                request.status = RequestStatus.RUNNING_PREFILL
            else:
                if self.enable_prefix_caching:
                    self._free_blocks(request)
                break
        for req in skip_requests:
            self.waiting.append(req)

    def get_prefix_cached_blocks(self, request):
        try:
            bs = self.block_size
            if self.enable_cache_manager_v1:  # _request_match_blocks, v1 branch (line 1399)
                self.cache_manager.match_prefix(request, True)
                result = request.match_result
                common_block_ids = result.device_block_ids
                matched_token_num = result.total_matched_blocks * bs
                metrics = {
                    "gpu_match_token_num": result.matched_device_nums * bs,
                    "cpu_match_token_num": result.matched_host_nums * bs,
                    "storage_match_token_num": result.matched_storage_nums * bs,
                    "match_gpu_block_ids": common_block_ids, "gpu_recv_block_ids": [], "match_storage_block_ids": [],
                    "cpu_cache_prepare_time": 0, "storage_cache_prepare_time": 0,
                }  # fmt: skip
                request.cache_info = [
                    len(common_block_ids),
                    (request.need_prefill_tokens - matched_token_num + bs - 1) // bs,
                ]
            else:
                common_block_ids, matched_token_num, metrics = self.cache_manager.request_match_blocks(request, bs)
                no_cache = self.cache_manager.get_required_block_num(
                    request.need_prefill_tokens - matched_token_num, bs
                )
                request.cache_info = [len(common_block_ids), no_cache]
            request.block_tables = common_block_ids
            request.num_cached_tokens = matched_token_num
            if matched_token_num == request.need_prefill_tokens:
                request.num_computed_tokens = matched_token_num - bs
            else:
                request.num_computed_tokens = matched_token_num
            if request.num_cached_tokens != request.num_computed_tokens:  # the revert, by block membership
                revert = (request.num_cached_tokens - request.num_computed_tokens) // bs
                for block_id in common_block_ids[len(common_block_ids) - revert :]:
                    if block_id in metrics["match_gpu_block_ids"]:
                        metrics["gpu_match_token_num"] -= bs
                    elif block_id in metrics["gpu_recv_block_ids"]:
                        metrics["cpu_match_token_num"] -= bs
            if not request.has_been_preempted_before:
                request.metrics.gpu_cache_token_num = metrics["gpu_match_token_num"]
                request.metrics.cpu_cache_token_num = metrics["cpu_match_token_num"]
                request.metrics.cpu_cache_prepare_time = metrics["cpu_cache_prepare_time"]
                self.main_metrics["prefix_cache_token_num"] += request.num_computed_tokens
                self.main_metrics["prefix_gpu_cache_token_num"] += request.metrics.gpu_cache_token_num
                self.main_metrics["prefix_cpu_cache_token_num"] += request.metrics.cpu_cache_token_num
            return True
        except Exception as e:  # "prefix match blocks error ... waiting reschedule"
            self.swallowed.append(e)
            return False

    def _free_blocks(self, request):
        if self.enable_cache_manager_v1:
            self.cache_manager.request_finish(request)
        elif self.enable_prefix_caching and self.splitwise_role != "decode":
            self.cache_manager.release_block_ids(request)
            self.cache_manager.recycle_gpu_blocks(request.block_tables[request.num_cached_blocks :], request.request_id)
        else:
            self.cache_manager.recycle_gpu_blocks(request.block_tables, request.request_id)
        request.block_tables = []

    def finish_requests(self, request_ids):
        self.update_metrics()
        try:
            need_postprocess_reqs = []
            for req_id in set(request_ids):
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
                self.req_dict.pop(req_id, None)
                self.waiting_abort_req_id_set.discard(req_id)
                self.to_be_aborted_req_id_set.discard(req_id)
            for req in need_postprocess_reqs:
                if self.splitwise_role == "decode":  # line 1734
                    self.cache_manager.write_cache_to_storage_decode(req)
                else:
                    self.cache_manager.write_cache_to_storage(req)
            for req in need_postprocess_reqs:
                try:
                    self._free_blocks(req)  # line 1742
                except Exception as e:  # "release block failed"
                    self.swallowed.append(e)
        except Exception as e:  # "finish_request err", line 1747
            self.swallowed.append(e)
        finally:
            self.update_metrics()

    def pre_recycle_resource(self, request_id):
        if request_id not in self.requests:
            return
        req = self.requests.pop(request_id)
        self.tasks_list[req.idx] = None
        self.stop_flags[req.idx] = True
        self._free_blocks(req)
        self.req_dict.pop(request_id, None)

    def update_metrics(self):
        used = set()
        for task in self.tasks_list:
            if task is not None:
                used.update(task.block_tables)
        if self.patched:  # E7: line 1767 counts what an allocation can take (state blocks are held)
            available = self.cache_manager.num_free_device_blocks
        else:
            available = self.total_block_number() - len(used)
        self.metrics = {
            "available_gpu_block_num": available,
            "gpu_cache_usage_perc": self.get_gpu_cache_usage_perc(),
            "batch_size": self.max_num_seqs - self.available_batch(),
        }
        if self.patched and self.enable_prefix_caching:  # E7: the hit-rate gauges PrefixCacheManager sets itself
            hits = self.cache_manager.metrics
            self.metrics |= {"hit_req_rate": hits.hit_req_ratio, "hit_token_rate": hits.hit_token_ratio,
                             "gpu_hit_token_rate": hits.gpu_hit_token_ratio,
                             "cpu_hit_token_rate": hits.cpu_hit_token_ratio}  # fmt: skip

    # ---- splitwise -----------------------------------------------------------------------------------------
    def _prealloc_blocks(self, request):
        bs = self.block_size
        return (request.need_prefill_tokens + bs - 1) // bs + self.enc_dec_block_num + self._state_blocks(request)

    def preallocate_resource_in_p(self, request):
        assert self.splitwise_role == "prefill"
        if self.available_batch() == 0:
            return False
        request.need_prefill_tokens = len(request.prompt_token_ids)
        need = self._prealloc_blocks(request)  # E2 adds the state sets
        if self.enable_prefix_caching:
            if not self.get_prefix_cached_blocks(request):
                self._free_blocks(request)
                return False
            extra = need - request.cache_info[0]
            if not self.cache_manager.can_allocate_gpu_blocks(extra):
                self._free_blocks(request)
                return False
            request.block_tables.extend(self._allocate_gpu_blocks(request, extra))
            self._take_slot(request)
            self.cache_manager.update_cache_blocks(request, self.block_size, request.need_prefill_tokens)
            return True
        if not self.cache_manager.can_allocate_gpu_blocks(need):
            return False
        request.block_tables.extend(self._allocate_gpu_blocks(request, need))
        request.num_computed_tokens = 0
        self._take_slot(request)
        return True

    def _take_slot(self, request):
        request.idx = self.get_available_position()
        self.tasks_list[request.idx] = request
        self.stop_flags[request.idx] = False
        self.requests[request.request_id] = request
        self.req_dict[request.request_id] = request.idx

    def add_request_in_p(self, requests):
        for request in requests:
            request.status = RequestStatus.RUNNING_PREFILL
            self.running.append(request)

    def preallocate_resource_in_d(self, request, pool=None):
        assert self.splitwise_role == "decode"
        request.need_prefill_tokens = len(request.prompt_token_ids)
        need = self._prealloc_blocks(request)  # E2 adds the state sets
        if self.waiting or self.available_batch() == 0:
            return False
        if not self.cache_manager.can_allocate_gpu_blocks(self._get_can_schedule_prefill_threshold_block(need)):
            return False
        request.block_tables = self._allocate_gpu_blocks(request, need)
        request.num_computed_tokens = request.need_prefill_tokens
        request.disaggregate_info["block_tables"] = request.block_tables
        if self.patched:  # S1: where to write the state sets too
            request.disaggregate_info["hybridkv_accept"] = self.cache_manager.transfer_accept(request, pool)
        request.idx = self.get_available_position()
        self.stop_flags[request.idx] = False
        self.requests[request.request_id] = request
        self.req_dict[request.request_id] = request.idx
        return True

    def add_prefilled_request(self, request_id, first_token):
        assert self.splitwise_role == "decode"
        if request_id not in self.requests:
            return
        request = self.requests[request_id]
        request.output_token_ids.append(first_token)
        request.need_prefill_tokens = len(request.prompt_token_ids) + 1
        request.status = RequestStatus.RUNNING_DECODE
        self.tasks_list[request.idx] = request
        self.running.append(request)

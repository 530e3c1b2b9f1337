"""The facade's prefix caching in FastDeploy's terms: legacy ``request_match_blocks`` and v1
``match_prefix`` (a pending match taken by the request's first allocation), host-tier hits split
into device and host parts as ``PrefixCacheManager`` splits them (patch E9), checkpoint
reservations at ``update_cache_blocks``, and the step boundary (:meth:`PrefixMixin.begin_step`,
:meth:`PrefixMixin.take_tier_copies`). A mixin of
:class:`~hybridkv.integrations.fastdeploy.facade.FastDeployBlockManager`, split from it by concern.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.blockmgr.prefix import PrefixHit
from hybridkv.blockmgr.records import RequestId, RequestStatus
from hybridkv.errors import RequestStateError
from hybridkv.integrations.fastdeploy.types import (
    EnginePatchError,
    MatchResult,
    _Hit,
    _Node,
    _Pending,
    _token_ids,
)
from hybridkv.units import as_count


class PrefixMixin:
    """Prefix caching and the step boundary of the facade (state lives on the facade)."""

    def request_match_blocks(self, task: Any, block_size: int, *args: Any) -> tuple[list[int], int, dict]:
        """Legacy match: ``(common_block_ids, matched_token_num, hit_info)``; the request is admitted by
        the next ``allocate_gpu_blocks`` in the same step (which shares these blocks and copies the
        checkpoint). The match replaces an earlier one of the request and lapses at the next
        :meth:`begin_step`.

        ``hit_info`` has the keys of ``PrefixCacheManager.request_match_blocks`` (read at 000bd93d)
        and its ``gpu_cache_blocks`` / ``cpu_cache_blocks``: ``match_gpu_block_ids`` are the hit's
        device-resident blocks, ``gpu_recv_block_ids`` the device blocks that receive its
        host-resident ones (a host hit is admitted here, as FastDeploy allocates those blocks at
        its match), ``gpu_match_token_num`` / ``cpu_match_token_num`` their tokens (together
        ``matched_token_num``). ``common_block_ids`` is the block table through the hit in chain
        order (FastDeploy concatenates device then host blocks; hybridkv's host-resident blocks may
        sit between device-resident ones). ``cpu_cache_prepare_time``: the **modelled** time of the
        hit's host -> device copies (``cpu_cache_prepare_bytes`` over the ``gpu``'s host link
        rate), 0.0 without a ``gpu``: the worker runs the copies after this call (patch E9), so the
        facade cannot measure them. ``cpu_cache_prepare_bytes`` (hybridkv's key): those copies'
        bytes, a host checkpoint's state blocks included."""
        self._require("request_match_blocks")
        block_size = as_count(block_size, "request_match_blocks block_size", minimum=1)
        if block_size != self.block_size:
            raise ValueError(f"block_size {block_size} differs from the layout's {self.block_size}")
        h = self._match(task)
        bs = self.block_size
        task.num_cached_blocks = task.cached_block_num = len(h.table)
        gpu_tokens, cpu_tokens = len(h.device_ids) * bs, len(h.recv_ids) * bs
        self.metrics.add(gpu_tokens, cpu_tokens, h.num_input_tokens)
        hit_info = {
            "gpu_cache_blocks": len(h.device_ids),
            "cpu_cache_blocks": len(h.recv_ids),
            "gpu_match_token_num": gpu_tokens,
            "cpu_match_token_num": cpu_tokens,
            "storage_match_token_num": 0,
            "match_gpu_block_ids": list(h.device_ids),
            "gpu_recv_block_ids": list(h.recv_ids),
            "match_storage_block_ids": [],
            "cpu_cache_prepare_time": self._prepare_time(h.onload_bytes),
            "storage_cache_prepare_time": 0.0,
            "cpu_cache_prepare_bytes": h.onload_bytes,
        }
        return list(h.table), h.num_cached_tokens, hit_info

    def match_prefix(self, request: Any, skip_storage: bool = True) -> None:
        """v1 match: sets ``request.match_result`` (device nodes = the hit's device-resident KV
        blocks, host nodes = its host-resident ones, as ``CacheManager.match_prefix`` splits them).
        7808a119's ``_request_match_blocks`` reads ``matched_host_nums`` as ``cpu_match_token_num``
        and ``device_block_ids`` as the block table: for a host hit (admitted here, see
        :meth:`request_match_blocks`) that is the whole table through the hit, the receiving
        blocks included, so the engine's next allocation asks only for blocks past the hit (where
        ``CacheManager`` hands the receiving blocks out in that allocation). Pending like
        :meth:`request_match_blocks`' match: taken by the next ``allocate_gpu_blocks(request, n)``,
        replaced by a new match, dropped by ``request_finish``, lapsed at the next :meth:`begin_step`.
        (7808a119 sets ``cpu_cache_prepare_time`` 0 in this mode, whatever the cache manager knows.)"""
        self._require("match_prefix")
        h = self._match(request)
        bs = self.block_size
        self.metrics.add(len(h.device_ids) * bs, len(h.recv_ids) * bs, h.num_input_tokens)
        table = list(h.table) if h.recv_ids else None
        result = MatchResult([_Node(b) for b in h.device_ids], [_Node(b) for b in h.host_ids], table=table)
        request._match_result = result
        try:
            request.match_result = result
        except AttributeError:  # FastDeploy's Request exposes it as a read-only property
            pass

    def _prepare_time(self, num_bytes: int) -> float:
        """Modelled seconds of ``num_bytes`` host -> device on the ``gpu``'s host link; 0.0 without one."""
        return num_bytes / self.gpu.host_link_bytes_per_s if self.gpu is not None and num_bytes else 0.0

    def _match(self, task: Any) -> _Hit:
        rid = getattr(task, "request_id", None)
        if rid is None:
            raise TypeError(f"a prefix match needs a request with request_id, got {type(task).__name__}")
        tokens = _token_ids(task)
        num_input = len(tokens)
        self._pending.pop(rid, None)  # a new match of the request replaces its old one
        self._lapsed.discard(rid)
        if rid in self._admitted:  # (a host hit admitted at its last match: given back first)
            self._drop_admitted(rid)
        m, cache = self.manager, self.manager.prefix_cache
        if cache is None or rid in m.requests:
            p = _Pending(tokens, 0, [])
        else:
            need = int(getattr(task, "need_prefill_tokens", None) or len(tokens))
            hit = cache.match(tokens, need)
            branch = hit.num_matched_tokens
            # a checkpoint reserved in this step is written only after this step's forward: a hit on
            # it would copy stale bytes. Match on the input cut before it (the request then caches
            # no blocks past the cut; rare: it needs a same-prefix request one chunk ahead).
            while hit.checkpoint_key is not None and hit.checkpoint_key in self._fresh:
                tokens = tokens[: hit.num_tokens]
                hit = cache.match(tokens, need)
            # hit or miss as the manager decides it for the smallest admission through the hit (its own
            # tokens): it admits a hit as a miss only when the hit pins more than it saves and does not
            # fit, which a larger first chunk does not change; _allocate refuses a hit that changed
            plan = m.plan_admission(hit.num_tokens, token_ids=tokens) if hit.num_tokens else None
            if plan is not None and plan.num_cached_tokens == hit.num_tokens:
                if hit.on_host:
                    return self._admit_host_hit(rid, tokens, hit, num_input)
                blocks = hit.kv_blocks.tolist()
                p = _Pending(tokens, hit.num_tokens, blocks, hit.checkpoint_key, branch)
            else:
                p = _Pending(tokens, 0, [], None, branch)
        self._pending[rid] = p
        return _Hit(p.block_ids, p.num_cached_tokens, p.block_ids, [], [], 0, num_input)

    def _admit_host_hit(self, rid: RequestId, tokens: list[int], hit: PrefixHit, num_input: int) -> _Hit:
        """Admit a hit that reads host-resident blocks now, with its own tokens: its device blocks
        (shared and receiving) are FastDeploy's block table through the hit, its checkpoint copy
        waits in the request's copies and its host -> device copies in the tier's queue (E9). Raises
        :class:`NoFreeBlocksError` when it does not fit, before any change (FastDeploy's own match
        raises there too; its ``get_prefix_cached_blocks`` catches it and the request waits)."""
        m = self.manager
        alloc = m.allocate(rid, hit.num_tokens, token_ids=tokens)
        if alloc.num_cached_tokens != hit.num_tokens:  # (plan_admission said hit a moment ago)
            m.free(rid)
            raise RequestStateError(f"prefix hit of {rid!r} changed during its admission: match again")
        self._admitted.add(rid)
        if len(alloc.copies):
            self._copies[rid] = alloc.copies
        n = hit.num_tokens // self.block_size
        table = m.requests[rid].kv_blocks[:n]
        on_dev = np.ones(n, dtype=bool)
        on_dev[hit.host_index] = False
        onload = int(hit.host_kv.size) + (m.num_state_blocks if hit.host_checkpoint is not None else 0)
        return _Hit(
            table.tolist(), hit.num_tokens, table[on_dev].tolist(), table[~on_dev].tolist(), hit.host_kv.tolist(),
            onload * m.layout.bytes_per_block, num_input,
        )  # fmt: skip

    def _drop_admitted(self, rid: RequestId) -> None:
        """Give back a host hit admitted at its match that no allocation took (its copies still run:
        the blocks it filled stay cached)."""
        self._admitted.discard(rid)
        self._copies.pop(rid, None)
        self.manager.free(rid)

    def update_cache_blocks(self, task: Any, block_size: int, num_computed_tokens: int) -> None:
        """After a prefill chunk is scheduled (``task`` is the prefill ``Request``, already prepared):
        set ``num_cached_blocks``, and if the chunk ends where the checkpoint policy wants the state,
        reserve a checkpoint and add its live -> checkpoint copy to ``task.checkpoint_copies``: the
        worker runs it right after this chunk's forward, when the live state is at that position.
        Only a chunk scheduled in this call's step checkpoints (``task.num_computed_tokens`` is the
        chunk's end): ``preallocate_resource_in_p`` calls it before any chunk ran. Raises
        :class:`EnginePatchError` (patch E4), before reserving, if :meth:`begin_step` never ran: the
        checkpoint's pins would never be released."""
        self._require("update_cache_blocks")
        task.num_cached_blocks = task.cached_block_num = num_computed_tokens // self.block_size
        rid = task.request_id
        rec = self.manager.requests.get(rid)
        if rec is None or self.manager.prefix_cache is None or rec.num_tokens != num_computed_tokens:
            return  # a speculative look-ahead block or a chunk ending mid-block: no exact state position
        if getattr(task, "num_computed_tokens", num_computed_tokens) != num_computed_tokens:
            return  # no chunk ends here in this step (the state is not at this position after the forward)
        if not self._stepped:  # its pins would never be released: the blocks would never come back
            raise EnginePatchError(
                f"update_cache_blocks: a checkpoint of {rid!r} would be reserved, but begin_step() never ran: "
                "patch E4 (self.cache_manager.begin_step() as the first line of schedule()) is missing; without it "
                "no checkpoint pin is released, so its blocks never come back and no prefix hit can read it"
            )
        copies = self.manager.checkpoint(rid)
        if len(copies):
            self._fresh.add(rec.block_keys[num_computed_tokens // self.block_size - 1])
            src, dst = getattr(task, "checkpoint_copies", None) or ([], [])
            task.checkpoint_copies = [list(src) + copies.src.tolist(), list(dst) + copies.dst.tolist()]

    def next_checkpoint_position(self, request: Any) -> int | None:
        """Input position where the next prefill chunk of ``request`` should end so that the state
        there can be checkpointed (``_get_num_new_tokens`` caps the chunk at it), or None."""
        self._require("next_checkpoint_position")
        cache, rid = self.manager.prefix_cache, request.request_id
        rec = self.manager.requests.get(rid)
        if cache is None:
            return None
        done = request.num_computed_tokens
        if rec is not None:
            if rec.status is not RequestStatus.RUNNING or rec.pending is not None:
                return None  # swapped out or handing over: it has no prefill chunk to end now
            return self.manager.next_checkpoint_position(rid, done)
        # not admitted yet: the deepest checkpoint on its chain is the hit's
        pending = self._pending.get(rid)
        if pending is None or pending.token_ids is None:
            return None
        return cache.next_checkpoint(done, len(pending.token_ids), pending.branch_tokens, pending.num_cached_tokens)

    def cache_output_blocks(self, request: Any, block_size: int) -> None:
        """Output tokens are not cached (their KV has no checkpoint to pair with): nothing to do."""

    def begin_step(self) -> None:
        """Call at the start of ``schedule()``: the copies that pinned checkpoints were sent in earlier
        steps, so those checkpoints may be evicted again, and hits may read them.

        Matches of the previous step that no allocation took lapse here: FastDeploy matches and
        allocates a request within one ``schedule()`` (and releases it when the allocation fails), so
        such a match was abandoned. It stops pinning blocks, and a later ``allocate_gpu_blocks`` of
        that request refuses (``RequestStateError`` in both forms) until it is matched again. Tickets
        (:meth:`state_blocks_for`) of requests not admitted lapse too, and so does a host hit admitted
        at its match that no allocation took (it is given back).

        With the host tier every copy handed out in a step is pinned (a pin epoch per step) until
        this call: the worker ran them before this step's copies. Tier copies that E9 has not taken
        yet (a step with an empty batch) keep their pins until a later step hands them out."""
        self._require("begin_step")
        self._check_e9()
        self._stepped = True
        self._tickets.clear()
        for rid in sorted(self._admitted, key=repr):
            self._drop_admitted(rid)
            self._lapsed.add(rid)
        tier = self._tier
        if tier is not None and tier.has_queued():
            self.manager.release_pins(before=self._take_epoch)
        else:
            self.manager.release_pins()
        if tier is not None:
            self.manager.begin_pin_epoch()
        self._fresh.clear()
        for rid in self._pending:
            if rid not in self.manager.requests:
                self._lapsed.add(rid)
        self._pending.clear()

    def _check_e9(self) -> None:
        """Patch E9 missing fails loudly, as a missing E4 does: tier copies queued across two
        ``begin_step`` calls while ``take_tier_copies`` never ran mean the engine has no E9 line
        (a patched engine takes them on its first non-empty batch). Without this the copies' pins
        never end and the engine waits forever. Raises before anything changes."""
        tier = self._tier
        if tier is None or not tier.has_queued():
            self._untaken_steps = 0
            return
        self._untaken_steps += 1
        if self._untaken_steps >= 2 and not self._took_tier_copies:
            raise EnginePatchError(
                "begin_step: the host tier's copies of earlier steps were never taken: patch E9 adds, at the end of "
                "schedule(), tier_copies = self.cache_manager.take_tier_copies() on the batch's first task "
                "(docs/fastdeploy.md); without it their blocks stay pinned and the engine waits forever"
            )

    def take_tier_copies(self) -> dict[str, list[list[int]]] | None:
        """Patch E9, the last lines of ``schedule()``: the host tier's copies of this step, for the
        first task of the batch (field :data:`TIER_COPIES_FIELD`), or None when there are none (or
        no tier). ``{"offload": [[device...], [host...]], "onload": [[device...], [host...]]}``,
        ``device[i] <-> host[i]``: the worker runs the offloads (device -> host, cached blocks
        evicted in this step) before anything else of the step, then the onloads (host -> device,
        host hits), then the tasks' ``state_copies`` and the forward (W6, docs/contract.md stages 0
        and 3b). Taken once per step, after every allocation and checkpoint reservation of the step;
        the host blocks they touch stay held until the next :meth:`begin_step`."""
        self._require("take_tier_copies")
        self._took_tier_copies, self._untaken_steps = True, 0
        tier = self._tier
        if tier is None or not tier.has_queued():
            return None
        self._take_epoch = self.manager.pin_epoch
        plan = self.manager.take_tier_copies()
        return {
            "offload": [plan.offload.device_blocks.tolist(), plan.offload.host_blocks.tolist()],
            "onload": [plan.onload.device_blocks.tolist(), plan.onload.host_blocks.tolist()],
        }

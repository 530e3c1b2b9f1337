"""A property test of disaggregation: a prefill role and a decode role on the loopback engine, with
real bytes in their pools, driven by random programs.

Both sides run the same byte-level executor. A forward over a row reads the request's state (its
first eight bytes are the running hash of the tokens so far), mixes in each scheduled token, writes
every token's KV bytes and the new state, and samples a token from the hash: a model in miniature,
so a byte that is wrong anywhere changes what is sampled next. Before each row the executor checks
every KV byte of every computed token and every state byte against what the request's *true*
tokens predict (the decode side's stand-in ids are replaced by the prompt the test knows), and at
the end every request's outputs must equal a reference run on one machine.

The programs mix: requests with and without token ids on the decode side, chunked prefill and
preemption on both sides (recompute and swap), hand-offs pulled late, twice, malformed or refused,
READs that fail (a ``TransferError`` before or half-way, any other exception), aborts on both
sides, cancels and settles. After every operation both managers pass ``check_integrity()``; at the
end every block (device and host) is back on both sides.

``DISAGG_EXAMPLES`` sets the number of examples (default 150, about 25 s here).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.errors import (
    DuplicateRequestError,
    HostPoolExhaustedError,
    NoFreeBlocksError,
    RequestTooLargeError,
    UnknownRequestError,
)
from hybridkv.blockmgr.spec import AttentionLayerSpec, RecurrentLayerSpec
from hybridkv.scheduler_adapter.cost import PreemptionMode
from hybridkv.scheduler_adapter.disagg import DecodeRole, PrefillRole
from hybridkv.scheduler_adapter.requests import StepOutputs
from hybridkv.scheduler_adapter.scheduler import SchedulerConfig
from hybridkv.transfer import TransferError
from hybridkv.transfer.handoff import BlocksMessage
from hybridkv.transfer.loopback import LoopbackEngine, LoopbackHub, connect_pair, regions_of_array
from hybridkv.transfer.testing import mini_layout, mini_mamba2, mini_minimax, reference_bytes, seeded_pool

try:
    from hybridkv.transfer.errors import HandoffRefusedError
except ImportError:  # an older tree: the property test still runs there (to find its defects)
    HandoffRefusedError = type("HandoffRefusedError", (TransferError,), {})  # type: ignore[misc]

EXAMPLES = int(os.environ.get("DISAGG_EXAMPLES", "150"))
H0 = 0x243F6A8885A308D3
M64 = (1 << 64) - 1


# ---- the model in miniature ----------------------------------------------------------------------
def mix(h: int, token: int) -> int:
    return ((h ^ (token & M64)) * 0x100000001B3 + 0x9E3779B97F4A7C15) & M64


def sample_of(h: int) -> int:
    return 1 + (h >> 33) % 97


def is_stop(token: int) -> bool:
    return token % 29 == 0


def hashes(tokens: list[int]) -> list[int]:
    """``out[p]``: the hash after tokens ``0..p``."""
    out, h = [], H0
    for t in tokens:
        h = mix(h, t)
        out.append(h)
    return out


def reference_outputs(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What one machine samples for ``prompt``: up to ``max_new_tokens`` tokens, ending at a stop."""
    h, out = hashes(prompt)[-1], []
    while True:
        t = sample_of(h)
        out.append(t)
        if is_stop(t) or len(out) == max_new_tokens:
            return out
        h = mix(h, t)


def pattern(h: np.ndarray, salt: int, n: int) -> np.ndarray:
    """uint8 ``[len(h), n]`` bytes derived from each hash (and a salt naming the tensor)."""
    x = h.astype(np.uint64)[:, None] ^ np.uint64((salt * 0x9E3779B97F4A7C15) & M64)
    i = np.arange(n, dtype=np.uint64)[None, :]
    y = x * np.uint64(0xBF58476D1CE4E5B9) + (i + np.uint64(1)) * np.uint64(0x94D049BB133111EB)
    return (y >> np.uint64(53)).astype(np.uint8)


class Executor:
    """Runs step plans on one side's pools (device and host, numpy) the way docs/contract.md says."""

    def __init__(self, layout, pool: np.ndarray, num_host_blocks: int) -> None:
        self.layout, self.pool = layout, pool
        self.host = np.zeros((*pool.shape[:2], max(1, num_host_blocks), pool.shape[3]), dtype=np.uint8)
        bs = layout.block_size
        self.kv = []  # (slot, heads, per-token bytes)
        if layout.kv_group is not None:
            for slot, lid in enumerate(layout.kv_group.layer_ids):
                if lid is not None:
                    spec = layout.model.layers[lid]
                    assert isinstance(spec, AttentionLayerSpec)
                    self.kv.append((slot, spec.num_kv_heads, spec.head_dim * spec.dtype.itemsize))
        self.state = []  # (group, slot, col, seg, off) per state layer: the addressing rule
        blk, segb = layout.block_bytes, layout.segment_bytes
        for g, group in enumerate(layout.state_groups):
            for slot, lid in enumerate(group.layer_ids):
                if lid is None:
                    continue
                spec = layout.model.layers[lid]
                assert isinstance(spec, RecurrentLayerSpec)
                o = np.arange(spec.state_bytes)
                self.state.append((g, slot, o // blk, (o % blk) // segb, (o % blk) % segb))
        self.bs = bs

    # ---- bytes of one request ------------------------------------------------------------------
    def _kv_index(self, table: np.ndarray, positions: np.ndarray, heads: int, per: int, head: int):
        blocks = table[positions // self.bs]
        off = head * self.bs * per + (positions % self.bs) * per
        return blocks[:, None], off[:, None] + np.arange(per)[None, :]

    def read_kv(self, table, positions):
        out = []
        for slot, heads, per in self.kv:
            for seg in range(2):
                for head in range(heads):
                    b, o = self._kv_index(table, positions, heads, per, head)
                    out.append(self.pool[slot, seg, b, o])
        return out

    def expected_kv(self, hs: np.ndarray):
        return [
            pattern(hs, 1 + slot * 8 + seg * 4 + head, per)
            for slot, heads, per in self.kv
            for seg in range(2)
            for head in range(heads)
        ]

    def write_kv(self, table, positions, hs):
        expected = iter(self.expected_kv(hs))
        for slot, heads, per in self.kv:
            for seg in range(2):
                for head in range(heads):
                    b, o = self._kv_index(table, positions, heads, per, head)
                    self.pool[slot, seg, b, o] = next(expected)

    def _state_bytes(self, h: int) -> list[np.ndarray]:
        out = []
        for i, (g, slot, col, _, _) in enumerate(self.state):
            data = pattern(np.array([h], dtype=np.uint64), 1000 + g * 16 + slot, col.size)[0]
            if i == 0:
                data[:8] = np.frombuffer(int(h).to_bytes(8, "little"), dtype=np.uint8)
            out.append(data)
        return out

    def read_state(self, sets: np.ndarray) -> list[np.ndarray]:
        return [self.pool[slot, seg, sets[g][col], off] for g, slot, col, seg, off in self.state]

    def write_state(self, sets: np.ndarray, h: int) -> None:
        for (g, slot, col, seg, off), data in zip(self.state, self._state_bytes(h), strict=True):
            self.pool[slot, seg, sets[g][col], off] = data

    # ---- one plan ------------------------------------------------------------------------------
    def run(self, plan, role, truth_of) -> StepOutputs:
        m, sched = role.manager, role.scheduler
        for copies in (plan.checkpoint_copies,):
            self.pool[:, :, copies.dst] = self.pool[:, :, copies.src]
        for sp in plan.swap_out:
            self.host[:, :, sp.host_blocks] = self.pool[:, :, sp.device_blocks]
        for sp in plan.swap_in:
            self.pool[:, :, sp.device_blocks] = self.host[:, :, sp.host_blocks]
        self.pool[:, :, plan.copies.dst] = self.pool[:, :, plan.copies.src]
        sampled, finished = {}, set()
        for row in plan.scheduled:
            rid, c, n = row.request_id, row.num_computed_tokens, row.num_scheduled_tokens
            req = sched.requests.get(rid)
            if req is None:
                continue  # aborted since the step (skipped, as the contract recommends)
            tokens = req.token_ids()
            truth = truth_of(rid, tokens)
            true_h = np.array(hashes(truth), dtype=np.uint64)
            table = m.block_table([rid])[0].astype(np.int64)
            sets = m.state_table([rid])[:, 0].astype(np.int64)
            if c:  # every byte this row reads is the one the true tokens predict
                got, want = self.read_kv(table, np.arange(c)), self.expected_kv(true_h[:c])
                for a, b in zip(got, want, strict=True):
                    assert np.array_equal(a, b), f"{rid!r}: KV of tokens < {c} is not what its tokens computed"
                state = self.read_state(sets)
                for a, b in zip(state, self._state_bytes(int(true_h[c - 1])), strict=True):
                    assert np.array_equal(a, b), f"{rid!r}: state after {c} tokens is not what its tokens computed"
                h = int.from_bytes(state[0][:8].tobytes(), "little")  # the model reads its state
            else:
                h = H0
            new_h = []
            for t in tokens[c : c + n]:
                h = mix(h, t)
                new_h.append(h)
            self.write_kv(table, np.arange(c, c + n), np.array(new_h, dtype=np.uint64))
            self.write_state(sets, h)
            if row.samples:
                token = sample_of(h)
                sampled[rid] = [token]
                if is_stop(token):
                    finished.add(rid)
        return StepOutputs(sampled, finished)


class FlakyEngine(LoopbackEngine):
    """A loopback engine whose next READ fails when armed: ``before`` (a TransferError, nothing
    moved), ``half`` (half the descriptors moved, then a TransferError) or ``crash`` (half moved, then
    an exception that is not a TransferError)."""

    armed: str | None = None

    def read(self, peer, pairs, remote, notification, timeout_s):
        mode, self.armed = self.armed, None
        if mode is None:
            return super().read(peer, pairs, remote, notification, timeout_s)
        if mode != "before":
            half = type(pairs)(*(type(side)(*(a[: len(pairs) // 2] for a in side)) for side in pairs))
            super().read(peer, half, remote, b"", timeout_s)
        if mode == "crash":
            raise RuntimeError("injected: the engine crashed half-way")
        raise TransferError("injected: the READ failed")


# ---- the world -----------------------------------------------------------------------------------
@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    send_ids: bool
    state: str = "prefill"  # prefill, handed, pulled, done, dropped
    outputs: list[int] = field(default_factory=list)
    handoff: object = None


class World:
    def __init__(self, data, model, kind, p_blocks, d_blocks, p_host, d_host, p_mode, d_mode, config):
        self.data = data
        self.p_layout = mini_layout(model(), p_blocks, kind)
        self.d_layout = mini_layout(model(), d_blocks, kind)
        self.src, self.dst = seeded_pool(self.p_layout, 1), seeded_pool(self.d_layout, 2)
        p_cfg = SchedulerConfig(preemption_mode=p_mode, **config)
        d_cfg = SchedulerConfig(preemption_mode=d_mode, **config)
        self.prefill = PrefillRole(
            self.p_layout, regions_of_array(self.p_layout, self.src), p_cfg, num_host_blocks=p_host
        )
        self.decode = DecodeRole(
            self.d_layout, regions_of_array(self.d_layout, self.dst), d_cfg, num_host_blocks=d_host
        )
        self.hub = LoopbackHub()
        self.p_engine = LoopbackEngine("prefill", self.prefill.pool, self.hub)
        self.d_engine = FlakyEngine("decode", self.decode.pool, self.hub)
        connect_pair(self.p_engine, self.d_engine)
        self.p_exec = Executor(self.p_layout, self.src, p_host)
        self.d_exec = Executor(self.d_layout, self.dst, d_host)
        self.requests: dict[int, Request] = {}
        self.seen: set[str] = set()  # what happened, for hypothesis' statistics
        self.to_add: list[tuple] = []  # requests the program adds, in order
        self.faults: list[str | None] = []  # what goes wrong with the first pulls of the drain
        self.decode_aborts: list[int] = []  # rounds of the drain that abort a request on the decode side
        self.handed: list[Request] = []  # handed over, not pulled (or pulled and failed)
        self.start = [self._free(r) for r in (self.prefill, self.decode)]

    @staticmethod
    def _free(role):
        m = role.manager
        return m.pool.num_free, m.host_pool.num_free if m.host_pool is not None else 0

    def check(self):
        self.prefill.manager.check_integrity()
        self.decode.manager.check_integrity()

    def _truth_prefill(self, rid, tokens):
        return list(tokens)

    def _truth_decode(self, rid, tokens):
        prompt = self.requests[rid].prompt
        return prompt + list(tokens[len(prompt) :])

    # ---- operations ----------------------------------------------------------------------------
    def add(self):
        if self.to_add:
            self._add(*self.to_add.pop(0))

    def _add(self, prompt_len: int, max_new: int, send_ids: bool, priority: int, id_type: str):
        n = len(self.requests)
        rid = {"int": n, "str": f"r{n}", "numpy": np.int64(n)}[id_type]  # numpy integers travel as int
        prompt = [int(x) for x in np.random.default_rng(n + 7 * prompt_len).integers(1, 500, prompt_len)]
        try:
            self.prefill.add_request(rid, prompt, priority)
        except RequestTooLargeError:
            return
        key = rid if isinstance(rid, str) else int(rid)
        self.requests[key] = Request(key, prompt, max_new, send_ids)

    def prefill_step(self):
        plan = self.prefill.step()
        for p in plan.preempted:
            self.seen.add(f"prefill preempted by {p.mode.value}")
        outputs = self.p_exec.run(plan, self.prefill, self._truth_prefill)
        for h in self.prefill.update(outputs):
            r = self.requests[h.request_id]
            assert h.first_token == reference_outputs(r.prompt, r.max_new_tokens)[0]
            r.outputs = [h.first_token]
            if h.stopped:
                r.state = "done"  # "drop it": nothing to decode, nothing to send
                continue
            if r.max_new_tokens == 1:  # done with its first token: give up the hand-off
                self.prefill.cancel(h.request_id)
                r.state = "done"
                continue
            r.state, r.handoff = "handed", h if r.send_ids else h._replace(prompt_token_ids=None)
            self.handed.append(r)

    def decode_step(self):
        plan = self.decode.step()
        for p in plan.preempted:
            self.seen.add(
                f"decode preempted by {p.mode.value}" + ("" if self.requests[p.request_id].send_ids else " (no ids)")
            )
        outputs = self.d_exec.run(plan, self.decode, self._truth_decode)
        self.decode.update(outputs)
        for rid, req in self.decode.scheduler.pop_finished().items():
            r = self.requests[rid]
            if r.state == "pulled":
                r.outputs += list(req.output_token_ids)
                r.state = "done"

    def _books(self):
        m = self.decode.manager
        host = m.host_pool.num_free if m.host_pool is not None else 0
        ids = sorted(map(repr, m.requests)), sorted(map(repr, self.decode.scheduler.requests))
        return m.pool.free_extents(), m.use.tolist(), host, *ids

    def pull(self, index: int, fault: str | None):
        if not self.handed:
            return
        then_abort = fault == "then abort"
        fault = None if then_abort else fault
        r = self.handed[index % len(self.handed)]
        h = r.handoff
        before = self._books()
        if fault in ("before", "half", "crash"):
            self.d_engine.armed = fault
        elif fault == "malformed":
            msg = json.loads(h.offer)
            edit = self.data.draw(st.sampled_from(["region", "ids", "json", "count"]), label="malformation")
            if edit == "region":
                msg["pool"]["plane_region"] = [[9] * len(row) for row in msg["pool"]["plane_region"]]
            elif edit == "ids":
                msg["blocks"]["kv_blocks"] = [10**6] * len(msg["blocks"]["kv_blocks"])
            elif edit == "count":
                msg["blocks"]["num_tokens"] += 1
            bad = b"{" if edit == "json" else json.dumps(msg).encode()
            self.seen.add(f"malformed offer ({edit})")
            with pytest.raises(TransferError):
                self.decode.pull(self.d_engine, "prefill", h._replace(offer=bad), r.max_new_tokens, 1.0)
            assert self._books() == before
            return
        try:
            plan = self.decode.pull(self.d_engine, "prefill", h, r.max_new_tokens, 1.0)
        except (NoFreeBlocksError, HostPoolExhaustedError):
            assert self._books() == before
            return  # retry later
        except (HandoffRefusedError, RequestTooLargeError) as e:
            self.seen.add(f"refused ({type(e).__name__})")
            assert self._books() == before
            self.prefill.cancel(r.rid)  # never here: drop it
            self.handed.remove(r)
            r.state = "dropped"
            return
        except (TransferError, RuntimeError):
            self.seen.add(f"failed READ ({fault})")
            assert fault is not None, "only injected faults fail a READ here"
            assert self._books() == before
            return  # the export is still pinned: pull again later, or cancel
        finally:
            self.d_engine.armed = None  # a pull refused before its READ leaves no fault armed
        assert fault is None
        self.seen.add("pulled" + ("" if r.send_ids else " without ids"))
        offered = BlocksMessage.from_bytes(h.offer).blocks
        assert reference_bytes(self.dst, self.d_layout, plan.blocks) == reference_bytes(
            self.src, self.p_layout, offered
        ), "the decode side's bytes differ from what the prefill side computed"
        self.handed.remove(r)
        r.state = "pulled"
        with pytest.raises(DuplicateRequestError):  # the same hand-off again, while it is queued here
            self.decode.pull(self.d_engine, "prefill", h, r.max_new_tokens, 1.0)
        if then_abort:  # aborted while it waits here, holding its blocks
            self.decode.scheduler.abort(r.rid)
            self.decode.scheduler.pop_finished()
            r.state = "dropped"
            self.seen.add("aborted on the decode side (queued)")

    def settle(self):
        for rid in self.prefill.settle(self.p_engine, "decode"):
            assert self.requests[rid].state in ("pulled", "done", "dropped")

    def cancel(self, index: int):
        if self.handed:
            r = self.handed.pop(index % len(self.handed))
            self.prefill.cancel(r.rid)
            self.seen.add("cancelled")
            r.state = "dropped"
        with pytest.raises(UnknownRequestError):
            self.prefill.cancel(-1)

    def abort(self, side: str, index: int):
        role = self.prefill if side == "prefill" else self.decode
        live = sorted(role.scheduler.requests, key=repr)
        if not live:
            return
        rid = live[index % len(live)]
        role.scheduler.abort(rid)
        role.scheduler.pop_finished()
        self.seen.add(f"aborted on the {side} side")
        self.requests[rid].state = "dropped"

    def drain(self, limit: int = 3000):
        while self.to_add:
            self.add()
        for i in range(limit):
            busy = False
            if i in self.decode_aborts:
                self.abort("decode", i)
            if self.prefill.scheduler.has_unfinished:
                self.prefill_step()
                busy = True
            for r in list(self.handed):
                fault = self.faults.pop(0) if self.faults else None
                self.pull(self.handed.index(r), fault)
                busy = True
            self.settle()
            if self.decode.scheduler.has_unfinished:
                self.decode_step()
                busy = True
            self.check()
            if not busy and not self.prefill.num_pending_handoffs:
                return
        raise AssertionError(
            f"no end after {limit} rounds: prefill {list(self.prefill.scheduler.requests)}, handed "
            f"{[r.rid for r in self.handed]}, pending exports {list(self.prefill.manager.exports)}, "
            f"decode {list(self.decode.scheduler.requests)}"
        )

    def final_checks(self):
        for r in self.requests.values():
            assert r.state in ("done", "dropped"), f"request {r.rid} ended {r.state}"
            if r.state == "done":
                assert r.outputs == reference_outputs(r.prompt, r.max_new_tokens), f"request {r.rid}: wrong outputs"
        for role, start in zip((self.prefill, self.decode), self.start, strict=True):
            role.manager.check_integrity()
            assert not role.manager.requests and not role.scheduler.requests
            assert self._free(role) == start, "a block did not come back"
        assert self.prefill.num_pending_handoffs == 0


FAULTS = st.sampled_from([None, "before", "half", "crash", "malformed", "then abort"])
REQUESTS = st.lists(
    st.tuples(
        st.integers(1, 30),
        st.integers(1, 40),
        st.booleans(),
        st.integers(0, 1),
        st.sampled_from(["int", "str", "numpy"]),
    ),
    min_size=1,
    max_size=10,
)
OPERATIONS = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("add")),
    st.tuples(st.just("prefill_step")),
    st.tuples(st.just("prefill_step")),
    st.tuples(st.just("decode_step")),
    st.tuples(st.just("decode_step")),
    *[
        st.tuples(
            st.just("pull"),
            st.integers(0, 7),
            FAULTS,
        )
    ]
    * 3,
    st.tuples(st.just("settle")),
    st.tuples(st.just("cancel"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.sampled_from(["prefill", "decode"]), st.integers(0, 7)),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_disaggregation_moves_every_byte_and_gives_every_block_back(data):
    model = data.draw(st.sampled_from([mini_mamba2, mini_mamba2, mini_minimax]), label="model")
    kind = data.draw(st.sampled_from(["paged", "paged", "padded"]), label="layout")
    probe = mini_layout(model(), 200, kind)
    per_request = probe.num_state_blocks_per_request
    small, large = per_request + 6, per_request * 3 + 24
    world = World(
        data,
        model,
        kind,
        p_blocks=data.draw(st.integers(small, (small + large) // 2), label="prefill blocks"),
        d_blocks=data.draw(st.integers(small, large), label="decode blocks"),
        p_host=data.draw(st.sampled_from([0, 4 * large]), label="prefill host blocks"),
        d_host=data.draw(st.sampled_from([0, 2 * large, 6 * large]), label="decode host blocks"),
        p_mode=data.draw(st.sampled_from([PreemptionMode.RECOMPUTE, PreemptionMode.SWAP]), label="prefill mode"),
        d_mode=data.draw(st.sampled_from([PreemptionMode.RECOMPUTE, PreemptionMode.SWAP]), label="decode mode"),
        config=dict(
            max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
            max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 32]), label="budget"),
        ),
    )
    world.to_add = data.draw(REQUESTS, label="requests (prompt, max_new_tokens, ids sent, priority, id type)")
    world.faults = data.draw(st.lists(FAULTS, max_size=8), label="faults of the drain's first pulls")
    world.decode_aborts = data.draw(st.lists(st.integers(0, 80), max_size=3), label="drain rounds that abort")
    for op in data.draw(st.lists(OPERATIONS, min_size=4, max_size=80), label="program"):
        getattr(world, op[0])(*op[1:])
        world.check()
    world.drain()
    world.final_checks()
    done = sum(r.state == "done" for r in world.requests.values())
    event(f"requests done: {'0' if not done else '1-4' if done < 5 else '5+'}")
    for what in sorted(world.seen):
        event(what)

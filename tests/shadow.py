"""A shadow of the device and host pools that checks data, not counts.

Every KV slot holds the hash of the token prefix it was computed from (position ``p`` of a request
holds ``prefix_hash(tokens[: p + 1])``); every block of a state set holds the hash of the prefix its
state summarises, mixed with the set's group and the block's index in the set. Copies, swaps and
forwards move or write these tags exactly as the executor contract says (docs/contract.md); a
request reads its own bytes iff every tag it reads is the one its tokens predict. A copy list in
which a block is both a source and a destination, or a destination appears twice, or the null block
is written, is rejected (on a GPU those run in parallel and race).

:class:`Ledger` is a lazy executor's books on top of it: every copy and swap a manager hands out is
queued with the bytes its source held at hand-out and run later; no block a queued copy touches (or
one whose pin epoch was not released) may get a new holder meanwhile; at idle nothing is in flight
and every cached block and checkpoint holds its node's bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hybridkv.blockmgr.records import BlockCopies, BlockUse, SwapDirection, SwapPlan

_MASK = (1 << 62) - 1
UNWRITTEN = -1
GARBAGE = -7


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """``h[p]`` = hash of ``tokens[:p]`` (``h[0] = 0``), one per prefix length."""
    out = [0]
    for t in tokens:
        out.append(hash((out[-1], int(t))) & _MASK)
    return out


def state_tag(prefix_hash: int, group: int, index: int) -> int:
    return hash((prefix_hash, group, index, "state")) & _MASK


class Shadow:
    """Tags of every device block (``kv[block, slot]``, ``state[block]``) and host block."""

    def __init__(self, manager) -> None:
        self.m = manager
        n, bs = manager.layout.num_blocks, manager.block_size
        self.kv = np.full((n, bs), UNWRITTEN, dtype=np.int64)
        self.state = np.full(n, UNWRITTEN, dtype=np.int64)
        nh = manager.host_pool.num_blocks if manager.host_pool is not None else 0
        self.host_kv = np.full((nh, bs), UNWRITTEN, dtype=np.int64)
        self.host_state = np.full(nh, UNWRITTEN, dtype=np.int64)

    # ---- moves --------------------------------------------------------------------------------
    def copy(self, copies: BlockCopies) -> None:
        src, dst = np.asarray(copies.src), np.asarray(copies.dst)
        assert src.size == dst.size
        if not src.size:
            return
        assert np.unique(dst).size == dst.size, f"a destination block appears twice: {dst.tolist()}"
        both = np.intersect1d(src, dst)
        assert not both.size, f"blocks {both.tolist()} are both source and destination of one copy list"
        assert not (dst == 0).any(), "a copy writes the null block"
        self.kv[dst] = self.kv[src]
        self.state[dst] = self.state[src]

    def swap(self, plan: SwapPlan) -> None:
        dev, host = plan.device_blocks, plan.host_blocks
        assert np.unique(dev).size == dev.size and np.unique(host).size == host.size
        if plan.direction is SwapDirection.OUT:
            self.host_kv[host] = self.kv[dev]
            self.host_state[host] = self.state[dev]
        else:
            self.kv[dev] = self.host_kv[host]
            self.state[dev] = self.host_state[host]

    def scribble(self, device_blocks: np.ndarray) -> None:
        """A transfer that failed half-way left garbage in its target blocks."""
        self.kv[device_blocks] = GARBAGE
        self.state[device_blocks] = GARBAGE

    # ---- forwards -----------------------------------------------------------------------------
    def _sets(self, sets: np.ndarray):
        mask = self.m._state_mask
        for g in range(sets.shape[0]):
            for j in range(sets.shape[1]):
                if mask[g, j]:
                    yield g, j, int(sets[g, j])

    def write_kv(self, blocks: np.ndarray, hashes: Sequence[int], start: int, end: int) -> None:
        """Positions ``[start, end)`` of a request with block table ``blocks``; ``hashes`` = prefix_hashes."""
        bs = self.m.block_size
        if not self.m._has_kv:
            return
        for p in range(start, end):
            block = int(blocks[p // bs])
            assert block != 0, f"position {p} maps to the null block"
            self.kv[block, p % bs] = hashes[p + 1]

    def write_state(self, sets: np.ndarray, prefix_hash: int) -> None:
        """A state set ``[G, bps]`` now holds the state after the prefix ``prefix_hash``."""
        for g, j, block in self._sets(sets):
            assert block != 0
            self.state[block] = state_tag(prefix_hash, g, j)

    # ---- reads ----------------------------------------------------------------------------------
    def check_kv(self, what: str, blocks: np.ndarray, hashes: Sequence[int], end: int) -> None:
        bs = self.m.block_size
        if not self.m._has_kv:
            return
        for p in range(end):
            got = self.kv[int(blocks[p // bs]), p % bs]
            assert got == hashes[p + 1], f"{what}: KV position {p} in block {int(blocks[p // bs])} holds {got}"

    def check_state(self, what: str, sets: np.ndarray, prefix_hash: int) -> None:
        for g, j, block in self._sets(sets):
            assert self.state[block] == state_tag(prefix_hash, g, j), (
                f"{what}: state group {g} block {j} (id {block}) holds another request's or position's state"
            )

    def check_host(self, what: str, host_blocks: np.ndarray, hashes: Sequence[int], end: int, prefix_hash: int):
        """A swapped request: KV blocks first, then its live sets in set order."""
        bs, nsb = self.m.block_size, self.m.num_state_blocks
        n_kv = host_blocks.size - nsb
        for p in range(end if self.m._has_kv else 0):
            got = self.host_kv[int(host_blocks[p // bs]), p % bs]
            assert got == hashes[p + 1], f"{what}: host KV position {p} holds {got}"
        flat = [
            (g, j)
            for g in range(self.m._state_mask.shape[0])
            for j in range(self.m._state_mask.shape[1])
            if self.m._state_mask[g, j]
        ]
        for i, (g, j) in enumerate(flat):
            assert self.host_state[int(host_blocks[n_kv + i])] == state_tag(prefix_hash, g, j), (
                f"{what}: host state group {g} block {j} differs"
            )


# ---- a lazy executor's books: what the manager handed out and what ran -------------------------------
class _Op:
    """One copy pair (``src -> dst``) or one swap plan handed out, with what its source held then."""

    __slots__ = ("kind", "src", "dst", "plan", "kv", "state", "epoch", "label")

    def __init__(self, kind, src, dst, plan, kv, state, epoch, label):
        self.kind, self.src, self.dst, self.plan = kind, src, dst, plan
        self.kv, self.state, self.epoch, self.label = kv, state, epoch, label

    def blocks(self) -> list[int]:
        """The device blocks the op touches (a tier op's host side is in :meth:`host_block`)."""
        if self.kind == "copy":
            return [self.src, self.dst]
        if self.kind == "out":  # offload: device src -> host dst
            return [self.src]
        if self.kind == "in":  # onload: host src -> device dst
            return [self.dst]
        return []

    def host_block(self) -> int | None:
        return self.dst if self.kind == "out" else self.src if self.kind == "in" else None

    def __repr__(self) -> str:
        if self.kind == "copy":
            return f"copy {self.src}->{self.dst} ({self.label}, epoch {self.epoch})"
        if self.kind == "out":
            return f"offload device {self.src}->host {self.dst} ({self.label}, epoch {self.epoch})"
        if self.kind == "in":
            return f"onload host {self.src}->device {self.dst} ({self.label}, epoch {self.epoch})"
        return f"swap-{self.plan.direction.value} of {self.plan.request_id!r} ({self.label})"


_COPIERS = ("allocate", "append", "fork", "checkpoint")  # manager calls that hand out copies
_CONTEXT = (
    "free", "begin_speculation", "commit_speculation", "end_speculation", "mark_computed", "import_request",
    "reserve_export",
)
# calls after which the host tier's copies (offloads of evicted cached blocks, host hits) are taken
_TIER = (*_COPIERS, "swap_in", "swap_out", "begin_speculation", "import_request", "reserve_export")


class Ledger:
    """The books of a lazy executor: every copy and swap the manager hands out is queued (in hand-out
    order) and run later by the test; the source bytes are recorded at hand-out and must still be there
    when the op runs.

    ``intent`` is the memory as the manager means it (every op applied the moment it is handed out);
    ``real`` is what the executor actually ran. At hand-out the op's source is read from ``intent``; when
    it runs, ``real`` must hold the same bytes at the source (else something wrote it in between, or it
    read a block nobody had written yet).

    HOLDER check: every ``pool.allocate`` (a new allocation, KV block, state set, swap-in target or
    checkpoint) is checked against the blocks of copies still queued (not yet run) and against the
    blocks of copies whose pin epoch was not released yet (``release_pins(before=...)`` says which
    ran): the manager may not give any of them to a new holder.

    The manager's methods are wrapped on the instance (``functools.wraps`` keeps their signatures).
    """

    def __init__(self, manager, real: Shadow | None = None, take_tier: bool = True) -> None:
        """``take_tier``: take the host tier's copies after every manager call (a manager-level
        executor); False: only look at them after each call (queued in hand-out order), and let the
        executor take them once per plan (``take_tier_copies``) and run them with :meth:`run_tier`."""
        self.m = manager
        self._take_tier = take_tier
        self._tier_seen = (0, 0)  # (offloads, onloads) looked at since the last take_tier_copies
        self.real = real if real is not None else Shadow(manager)
        self.intent = Shadow(manager)
        self.queue: list[_Op] = []
        self.pins: list[tuple[int, np.ndarray, str]] = []  # (epoch, blocks, label): handed out, not released
        self.calls: list[str] = []  # the manager calls in progress (for messages)
        self.phase = ""  # where the caller is (a step, an update...), for messages
        self.prefix_len: dict[int, int] = {}  # prefix hash -> its length in tokens
        self.last_block: dict[int, tuple[int, ...]] = {}  # prefix hash at a block boundary -> that block's tokens
        self.state_prefix: dict[int, int] = {}  # state tag -> the prefix hash it summarises
        self.stats = {"copies": 0, "swaps": 0, "late": 0, "offloads": 0, "onloads": 0}
        self.host_pins: list[tuple[int, np.ndarray, str]] = []  # host blocks of tier copies, by pin epoch
        self._tier = getattr(manager, "take_tier_copies", None)
        self._wrap()

    # ---- wrapping the manager ---------------------------------------------------------------------
    def _wrap(self) -> None:
        m = self.m

        def wrap(name, after):
            orig = getattr(m, name)

            @functools.wraps(orig)
            def call(*args, **kwargs):
                nested = bool(self.calls)  # called by another manager call: that one takes the tier's copies
                self.calls.append(f"{name}{args!r}"[:80])
                try:
                    out = orig(*args, **kwargs)
                finally:
                    self.calls.pop()
                if name in _TIER and not nested:  # the tier's copies of this call run before the call's own copies
                    self.take_tier(f"{self.phase}: {name}{args[:1]!r}")
                if after is not None:
                    after(name, args, out)
                return out

            setattr(m, name, call)

        for name in _COPIERS:
            wrap(name, self._after_copier)
        if not self._take_tier and self._tier is not None:
            orig_take = m.take_tier_copies

            @functools.wraps(orig_take)
            def take_tier_copies():
                plan = orig_take()
                assert self._tier_seen == (len(plan.offload), len(plan.onload)), (
                    f"{self.phase}: the tier hands out copies no manager call was seen making: "
                    f"{self._tier_seen} looked at, {len(plan.offload)} offloads and {len(plan.onload)} onloads taken")
                self._tier_seen = (0, 0)
                return plan

            m.take_tier_copies = take_tier_copies
        for name in ("swap_out", "swap_in"):
            wrap(name, lambda name, args, plan: self.hand_out_swap(plan, f"{self.phase}: {name}{args!r}"))
        for name in _CONTEXT:
            if hasattr(m, name):
                wrap(name, None)
        if hasattr(m, "cancel_checkpoints"):
            wrap("cancel_checkpoints", lambda name, args, ids: self._cancelled(ids))
        if hasattr(m, "release_pins"):
            orig_release = m.release_pins

            @functools.wraps(orig_release)
            def release_pins(before=None, *args, **kwargs):  # (further arguments passed on as given)
                self.calls.append(f"release_pins({before})")
                try:
                    orig_release(before, *args, **kwargs)
                finally:
                    self.calls.pop()
                self.pins = [p for p in self.pins if before is not None and p[0] >= before]
                self.host_pins = [p for p in self.host_pins if before is not None and p[0] >= before]

            m.release_pins = release_pins
        orig_allocate = m.pool.allocate

        def pool_allocate(n):
            ids = orig_allocate(n)
            if ids.size:
                self.check_holders(ids)
            return ids

        m.pool.allocate = pool_allocate
        if m.host_pool is not None:
            orig_host_allocate = m.host_pool.allocate

            def host_allocate(n):
                ids = orig_host_allocate(n)
                if ids.size:
                    self.check_host_holders(ids)
                return ids

            m.host_pool.allocate = host_allocate

    def _after_copier(self, name, args, out) -> None:
        copies = out.copies if name == "allocate" else out
        if len(copies):
            self.hand_out(copies, f"{self.phase}: {name}{args[:1]!r}")

    def _cancelled(self, ids: np.ndarray) -> None:
        """``cancel_checkpoints``: those copies will never run; their destinations are free again."""
        if not ids.size:
            return
        gone = set(ids.tolist())
        self.queue = [op for op in self.queue if not (op.kind == "copy" and op.dst in gone)]
        self.intent.kv[ids] = self.real.kv[ids]  # never written: as the manager means them now
        self.intent.state[ids] = self.real.state[ids]
        self.pins = [(e, b[~np.isin(b, ids)], label) for e, b, label in self.pins]

    # ---- hand-out --------------------------------------------------------------------------------
    def _epoch(self) -> int:
        return int(getattr(self.m, "pin_epoch", 0))

    def hand_out(self, copies: BlockCopies, label: str) -> None:
        """The manager handed out ``copies`` (one list: may run as one parallel launch)."""
        src, dst = np.asarray(copies.src), np.asarray(copies.dst)
        epoch = self._epoch()
        it = self.intent
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            self.queue.append(_Op("copy", s, d, None, it.kv[s].copy(), int(it.state[s]), epoch, label))
        it.copy(copies)  # (checks the list: no block both source and destination, no destination twice)
        if epoch:
            self.pins.append((epoch, np.concatenate((src, dst)), label))
        self.stats["copies"] += src.size

    def take_tier(self, label: str) -> None:
        """Take the host tier's copies of the call just made and queue them: every offload (device
        -> host), then every onload (host -> device), one op per block, with its source's bytes."""
        if self._tier is None:
            return
        if self._take_tier:
            tier = self._tier()
        else:  # look only: the executor takes them per plan
            cache = getattr(self.m, "prefix_cache", None)
            if cache is None or cache.tier is None:
                return
            seen_out, seen_in = self._tier_seen
            q = cache.tier.queued()
            self._tier_seen = (len(q.offload), len(q.onload))
            tier = type(q)(type(q.offload)(q.offload.device_blocks[seen_out:], q.offload.host_blocks[seen_out:],
                                           q.offload.direction),
                           type(q.onload)(q.onload.device_blocks[seen_in:], q.onload.host_blocks[seen_in:],
                                          q.onload.direction))
        if not len(tier):
            return
        it, epoch = self.intent, self._epoch()
        out, inn = tier.offload, tier.onload
        assert out.direction is SwapDirection.OUT and inn.direction is SwapDirection.IN
        for copies, kind in ((out, "out"), (inn, "in")):
            dev, host = np.asarray(copies.device_blocks), np.asarray(copies.host_blocks)
            assert np.unique(dev).size == dev.size and np.unique(host).size == host.size, (
                f"{label}: a tier copy list repeats a block: device {dev.tolist()}, host {host.tolist()}")
            assert not (dev == 0).any(), f"{label}: a tier copy touches the null block"
            for d, h in zip(dev.tolist(), host.tolist(), strict=True):
                if kind == "out":
                    self.queue.append(_Op("out", d, h, None, it.kv[d].copy(), int(it.state[d]), epoch, label))
                else:
                    self.queue.append(_Op("in", h, d, None, it.host_kv[h].copy(), int(it.host_state[h]), epoch,
                                          label))
            if kind == "out":
                it.host_kv[host], it.host_state[host] = it.kv[dev], it.state[dev]
            else:
                it.kv[dev], it.state[dev] = it.host_kv[host], it.host_state[host]
            if epoch and host.size:
                self.host_pins.append((epoch, host.copy(), label))
                if kind == "in":
                    self.pins.append((epoch, dev.copy(), label))
            self.stats["offloads" if kind == "out" else "onloads"] += int(dev.size)

    def hand_out_swap(self, plan: SwapPlan, label: str) -> None:
        it = self.intent
        if plan.direction is SwapDirection.OUT:
            kv, state = it.kv[plan.device_blocks].copy(), it.state[plan.device_blocks].copy()
        else:
            kv, state = it.host_kv[plan.host_blocks].copy(), it.host_state[plan.host_blocks].copy()
        self.queue.append(_Op("swap", -1, -1, plan, kv, state, self._epoch(), label))
        it.swap(plan)
        self.stats["swaps"] += 1

    # ---- holders ---------------------------------------------------------------------------------
    def check_holders(self, ids: np.ndarray) -> None:
        """``ids`` are being handed to a new holder: no copy not yet run, nor one whose pin epoch is
        not released, may touch them."""
        new = set(ids.tolist())
        where = " > ".join(self.calls) or "?"
        for op in self.queue:
            # (an offload's device source is given to a new holder at once: the offload runs first,
            # and its source is checked when it runs)
            touched = [b for b in op.blocks() if b in new and op.kind != "out"]
            if touched:
                b = touched[0]
                raise AssertionError(
                    f"HOLDER: block {b} handed to a new holder ({self.phase}: {where}) while {op} has not run"
                )
        for epoch, blocks, label in self.pins:
            hit = np.isin(blocks, ids)
            if hit.any():
                raise AssertionError(
                    f"HOLDER: block {int(blocks[hit][0])} handed to a new holder ({self.phase}: {where}) while a "
                    f"copy handed out in pin epoch {epoch} ({label}) touches it and that epoch was not released "
                    f"(release_pins(before=...) has not said the copy ran)"
                )

    def check_host_holders(self, ids: np.ndarray) -> None:
        """Host blocks ``ids`` are being handed to a new holder (a swap-out, an offload): with pins on,
        no tier copy not yet run, nor one whose pin epoch is not released, may touch them."""
        if not self._epoch():
            return  # no pins: the caller runs each call's copies before the next call
        new = set(ids.tolist())
        where = " > ".join(self.calls) or "?"
        for op in self.queue:
            if op.host_block() in new:
                raise AssertionError(f"HOLDER: host block {op.host_block()} handed to a new holder "
                                     f"({self.phase}: {where}) while {op} has not run")
        for epoch, blocks, label in self.host_pins:
            hit = np.isin(blocks, ids)
            if hit.any():
                raise AssertionError(
                    f"HOLDER: host block {int(blocks[hit][0])} handed to a new holder ({self.phase}: {where}) "
                    f"while a tier copy of pin epoch {epoch} ({label}) touches it and that epoch was not released")

    # ---- running ---------------------------------------------------------------------------------
    def _check_source(self, op: _Op, kv: np.ndarray, state, what: str) -> None:
        if not (np.array_equal(kv, op.kv) and np.array_equal(state, op.state)):
            raise AssertionError(
                f"{what}: the source of {op} no longer holds what it held at hand-out "
                f"(state {op.state!r} then, {state!r} now; KV {op.kv.tolist()} then, {kv.tolist()} now)"
            )

    def run_copies(self, copies: BlockCopies, what: str) -> None:
        """Run a copy list of a plan (as one launch): each pair must be a copy handed out and not yet
        run (the earliest with that destination), and its source must hold the bytes of hand-out."""
        src, dst = np.asarray(copies.src), np.asarray(copies.dst)
        if not src.size:
            return
        ran = []
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            op = next((o for o in self.queue if o.kind == "copy" and o.dst == d and o not in ran), None)
            assert op is not None, f"{what}: the plan copies {s}->{d}, a copy the manager never handed out (or ran)"
            self._check_source(op, self.real.kv[s], int(self.real.state[s]), what)
            ran.append(op)
        self.real.copy(copies)
        self.queue = [o for o in self.queue if o not in ran]

    def run_tier(self, plan, what: str, parts: tuple[str, ...] = ("offload", "onload")) -> None:
        """Run the host tier's copies of a plan (a ``TierPlan``): its offloads (stage 0), its onloads
        (after the swaps), or both in that order; each pair must be one handed out and not yet run,
        and its source must hold the bytes of hand-out."""
        for copies, kind in [(getattr(plan, p), "out" if p == "offload" else "in") for p in parts]:
            for d, h in zip(np.asarray(copies.device_blocks).tolist(), np.asarray(copies.host_blocks).tolist(),
                            strict=True):
                src, dst = (d, h) if kind == "out" else (h, d)
                op = next((o for o in self.queue if o.kind == kind and o.src == src and o.dst == dst), None)
                assert op is not None, f"{what}: the plan's tier copy {kind} {src}->{dst} was never handed out (or ran)"
                self._run_op(op, what)
                self.queue.remove(op)

    def run_swap(self, plan: SwapPlan, what: str) -> None:
        op = next((o for o in self.queue if o.plan is plan), None)
        assert op is not None, f"{what}: swap plan of {plan.request_id!r} was never handed out (or ran already)"
        self._run_op(op, what)
        self.queue.remove(op)

    def _run_op(self, op: _Op, what: str) -> None:
        r = self.real
        if op.kind == "copy":
            self._check_source(op, r.kv[op.src], int(r.state[op.src]), what)
            r.kv[op.dst] = r.kv[op.src]
            r.state[op.dst] = r.state[op.src]
            return
        if op.kind == "out":
            self._check_source(op, r.kv[op.src], int(r.state[op.src]), what)
            r.host_kv[op.dst], r.host_state[op.dst] = r.kv[op.src], r.state[op.src]
            return
        if op.kind == "in":
            self._check_source(op, r.host_kv[op.src], int(r.host_state[op.src]), what)
            r.kv[op.dst], r.state[op.dst] = r.host_kv[op.src], r.host_state[op.src]
            return
        plan = op.plan
        if plan.direction is SwapDirection.OUT:
            self._check_source(op, r.kv[plan.device_blocks], r.state[plan.device_blocks], what)
        else:
            self._check_source(op, r.host_kv[plan.host_blocks], r.host_state[plan.host_blocks], what)
        r.swap(plan)

    def run_first(self, n: int, what: str) -> None:
        """Run the first ``n`` queued ops, in hand-out order (the manager-level executor)."""
        ops, self.queue = self.queue[:n], self.queue[n:]
        for op in ops:
            self._run_op(op, what)

    def run_all(self, what: str) -> None:
        self.run_first(len(self.queue), what)

    def flush_for(self, reads, writes, what: str) -> None:
        """Run the queue up to the last op a forward must wait for: one that writes a block the forward
        reads or writes, or reads a block it writes (reads of a block by both need no order)."""
        last = -1
        for i, op in enumerate(self.queue):
            if op.kind == "copy" and (op.dst in reads or op.dst in writes or op.src in writes):
                last = i
            elif op.kind == "out" and op.src in writes:  # an offload reads a block the forward writes
                last = i
            elif op.kind == "in" and (op.dst in reads or op.dst in writes):  # an onload writes one it uses
                last = i
        if last >= 0:
            self.stats["late"] += 1
            self.run_first(last + 1, what)

    def oldest_queued_epoch(self) -> int | None:
        return min((op.epoch for op in self.queue if op.kind in ("copy", "out", "in")), default=None)

    def queued_blocks(self) -> set[int]:
        return {b for op in self.queue for b in op.blocks()}

    # ---- forwards: both memories -------------------------------------------------------------------
    def note_prefixes(self, tokens: Sequence[int], hashes: Sequence[int]) -> None:
        bs = self.m.block_size
        for p in range(1, len(hashes)):
            self.prefix_len[hashes[p]] = p
            if p % bs == 0:
                self.last_block[hashes[p]] = tuple(int(t) for t in tokens[p - bs : p])

    def write_kv(self, blocks, hashes, start, end) -> None:
        self.real.write_kv(blocks, hashes, start, end)
        self.intent.write_kv(blocks, hashes, start, end)

    def write_state(self, sets, prefix_hash) -> None:
        self.real.write_state(sets, prefix_hash)
        self.intent.write_state(sets, prefix_hash)
        for g, j, _ in self.real._sets(sets):
            self.state_prefix[state_tag(prefix_hash, g, j)] = prefix_hash

    def scribble(self, device_blocks) -> None:
        self.real.scribble(device_blocks)
        self.intent.scribble(device_blocks)

    # ---- checks ------------------------------------------------------------------------------------
    def check_agree(self, what: str) -> None:
        """Every block someone holds and no queued op touches holds in ``real`` what the manager
        means it to hold (``intent``)."""
        m = self.m
        use = m.use
        held = (use != BlockUse.FREE) & (use != BlockUse.NULL) & (use != BlockUse.PENDING_FREE)
        touched = [b for op in self.queue for b in op.blocks()]
        for op in self.queue:
            if op.kind == "swap":
                touched.extend(op.plan.device_blocks.tolist())
        held[touched] = False
        kv = np.isin(use, (BlockUse.KV, BlockUse.CACHED_KV))  # a block's other half is stale from an earlier use
        state = np.isin(use, (BlockUse.STATE, BlockUse.SPECULATIVE, BlockUse.CHECKPOINT))
        bad = held & (
            (kv & (self.real.kv != self.intent.kv).any(axis=1)) | (state & (self.real.state != self.intent.state))
        )
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise AssertionError(
                f"{what}: block {b} ({BlockUse(int(use[b])).name}) holds state {int(self.real.state[b])}, "
                f"KV {self.real.kv[b].tolist()}; the manager means state {int(self.intent.state[b])}, "
                f"KV {self.intent.kv[b].tolist()} (a copy or swap lost, late or out of order)"
            )

    def check_cache_bytes(self, what: str) -> None:
        """Every node of the prefix cache holds its own bytes: a cached KV block the KV of the node's
        tokens, a checkpoint the state after exactly the node's prefix (never unwritten, never another's)."""
        cache = getattr(self.m, "prefix_cache", None)
        if cache is None:
            return
        bs, mask = self.m.block_size, self.m._state_mask
        flat = [(g, j) for g in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[g, j]]
        queued = self.queued_blocks()
        for key, node in cache.nodes.items():
            p, toks = node.position, tuple(node.tokens)
            if node.kv_block and node.kv_block not in queued and self.m._has_kv:
                tags = self.real.kv[node.kv_block].tolist()
                last = tags[-1]
                ok = self.prefix_len.get(last) == p and self.last_block.get(last) == toks
                ok = ok and all(tags[s] == hash((tags[s - 1], toks[s])) & _MASK for s in range(1, bs))
                assert ok, f"{what}: cached KV block {node.kv_block} of node {key} (position {p}) holds {tags}"
            if node.checkpoint is not None and not queued.intersection(node.checkpoint.tolist()):
                ids = node.checkpoint.tolist()
                ph = self.state_prefix.get(int(self.real.state[ids[0]]))
                ok = ph is not None and self.prefix_len.get(ph) == p and self.last_block.get(ph) == toks
                ok = ok and all(self.real.state[b] == state_tag(ph, g, j) for b, (g, j) in zip(ids, flat, strict=True))
                assert ok, (
                    f"{what}: checkpoint {ids} of node {key} (position {p}) does not hold the state after its "
                    f"prefix (holds {self.real.state[ids].tolist()}: unwritten is {UNWRITTEN})"
                )

    def check_host_cache_bytes(self, what: str) -> None:
        """Every unit of the host tier holds its own bytes: a KV block the KV of a prefix ending in
        the unit's tokens (its slots chained), a checkpoint the state after exactly such a prefix."""
        cache = getattr(self.m, "prefix_cache", None)
        tier = getattr(cache, "tier", None)
        if tier is None:
            return
        bs, mask = self.m.block_size, self.m._state_mask
        flat = [(g, j) for g in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[g, j]]
        queued = {op.host_block() for op in self.queue}
        for key, hb in tier.kv.items():
            if hb in queued:
                continue
            toks = tuple(int(t) for t in tier._tok[hb])
            tags = self.real.host_kv[hb].tolist()
            p = self.prefix_len.get(tags[-1])
            ok = p is not None and p % bs == 0 and self.last_block.get(tags[-1]) == toks
            ok = ok and all(tags[s] == hash((tags[s - 1], toks[s])) & _MASK for s in range(1, bs))
            assert ok, f"{what}: host KV block {hb} of key {key} holds {tags}"
        for key, ids in tier.ck.items():
            if queued.intersection(ids.tolist()):
                continue
            toks = tuple(int(t) for t in tier._tok[int(ids[0])])
            ph = self.state_prefix.get(int(self.real.host_state[int(ids[0])]))
            ok = ph is not None and self.last_block.get(ph) == toks
            ok = ok and all(self.real.host_state[b] == state_tag(ph, g, j)
                            for b, (g, j) in zip(ids.tolist(), flat, strict=True))
            assert ok, f"{what}: host checkpoint {ids.tolist()} of key {key} does not hold the state after its prefix"

    def check_idle(self, what: str) -> None:
        """Nothing in flight: every op handed out ran, no pins, nothing pending-free, every cached
        block and checkpoint holds its bytes."""
        m = self.m
        assert not self.queue, f"{what}: handed out and never run: {self.queue[:6]}"
        assert not getattr(m, "_pin_chunks", []), f"{what}: pins left: {[e for e, _ in m._pin_chunks]}"
        assert m.pending_free_blocks().size == 0, f"{what}: pending-free blocks left: {m.pending_free_blocks()}"
        cache = getattr(m, "prefix_cache", None)
        assert cache is None or not cache.pinned, f"{what}: pinned checkpoints left: {cache.pinned}"
        m.check_integrity()
        self.check_agree(what)
        self.check_cache_bytes(what)
        self.check_host_cache_bytes(what)

"""The FastDeploy facade driven in FastDeploy 7808a119's ``ResourceManagerV1`` call order, as it is
and with the patch series, for MiniMax-M1 TP8 and Qwen3-Next TP2 (block size 64, FastDeploy's).

The driver is :class:`tests.test_fastdeploy_rmv1.RMv1` (the project's transcription, with the
7808a119 line numbers). Every scenario runs in the legacy and the v1 cache-manager mode:

- patched: every request finishes (or is aborted through ``add_abort_req_ids``), every block comes
  back, ``check_integrity`` passes and FastDeploy's block tables equal the manager's after every
  step, each ``allocate_gpu_blocks(n)`` takes exactly ``n`` (the driver asserts it), no prefill task
  covers more tokens than its block table has slots, FastDeploy swallowed no exception, prefix hits
  happen where prefixes are shared, and the tight pools preempt through ``_select_preempt_candidate``;
- unpatched (FastDeploy's text over the facade, E1 only): the run stops at its first call with
  :class:`EnginePatchError` naming the patch, and nothing was allocated.

The splitwise scenario runs a prefill and a decode instance, each its own facade and pool, the
requests' KV blocks and state sets moving through ``hybridkv.transfer`` (loopback engine, real
bytes); one request's WRITE fails, and the decode side aborts its import (blocks back) while the
prefill side frees it as FastDeploy does. :func:`scenario_table` prints the measured table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import hybridkv
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.fastdeploy.facade import HYBRID_TASK_FIELDS, EnginePatchError, FastDeployBlockManager
from hybridkv.planner.layout import plan
from hybridkv.transfer.errors import TransferError
from hybridkv.transfer.loopback import LoopbackEngine, LoopbackHub, connect_pair, regions_of_array
from hybridkv.transfer.testing import reference_bytes, seeded_pool
from tests.test_fastdeploy_rmv1 import RMv1
from tests.test_fastdeploy_world import Request, ScheduledPreemptTask, check_books, run_worker_step

BS = 64
PRESETS = {"minimax-m1-tp8": ("minimax-m1", 8), "qwen3-next-tp2": ("qwen3-next", 2)}
SHARED_PREFIX = 1024  # a system prompt of 16 blocks


def preset_layout(name: str, num_blocks: int):
    model, tp = PRESETS[name]
    spec = hybridkv.preset(model, tp_size=tp)
    probe = plan(spec, 1 << 30, block_size=BS)
    return plan(spec, num_blocks * probe.bytes_per_block, block_size=BS)


@dataclass(frozen=True)
class Scenario:
    pool: int  # blocks besides the state sets of `seqs` requests
    seqs: int = 8  # max_num_seqs
    budget: int = 2048  # max_num_batched_tokens
    n: int = 12
    prompt: tuple[int, int] = (100, 2000)
    out: tuple[int, int] = (4, 40)
    prefix: bool = False
    arrivals: int = 2
    abort_every: int = 0
    long_prompt: int = 0
    preempts: bool = False
    late_out: tuple[int, int] | None = None  # outputs of the second half of the requests (default: `out`)
    late_every: int = 1  # the second half arrives one request every this many steps, after the first half
    prefixes: int = 1  # distinct shared prompts (with `prefix`), request i uses prompt i % prefixes
    host: int = 0  # host blocks of the prefix cache's host tier (0: no tier)


SCENARIOS = {
    "roomy": Scenario(pool=400),
    "tight": Scenario(pool=20, seqs=3, n=8, prompt=(100, 600), out=(100, 300), preempts=True),
    "prefix": Scenario(pool=400, prefix=True, arrivals=1, prompt=(50, 600)),
    "prefix-tight": Scenario(
        pool=60, seqs=3, n=12, prefix=True, prompt=(50, 400), out=(200, 400), late_out=(4, 30), preempts=True
    ),
    # a hit that pins more than it saves and barely fits (MiniMax-M1's 56-block checkpoint for 16 KV blocks)
    "prefix-pressure": Scenario(pool=90, seqs=3, n=8, prefix=True, prompt=(50, 400), out=(150, 300)),
    # four shared prompts on a pool that holds fewer: the others are offloaded to the host tier
    # and served from it when their turn comes again (E9)
    "prefix-host": Scenario(
        pool=100, seqs=3, n=18, prefix=True, prefixes=4, prompt=(1100, 1400), out=(2, 6), arrivals=1, host=4000
    ),
    "aborts": Scenario(pool=400, abort_every=3, out=(20, 40)),
    "short-60": Scenario(pool=60, seqs=16, n=60, prompt=(10, 100), out=(2, 8), arrivals=4),
    "chunked": Scenario(pool=400, budget=256, prompt=(800, 3000)),
    "zero-block-chunks": Scenario(pool=300, budget=100, prompt=(300, 900), n=8),
    "long-prompt": Scenario(pool=420, seqs=3, n=4, long_prompt=8168, prompt=(100, 400)),
}


def make_requests(sc: Scenario, rng: random.Random) -> list[Request]:
    systems = [[rng.randrange(50_000) for _ in range(SHARED_PREFIX)] for _ in range(sc.prefixes)]
    out = []
    for i in range(sc.n):
        length = sc.long_prompt if sc.long_prompt and i % 2 == 0 else rng.randrange(*sc.prompt)
        head = systems[i % sc.prefixes] if sc.prefix else []
        tail = [rng.randrange(50_000) for _ in range(max(length - len(head), 1))]
        outs = sc.late_out if sc.late_out and i >= sc.n // 2 else sc.out
        out.append(Request(f"r{i}", head + tail, max_tokens=rng.randrange(*outs)))
    return out


def build(preset: str, sc: Scenario, *, v1_mode: bool, patched: bool, role: str = "mixed", **kw):
    layout = preset_layout(preset, 64)
    S = sum(layout.blocks_per_state)
    total = sc.seqs * S + sc.pool + 1
    cfg = PrefixCacheConfig(host_tier=sc.host > 0) if sc.prefix else None
    fd = FastDeployBlockManager(HybridBlockManager(layout, num_host_blocks=sc.host, prefix_cache=cfg))
    rm = RMv1(
        fd, max_num_seqs=sc.seqs, max_num_batched_tokens=sc.budget, v1_mode=v1_mode, prefix=sc.prefix,
        patched=patched, role=role, enc_dec_block_num=2, prealloc_threshold=12, **kw,
    )  # fmt: skip
    return fd, rm, total


def run_mixed(preset: str, name: str, *, v1_mode: bool, seed: int = 0, max_steps: int = 3000, **kw) -> dict:
    sc = SCENARIOS[name]
    fd, rm, total = build(preset, sc, v1_mode=v1_mode, patched=True, **kw)
    rm.reset_cache_config(SimpleNamespace(total_block_num=total))  # E6: after the profiling run
    assert rm.total_block_number() == total and fd.manager.layout.num_blocks == total
    rng = random.Random(seed)
    pending = make_requests(sc, rng)
    finished, aborted, steps = [], [], 0
    for steps in range(1, max_steps + 1):  # noqa: B007
        late = len(pending) <= sc.n - sc.n // 2  # the second wave comes once the first has left
        wave_done = not any(int(r[1:]) < sc.n // 2 for r in rm.requests)
        for _ in range(1 if late else sc.arrivals):
            if pending and (not late or (wave_done and steps % sc.late_every == 0)):
                rm.add_request(pending.pop(0))
        tasks, errors = rm.schedule()
        assert not errors
        check_books(rm, fd)
        for t in tasks:
            if not isinstance(t, ScheduledPreemptTask) and t.task_type.name in ("PREFILL", "DECODE"):
                assert all(hasattr(t, f) for f in HYBRID_TASK_FIELDS), t
        done = run_worker_step(rm, tasks, rng)
        aborted += [t.request_id for t in tasks if t.task_type.name == "ABORT"]
        if sc.abort_every:  # the user aborts some requests once they decode
            for r in rm.running:
                if int(r.request_id[1:]) % sc.abort_every == 0 and len(r.output_token_ids) >= 2:
                    rm.add_abort_req_ids(r.request_id)
        rm.finish_requests(done)
        finished += done
        check_books(rm, fd)
        if not pending and not rm.running and not rm.waiting and not rm.requests:
            break
    m = fd.manager
    usage = m.usage()
    return {
        "finished": len(finished), "aborted": len(aborted), "n": sc.n, "steps": steps,
        "hit_tokens": rm.hit_tokens, "preemptions": sum(rm.preemptions.values()),
        "blocks_back": m.num_available_blocks == m.pool.num_usable and not m.requests,
        "live": usage.kv_live + usage.state_live, "over_slots": list(rm.over_slots), "swallowed": list(rm.swallowed),
        "zero_block_chunks": rm.zero_block_chunks, "backup_calls": rm.backup_calls, "metrics": rm.metrics,
        "free_device": fd.num_free_device_blocks, "usable": m.pool.num_usable, "total": total,
        "host_hit_tokens": m.prefix_cache.stats.hit_tokens_host if m.prefix_cache else 0,
        "cpu_match_tokens": fd.metrics.total_cpu_matched_token_num,
        "cpu_reported": rm.main_metrics["prefix_cpu_cache_token_num"],
        "host_back": m.host_pool is None or m.host_pool.num_free + m.usage().host_cached == m.host_pool.num_usable,
    }  # fmt: skip


def check_outcome(out: dict, name: str) -> None:
    sc = SCENARIOS[name]
    assert out["finished"] + out["aborted"] == out["n"], out
    assert out["blocks_back"] and out["live"] == 0 and out["free_device"] == out["usable"], out
    assert not out["over_slots"] and not out["swallowed"], out
    assert out["metrics"]["available_gpu_block_num"] == out["usable"], out
    if sc.prefix:
        assert out["hit_tokens"] > 0, f"shared {SHARED_PREFIX}-token prefix never hit: {out}"
    else:
        assert out["hit_tokens"] == 0
    assert (out["preemptions"] > 0) == sc.preempts, out
    if sc.abort_every:
        assert out["aborted"] > 0
    if name == "zero-block-chunks":
        assert out["zero_block_chunks"] > 0
    # host hits: what FastDeploy is told equals the manager's count (a rescheduled request's are not reported)
    assert out["cpu_match_tokens"] == out["host_hit_tokens"] >= out["cpu_reported"] and out["host_back"], out
    assert (out["host_hit_tokens"] > 0) == (sc.host > 0), out


MATRIX = [
    pytest.param(p, s, v1, id=f"{p}-{s}-{('legacy', 'v1')[v1]}")
    for p in PRESETS
    for s in SCENARIOS
    for v1 in (False, True)
]


@pytest.mark.parametrize(("preset", "name", "v1_mode"), MATRIX)
def test_patched_engine_runs_every_scenario(preset, name, v1_mode):
    out = run_mixed(preset, name, v1_mode=v1_mode)
    check_outcome(out, name)
    if v1_mode:
        assert out["backup_calls"] == out["steps"]  # check_and_add_pending_backup ends every v1 schedule()


@pytest.mark.parametrize("v1_mode", [False, True])
def test_an_engine_without_e9_stops_loudly_when_the_host_tier_queues_copies(v1_mode):
    """E9 left out with a host tier: the tier's copies were never handed out, so their pins never
    ended and the engine waited forever, silently. Now the facade raises at the second begin_step
    that finds them queued, naming E9, as a missing E4 raises at the first checkpoint reservation."""
    with pytest.raises(EnginePatchError, match=r"begin_step: .*patch E9"):
        run_mixed("qwen3-next-tp2", "prefix-host", v1_mode=v1_mode, omit={"E9"})


@pytest.mark.parametrize(("preset", "name", "v1_mode"), MATRIX)
def test_unpatched_engine_stops_at_its_first_call(preset, name, v1_mode):
    sc = SCENARIOS[name]
    fd, rm, total = build(preset, sc, v1_mode=v1_mode, patched=False)  # ResourceManager.__init__'s info() ran
    with pytest.raises(EnginePatchError, match=r"update_cache_config: no engine bound.*bind_engine"):
        rm.reset_cache_config(SimpleNamespace(total_block_num=total))  # the engine's first call after __init__
    for r in make_requests(sc, random.Random(0)):
        rm.add_request(r)
    first = "release_block_ids" if sc.prefix and not v1_mode else "request_finish" if sc.prefix else "can_allocate"
    if sc.host and not v1_mode:  # num_cpu_blocks > 0: the legacy engine checks the prompt fits before matching
        first = "can_allocate"
    with pytest.raises(EnginePatchError, match=rf"{first}\w*: no engine bound"):
        rm.schedule()  # a prefix match's error is swallowed by FastDeploy; the _free_blocks after it is not
    assert not fd.manager.requests and not rm.over_slots and not rm.running


# ---- splitwise: a prefill and a decode instance ------------------------------------------------------
class FailingWrite(LoopbackEngine):
    """A prefill-side engine whose WRITE of chosen requests fails (the peer vanished)."""

    fail: set[str] = set()

    def write(self, peer, pairs, remote, notification, timeout_s):
        if any(rid.encode() in notification for rid in self.fail):
            raise TransferError("the decode instance went away")
        super().write(peer, pairs, remote, notification, timeout_s)


def run_splitwise(
    preset: str, *, v1_mode: bool, prefix: bool = False, seed: int = 0, max_steps: int = 2000, version: str = "7808a119"
) -> dict:
    sc = Scenario(pool=60, seqs=3, n=6, prompt=(100, 1200), out=(3, 30), prefix=prefix)
    P_fd, P, p_total = build(preset, sc, v1_mode=v1_mode, patched=True, role="prefill", version=version)
    D_fd, D, d_total = build(preset, sc, v1_mode=v1_mode, patched=True, role="decode", version=version)
    P.reset_cache_config(SimpleNamespace(total_block_num=p_total))
    D.reset_cache_config(SimpleNamespace(total_block_num=d_total))
    p_pool, d_pool = seeded_pool(P_fd.manager.layout, 1), seeded_pool(D_fd.manager.layout, 2)
    hub = LoopbackHub()
    p_eng = FailingWrite("prefill", regions_of_array(P_fd.manager.layout, p_pool), hub)
    d_eng = LoopbackEngine("decode", regions_of_array(D_fd.manager.layout, d_pool), hub)
    connect_pair(p_eng, d_eng)
    p_eng.fail = {"r3"}
    rng = random.Random(seed)
    pending = make_requests(sc, rng)
    finished, failed, moved, checked, sent_bytes = [], [], 0, 0, {}
    for _ in range(max_steps):
        if pending:  # the router: D preallocates first, then P takes the request
            req = pending[0]
            d_req = Request(req.request_id, list(req.prompt_token_ids), req.max_tokens)
            if D.preallocate_resource_in_d(d_req, d_eng.pool):
                assert P.preallocate_resource_in_p(req)
                P.add_request_in_p([req])
                pending.pop(0)
        tasks, _ = P.schedule()
        check_books(P, P_fd)
        run_worker_step(P, tasks, rng)
        for req in [r for r in P.running if r.num_computed_tokens >= r.need_prefill_tokens]:
            d_req = D.requests[req.request_id]
            blocks = P_fd.manager.request_blocks(req.request_id)
            check = not sent_bytes  # the first request's bytes are compared (reading them is slow)
            try:
                P_fd.transfer_send(req, p_eng, "decode", d_req.disaggregate_info["hybridkv_accept"], 1.0)
                if check:
                    sent_bytes[req.request_id] = reference_bytes(p_pool, P_fd.manager.layout, blocks)
            except TransferError:
                pass  # P frees it below as any finished request; D's wait times out
            P.finish_requests([req.request_id])
            try:
                D_fd.transfer_received(d_req, d_eng, "prefill", 0.0)
                if req.request_id in sent_bytes:  # KV blocks and every state set arrived, byte for byte
                    got = D_fd.manager.request_blocks(d_req.request_id)
                    assert reference_bytes(d_pool, D_fd.manager.layout, got) == sent_bytes[req.request_id]
                    checked += 1
                moved += 1
                D.add_prefilled_request(d_req.request_id, req.output_token_ids[0])
            except TransferError:
                failed.append(d_req.request_id)
                D.pre_recycle_resource(d_req.request_id)
        check_books(P, P_fd)
        tasks, _ = D.schedule()
        check_books(D, D_fd)
        done = run_worker_step(D, tasks, rng)
        D.finish_requests(done)
        finished += done
        check_books(D, D_fd)
        if not pending and not D.requests and not P.requests:
            break
    out = {"finished": len(finished), "failed": failed, "moved": moved, "n": sc.n, "bytes_checked": checked}
    for side, fd, rm in (("P", P_fd, P), ("D", D_fd, D)):
        m = fd.manager
        out[side] = {
            "blocks_back": m.num_available_blocks == m.pool.num_usable and not m.requests,
            "over_slots": list(rm.over_slots), "swallowed": list(rm.swallowed),
            "preemptions": sum(rm.preemptions.values()), "hit_tokens": rm.hit_tokens,
        }  # fmt: skip
    return out


@pytest.mark.parametrize("v1_mode", [False, True], ids=["legacy", "v1"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_splitwise_prefill_and_decode_roles_move_state_and_leak_nothing(preset, v1_mode):
    out = run_splitwise(preset, v1_mode=v1_mode)
    assert out["failed"] == ["r3"] and out["moved"] == out["n"] - 1 and out["finished"] == out["n"] - 1, out
    assert out["bytes_checked"] == 1, out
    for side in ("P", "D"):
        assert out[side]["blocks_back"] and not out[side]["over_slots"] and not out[side]["swallowed"], out


OTHER_VERSIONS = [("c1b7c083", False), ("c1b7c083", True), ("7198b588", False)]  # release/2.6: no v1 manager


@pytest.mark.parametrize(("version", "v1_mode"), OTHER_VERSIONS, ids=["develop-legacy", "develop-v1", "2.6-legacy"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_patched_engine_runs_every_scenario_in_the_call_order_of_develop_and_release_2_6(name, version, v1_mode):
    """The same scenarios with the differences of develop c1b7c083 (int v1 flag, no clamp in
    get_new_block_nums) and release/2.6 7198b588 (no v1 manager), on one preset."""
    check_outcome(run_mixed("qwen3-next-tp2", name, v1_mode=v1_mode, version=version), name)


@pytest.mark.parametrize(("version", "v1_mode"), OTHER_VERSIONS, ids=["develop-legacy", "develop-v1", "2.6-legacy"])
def test_splitwise_roles_in_the_call_order_of_develop_and_release_2_6(version, v1_mode):
    """develop's prefill role asks can_allocate_gpu_blocks(n < 0) for a chunk of a preallocated
    request: the facade answers it as FastDeploy's managers do (it used to refuse: a stall)."""
    out = run_splitwise("minimax-m1-tp8", v1_mode=v1_mode, version=version)
    assert out["failed"] == ["r3"] and out["finished"] == out["n"] - 1, out
    for side in ("P", "D"):
        assert out[side]["blocks_back"] and not out[side]["over_slots"] and not out[side]["swallowed"], out


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_unpatched_splitwise_roles_stop_at_their_first_call(role):
    sc = Scenario(pool=300, seqs=4)
    fd, rm, _ = build("minimax-m1-tp8", sc, v1_mode=False, patched=False, role=role)
    req = Request("a", list(range(300)), 4)
    with pytest.raises(EnginePatchError, match="can_allocate_gpu_blocks: no engine bound"):
        rm.preallocate_resource_in_p(req) if role == "prefill" else rm.preallocate_resource_in_d(req)
    assert not fd.manager.requests


def test_decode_role_request_released_before_its_bytes_arrived_gives_every_block_back():
    sc = Scenario(pool=300, seqs=4)
    fd, D, total = build("qwen3-next-tp2", sc, v1_mode=False, patched=True, role="decode")
    D.reset_cache_config(SimpleNamespace(total_block_num=total))
    pool = seeded_pool(fd.manager.layout, 3)
    eng = LoopbackEngine("d", regions_of_array(fd.manager.layout, pool), LoopbackHub())
    req = Request("x", list(range(500)), 4)
    assert D.preallocate_resource_in_d(req, eng.pool)
    assert fd.manager.requests["x"].pending is not None  # an import plan holds KV and state sets
    D.pre_recycle_resource("x")  # FastDeploy gives up on the request (abort, P failure) before arrival
    m = fd.manager
    assert not m.requests and m.num_available_blocks == m.pool.num_usable
    m.check_integrity()


def scenario_table() -> list[tuple]:
    """The measured rows of the closing note (run by hand: python -m tests.test_fastdeploy_conformance)."""
    rows = []
    for p in PRESETS:
        for v1 in (False, True):
            mode = ("legacy", "v1")[v1]
            for s in SCENARIOS:
                o = run_mixed(p, s, v1_mode=v1)
                done = f"{o['finished']} done, {o['aborted']} aborted of {o['n']}"
                rows.append((p, mode, s, "patched", done, o["hit_tokens"], o["preemptions"], o["blocks_back"]))
            o = run_splitwise(p, v1_mode=v1)
            done = f"{o['finished']} done, {len(o['failed'])} transfer failed of {o['n']}"
            back = o["P"]["blocks_back"] and o["D"]["blocks_back"]
            rows.append((p, mode, "splitwise P+D", "patched", done, 0, o["D"]["preemptions"], back))
    return rows


if __name__ == "__main__":
    for row in scenario_table():
        print(" | ".join(str(x) for x in row))

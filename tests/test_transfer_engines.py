"""Two spawned processes, each with its own pool and manager, move a request through a transfer engine
over TCP on loopback (NIXL with UCX, then Mooncake Transfer Engine): decode-side READ and
prefill-side WRITE, and sources that die half-way. The same workers and assertions for both engines.

Each engine's tests skip when it cannot be imported (``.ci/run`` installs both: ``pip install
--no-deps nixl==1.5.1 nixl-cu12==1.5.1``; Mooncake: docs/transfer.md). Every wait is bounded;
leftover processes are killed.
"""

import multiprocessing as mp
import os

import pytest

from hybridkv.transfer.mooncake_engine import mooncake_available
from hybridkv.transfer.nixl_engine import nixl_available
from hybridkv.transfer.testing import aborted_destination, failing_source, happy_worker

ENGINES = [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")),
    pytest.param(
        "mooncake",
        marks=pytest.mark.skipif(not mooncake_available(), reason="Mooncake Transfer Engine is not installed"),
    ),
]

TIMEOUT_S = 30.0  # per wait inside the workers; process start-up (imports, agents) dominates on 2 cores
JOIN_S = 180.0


@pytest.fixture(autouse=True)
def loopback_ucx(monkeypatch):
    """Spawned children inherit the environment: NIXL's UCX over TCP on the loopback interface."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


def _recv(conn, timeout_s, procs):
    if not conn.poll(timeout_s):
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"no result in {timeout_s} s (exit codes {codes})")
    return conn.recv()


def _stop(procs):
    for p in procs:
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@pytest.mark.parametrize("kind", ENGINES)
def test_read_and_write_move_both_models_byte_exact(kind):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    (src_res, src_out), (dst_res, dst_out) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
    num_tokens = 9 * 4 + 3  # mini layouts: 4-token blocks, so 10 KV blocks, the last one partly filled
    procs = [
        ctx.Process(target=happy_worker, args=("src", a, src_out, kind, num_tokens, TIMEOUT_S)),
        ctx.Process(target=happy_worker, args=("dst", b, dst_out, kind, num_tokens, TIMEOUT_S)),
    ]
    try:
        for p in procs:
            p.start()
        src, dst = _recv(src_res, JOIN_S, procs), _recv(dst_res, JOIN_S, procs)
    finally:
        _stop(procs)
    assert "error" not in src and "error" not in dst, (src.get("error"), dst.get("error"))
    assert (
        sorted(src)
        == sorted(dst)
        == [
            "mini-mamba2/read",
            "mini-mamba2/write",
            "mini-minimax/read",
            "mini-minimax/write",
        ]
    )
    for key in src:
        s, d = src[key], dst[key]
        assert s["sha256"] == d["sha256"], key
        assert len(s["ids"]) == len(d["ids"]) and s["ids"] != d["ids"], key  # other block ids on each side
        assert s["kv_runs"] > 1, key  # the KV blocks really were scattered on the source
        assert s["num_descriptors"] > 16, key  # more than one Mooncake batch (the workers use batches of 16)
        assert d["others_untouched"] and d["covered_bytes"] > 0, key
        assert s["freed"], key  # the prefill side freed the request after the hand-over
        notified = s if key.endswith("read") else d  # READ notifies the source, WRITE the destination
        assert notified["notified"], key
        assert s["integrity"] == d["integrity"] == "ok", key
        assert not s["leaked"] and not d["leaked"], key
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_source_killed_half_way_leaves_the_destination_as_it_was(kind, mode):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    src_ctl, src_side = ctx.Pipe()
    dst_ctl, dst_side = ctx.Pipe()
    timeout_s = 3.0
    args = (kind, mode, 9 * 4 + 3, timeout_s)
    src = ctx.Process(target=failing_source, args=(a, src_side, *args))
    dst = ctx.Process(target=aborted_destination, args=(b, dst_side, *args))
    procs = [src, dst]
    try:
        for p in procs:
            p.start()
        assert _recv(src_ctl, JOIN_S, procs) == "ready"
        src.kill()  # the peer disappears: SIGKILL, no goodbye
        src.join(timeout=10)
        dst_ctl.send("go")
        out = _recv(dst_ctl, JOIN_S, procs)
    finally:
        _stop(procs)
    assert "crash" not in out, out.get("crash")
    assert out["error"] is not None and out["error"].startswith("Transfer"), out
    assert out["seconds"] < timeout_s + 5
    assert out["books_as_before"] and out["owned_bytes_untouched"], out
    assert out["integrity"] == "ok"
    if mode == "write":
        assert out["reserved_bytes_written"] > 0  # half the request did arrive before the source died
    assert dst.exitcode == 0
    assert os.environ["UCX_TLS"] == "tcp"

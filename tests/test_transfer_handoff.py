"""The hand-off flows in one process (loopback engine): both directions, and every failure settles its plan."""

import gc
import json
import weakref

import numpy as np
import pytest

from hybridkv.blockmgr.errors import RequestStateError
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.transfer import TransferError, TransferTimeoutError
from hybridkv.transfer.handoff import (
    BlocksMessage,
    finish_export,
    finish_import,
    notification_for,
    offer_request,
    pull_request,
    push_request,
    reserve_request,
)
from hybridkv.transfer.loopback import LoopbackEngine, LoopbackHub, connect_pair, regions_of_array
from hybridkv.transfer.testing import mini_layout, mini_mamba2, reference_bytes, scattered_request, seeded_pool


@pytest.fixture
def sides():
    layout = mini_layout(mini_mamba2(), 120)
    src_m, dst_m = HybridBlockManager(layout), HybridBlockManager(layout)
    src, dst = seeded_pool(layout, 1), seeded_pool(layout, 2)
    scattered_request(src_m, "r", 23, "neighbour")
    dst_m.allocate("resident", 8)
    hub = LoopbackHub()
    a = LoopbackEngine("prefill", regions_of_array(layout, src), hub)
    b = LoopbackEngine("decode", regions_of_array(layout, dst), hub)
    connect_pair(a, b)
    return layout, src_m, dst_m, src, dst, a, b


def books(m):
    return m.pool.free_extents(), m.use.tolist(), sorted(m.requests)


def test_decode_side_read(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    expected = reference_bytes(src, layout, src_m.request_blocks("r"))
    plan, offer = offer_request(src_m, a.pool, "r")
    with pytest.raises(RequestStateError):
        src_m.append("r", 1)  # pinned while the peer reads
    imported = pull_request(dst_m, b, "prefill", offer, timeout_s=1.0)
    assert reference_bytes(dst, layout, dst_m.request_blocks("r")) == expected
    assert imported.settled and dst_m.block_table(["r"]).shape[1] == layout.num_kv_blocks(23)
    finish_export(a, "decode", plan, timeout_s=1.0)
    assert "r" not in src_m.requests
    src_m.check_integrity()
    dst_m.check_integrity()


def test_prefill_side_write(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    expected = reference_bytes(src, layout, src_m.request_blocks("r"))
    incoming, accept = reserve_request(dst_m, b.pool, "r", 23)
    export = src_m.export_request("r")
    push_request(src_m, a, "decode", export, accept, timeout_s=1.0)
    assert "r" not in src_m.requests
    finish_import(b, "prefill", incoming, timeout_s=1.0)
    assert reference_bytes(dst, layout, dst_m.request_blocks("r")) == expected
    src_m.check_integrity()
    dst_m.check_integrity()


def test_failures_settle_every_plan(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    src_books, dst_books = books(src_m), books(dst_m)
    # the decode side never reads: the prefill side times out and keeps running the request
    plan, offer = offer_request(src_m, a.pool, "r")
    with pytest.raises(TransferTimeoutError):
        finish_export(a, "decode", plan, timeout_s=0.0)
    assert plan.settled and books(src_m) == src_books
    src_m.append("r", 1)  # runs on here
    # the decode side reserved, the writer never comes: abort
    incoming, accept = reserve_request(dst_m, b.pool, "r", 24)
    with pytest.raises(TransferTimeoutError):
        finish_import(b, "prefill", incoming, timeout_s=0.0)
    assert incoming.settled and books(dst_m) == dst_books
    # the peer is gone before a WRITE: the export is aborted, the request runs on here
    incoming, accept = reserve_request(dst_m, b.pool, "r", 24)
    export = src_m.export_request("r")
    b.close()
    with pytest.raises(TransferError, match="not connected"):
        push_request(src_m, a, "decode", export, accept, timeout_s=1.0)
    assert export.settled and "r" in src_m.requests
    incoming.abort()
    # an offer for a pool of another layout is refused before anything is reserved
    other = HybridBlockManager(mini_layout(mini_mamba2(), 120, block_size=8))
    _, offer = offer_request(src_m, a.pool, "r")
    with pytest.raises(TransferError, match="block_size"):
        pull_request(other, b, "prefill", offer, timeout_s=1.0)
    assert not other.requests
    src_m.check_integrity()
    dst_m.check_integrity()
    other.check_integrity()


def _edited(offer, edit):
    msg = json.loads(offer)
    edit(msg)
    return json.dumps(msg).encode()


MALFORMED = {
    "plane_region names a missing region": lambda m: m["pool"].__setitem__("plane_region", [[0, 7], [0, 0]]),
    "a plane past its region": lambda m: m["pool"]["regions"][0].__setitem__(1, 64),
    "ids past the peer's pool": lambda m: m["blocks"]["kv_blocks"].__setitem__(0, 10**6),
    "the null block": lambda m: m["blocks"]["kv_blocks"].__setitem__(0, 0),
    "a KV block too few": lambda m: m["blocks"]["kv_blocks"].pop(),
    "an id twice": lambda m: m["blocks"]["kv_blocks"].__setitem__(1, m["blocks"]["kv_blocks"][0]),
    "a float id": lambda m: m["blocks"]["kv_blocks"].__setitem__(0, 1.5),
    "no pool": lambda m: m.pop("pool"),
    "a list request id": lambda m: m.__setitem__("request_id", ["r"]),
    "another layout": lambda m: m["pool"]["signature"].__setitem__("block_size", 8),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_offer_is_refused_before_anything_is_reserved(sides, what):
    layout, src_m, dst_m, src, dst, a, b = sides
    before = books(dst_m)
    _, offer = offer_request(src_m, a.pool, "r")
    with pytest.raises(TransferError):
        pull_request(dst_m, b, "prefill", _edited(offer, MALFORMED[what]), timeout_s=1.0)
    assert books(dst_m) == before and not a.take_notification("decode", notification_for("r"))
    dst_m.check_integrity()
    with pytest.raises(TransferError, match="not JSON"):
        pull_request(dst_m, b, "prefill", b"{not json", timeout_s=1.0)
    assert books(dst_m) == before


class _Crashing(LoopbackEngine):
    """An engine whose READ fails with something other than a TransferError (a bug, a driver error)."""

    def read(self, peer, pairs, remote, notification, timeout_s):
        raise IndexError("a driver error half-way")


def test_any_exception_of_the_engine_aborts_the_import(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    before = books(dst_m)
    crashing = _Crashing("crashing", b.pool, a.hub)
    crashing.connect(lambda _: b"prefill")
    _, offer = offer_request(src_m, a.pool, "r")
    with pytest.raises(IndexError, match="half-way"):
        pull_request(dst_m, crashing, "prefill", offer, timeout_s=1.0)
    assert books(dst_m) == before and "r" not in dst_m.requests
    dst_m.check_integrity()


def test_int_and_str_ids_never_share_a_notification():
    assert notification_for(5) != notification_for("5")
    assert notification_for(np.int64(5)) == notification_for(5)
    with pytest.raises(TypeError, match="str or an int"):
        notification_for(("a", 1))


def test_request_ids_that_cannot_travel_are_refused_before_the_export(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    src_m.allocate(("t", 1), 5)
    with pytest.raises(TypeError, match="str or an int"):
        offer_request(src_m, a.pool, ("t", 1))
    src_m.append(("t", 1), 1)  # not pinned: it runs on
    src_m.allocate(np.int64(9), 5)
    _, offer = offer_request(src_m, a.pool, np.int64(9))  # numpy integers travel as int
    assert BlocksMessage.from_bytes(offer).request_id == 9
    src_m.check_integrity()


def test_a_registered_pool_lives_as_long_as_its_engine():
    layout = mini_layout(mini_mamba2(), 40)
    pool = seeded_pool(layout, 1)
    expected, ref = pool.copy(), weakref.ref(pool)
    engine = LoopbackEngine("owner", regions_of_array(layout, pool), LoopbackHub())
    del pool
    gc.collect()
    assert ref() is not None, "the engine registered this memory: it must keep it alive"
    assert np.array_equal(ref(), expected)
    engine.close()
    del engine
    gc.collect()
    assert ref() is None  # and lets it go once it is closed and dropped


def test_descriptors_into_memory_the_peer_did_not_register_are_refused(sides):
    layout, src_m, dst_m, src, dst, a, b = sides
    before = books(dst_m)
    stranger = seeded_pool(layout, 3)  # a pool of this process that no engine registered
    _, offer = offer_request(src_m, a.pool, "r")
    region = [stranger.ctypes.data, stranger.nbytes, 0, "DRAM"]
    forged = _edited(offer, lambda m: m["pool"].__setitem__("regions", [region]))
    with pytest.raises(TransferError, match="did not register"):
        pull_request(dst_m, b, "prefill", forged, timeout_s=1.0)
    assert books(dst_m) == before

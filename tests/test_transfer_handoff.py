"""The hand-off flows in one process (loopback engine): both directions, and every failure settles its plan."""

import pytest

from hybridkv.blockmgr.errors import RequestStateError
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.transfer import TransferError, TransferTimeoutError
from hybridkv.transfer.handoff import (
    finish_export,
    finish_import,
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

"""Test helpers of the transfer room: miniature models, seeded pools, and a reference reader of a
request's bytes that follows the layout's addressing rule, not the descriptors it checks."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.pool import runs
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.models.presets import layers_from_pattern, lightning_layer, mamba2_layer
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec
from hybridkv.planner.layout import Layout, plan
from hybridkv.transfer.descriptors import DescriptorPairs, Descriptors, PoolRegions, request_descriptors
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.errors import TransferError, TransferTimeoutError
from hybridkv.transfer.handoff import (
    finish_export,
    finish_import,
    offer_request,
    pull_request,
    push_pairs,
    push_request,
    reserve_request,
)
from hybridkv.transfer.loopback import covered_mask, pool_array, regions_of_array


def mini_minimax() -> ModelSpec:
    """MiniMax-M1 in miniature: 2 x (7 lightning + 1 attention); lightning state 512 B (fp32 kv [2, 8, 8])."""
    return ModelSpec(
        "mini-minimax",
        layers_from_pattern("RRRRRRRA" * 2, AttentionLayerSpec(1, 8, DType.BFLOAT16), lightning_layer(2, 8)),
    )


def mini_mamba2() -> ModelSpec:
    """A two-component state model: 2 attention + 4 Mamba2 layers (ssm 64 B + conv 96 B = 160 B)."""
    m2 = mamba2_layer(num_heads=2, head_dim=4, d_state=4, n_groups=1, conv_kernel=4)
    return ModelSpec("mini-mamba2", layers_from_pattern("MMAMMA", AttentionLayerSpec(1, 8, DType.BFLOAT16), m2))


def mini_layout(model: ModelSpec, num_blocks: int, layout: str = "paged", block_size: int = 4) -> Layout:
    """``model`` planned into exactly ``num_blocks`` blocks (null block included)."""
    probe = plan(model, 1 << 30, block_size=block_size, layout=layout)
    return plan(model, num_blocks * probe.bytes_per_block, block_size=block_size, layout=layout)


def seeded_pool(layout: Layout, seed: int, num_blocks: int | None = None) -> np.ndarray:
    """A :func:`pool_array` of random bytes from ``seed`` (block 0 zero, as the null block is)."""
    pool = pool_array(layout, num_blocks)
    pool[...] = np.random.default_rng(seed).integers(0, 256, size=pool.shape, dtype=np.uint8)
    pool[:, :, 0] = 0
    return pool


def reference_bytes(pool: np.ndarray, layout: Layout, blocks: RequestBlocks) -> bytes:
    """The request's bytes read by the layout's rule: every KV layer's K and V of every KV block, then
    every state layer's flat state (byte ``o`` in block ``set[o // block_bytes]``, segment
    ``o % block_bytes // segment_bytes``), in layer-slot order."""
    out = []
    kv = layout.kv_group
    if kv is not None:
        for slot, layer_id in enumerate(kv.layer_ids):
            if layer_id is not None:
                out.append(pool[slot][:, blocks.kv_blocks].tobytes())
    for g, group in enumerate(layout.state_groups):
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is None:
                continue
            layer = layout.model.layers[layer_id]
            assert isinstance(layer, RecurrentLayerSpec)
            out.append(state_bytes(pool, layout, blocks.state_blocks[g], slot, np.arange(layer.state_bytes)).tobytes())
    return b"".join(out)


def state_bytes(pool: np.ndarray, layout: Layout, state_ids: np.ndarray, slot: int, offsets: np.ndarray) -> np.ndarray:
    """Bytes ``offsets`` of the state in layer slot ``slot`` whose set is ``state_ids`` (one state
    group's block ids), by the layout's rule: byte ``o`` lies in block ``state_ids[o // block_bytes]``,
    segment ``o % block_bytes // segment_bytes``. A new uint8 array (``pool``: ``[slots, segments,
    blocks, segment_bytes]``)."""
    within = offsets % layout.block_bytes
    return pool[slot][
        within // layout.segment_bytes, state_ids[offsets // layout.block_bytes], within % layout.segment_bytes
    ]


MODELS = {"mini-minimax": mini_minimax, "mini-mamba2": mini_mamba2}


def scattered_request(m: HybridBlockManager, request_id: str, num_tokens: int, neighbour: str) -> None:
    """Admit ``request_id`` with its state sets in place and its KV blocks scattered between the
    blocks of ``neighbour`` (appended to in turn), as a decode-heavy pool leaves them."""
    layout = m.layout
    m.allocate(request_id, 1)
    m.allocate(neighbour, 1)
    for i in range(layout.num_kv_blocks(num_tokens) - 1):
        m.append(request_id, layout.block_size)
        m.append(neighbour, layout.block_size if i % 2 else 0)
    m.append(request_id, num_tokens - m.requests[request_id].num_tokens)


# ---- two-process workers (multiprocessing "spawn" targets) ------------------------------------------
def make_engine(kind: str, name: str, pool: PoolRegions) -> TransferEngine:
    if kind == "nixl":
        from hybridkv.transfer.nixl_engine import NixlEngine

        return NixlEngine(name, pool)
    if kind == "mooncake":
        from hybridkv.transfer.mooncake_engine import MooncakeEngine

        return MooncakeEngine(name, pool, max_batch=16)  # small batches: the tests cross batch boundaries
    raise ValueError(f"unknown engine kind {kind!r}")


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TransferTimeoutError(f"no message from the peer process in {timeout_s} s")
    return conn.recv()


def _exchange(conn: Connection, timeout_s: float) -> Callable[[bytes], bytes]:
    def exchange(data: bytes) -> bytes:
        conn.send(data)
        return _recv(conn, timeout_s)

    return exchange


def _check(m: HybridBlockManager) -> str:
    try:
        m.check_integrity()
    except AssertionError as e:
        return str(e)
    return "ok"


def _owned_mask(m: HybridBlockManager) -> np.ndarray:
    """Blocks whose bytes the manager vouches for: not free (the null block included)."""
    return ~m.pool.free_mask()


def seeded_regions(layout: Layout, seed: int, device: str) -> tuple[PoolRegions, Callable[[], np.ndarray], Any]:
    """A seeded pool on ``device`` ("cpu": numpy; "cuda:N": an ``ops`` torch pool in GPU memory): its
    regions, a function returning its bytes as a numpy array (a copy for GPU pools), and the owner to keep."""
    if device == "cpu":
        pool = seeded_pool(layout, seed)
        return regions_of_array(layout, pool), lambda: pool, pool
    import torch

    from hybridkv.ops.pools import allocate_pools
    from hybridkv.transfer.loopback import regions_of_pools

    pools = allocate_pools(layout, device=device)
    pools.torch_data.copy_(torch.from_numpy(seeded_pool(layout, seed)))
    return regions_of_pools(pools), lambda: pools.torch_data.cpu().numpy(), pools


def happy_worker(
    role: str, peer: Connection, parent: Connection, kind: str, num_tokens: int, timeout_s: float, device: str = "cpu"
) -> None:
    """For each miniature model, one decode-side READ and one prefill-side WRITE of a request with
    scattered KV; reports SHA-256 of the request's bytes, the notification, integrity and leaks.
    ``device``: where the pools live ("cpu", or "cuda:N" for :mod:`hybridkv.transfer.gpu_check`)."""
    results: dict[str, Any] = {}
    try:
        for model_name, model in MODELS.items():
            layout = mini_layout(model(), 200)
            for mode in ("read", "write"):
                key, rid = f"{model_name}/{mode}", f"{model_name}-{mode}"
                m = HybridBlockManager(layout)
                regions, snapshot, _owner = seeded_regions(layout, 1 if role == "src" else 2, device)
                pool = snapshot()
                before = pool.copy()
                engine = make_engine(kind, f"{role}-{rid}", regions)
                other = engine.connect(_exchange(peer, timeout_s))
                out: dict[str, Any] = {}
                if role == "src":
                    scattered_request(m, rid, num_tokens, "neighbour")
                    blocks = m.request_blocks(rid)
                    out["sha256"] = hashlib.sha256(reference_bytes(pool, layout, blocks)).hexdigest()
                    out["ids"] = blocks.ids().tolist()
                    out["kv_runs"] = len(runs(np.sort(blocks.kv_blocks)))
                    out["num_descriptors"] = len(request_descriptors(engine.pool, blocks))
                    if mode == "read":
                        plan, offer = offer_request(m, engine.pool, rid)
                        peer.send(offer)
                        finish_export(engine, other, plan, timeout_s)
                        out["notified"] = True
                    else:
                        plan = m.export_request(rid)
                        peer.send(num_tokens)
                        push_request(m, engine, other, plan, _recv(peer, timeout_s), timeout_s)
                    out["freed"] = rid not in m.requests
                    m.free("neighbour")
                else:
                    m.allocate("resident", 3 * layout.block_size)  # the import gets other ids
                    if mode == "read":
                        plan = pull_request(m, engine, other, _recv(peer, timeout_s), timeout_s)
                    else:
                        plan, accept = reserve_request(m, engine.pool, rid, _recv(peer, timeout_s))
                        peer.send(accept)
                        finish_import(engine, other, plan, timeout_s)
                        out["notified"] = True
                    pool = snapshot()
                    blocks = m.request_blocks(rid)  # running: committed
                    out["sha256"] = hashlib.sha256(reference_bytes(pool, layout, blocks)).hexdigest()
                    out["ids"] = blocks.ids().tolist()
                    covered = covered_mask(engine.pool, request_descriptors(engine.pool, blocks))[0]
                    flat, old = pool.reshape(-1), before.reshape(-1)
                    out["others_untouched"] = bool(np.array_equal(flat[~covered], old[~covered]))
                    out["covered_bytes"] = int(covered.sum())
                    m.free(rid)
                    m.free("resident")
                out["integrity"] = _check(m)
                out["leaked"] = m.pool.free_extents() != [(1, layout.num_blocks)] or bool(m.requests)
                peer.send("next")  # lockstep: neither side closes its agent before the other is done
                _recv(peer, timeout_s)
                engine.close()
                results[key] = out
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
        results["error"] = f"{type(e).__name__}: {e}"
    parent.send(results)


def failing_source(
    peer: Connection, parent: Connection, kind: str, mode: str, num_tokens: int, timeout_s: float
) -> None:
    """Source that dies half-way (the parent kills it after 'ready'): ``read`` offers the request and
    waits to be killed; ``write`` WRITEs half the descriptors without a notification, then waits."""
    layout = mini_layout(mini_minimax(), 200)
    m = HybridBlockManager(layout)
    pool = seeded_pool(layout, 1)
    engine = make_engine(kind, f"src-{mode}", regions_of_array(layout, pool))
    other = engine.connect(_exchange(peer, timeout_s))
    scattered_request(m, "r", num_tokens, "neighbour")
    if mode == "read":
        _, offer = offer_request(m, engine.pool, "r")
        peer.send(offer)
    else:
        plan = m.export_request("r")
        pairs, remote = push_pairs(m, engine, plan, _recv(peer, timeout_s))
        half = len(pairs) // 2
        cut = DescriptorPairs(*(Descriptors(*(a[:half] for a in side)) for side in pairs))
        engine.write(other, cut, remote, b"", timeout_s)
    parent.send("ready")
    time.sleep(3600)


def aborted_destination(
    peer: Connection, parent: Connection, kind: str, mode: str, num_tokens: int, timeout_s: float
) -> None:
    """Destination whose source dies: the READ or the wait for the WRITE's notification fails; reports
    whether the import was aborted with the books and every owned byte as before."""
    out: dict[str, Any] = {}
    try:
        layout = mini_layout(mini_minimax(), 200)
        m = HybridBlockManager(layout)
        m.allocate("resident", 3 * layout.block_size)
        pool = seeded_pool(layout, 2)
        before = pool.copy()
        engine = make_engine(kind, f"dst-{mode}", regions_of_array(layout, pool))
        other = engine.connect(_exchange(peer, timeout_s))
        books = (m.pool.free_extents(), m.use.tolist(), m.pool.ref_counts.tolist(), sorted(m.requests))
        owned = _owned_mask(m)
        t0 = time.monotonic()
        try:
            if mode == "read":
                offer = _recv(peer, timeout_s)
                _recv(parent, 60)  # 'go': the source is dead now
                t0 = time.monotonic()
                pull_request(m, engine, other, offer, timeout_s)
            else:
                plan, accept = reserve_request(m, engine.pool, "r", num_tokens)
                peer.send(accept)
                reserved = np.zeros(layout.num_blocks, dtype=bool)
                reserved[plan.blocks.ids()] = True
                _recv(parent, 60)  # 'go': half written, the source is dead now
                t0 = time.monotonic()
                finish_import(engine, other, plan, timeout_s)
            out["error"] = None
        except TransferError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - t0
        out["books_as_before"] = books == (
            m.pool.free_extents(),
            m.use.tolist(),
            m.pool.ref_counts.tolist(),
            sorted(m.requests),
        )
        out["owned_bytes_untouched"] = bool(np.array_equal(pool[:, :, owned], before[:, :, owned]))
        if mode == "write":
            out["reserved_bytes_written"] = int((pool[:, :, reserved] != before[:, :, reserved]).sum())
        out["integrity"] = _check(m)
        engine.close()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["crash"] = f"{type(e).__name__}: {e}"
    parent.send(out)

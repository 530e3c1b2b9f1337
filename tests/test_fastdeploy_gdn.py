"""FastDeploy's GDN call path (Qwen3-Next / Qwen3.5) with the states in hybridkv's pool.

The engine is :class:`tests.test_fastdeploy_rmv1.RMv1` (7808a119's control flow, patched) over the
facade; the worker keeps :class:`StateTables` and stands :class:`HybridGDNStatePool` where PR #7074
(FastDeploy branch commit ced07862) puts its ``GDNStatePool``. :func:`gdn_backend_forward` does, per
GDN layer, what that PR's ``layers/attention/gdn_backend.py`` does with the pool (read
``forward_meta.gdn_state_pool.get_layer_conv_pool / get_layer_ssm_pool(layer.gdn_layer_idx)``,
offset ``forward_meta.gdn_slot_ids`` by +1, read and update the rows of its batch in place); the
recurrence itself is a stand-in whose state after ``n`` tokens is a known function of them, so every
forward checks that each request starts from the state after exactly the tokens before it, through
prefix hits (checkpoint -> live copies), checkpoints (live -> checkpoint), chunks and preemption.
Runs on torch CPU tensors in the torch lane and on Paddle CPU tensors in the no-torch lane (the
worker side imports no torch); the same objects take Paddle GPU tensors on a worker.
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import numpy as np
import pytest

import hybridkv
from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.fastdeploy.facade import FastDeployBlockManager
from hybridkv.integrations.fastdeploy.gdn import HybridGDNStatePool, attach_gdn
from hybridkv.integrations.fastdeploy.state import read_state_bytes
from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches, copy_blocks
from hybridkv.models.presets import gdn_layer, layers_from_pattern
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec
from hybridkv.planner.layout import plan
from tests.test_fastdeploy_rmv1 import RMv1
from tests.test_fastdeploy_world import Request, check_books, run_worker_step

_MOD = 65521
FW = "torch" if importlib.util.find_spec("torch") is not None else "paddle"
"""torch in the torch lane, Paddle in the no-torch lane."""


@pytest.fixture(autouse=True)
def one_thread():
    """The CPU index moves of MiB-sized states run 10x faster on one thread on this shared 2-core
    machine; restored afterwards (torch only: Paddle's CPU kernels here run on one thread)."""
    if FW != "torch":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _values(t) -> np.ndarray:
    """A state tensor's values as float32 numpy (bf16 included), either framework."""
    return (t.astype("float32") if FW == "paddle" else t.float()).numpy()


def fold(tokens) -> int:
    """The stand-in SSM state after ``tokens``: exact in float32 (below 2**24)."""
    v = 0
    for t in tokens:
        v = (v * 31 + t + 1) % _MOD
    return v


def expected(tokens, layer_idx: int) -> tuple[float, float]:
    """(ssm value, conv value) of GDN layer ``layer_idx`` after ``tokens`` (0, 0 for none: a fresh slot)."""
    if not tokens:
        return 0.0, 0.0
    return float((fold(tokens) + layer_idx) % _MOD), float(len(tokens) % 97 + 1)  # bf16-exact conv


def gdn_backend_forward(forward_meta, rows: dict[int, tuple[list[int], int, int]], num_layers: int, seen: dict):
    """PR #7074's pool use, layer by layer: ``rows`` maps a batch slot to (tokens, start, end) of what
    it computes now. Checks each row's initial state, then writes the state after ``end``."""
    slot_ids = HybridGDNStatePool.offset_slot_ids(forward_meta.gdn_slot_ids)
    for layer in range(num_layers):
        conv = forward_meta.gdn_state_pool.get_layer_conv_pool(layer)  # [max_num_seqs + 1, conv_dim, k - 1]
        ssm = forward_meta.gdn_state_pool.get_layer_ssm_pool(layer)  # [max_num_seqs + 1, H, K, V]
        assert not _values(ssm[0]).any() and not _values(conv[0]).any(), "slot 0 is the zero sentinel"
        for idx, (tokens, start, end) in rows.items():
            sid = int(slot_ids[idx])
            assert sid == idx + 1
            want_ssm, want_conv = expected(tokens[:start], layer)
            got_ssm, got_conv = ssm[sid], conv[sid]
            assert (_values(got_ssm) == want_ssm).all() and (_values(got_conv) == want_conv).all(), (idx, layer, start)
            seen["checked"] += 1
            seen["initial"] += start > 0
            new_ssm, new_conv = expected(tokens[:end], layer)
            ssm[sid] = new_ssm  # the kernels update the pool rows in place
            conv[sid] = new_conv


def run_gdn(layout, requests, *, max_num_seqs, budget, v1_mode, steps=400, arrivals=1, seed=0, cfg=None):
    cfg = cfg or PrefixCacheConfig()
    fd = FastDeployBlockManager(HybridBlockManager(layout, prefix_cache=cfg))
    rm = RMv1(fd, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, v1_mode=v1_mode, prefix=True)
    rm.reset_cache_config(SimpleNamespace(total_block_num=layout.num_blocks))
    caches = allocate_caches(layout, framework=FW)
    tables = StateTables(layout, max_num_seqs, framework=FW)
    gdn = HybridGDNStatePool(caches, tables)
    n_gdn = len(gdn.gdn_layer_ids)
    rng = random.Random(seed)
    pending = list(requests)
    seen = {"checked": 0, "initial": 0, "hits": 0}
    for _ in range(steps):
        for _ in range(arrivals):
            if pending:
                rm.add_request(pending.pop(0))
        tasks, _ = rm.schedule()
        check_books(rm, fd)
        tables.apply(tasks)
        for t in tasks:
            if getattr(t, "state_copies", None):
                copy_blocks(caches, t.state_copies)  # before the forward (a prefix hit fills the live sets)
        prefills = {t.request_id for t in tasks if isinstance(t, Request)}
        rows, init = {}, np.zeros(max_num_seqs, dtype=bool)
        for req in rm.running:
            tokens = req.prompt_token_ids + req.output_token_ids
            if req.request_id in prefills:
                start, end = req.prefill_start_index, req.prefill_end_index
                seen["hits"] += start > 0 and start == req.num_cached_tokens
            elif req.num_computed_tokens >= req.need_prefill_tokens and rm.allocated_slots(req) >= len(tokens):
                start, end = len(tokens) - 1, len(tokens)
            else:
                init[req.idx] = True  # live, not computing now: its state must come back unchanged
                continue
            rows[req.idx] = (tokens, start, end)
            init[req.idx] = start > 0  # seq_lens_decoder > 0
        forward_meta = attach_gdn(SimpleNamespace(), gdn, init)
        gdn_backend_forward(forward_meta, rows, n_gdn, seen)
        gdn.end_forward()
        for t in tasks:
            if getattr(t, "checkpoint_copies", None):
                copy_blocks(caches, t.checkpoint_copies)  # right after the forward
        # the paged pool itself holds each row's new state (the staging was written back)
        for idx, (tokens, _, end) in rows.items():
            rid = tables.request_ids[idx]
            layer_id = gdn.gdn_layer_ids[-1]
            st = caches.layer_slots[layer_id]
            raw = read_state_bytes(
                st, layout, fd.state_block_table(rid)[st.group], layout.model.layers[layer_id].state_bytes
            )
            assert np.all(raw[:4].view(np.float32) == expected(tokens[:end], n_gdn - 1)[0])
        done = run_worker_step(rm, tasks, rng)
        for rid in done:
            tables.release(rm.requests[rid].idx)
        rm.finish_requests(done)
        if not pending and not rm.running and not rm.waiting:
            break
    m = fd.manager
    assert not m.requests and m.num_available_blocks == m.pool.num_usable
    return rm, seen


def _shared(rng, n, prefix_len, tail, out):
    system = [rng.randrange(50_000) for _ in range(prefix_len)]
    return [
        Request(f"r{i}", system + [rng.randrange(50_000) for _ in range(rng.randrange(*tail))], rng.randrange(*out))
        for i in range(n)
    ]


SHARED = 1024  # a system prompt of 16 blocks


@pytest.mark.parametrize("v1_mode", [False, True], ids=["legacy", "v1"])
def test_qwen35_states_live_in_the_pool_through_fastdeploys_gdn_call_path(v1_mode):
    """Qwen3.5-35B-A3B at TP2 (30 GDN layers: ssm [16, 128, 128] float32, conv [4096, 3] bf16, 51 state
    blocks of 64 tokens a request): shared system prompt, prefix hits, checkpoints, decode."""
    spec = hybridkv.preset("qwen3.5-35b-a3b", tp_size=2)
    probe = plan(spec, 1 << 30, block_size=64)
    layout = plan(spec, (3 * 51 + 60) * probe.bytes_per_block, block_size=64)
    rng = random.Random(0)
    reqs = _shared(rng, 3, SHARED, (20, 120), (2, 4))
    rm, seen = run_gdn(layout, reqs, max_num_seqs=3, budget=2048, v1_mode=v1_mode)
    assert seen["hits"] > 0 and seen["initial"] > 0 and rm.hit_tokens >= SHARED, (seen, rm.hit_tokens)


def mini_gdn(num_blocks: int):
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    rec = gdn_layer(1, 2, 4, 4, 4, DType.FLOAT32, DType.BFLOAT16)  # ssm [2, 4, 4] f32, conv [16, 3] bf16
    spec = ModelSpec("mini-gdn", layers_from_pattern("RRRARRRA", attn, rec))
    probe = plan(spec, 1 << 20, block_size=4)
    return plan(spec, num_blocks * probe.bytes_per_block, block_size=4)


@pytest.mark.parametrize("v1_mode", [False, True], ids=["legacy", "v1"])
def test_gdn_states_survive_preemption_prefix_hits_and_chunks(v1_mode):
    layout = mini_gdn(40)
    rng = random.Random(3)
    reqs = _shared(rng, 16, 12, (3, 20), (2, 14))
    cfg = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1)  # a 12-token prefix: checkpoint every block
    rm, seen = run_gdn(layout, reqs, max_num_seqs=4, budget=10, v1_mode=v1_mode, arrivals=2, cfg=cfg)
    assert sum(rm.preemptions.values()) > 0 and seen["hits"] > 0 and seen["checked"] > 200, (rm.preemptions, seen)


def test_the_gdn_pool_refuses_what_it_cannot_serve():
    layout = mini_gdn(40)
    caches = allocate_caches(layout, framework=FW)
    tables = StateTables(layout, 3, framework=FW)
    gdn = HybridGDNStatePool(caches, tables)
    assert len(gdn.gdn_layer_ids) == 6 and list(gdn.ssm_staging.shape) == [4, 2, 4, 4]
    with pytest.raises(IndexError, match="gdn_layer_idx"):
        gdn.get_layer_ssm_pool(6)
    with pytest.raises(ValueError, match="max_num_seqs"):
        gdn.begin_forward([False] * 2)
    gdn.begin_forward([False] * 3)
    gdn.get_layer_conv_pool(0)
    with pytest.raises(RuntimeError, match="end_forward"):
        gdn.begin_forward([False] * 3)
    gdn.end_forward()
    attn_only = ModelSpec("attn", (AttentionLayerSpec(1, 8, DType.BFLOAT16),))
    lay = plan(attn_only, 1 << 16, block_size=4)
    with pytest.raises(ValueError, match="no GDN"):
        HybridGDNStatePool(allocate_caches(lay, framework=FW), StateTables(lay, 2, framework=FW))

"""Tiny MiniMax-M1-style and Qwen3-Next-style models in Paddle, in FastDeploy's flat layout, served
over the facade.

Each model (embedding, two recurrent layers: lightning through :func:`lightning_attention`, or Gated
DeltaNet through :func:`gdn_conv` / :func:`gated_delta_rule`; one softmax attention layer over the
paged K/V of ``caches``; an output head) runs the batches that the project's
transcription of ``ResourceManagerV1`` (:class:`tests.test_fastdeploy_rmv1.RMv1`, patched) schedules:
requests joining every step, chunked prefill, preemption by recompute, prefix hits that restore a
checkpoint into the live sets (``state_copies``) and checkpoints taken after a chunk
(``checkpoint_copies``). Every logit computed in the batch must equal the same request computed alone
(a float64 numpy model with no paging, from position 0). Broken variants (a row reading another row's
state set; a prefix hit whose checkpoint copy is skipped, so the live set is stale; a checkpoint that
is never written, so the state stays in the live set only) must fail by a wide margin.
"""

from __future__ import annotations

import importlib.util
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.fastdeploy.facade import FastDeployBlockManager
from hybridkv.integrations.fastdeploy.layers import gated_delta_rule, gdn_conv, lightning_attention
from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches, attach_worker, copy_blocks
from hybridkv.models.presets import gdn_layer, layers_from_pattern, lightning_layer
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec
from hybridkv.planner.layout import plan
from tests.test_fastdeploy_rmv1 import RMv1
from tests.test_fastdeploy_world import Request, check_books, run_worker_step

# the kernels in the torch lane under Triton's interpreter (tests/test_fastdeploy_kernels.py compares the
# two paths directly), the reference elsewhere
BACKEND = "triton" if importlib.util.find_spec("torch") and os.environ.get("TRITON_INTERPRET") == "1" else "naive"

paddle = pytest.importorskip("paddle")

H, D, HIDDEN, VOCAB, BS = 2, 4, 8, 1000, 4
PATTERNS = {"minimax": "RAR", "qwen3-next": "GAG"}  # R lightning, G Gated DeltaNet, A softmax attention
POOL_BLOCKS = {"minimax": 28, "qwen3-next": 40}  # tight enough to preempt, roomy enough for prefix hits
HK, HV, KERNEL = 1, 2, 4  # GDN: one q / k head of dim D, two value heads of dim D, a 4-tap conv
DIM = 2 * HK * D + HV * D
TOLERANCE = 1e-4  # float32 batch against the float64 model alone: measured 5.5e-6 (MiniMax), 3.1e-7 (GDN)


def _weights(pattern: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"emb": rng.standard_normal((VOCAB, HIDDEN)) * 0.5, "head": rng.standard_normal((HIDDEN, 16)) * 0.5}
    for i, kind in enumerate(pattern):
        if kind == "G":
            w[f"{i}in"] = rng.standard_normal((HIDDEN, DIM)) * 0.3
            w[f"{i}o"] = rng.standard_normal((HV * D, HIDDEN)) * 0.3
            w[f"{i}conv"], w[f"{i}g"] = rng.standard_normal((DIM, KERNEL)), rng.standard_normal((HIDDEN, HV))
            w[f"{i}b"] = rng.standard_normal((HIDDEN, HV))
            continue
        width = H * D if kind == "R" else D * 2  # attention: one KV head of dim 8
        for name in ("q", "k", "v"):
            w[f"{i}{name}"] = rng.standard_normal((HIDDEN, width)) * 0.3
        w[f"{i}o"] = rng.standard_normal((width, HIDDEN)) * 0.3
    return w


def _gdn_alone(h: np.ndarray, w: dict, i: int) -> np.ndarray:
    """One GDN mixer over a whole sequence from zero (conv, SiLU, L2-normalised q / k, the delta rule)."""
    n, x = len(h), h @ w[f"{i}in"]
    seq = np.concatenate([np.zeros((KERNEL - 1, DIM)), x])
    x = np.stack([(seq[t : t + KERNEL] * w[f"{i}conv"].T).sum(0) for t in range(n)])
    x = x / (1 + np.exp(-x))
    q, k = (x[:, a * D : (a + 1) * D].reshape(n, HK, D) for a in (0, 1))
    v = x[:, 2 * D :].reshape(n, HV, D)
    q, k = (np.repeat(a / np.linalg.norm(a, axis=-1, keepdims=True), HV // HK, axis=1) for a in (q, k))
    g, beta = -np.log1p(np.exp(h @ w[f"{i}g"])), 1 / (1 + np.exp(-(h @ w[f"{i}b"])))
    s, o = np.zeros((HV, D, D)), np.zeros((n, HV, D))
    for t in range(n):
        s = s * np.exp(g[t])[:, None, None]
        s = s + k[t][:, :, None] * ((v[t] - np.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None])[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t] * D**-0.5, s)
    return o.reshape(n, HV * D)


def _slopes(i: int) -> np.ndarray:
    return np.array([0.5, 0.1]) * (i + 1)


def alone(tokens: list[int], w: dict, pattern: str) -> np.ndarray:
    """The model over one whole sequence, float64, no paging: logits ``[len(tokens), 16]``."""
    h = w["emb"][tokens]
    n = len(tokens)
    for i, kind in enumerate(pattern):
        if kind == "G":
            h = h + _gdn_alone(h, w, i) @ w[f"{i}o"]
            continue
        q, k, v = (h @ w[f"{i}{x}"] for x in "qkv")
        if kind == "R":
            q, k, v = (x.reshape(n, H, D) for x in (q, k, v))
            s, o = np.zeros((H, D, D)), np.zeros((n, H, D))
            for t in range(n):
                s = np.exp(-_slopes(i))[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
                o[t] = np.einsum("hk,hkv->hv", q[t], s)
            o = o.reshape(n, H * D)
        else:
            scores = q @ k.T / np.sqrt(q.shape[1]) + np.triu(np.full((n, n), -np.inf), 1)
            p = np.exp(scores - scores.max(1, keepdims=True))
            o = (p / p.sum(1, keepdims=True)) @ v
        h = h + o @ w[f"{i}o"]
    return h @ w["head"]


class PaddleModel:
    """The same model over FastDeploy's flat batch, in Paddle, its state and K/V in ``caches``."""

    def __init__(self, w: dict, caches, tables: StateTables, pattern: str) -> None:
        self.w = {k: paddle.to_tensor(v.astype(np.float32)) for k, v in w.items()}
        self.caches, self.tables, self.pattern = caches, tables, pattern

    def forward(self, rows: dict[int, tuple[list[int], int, int, list[int]]], meta_hook=None) -> np.ndarray:
        """``rows``: batch slot -> (tokens, start, end, block_tables). Returns float32 logits [T, 16]."""
        slots = sorted(rows)
        tokens = [t for s in slots for t in rows[s][0][rows[s][1] : rows[s][2]]]
        sizes = [rows[s][2] - rows[s][1] if s in rows else 0 for s in range(self.tables.max_num_seqs)]
        fm = attach_worker(SimpleNamespace(), self.caches, self.tables)
        fm.cu_seqlens_q = np.concatenate([[0], np.cumsum(sizes)])
        fm.seq_lens_decoder = np.array([rows[s][1] if s in rows else 0 for s in range(self.tables.max_num_seqs)])
        if meta_hook is not None:
            meta_hook(fm)
        h = paddle.index_select(self.w["emb"], paddle.to_tensor(np.array(tokens, dtype=np.int64)))
        n = len(tokens)
        for i, kind in enumerate(self.pattern):
            if kind == "G":
                h = h + paddle.matmul(self._gdn(i, h, fm), self.w[f"{i}o"])
                continue
            q, k, v = (paddle.matmul(h, self.w[f"{i}{x}"]) for x in "qkv")
            if kind == "R":
                o = lightning_attention(*(x.reshape([n, H, D]) for x in (q, k, v)), _slopes(i), fm, i, backend=BACKEND)
                o = o.reshape([n, H * D])
            else:
                o = self._attention(i, q, k, v, rows, slots)
            h = h + paddle.matmul(o, self.w[f"{i}o"])
        return paddle.matmul(h, self.w["head"]).numpy()

    def _gdn(self, i: int, h, fm):
        """A Qwen3-Next-style GDN mixer: projections and gates in Paddle, the conv window and the delta
        rule through hybridkv (both read and write the row's state set in place)."""
        n = int(h.shape[0])
        mixed = paddle.matmul(h, self.w[f"{i}in"])
        x = paddle.nn.functional.silu(gdn_conv(mixed, self.w[f"{i}conv"], fm, i, backend=BACKEND))
        q, k = (x[:, a * D : (a + 1) * D].reshape([n, HK, D]) for a in (0, 1))
        v = x[:, 2 * D :].reshape([n, HV, D])
        g = -paddle.nn.functional.softplus(paddle.matmul(h, self.w[f"{i}g"]))
        beta = paddle.nn.functional.sigmoid(paddle.matmul(h, self.w[f"{i}b"]))
        return gated_delta_rule(q, k, v, g, beta, fm, i, backend=BACKEND).reshape([n, HV * D])

    def _attention(self, i: int, q, k, v, rows, slots):
        """Write the chunk's K/V into its blocks of ``caches`` (``[num_blocks, 1, block_size, 8]``),
        then attend over every position up to each token through the block table."""
        kc, vc = self.caches.caches[2 * i], self.caches.caches[2 * i + 1]
        at, outs = 0, []
        for s in slots:
            _, start, end, blocks = rows[s]
            n = end - start
            for j, pos in enumerate(range(start, end)):
                b, off = blocks[pos // BS], pos % BS
                kc[b, 0, off] = k[at + j]
                vc[b, 0, off] = v[at + j]
            ids = paddle.to_tensor(np.array([blocks[p // BS] for p in range(end)], dtype=np.int64))
            offs = paddle.to_tensor(np.array([p % BS for p in range(end)], dtype=np.int64))
            keys, values = kc[ids, 0, offs], vc[ids, 0, offs]  # [end, 8] through the block table
            scores = paddle.matmul(q[at : at + n], keys, transpose_y=True) / np.sqrt(8.0)
            mask = np.triu(np.full((n, end), -np.inf, dtype=np.float32), start + 1)
            outs.append(paddle.matmul(paddle.nn.functional.softmax(scores + paddle.to_tensor(mask), axis=1), values))
            at += n
        return paddle.concat(outs)


def serve(variant: str = "", model: str = "minimax", seed: int = 0) -> tuple[float, dict]:
    """Serve a stream of requests with shared prefixes; returns the worst |logit - alone| and counts."""
    pattern = PATTERNS[model]
    gdn = gdn_layer(HK, HV, D, D, KERNEL, "float32", "float32")
    rec = lightning_layer(H, D, "float32") if model == "minimax" else gdn
    spec = ModelSpec(f"paddle-{model}-mini", layers_from_pattern(pattern.replace("G", "R"),
                                                                 AttentionLayerSpec(1, 8, "float32"), rec))  # fmt: skip
    probe = plan(spec, 1 << 20, block_size=BS)
    layout = plan(spec, POOL_BLOCKS[model] * probe.bytes_per_block, block_size=BS)
    cfg = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1)
    fd = FastDeployBlockManager(HybridBlockManager(layout, prefix_cache=cfg))
    rm = RMv1(fd, max_num_seqs=4, max_num_batched_tokens=10, prefix=True)
    rm.reset_cache_config(SimpleNamespace(total_block_num=layout.num_blocks))
    caches = allocate_caches(layout, framework="paddle")
    tables = StateTables(layout, 4, framework="paddle")
    w = _weights(pattern)
    net = PaddleModel(w, caches, tables, pattern)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(8)] for _ in range(2)]
    pending = [Request(f"r{i}", prefixes[i % 2] + [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))],
                       rng.randrange(6, 16)) for i in range(10)]  # fmt: skip
    worst, seen = 0.0, {"rows": 0, "hits": 0, "chunks": 0}
    for _ in range(300):
        if pending:
            rm.add_request(pending.pop(0))
        tasks, errors = rm.schedule()
        assert not errors
        check_books(rm, fd)
        tables.apply(tasks)
        for t in tasks:
            if getattr(t, "state_copies", None) and variant != "stale-hit":
                copy_blocks(caches, t.state_copies)
        prefills = {t.request_id for t in tasks if isinstance(t, Request)}
        rows = {}
        for req in rm.running:
            tokens = req.prompt_token_ids + req.output_token_ids
            if req.request_id in prefills:
                start, end = req.prefill_start_index, req.prefill_end_index
                seen["hits"] += start > 0 and start == req.num_cached_tokens
                seen["chunks"] += start > 0
            elif req.num_computed_tokens >= req.need_prefill_tokens and rm.allocated_slots(req) >= len(tokens):
                start, end = len(tokens) - 1, len(tokens)
            else:
                continue
            rows[req.idx] = (tokens, start, end, list(req.block_tables))
        if rows:
            hook = _swap_rows if variant == "swap" else None
            logits = net.forward(rows, hook)
            at = 0
            for s in sorted(rows):
                tokens, start, end, _ = rows[s]
                want = alone(tokens[:end], w, pattern)[start:end]
                worst = max(worst, float(np.abs(logits[at : at + end - start] - want).max()))
                at += end - start
                seen["rows"] += 1
        for t in tasks:
            if getattr(t, "checkpoint_copies", None) and variant != "no-checkpoint":
                copy_blocks(caches, t.checkpoint_copies)
        done = run_worker_step(rm, tasks, rng)
        for rid in done:
            tables.release(rm.requests[rid].idx)
        rm.finish_requests(done)
        if not pending and not rm.running and not rm.waiting:
            break
    assert not fd.manager.requests
    return worst, dict(seen, preemptions=sum(rm.preemptions.values()), hit_tokens=rm.hit_tokens)


def _swap_rows(fm) -> None:
    t = fm.state_block_tables.numpy()
    live = [s for s in range(t.shape[1]) if (t[0, s] >= 0).all()]
    if len(live) >= 2:
        t[:, live[:2]] = t[:, live[1::-1]]
    fm.state_block_tables = t


@pytest.mark.parametrize("model", list(PATTERNS))
def test_every_logit_equals_the_request_alone_through_chunks_hits_and_preemption(model):
    worst, seen = serve(model=model)
    assert seen["hits"] > 0 and seen["chunks"] > 0 and seen["preemptions"] > 0 and seen["rows"] > 40, seen
    assert worst < TOLERANCE, (worst, seen)


@pytest.mark.parametrize("model", list(PATTERNS))
@pytest.mark.parametrize("variant", ["swap", "stale-hit", "no-checkpoint"])
def test_broken_variants_fail_by_a_wide_margin(variant, model):
    worst, seen = serve(variant, model)
    assert worst > 1e3 * TOLERANCE, (variant, worst, seen)

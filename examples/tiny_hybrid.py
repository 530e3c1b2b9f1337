"""A tiny hybrid model that computes through hybridkv's paged pool, and an engine loop that serves it.

MiniMax-M1's pattern in miniature: lightning-attention layers and one softmax-attention layer
(``pattern``), seeded random weights, small dims. Per layer: ``x += mixer(rmsnorm(x))``, then
``x += mlp(rmsnorm(x))``.

- Lightning layers (docs/models.md): SiLU on one fused projection laid out per head as ``[q_h | k_h | v_h]``,
  the recurrence with MiniMax's per-layer slopes, RMSNorm over ``H x D`` (fp32 or wider, eps 1e-6), a
  sigmoid output gate, the output projection. The state lives in the pool: decode rows run
  :func:`hybridkv.ops.lightning.lightning_decode` in place through the state table (the verify step of
  speculative decoding writes the state after draft ``j`` into speculative set ``j - 1``), prefill
  chunks :func:`~hybridkv.ops.lightning.lightning_prefill` (with ``has_initial_state``).
- The attention layer (GQA, RoPE) writes K/V at ``slot_mapping`` into the paged KV views and reads
  them back through ``block_tables``.

:meth:`TinyHybrid.reference_logits` is the sequential reference: one request alone, a fresh state,
no paging, the token recurrence. :class:`Engine` drives a :class:`~hybridkv.scheduler_adapter.Scheduler`:
it runs each plan's copies and swaps in the documented order, the forward, sampling and draft
verification, and records every logit it computes, so tests can compare them with the reference.

fp64 without a float64 pool dtype: a component or KV head declared ``float32`` with twice the
elements holds the float64 values' bytes (the pool moves bytes; only the model reads them as fp64).

    python examples/tiny_hybrid.py     # one request, batched vs sequential logits
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.ops import allocate_host_pools, allocate_pools, copy_blocks, kv_cache_views, swap_blocks
from hybridkv.ops._framework import resolve_backend
from hybridkv.ops.lightning import lightning_decode, lightning_prefill, lightning_recurrent_naive, lightning_slopes
from hybridkv.planner.layout import NULL_BLOCK, Layout, plan
from hybridkv.scheduler_adapter import RequestState, SchedRequest, Scheduler, StepMetadata, StepOutputs, StepPlan
from hybridkv.scheduler_adapter import build_step_metadata as _build_step_metadata


@dataclass(frozen=True)
class TinyConfig:
    """``pattern``: one letter per decoder layer, ``L`` lightning, ``A`` softmax attention."""

    pattern: str = "LLAL"
    vocab_size: int = 32
    hidden: int = 16
    lightning_heads: int = 2
    lightning_head_dim: int = 4
    attn_q_heads: int = 2
    attn_kv_heads: int = 1
    attn_head_dim: int = 4
    mlp_hidden: int = 32
    dtype: torch.dtype = torch.float64
    slope_rule: str = "minimax"
    prefill_block: int = 4  # block length of the block-wise lightning prefill
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.pattern)


def _widen(dim: int, dtype: torch.dtype) -> int:
    """Last-axis length of the float32 pool tensor that holds ``dim`` elements of ``dtype``."""
    return dim * torch.empty(0, dtype=dtype).element_size() // 4


def model_spec(cfg: TinyConfig) -> ModelSpec:
    """The cache spec of the tiny model (float32 pool dtype; fp64 values in twice the elements)."""
    if cfg.dtype not in (torch.float32, torch.float64):
        raise ValueError("the tiny model runs in float32 or float64")
    h, d = cfg.lightning_heads, cfg.lightning_head_dim
    lightning = RecurrentLayerSpec("lightning", (StateComponent("kv", (h, d, _widen(d, cfg.dtype)), "float32"),))
    attn = AttentionLayerSpec(cfg.attn_kv_heads, _widen(cfg.attn_head_dim, cfg.dtype), "float32", cfg.attn_q_heads)
    layers = tuple(attn if c == "A" else lightning for c in cfg.pattern)
    d, ad = cfg.hidden, cfg.attn_head_dim
    per_layer = {"L": d * h * d * 4 + h * d * d, "A": d * ad * (2 * cfg.attn_q_heads + 2 * cfg.attn_kv_heads)}
    params = sum(per_layer[c] + 2 * d * cfg.mlp_hidden for c in cfg.pattern) + d * cfg.vocab_size
    return ModelSpec(f"tiny-hybrid-{cfg.pattern}", layers, hidden_size=cfg.hidden, params_active=float(params))


def tiny_layout(cfg: TinyConfig, num_blocks: int, block_size: int = 4) -> Layout:
    """A paged layout of ``num_blocks`` blocks (null block included) for the tiny model."""
    spec = model_spec(cfg)
    probe = plan(spec, 1 << 40, block_size=block_size)
    return plan(spec, probe.bytes_per_block * num_blocks, block_size=block_size)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last axis in fp32 or wider."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(cd)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * w.to(cd)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, d]`` (d even) at ``positions`` ``[T]``."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return out


class TinyHybrid:
    """Seeded random weights and two forwards: :meth:`forward_step` (paged, batched) and :meth:`reference_logits`."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        dt, d = cfg.dtype, cfg.hidden

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = 1.0 / math.sqrt(shape[0]) if scale is None else scale
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dt)

        h, hd = cfg.lightning_heads, cfg.lightning_head_dim
        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in cfg.pattern:
            p = {"norm1": 1 + 0.1 * w(d, scale=1.0), "norm2": 1 + 0.1 * w(d, scale=1.0)}
            if kind == "L":
                p |= {"qkv": w(d, h * 3 * hd), "gate": w(d, h * hd), "onorm": 1 + 0.1 * w(h * hd, scale=1.0)}
                p |= {"out": w(h * hd, d)}
            elif kind == "A":
                qh, kvh, ad = cfg.attn_q_heads, cfg.attn_kv_heads, cfg.attn_head_dim
                p |= {"wq": w(d, qh * ad), "wk": w(d, kvh * ad), "wv": w(d, kvh * ad), "wo": w(qh * ad, d)}
            else:
                raise ValueError(f"pattern letters are L and A, got {kind!r}")
            p |= {"w1": w(d, cfg.mlp_hidden), "w2": w(cfg.mlp_hidden, d)}
            self.layers.append(p)
        self.final_norm = 1 + 0.1 * w(d, scale=1.0)
        self.unembed = w(d, cfg.vocab_size, scale=2.0 / math.sqrt(d))
        self.slopes = [lightning_slopes(h, i, cfg.num_layers, cfg.slope_rule) for i in range(cfg.num_layers)]

    # ---- pieces shared by both forwards -------------------------------------------------------------
    def _lightning_in(self, p: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, hd = self.cfg.lightning_heads, self.cfg.lightning_head_dim
        qkv = torch.nn.functional.silu(x @ p["qkv"]).view(-1, h, 3, hd)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def _lightning_out(self, p: dict, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        o = _rms(o.reshape(o.shape[0], -1), p["onorm"])
        return (torch.sigmoid(x @ p["gate"]) * o) @ p["out"]

    def _attn_qkv(self, p: dict, x: torch.Tensor, positions: torch.Tensor):
        c = self.cfg
        q = _rope((x @ p["wq"]).view(-1, c.attn_q_heads, c.attn_head_dim), positions)
        k = _rope((x @ p["wk"]).view(-1, c.attn_kv_heads, c.attn_head_dim), positions)
        return q, k, (x @ p["wv"]).view(-1, c.attn_kv_heads, c.attn_head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """``q`` ``[n, qh, d]`` at positions ``q_pos`` over keys ``[L, kvh, d]`` at positions 0..L-1 (causal)."""
        rep = self.cfg.attn_q_heads // self.cfg.attn_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        future = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(future[None], float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)

    def _mlp(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(_rms(x, p["norm2"]) @ p["w1"]) @ p["w2"]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.final_norm) @ self.unembed

    # ---- the sequential reference ------------------------------------------------------------------
    def reference_logits(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one request alone: a fresh state, no paging, the token recurrence."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.arange(ids.numel())
        x = self.embed[ids]
        for i, (kind, p) in enumerate(zip(self.cfg.pattern, self.layers, strict=True)):
            hn = _rms(x, p["norm1"])
            if kind == "L":
                q, k, v = self._lightning_in(p, hn)
                o, _ = lightning_recurrent_naive(q, k, v, self.slopes[i])
                x = x + self._lightning_out(p, hn, o)
            else:
                q, k, v = self._attn_qkv(p, hn, pos)
                x = x + self._attend(q, k, v, pos) @ p["wo"]
            x = x + self._mlp(p, x)
        return self._logits(x)

    # ---- the paged, batched forward ----------------------------------------------------------------
    def forward_step(
        self,
        pools,
        meta: StepMetadata,
        tokens: torch.Tensor,
        backend: str = "auto",
        state_tables: np.ndarray | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one step's query tokens (``tokens`` ``[T]``, the plan's rows in order:
        each row's scheduled tokens, then its drafts).

        Reads and writes KV through ``meta.block_tables`` / ``meta.slot_mapping`` and lightning state
        through ``meta.state_tables`` (override: ``state_tables``) and ``meta.speculative_state_tables``.
        A row is a decode (state in place, per token) when it runs one token on an initial state, plus
        drafts; otherwise a prefill chunk. ``validate``: the ops' id checks (None: their default).
        """
        cfg, layout = self.cfg, meta.layout
        live_tables = meta.state_tables if state_tables is None else state_tables
        r = meta.num_rows
        cu = meta.cu_seqlens_q.astype(np.int64)
        drafts = meta.num_drafts[:r].astype(np.int64)
        n_sched = meta.seq_lens_this_time[:r].astype(np.int64) - drafts
        decode = (n_sched == 1) & meta.has_initial_state[:r]
        if (drafts[~decode] > 0).any():
            raise ValueError("a row with drafts must be a one-token decode on an initial state")
        positions = torch.from_numpy(meta.positions)
        x = self.embed[tokens]
        kv_views = self._kv_views(pools)
        where = self._state_slots(layout)
        bs = layout.block_size
        pre_rows = np.flatnonzero(~decode)
        dec_rows = np.flatnonzero(decode)
        for i, (kind, p) in enumerate(zip(cfg.pattern, self.layers, strict=True)):
            hn = _rms(x, p["norm1"])
            if kind == "L":
                g, s = where[i]
                q, k, v = self._lightning_in(p, hn)
                o = torch.zeros_like(v)
                if pre_rows.size:  # prefill chunks, packed
                    idx = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in pre_rows])
                    lens = cu[pre_rows + 1] - cu[pre_rows]
                    sub_cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]))
                    table = torch.from_numpy(np.ascontiguousarray(live_tables[g, pre_rows]))
                    init = torch.from_numpy(meta.has_initial_state[pre_rows])
                    ti = torch.from_numpy(idx)
                    o[ti] = lightning_prefill(
                        pools,
                        table,
                        g,
                        s,
                        q[ti],
                        k[ti],
                        v[ti],
                        sub_cu,
                        init,
                        self.slopes[i],
                        block_size=cfg.prefill_block,
                        state_dtype=cfg.dtype,
                        backend=backend,
                        validate=validate,
                    )
                for j in range(int(drafts[dec_rows].max(initial=-1)) + 1 if dec_rows.size else 0):
                    # token j of every decode row: j = 0 updates the live set in place; draft j reads the
                    # state after draft j - 1 and writes speculative set j - 1
                    rows = dec_rows[drafts[dec_rows] >= j]
                    src = live_tables[g, dec_rows] if j <= 1 else meta.speculative_state_tables[j - 2, g, dec_rows]
                    dst = live_tables[g, dec_rows] if j == 0 else meta.speculative_state_tables[j - 1, g, dec_rows]
                    dst = np.where((drafts[dec_rows] >= j)[:, None], dst, NULL_BLOCK)
                    ti = torch.from_numpy(cu[dec_rows] + np.minimum(j, drafts[dec_rows]))
                    o_j = lightning_decode(
                        pools,
                        torch.from_numpy(np.ascontiguousarray(src)),
                        g,
                        s,
                        q[ti],
                        k[ti],
                        v[ti],
                        self.slopes[i],
                        out_table=torch.from_numpy(np.ascontiguousarray(dst)),
                        state_dtype=cfg.dtype,
                        backend=backend,
                        validate=validate,
                    )
                    keep = torch.from_numpy(np.isin(dec_rows, rows))
                    o[ti[keep]] = o_j[keep]
                x = x + self._lightning_out(p, hn, o)
            else:
                k_cache, v_cache = kv_views[i]
                q, k, v = self._attn_qkv(p, hn, positions)
                slots = torch.from_numpy(meta.slot_mapping)
                k_cache[slots // bs, :, slots % bs] = k
                v_cache[slots // bs, :, slots % bs] = v
                att = torch.empty(q.shape[0], cfg.attn_q_heads * cfg.attn_head_dim, dtype=q.dtype)
                for b in range(r):
                    a, e = int(cu[b]), int(cu[b + 1])
                    n_keys = int(meta.seq_lens_decoder[b]) + e - a
                    kp = torch.arange(n_keys)
                    blocks = torch.from_numpy(meta.block_tables[b].astype(np.int64))[kp // bs]
                    att[a:e] = self._attend(
                        q[a:e], k_cache[blocks, :, kp % bs], v_cache[blocks, :, kp % bs], positions[a:e]
                    )
                x = x + att @ p["wo"]
            x = x + self._mlp(p, x)
        return self._logits(x)

    def _kv_views(self, pools) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Attention layer id -> (K, V) ``[num_blocks, kv_heads, block_size, head_dim]`` in the model dtype."""
        kv = pools.layout.kv_group
        views = kv_cache_views(pools)
        ids = [lid for lid in (kv.layer_ids if kv is not None else ()) if lid is not None]
        return {
            lid: (views[2 * n].view(self.cfg.dtype), views[2 * n + 1].view(self.cfg.dtype)) for n, lid in enumerate(ids)
        }

    @staticmethod
    def _state_slots(layout: Layout) -> dict[int, tuple[int, int]]:
        """Lightning layer id -> (state group, layer slot)."""
        out = {}
        for g in range(layout.num_state_groups):
            for s in range(layout.group_size):
                entry = layout.state_layer(g, s)
                if entry is not None:
                    out[entry[0]] = (g, s)
        return out


# ---- sampling and drafting ---------------------------------------------------------------------------


def _noise(request_id, position: int, vocab: int, scale: float) -> np.ndarray:
    """Deterministic Gumbel noise of one (request, position): sampling without a shared RNG stream."""
    seed = zlib.crc32(repr(request_id).encode())
    u = np.random.default_rng([seed, position]).random(vocab)
    return scale * -np.log(-np.log(np.clip(u, 1e-12, 1 - 1e-12)))


@dataclass
class Sampler:
    """Token at ``position + 1`` = argmax(logits at ``position`` + noise(request, position)). The drafter
    guesses argmax(noise) alone: right when the noise dominates, so some drafts are accepted and some
    rejected (a deliberately imperfect drafter)."""

    vocab: int
    noise_scale: float = 2.0

    def sample(self, request_id, position: int, logits: torch.Tensor) -> int:
        return int(np.argmax(logits.double().numpy() + _noise(request_id, position, self.vocab, self.noise_scale)))

    def draft(self, request_id, position: int) -> int:
        return int(np.argmax(_noise(request_id, position, self.vocab, self.noise_scale)))


# ---- the engine ----------------------------------------------------------------------------------------


@dataclass
class Events:
    """What happened, for the demonstration and for tests to check the run covered what it claims."""

    steps: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swapped_in: int = 0
    prefix_hit_tokens: int = 0
    checkpoint_copies: int = 0
    forks: int = 0
    drafts: int = 0
    accepted: int = 0
    rejected_steps: int = 0
    log: list[str] = field(default_factory=list)


class Engine:
    """Scheduler -> copies and swaps (ops) -> paged forward -> sampling and verification -> update.

    ``logits[rid]`` collects ``(position, logits)`` of every token the engine computed for a request
    whose inputs are the request's real tokens (rejected drafts excluded), for comparison with
    :meth:`TinyHybrid.reference_logits` of the request's final tokens. Subclasses may override
    :meth:`forward_state_tables` and :meth:`after_update` (tests plant deliberate bugs there).
    """

    def __init__(
        self,
        model: TinyHybrid,
        scheduler: Scheduler,
        num_host_blocks: int = 0,
        backend: str = "auto",
        sampler: Sampler | None = None,
        validate: bool | None = None,
    ) -> None:
        self.model, self.scheduler, self.manager = model, scheduler, scheduler.manager
        layout = self.manager.layout
        self.pools = allocate_pools(layout, "cpu", fill="nan")  # stray reads show up as NaN logits
        self.host = allocate_host_pools(layout, num_host_blocks, fill="nan") if num_host_blocks else None
        self.backend = resolve_backend(backend, self.pools.device).value  # once, not per op call
        self.validate = validate
        self.sampler = sampler or Sampler(model.cfg.vocab_size)
        self.logits: dict = defaultdict(list)
        self.tokens: dict = {}  # request id -> prompt + outputs, kept after the request finishes
        self.events = Events()
        self.usage = self.manager.usage()

    def add_request(self, request_id, prompt: list[int], max_new_tokens: int) -> None:
        self.scheduler.add_request(request_id, prompt, max_new_tokens)

    def fork(self, parent_id, child_id, max_new_tokens: int) -> bool:
        """Fork a running, decoding request into ``child_id`` between steps (KV shared, state copied).

        The scheduler has no fork call: the child's record is added to its running queue here. The
        state copy runs at once (between steps nothing else is pending on those blocks). Returns
        False when the parent is not decoding or the pool cannot hold the child's state.
        """
        sched, m = self.scheduler, self.manager
        parent = sched.requests.get(parent_id)
        if parent is None or parent.state is not RequestState.RUNNING or parent.is_prefilling:
            return False
        if m.num_state_blocks > m.num_available_blocks or parent.num_remaining_tokens < 2:
            return False
        copy_blocks(self.pools, m.fork(parent_id, child_id))
        child = SchedRequest(
            request_id=child_id,
            num_prompt_tokens=parent.num_prompt_tokens,
            max_new_tokens=len(parent.output_token_ids) + max_new_tokens,
            priority=parent.priority,
            arrival=10**9 + self.events.forks,  # after every submitted request
            prompt_token_ids=parent.prompt_token_ids,
            output_token_ids=list(parent.output_token_ids),
            num_computed_tokens=parent.num_computed_tokens,
            num_allocated_tokens=parent.num_allocated_tokens,
            token_ids_given=parent.token_ids_given,
            state=RequestState.RUNNING,
        )
        sched.requests[child_id] = child
        bisect.insort(sched.running, child, key=lambda r: r.sort_key)
        self.events.forks += 1
        self.events.log.append(
            f"step {sched.num_steps}: fork {parent_id} -> {child_id} at {parent.num_computed_tokens + 1} tokens"
        )
        return True

    # ---- hooks for deliberately broken variants -------------------------------------------------------
    def forward_state_tables(self, meta: StepMetadata) -> np.ndarray:
        """The live state tables the forward uses (the metadata's)."""
        return meta.state_tables

    def after_update(self, plan: StepPlan, meta: StepMetadata, accepted: dict) -> None:
        """Called after ``scheduler.update``."""

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> StepPlan:
        sched, ev = self.scheduler, self.events
        plan = sched.step()
        # the executor, in StepPlan's order: checkpoint copies, swap-outs, swap-ins, this step's copies
        copy_blocks(self.pools, plan.checkpoint_copies)
        for p in (*plan.swap_out, *plan.swap_in):
            swap_blocks(self.pools, self.host, p).synchronize()
        copy_blocks(self.pools, plan.copies)
        ev.checkpoint_copies += len(plan.checkpoint_copies)
        self.usage = self.manager.usage()  # blocks by category while the step runs
        for pre in plan.preempted:
            if pre.mode.value == "swap":
                ev.preempted_swap += 1
            else:
                ev.preempted_recompute += 1
            ev.log.append(f"step {plan.step}: preempt {pre.request_id} ({pre.mode.value})")
        ev.swapped_in += len(plan.swap_in)
        for rid in plan.resumed:
            ev.log.append(f"step {plan.step}: swap in {rid}")
        if plan.is_empty:
            sched.update(StepOutputs({}))
            ev.steps += 1
            return plan
        meta = _build_step_metadata(self.manager, plan)
        tokens, draft_ids = [], {}
        for row in plan.scheduled:
            rid = row.request_id
            req = sched.requests[rid]
            known = req.token_ids() or []
            self.tokens[rid] = known
            if row.num_computed_tokens == req.num_cached_tokens and req.num_cached_tokens and rid in plan.admitted:
                ev.prefix_hit_tokens += req.num_cached_tokens
                ev.log.append(f"step {plan.step}: {rid} prefix hit of {req.num_cached_tokens} tokens")
            run = known[row.num_computed_tokens : row.num_computed_tokens + row.num_scheduled_tokens]
            last = row.num_computed_tokens + row.num_scheduled_tokens - 1  # position of the last real token
            drafts = [self.sampler.draft(rid, last + j) for j in range(row.num_drafts)]
            draft_ids[rid] = drafts
            tokens.extend(run + drafts)
        logits = self.model.forward_step(
            self.pools,
            meta,
            torch.tensor(tokens, dtype=torch.long),
            self.backend,
            self.forward_state_tables(meta),
            self.validate,
        )
        sampled, accepted = {}, {}
        cu = meta.cu_seqlens_q
        for b, row in enumerate(plan.scheduled):
            rid, start = row.request_id, row.num_computed_tokens
            rows = logits[int(cu[b]) : int(cu[b + 1])]
            n = row.num_scheduled_tokens
            for t in range(n):  # real tokens: always comparable
                self.logits[rid].append((start + t, rows[t].clone()))
            if not row.samples:
                continue
            pos = start + n - 1
            out, a = [self.sampler.sample(rid, pos, rows[n - 1])], 0
            for j, d in enumerate(draft_ids[rid]):  # verify: draft j + 1 stands while it equals the sample
                if out[-1] != d:
                    break
                a += 1
                self.logits[rid].append((pos + j + 1, rows[n + j].clone()))
                out.append(self.sampler.sample(rid, pos + j + 1, rows[n + j]))
            sampled[rid] = out
            if row.num_drafts:
                accepted[rid] = a
                ev.drafts += row.num_drafts
                ev.accepted += a
                ev.rejected_steps += a < row.num_drafts
                ev.log.append(f"step {plan.step}: {rid} speculative commit, {a} of {row.num_drafts} drafts accepted")
        result = sched.update(StepOutputs(sampled, frozenset(), accepted))
        for rid in sampled:
            req = sched.requests.get(rid) or sched.finished.get(rid)
            if req is not None:
                self.tokens[rid] = req.token_ids() or []
        self.after_update(plan, meta, accepted)
        for rid in result.finished:
            ev.log.append(f"step {plan.step}: {rid} finished")
        ev.steps += 1
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.has_unfinished and self.events.steps < max_steps:
            self.step()

    def max_error(self) -> tuple[float, object, int]:
        """Largest |logit - sequential reference| over every recorded token: (error, request, position)."""
        worst = (0.0, None, -1)
        for rid, entries in self.logits.items():
            ref = self.model.reference_logits(self.tokens[rid][: 1 + max(p for p, _ in entries)])
            for pos, lg in entries:
                err = float((lg - ref[pos]).abs().max())
                if not err <= worst[0]:  # NaN counts as the worst
                    worst = (err if err == err else math.inf, rid, pos)
        return worst


def main() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they save
    try:
        _demo()
    finally:
        torch.set_num_threads(threads)


def _demo() -> None:
    cfg = TinyConfig()
    model = TinyHybrid(cfg)
    layout = tiny_layout(cfg, num_blocks=64)
    print(layout.describe())
    sched = Scheduler(HybridBlockManager(layout))
    engine = Engine(model, sched)
    engine.add_request("r0", [3, 1, 4, 1, 5, 9, 2, 6], 6)
    engine.run()
    err, _, _ = engine.max_error()
    print(f"tokens {engine.tokens['r0']}; {engine.events.steps} steps; max |logit - sequential reference| = {err:.2e}")


if __name__ == "__main__":
    main()

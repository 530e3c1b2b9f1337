"""hybridkv against vLLM 0.33.0 in one process: the block pool, the manager, the prefix-cache path.

Only ratios measured in the same process count on a shared machine (timings move 2x between
runs), so every row times the two systems interleaved: ``--repeats`` rounds, each timing a batch
of hybridkv operations and then the same batch on vLLM; per-operation best and median over the
rounds, and the ratio (hybridkv / vLLM, median and best) as the headline. A ratio below 1 means
hybridkv is faster.

Rows (the table of issue 14):

- ``pool_admit_free``: allocate + free 624 blocks beside 256 x 624 held (hybridkv: ``make_pool``, the
  manager's pool; vLLM: ``BlockPool``).
- ``pool_one_block``: 256 x allocate(1) then 256 x free(1), per block (the decode pattern).
- ``manager_admit_free``: admit + free one 32k-token MiniMax-M1 TP8 request beside 256 running, no
  prefix cache (hybridkv: 512 KV + 112 state blocks of 64 tokens; vLLM ``KVCacheManager``: one
  full-attention group + 7 mamba groups, 1,024-token blocks, 39 blocks).
- ``prefix_miss``: admissions of fresh tokens with prefix caching on, hashing included on both
  sides, in a steady state with evictions, per admitted token (hybridkv at its 64-token granularity:
  allocate with the token ids, the prefill's ``checkpoint`` (registers every block, checkpoints at
  the input's end), free; vLLM in align mode at 1,024: ``Request`` (its block hashes),
  ``get_computed_blocks``, ``allocate_slots``, free).
- ``prefix_hit``: the same with prompts that extend an earlier prompt of ``--prefix-tokens`` tokens
  (a conversation's next turn: hybridkv restores the checkpoint at that prompt's end, vLLM's
  align-mode hit reads its state there), per admitted token.
- ``scheduler_step``: one scheduler step and its update with 256 requests decoding (2,048-token
  prompts, one sampled token per request, no finishing or preemption), per step. hybridkv: the
  ``scheduler_adapter`` ``Scheduler`` of ``bench_scheduler.py`` (MiniMax-M1 TP8, fp32 state, 64-token
  blocks, no prefix cache), ``step()`` + ``update()``; also reported with ``build_step_metadata``
  in the step (``with_metadata``). vLLM: the v1 ``Scheduler`` over the ``manager_admit_free`` groups
  (one full-attention group of 1,024-token blocks + 7 mamba groups), its ``VllmConfig`` from a
  2-layer llama ``config.json`` written to a temporary directory, ``schedule()`` +
  ``update_from_output()``. The outputs of a step (the same on every step of the steady state) are
  built outside the timed batch on both sides.

Run with a Python that has vLLM (see ``shared/peer/README.md``)::

    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vs_vllm.py            # all rows, JSON saved
    python benchmarks/bench_vs_vllm.py --rows pool_one_block --repeats 5
    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vs_vllm.py --rows scheduler_step --save-as vs_vllm_scheduler

Without vLLM it prints why and exits 0 (it is not part of ``.ci/run``); if vLLM imports but its
``Scheduler`` cannot be built, the ``scheduler_step`` row says why and the other rows still run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save  # noqa: E402
from benchmarks.bench_scheduler import NUM_REQUESTS, PROMPT_TOKENS, warm_decode  # noqa: E402
from benchmarks.vllm_replay import vllm_config  # noqa: E402
from hybridkv.blockmgr.manager import HybridBlockManager  # noqa: E402
from hybridkv.blockmgr.pool import make_pool  # noqa: E402
from hybridkv.blockmgr.prefix import EvictionPolicy, PrefixCacheConfig  # noqa: E402
from hybridkv.models.presets import preset  # noqa: E402
from hybridkv.planner.layout import plan  # noqa: E402
from hybridkv.scheduler_adapter import StepOutputs, build_step_metadata  # noqa: E402

GiB = 1024**3
ROWS = ("pool_admit_free", "pool_one_block", "manager_admit_free", "prefix_miss", "prefix_hit", "scheduler_step")
VLLM_BLOCK = 1024  # vLLM's block in align mode (hybrid models pad attention blocks to the state page)
BLOCK = 64  # hybridkv's
MAX_MODEL_LEN = 64 * 1024


def interleave(ours: Callable[[], float], theirs: Callable[[], float], repeats: int) -> dict:
    """Each callable runs one batch and returns its seconds per unit; alternate them ``repeats`` times."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        b.append(theirs())
    med_a, med_b = statistics.median(a), statistics.median(b)
    return {
        "hybridkv_us": {"best": min(a) * 1e6, "median": med_a * 1e6},
        "vllm_us": {"best": min(b) * 1e6, "median": med_b * 1e6},
        "ratio_median": med_a / med_b,
        "ratio_best": min(a) / min(b),
    }


def timed(fn: Callable[[], None], units: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) / units

    return run


# ---- vLLM side -----------------------------------------------------------------------------------
class Vllm:
    """The vLLM objects the rows need (imported lazily: the module must import without vLLM)."""

    def __init__(self) -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.block_pool import BlockPool as VBlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.request import Request

        self.version = vllm.__version__
        self.torch, self.BlockPool, self.KVCacheManager, self.Request = torch, VBlockPool, KVCacheManager, Request
        self.FullAttentionSpec, self.MambaSpec = FullAttentionSpec, MambaSpec
        self.KVCacheConfig, self.KVCacheGroupSpec = KVCacheConfig, KVCacheGroupSpec
        self.params = SamplingParams(max_tokens=1)
        self.SamplingParams = SamplingParams
        self.hash_fn = get_hash_fn_by_name("sha256_cbor")  # vLLM's default prefix-caching hash
        init_none_hash(self.hash_fn)
        self.hasher = get_request_block_hasher(VLLM_BLOCK, self.hash_fn)

    def kv_cache_config(self, num_blocks: int, caching: bool) -> object:
        """One full-attention group + 7 mamba groups (MiniMax-M1's lightning layers at TP8, as groups)."""
        torch = self.torch
        attn = self.FullAttentionSpec(block_size=VLLM_BLOCK, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
        # without prefix caching a mamba group's block holds a whole sequence (one block per request)
        mamba = self.MambaSpec(
            block_size=VLLM_BLOCK if caching else MAX_MODEL_LEN,
            shapes=((8, 128, 128),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align" if caching else "none",
        )
        groups = [self.KVCacheGroupSpec(["attn"], attn)]
        groups += [self.KVCacheGroupSpec([f"lightning{i}"], mamba) for i in range(7)]
        return self.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

    def manager(self, num_blocks: int, caching: bool) -> object:
        """A ``KVCacheManager`` over :meth:`kv_cache_config`'s groups."""
        return self.KVCacheManager(
            self.kv_cache_config(num_blocks, caching),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=VLLM_BLOCK if caching else MAX_MODEL_LEN,  # the LCM of the groups' blocks
            hash_block_size=VLLM_BLOCK,
            enable_caching=caching,
        )

    def scheduler(self, num_blocks: int, max_num_seqs: int, max_batched_tokens: int, model_dir: str) -> object:
        """vLLM's v1 ``Scheduler`` (no prefix caching) over :meth:`kv_cache_config`'s groups with
        ``num_blocks`` blocks. Its ``VllmConfig`` reads a 2-layer llama ``config.json`` written to
        ``model_dir`` (no weights, no tokenizer); the scheduler and hash block sizes come from vLLM's
        own resolution for these groups, as its engine core does."""
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        config = vllm_config(model_dir, max_num_seqs, max_batched_tokens, VLLM_BLOCK, True, max_model_len=MAX_MODEL_LEN)
        kv = self.kv_cache_config(num_blocks, caching=False)
        config.cache_config.num_gpu_blocks = num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
        return Scheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )

    def request(self, rid: str, tokens: list[int], hashed: bool = True) -> object:
        """A ``Request``; ``hashed``: its block hashes are computed here (prefix caching on)."""
        return self.Request(rid, tokens, self.params, None, block_hasher=self.hasher if hashed else None)

    def admit(self, m, rid: str, tokens: list[int], req: object = None) -> tuple[object, int]:  # noqa: ANN001
        """Hash (the ``Request``, unless given), look up, allocate the prompt as one prefill chunk,
        and mark it computed."""
        req = self.request(rid, tokens) if req is None else req
        blocks, hit, _ = m.get_computed_blocks(req)
        got = m.allocate_slots(req, len(tokens) - hit, hit, blocks)
        if got is None:
            raise RuntimeError(f"vLLM could not admit {rid}")
        req.num_computed_tokens = len(tokens)
        m.new_step_starts()
        return req, hit


# ---- rows ----------------------------------------------------------------------------------------
def row_pool_admit_free(v: Vllm, repeats: int, number: int) -> dict:
    held, n = 256, 624
    ours = make_pool(held * n + n + 1)  # the manager's pool (compiled extents with numba)
    keep = [ours.allocate(n) for _ in range(held)]
    theirs = v.BlockPool(held * n + n + 1, enable_caching=False, hash_block_size=VLLM_BLOCK)
    keep_v = [theirs.get_new_blocks(n) for _ in range(held)]

    def a() -> None:
        for _ in range(number):
            ours.release(ours.allocate(n))

    def b() -> None:
        for _ in range(number):
            theirs.free_blocks(theirs.get_new_blocks(n))

    out = interleave(timed(a, number), timed(b, number), repeats)
    del keep, keep_v
    return {"what": f"allocate + free {n} blocks beside {held} x {n} held, per admission", **out}


def row_pool_one_block(v: Vllm, repeats: int, number: int) -> dict:
    held, n, k = 256, 624, 256
    ours = make_pool(held * n + 4 * k)
    keep = [ours.allocate(n) for _ in range(held)]
    theirs = v.BlockPool(held * n + 4 * k, enable_caching=False, hash_block_size=VLLM_BLOCK)
    keep_v = [theirs.get_new_blocks(n) for _ in range(held)]

    def a() -> None:
        for _ in range(number):
            ids = [ours.allocate(1) for _ in range(k)]
            for i in ids:
                ours.release(i)

    def b() -> None:
        for _ in range(number):
            blocks = [theirs.get_new_blocks(1) for _ in range(k)]
            for x in blocks:
                theirs.free_blocks(x)

    a(), b()  # the first round takes hybridkv's single ids from the extents, later ones from freed ids
    out = interleave(timed(a, number * k), timed(b, number * k), repeats)
    problems = ours.check_free_extents()
    del keep, keep_v
    return {"what": f"{k} x allocate(1) then {k} x free(1), per block", "pool_problems": problems, **out}


def _minimax(budget_gib: float, prefix: PrefixCacheConfig | None) -> HybridBlockManager:
    layout = plan(preset("minimax-m1", "float32", 8), int(budget_gib * GiB), block_size=BLOCK)
    return HybridBlockManager(layout, prefix_cache=prefix)


def row_manager_admit_free(v: Vllm, repeats: int, number: int) -> dict:
    tokens, running = 32 * 1024, 256
    ours = _minimax(1024, None)
    per = ours.blocks_to_admit(tokens)
    if per * (running + 2) > ours.pool.num_usable:
        raise RuntimeError(f"the hybridkv budget holds fewer than {running + 2} requests of {per} blocks")
    for i in range(running):
        ours.allocate(i, tokens)
    v_per = tokens // VLLM_BLOCK + 7
    theirs = v.manager(v_per * (running + 2) + 1, caching=False)
    toks = [1] * tokens
    for i in range(running):
        v.admit(theirs, f"run{i}", toks, v.request(f"run{i}", toks, hashed=False))
    # vLLM's Request objects are made outside the timed batch (hybridkv has no per-request object to make)
    reqs = [[v.request(f"x{j}", toks, hashed=False) for j in range(number)] for _ in range(repeats + 1)]

    def a() -> None:
        for _ in range(number):
            ours.allocate("x", tokens)
            ours.free("x")

    def b() -> None:
        for req in reqs.pop():
            v.admit(theirs, req.request_id, toks, req)
            theirs.free(req)

    b()
    out = interleave(timed(a, number), timed(b, number), repeats)
    return {
        "what": f"admit + free one {tokens}-token request beside {running} running, no prefix cache",
        "hybridkv_blocks": per,
        "vllm_blocks": v_per,
        **out,
    }


def _prefix_rows(v: Vllm, repeats: int, number: int, args: argparse.Namespace, hit: bool) -> dict:
    """Miss (fresh tokens) or hit (a cached ``prefix_tokens`` prefix + fresh tokens), steady state."""
    n_tok, n_pre = args.request_tokens, args.prefix_tokens
    rng = random.Random(0)
    counter = iter(range(1 << 30))

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 150_000) for _ in range(n)]

    shared = fresh(n_pre)

    def prompt() -> list[int]:
        return (shared + fresh(n_tok - n_pre)) if hit else fresh(n_tok)

    out: dict = {}
    for eviction in args.evictions:
        # the default checkpoint policy (branch_spaced: a fresh 8k prompt is checkpointed at its end,
        # the shared 6k prompt too) with each eviction policy
        config = PrefixCacheConfig(eviction=EvictionPolicy(eviction))
        ours = _minimax(args.prefix_budget_gib, config)
        # fill the cache until evictions run (steady state); the shared prefix last, as a prompt of
        # its own (an earlier turn), so both systems hold its state at its end
        warm = 2 * ours.pool.num_usable // ours.blocks_to_admit(n_tok) + 2
        prompts = [prompt() for _ in range(max(warm, 4))] + [shared]
        for p in prompts:
            rid = next(counter)
            ours.allocate(rid, len(p), token_ids=p)
            # the shared prompt is a finished earlier turn: its end is offered as such (final), as a
            # serving loop that knows the turn ended does; vLLM caches its state there too
            ours.checkpoint(rid, final=p is shared)
            ours.release_pins()
            ours.free(rid)
        evicted_before = ours.prefix_cache.stats.kv_evicted + ours.prefix_cache.stats.checkpoints_evicted
        batch = [[prompt() for _ in range(number)] for _ in range(repeats + 1)]
        hits: list[int] = []

        def a(batch=batch, ours=ours, hits=hits) -> None:
            for p in batch.pop():
                rid = next(counter)
                got = ours.allocate(rid, len(p), token_ids=p)
                hits.append(got.num_cached_tokens)
                ours.checkpoint(rid)
                ours.release_pins()
                ours.free(rid)

        theirs = v.manager(args.vllm_blocks, caching=True)
        for p in prompts:
            req, _ = v.admit(theirs, f"w{next(counter)}", p)
            theirs.free(req)
        vbatch = [[prompt() for _ in range(number)] for _ in range(repeats + 1)]
        vhits: list[int] = []

        def b(vbatch=vbatch, theirs=theirs, vhits=vhits) -> None:
            for p in vbatch.pop():
                req, got = v.admit(theirs, f"v{next(counter)}", p)
                vhits.append(got)
                theirs.free(req)

        a(), b()  # one batch each to settle
        hits.clear()
        vhits.clear()
        res = interleave(timed(a, number * n_tok), timed(b, number * n_tok), repeats)
        ours.check_integrity()
        stats = ours.prefix_cache.stats
        res["hybridkv_mean_hit_tokens"] = statistics.mean(hits)
        res["vllm_mean_hit_tokens"] = statistics.mean(vhits)
        res["hybridkv_evictions_while_timed"] = stats.kv_evicted + stats.checkpoints_evicted - evicted_before
        res["vllm_free_blocks_after"] = theirs.block_pool.get_num_free_blocks()
        out[eviction] = res
    kind = f"a cached prefix of {n_pre} tokens + fresh tokens" if hit else "fresh tokens (misses)"
    return {
        "what": f"admit {n_tok}-token prompts of {kind}, prefill as one chunk, free; per admitted token",
        "hybridkv_block_tokens": BLOCK,
        "vllm_block_tokens": VLLM_BLOCK,
        "hybridkv_budget_gib": args.prefix_budget_gib,
        "vllm_num_blocks": args.vllm_blocks,
        "by_eviction": out,
        "ratio_median": max(r["ratio_median"] for r in out.values()),
    }


def row_scheduler_step(v: Vllm, repeats: int, number: int) -> dict:
    """One step + update with ``NUM_REQUESTS`` requests decoding, per step; ``{"skipped": why}`` if
    vLLM's ``Scheduler`` cannot be built here."""
    n = NUM_REQUESTS
    with tempfile.TemporaryDirectory(prefix="bench_vs_vllm_") as model_dir:
        try:
            # 3 attention blocks (the prompt and its decode) + 7 states per request, and spare
            theirs = v.scheduler(n * 16 + 1, n, n * PROMPT_TOKENS, model_dir)
        except Exception as e:  # noqa: BLE001 - whatever stops it, this row only is skipped
            return {"skipped": f"vLLM's Scheduler could not be built ({type(e).__name__}: {e})"}
        return _scheduler_step(v, theirs, repeats, number)


def _scheduler_step(v: Vllm, theirs, repeats: int, number: int) -> dict:  # noqa: ANN001
    from vllm.v1.outputs import ModelRunnerOutput

    n = NUM_REQUESTS
    ours = warm_decode(0)  # 256 x 2,048-token prompts prefilled, then 20 decode steps
    params = v.SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_TOKENS, ignore_eos=True)
    prompt = [1] * PROMPT_TOKENS
    for i in range(n):
        theirs.add_request(v.Request(f"d{i}", prompt, params, None))

    def sampled(so) -> object:  # noqa: ANN001
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids]
        )

    while any(r.num_computed_tokens < PROMPT_TOKENS for r in theirs.requests.values()):
        so = theirs.schedule()
        theirs.update_from_output(so, sampled(so))
    for _ in range(20):  # into the steady state, as warm_decode
        so = theirs.schedule()
        theirs.update_from_output(so, sampled(so))
    if len(theirs.running) != n or len(ours.running) != n:
        raise RuntimeError(f"not {n} decoding: hybridkv {len(ours.running)}, vLLM {len(theirs.running)}")
    # one step's outputs serve every step: the same requests decode one token each (no stop)
    out_v = sampled(so)
    out_ours = StepOutputs({r.request_id: [7] for r in ours.running})

    def a(meta: bool = False) -> None:
        rows = []
        for _ in range(number):
            p = ours.step()
            if meta:
                build_step_metadata(ours.manager, p, batch_size=n)
            ours.update(out_ours)
            rows.append((len(p.scheduled), p.num_batched_tokens, len(p.preempted)))
        assert rows == [(n, n, 0)] * number, f"hybridkv steps were not {n} one-token decodes: {rows}"

    def b() -> None:
        rows = []
        for _ in range(number):
            so = theirs.schedule()
            theirs.update_from_output(so, out_v)
            rows.append((len(so.num_scheduled_tokens), so.total_num_scheduled_tokens, len(so.preempted_req_ids or ())))
        assert rows == [(n, n, 0)] * number, f"vLLM steps were not {n} one-token decodes: {rows}"

    a(), b()
    free, free_v = ours.manager.pool.num_free, theirs.kv_cache_manager.block_pool.get_num_free_blocks()
    steps = len(ours.requests[0].output_token_ids)
    out = interleave(timed(a, number), timed(b, number), repeats)
    out["with_metadata"] = interleave(timed(lambda: a(meta=True), number), timed(b, number), repeats)
    if len(theirs.running) != n or len(ours.running) != n or theirs.waiting or ours.waiting:
        raise RuntimeError("a request stopped decoding while timed")
    return {
        "what": f"scheduler step + update, {n} requests decoding one token each ({PROMPT_TOKENS}-token prompts), "
        "per step; with_metadata: hybridkv also builds the step metadata",
        "hybridkv": "scheduler_adapter.Scheduler, minimax-m1 TP8 fp32 state, 64-token blocks, no prefix cache",
        "vllm": "v1 Scheduler, 1 full-attention group (1,024-token blocks) + 7 mamba groups (mode none), "
        f"scheduler block {theirs.block_size}, no prefix caching",
        "scheduled_per_step": n,
        "steps_timed_per_side": 2 * repeats * number,
        "decode_tokens_before_timing": steps,
        "hybridkv_blocks_allocated_while_timed": free - ours.manager.pool.num_free,
        "vllm_blocks_allocated_while_timed": free_v - theirs.kv_cache_manager.block_pool.get_num_free_blocks(),
        **out,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--request-tokens", type=int, default=8192, help="prompt length of the prefix rows")
    ap.add_argument("--prefix-tokens", type=int, default=6144, help="cached prefix of prefix_hit (whole 1,024s)")
    ap.add_argument("--prefix-budget-gib", type=float, default=8.0, help="hybridkv pool of the prefix rows")
    ap.add_argument("--vllm-blocks", type=int, default=400, help="vLLM pool of the prefix rows (1,024-token blocks)")
    ap.add_argument("--evictions", nargs="+", default=["lru", "flop_aware"], choices=["lru", "flop_aware"])
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--save-as",
        default=None,
        help="results name (<name>_<date>_<time>.json); default vs_vllm when every row runs, else vs_vllm_partial",
    )
    args = ap.parse_args(argv)
    try:
        v = Vllm()
    except ImportError as e:
        print(f"bench_vs_vllm: skipped, vLLM is not importable here ({e}); see shared/peer/README.md", flush=True)
        return 0
    rows = {}
    for name in args.rows:
        t0 = time.perf_counter()
        if name == "pool_admit_free":
            r = row_pool_admit_free(v, args.repeats, 200)
        elif name == "pool_one_block":
            r = row_pool_one_block(v, args.repeats, 20)
        elif name == "manager_admit_free":
            r = row_manager_admit_free(v, args.repeats, 50)
        elif name == "scheduler_step":
            r = row_scheduler_step(v, args.repeats, 20)
        else:
            r = _prefix_rows(v, args.repeats, 4, args, hit=name == "prefix_hit")
        r["seconds"] = time.perf_counter() - t0
        rows[name] = r
        if "skipped" in r:
            print(f"{name:20s} skipped: {r['skipped']}", flush=True)
            continue
        if "by_eviction" in r:  # the prefix rows: one line per eviction policy below
            print(f"{name:20s} worst ratio {r['ratio_median']:.3f}", flush=True)
        else:
            print(
                f"{name:20s} hybridkv {r['hybridkv_us']['median']:10.3f} us  "
                f"vLLM {r['vllm_us']['median']:10.3f} us  ratio {r['ratio_median']:.3f}",
                flush=True,
            )
        if "with_metadata" in r:
            sub = r["with_metadata"]
            print(
                f"  {'+ metadata':11s} hybridkv {sub['hybridkv_us']['median']:10.3f} us  "
                f"vLLM {sub['vllm_us']['median']:10.3f} us  ratio {sub['ratio_median']:.3f}",
                flush=True,
            )
        for ev, sub in r.get("by_eviction", {}).items():
            print(
                f"  {ev:11s} hybridkv {sub['hybridkv_us']['median']:.4f} us/token  vLLM {sub['vllm_us']['median']:.4f}"
                f" us/token  ratio {sub['ratio_median']:.3f}  hits {sub['hybridkv_mean_hit_tokens']:.0f} vs "
                f"{sub['vllm_mean_hit_tokens']:.0f} tokens",
                flush=True,
            )
    if not args.no_save:
        name = args.save_as or ("vs_vllm" if set(args.rows) == set(ROWS) else "vs_vllm_partial")
        print("saved", save(name, {"vllm": v.version, "note": "ratio = hybridkv / vLLM; < 1: hybridkv faster",
                                   "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

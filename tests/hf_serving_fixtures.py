"""Tiny random transformers models of every served hybrid family, a serving workload, and HF-alone references.

Used by tests/test_hf_serving.py. The configs follow tests/test_models_hf.py's (2-4 layers, hidden 64,
vocab 128, a few heads, two experts), with small SSM chunk sizes so the CPU runs fast. Models are
fp32 with transformers' own random init (seed 0).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.transformers import EngineConfig, HFEngine, ModelDrafter, SamplingParams, model_spec
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import H200, PreemptionMode, Preemptor
from tests.hf_tiny_configs import CASES

# the oracle tests' tiny configs (tests/hf_tiny_configs.py) with what serving changes: SSD / lightning
# chunks shorter than a prompt (HF's chunked scans run), and Nemotron-H without its MoE block
_NEMOTRON_MOE = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
)
_ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _serving(model_type: str, drop: tuple[str, ...] = (), **changes: object) -> dict:
    return {k: v for k, v in CASES[model_type].items() if k not in drop} | changes


FAMILY_CONFIGS: dict[str, dict] = {
    "qwen3_5_text": _serving("qwen3_5_text", layer_types=_ALTERNATING),
    "qwen3_5_moe_text": _serving("qwen3_5_moe_text", layer_types=_ALTERNATING),
    "qwen3_next": _serving("qwen3_next", layer_types=_ALTERNATING),
    "mamba2": _serving("mamba2", chunk_size=8),
    "nemotron_h": _serving(
        "nemotron_h",
        drop=_NEMOTRON_MOE,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
        chunk_size=8,
    ),
    "jamba": _serving("jamba"),
    "minimax": _serving("minimax", block_size=8),
    "falcon_h1": _serving("falcon_h1", mamba_chunk_size=8),
    "bamba": _serving("bamba", mamba_chunk_size=8),
    "granitemoehybrid": _serving("granitemoehybrid", mamba_chunk_size=8),
    # served since issue 38 (the oracle tests' configs as they are)
    **{
        t: _serving(t)
        for t in (
            "zamba",
            "zamba2",
            "olmo_hybrid",
            "mamba",
            "falcon_mamba",
            "lfm2",
            "lfm2_moe",
            "kimi_linear",
            "bailing_hybrid",
            "minimax_m2",
        )
    },
}


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model of ``model_type`` (eval mode, no EOS so runs have their full length)."""
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    cfg = transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **FAMILY_CONFIGS[model_type])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class AlternatingPreemptor(Preemptor):
    """Recompute and swap in turn (swap only where the host pool has room), so one run sees both modes."""

    def __init__(self, manager) -> None:
        super().__init__(manager, PreemptionMode.SWAP, H200)
        self.turn = 0

    def mode_for(self, req):
        self.turn += 1
        return PreemptionMode.RECOMPUTE if self.turn % 2 else super().mode_for(req)


class InjectedFault(RuntimeError):
    """The fault :func:`run_workload` injects into the model's forward."""


@dataclass
class Workload:
    """Requests with shared prefixes arriving at steps; some with parallel samples (``n`` 2 or 3),
    some aborted, and faults injected in the middle of steps."""

    arrivals: dict[int, list[tuple[str, list[int], int, SamplingParams]]] = field(default_factory=dict)
    aborts: tuple[int, ...] = ()  # steps at which the oldest running request (else waiting) is aborted
    # steps from which the model's forward raises InjectedFault once, in the middle of a step (on a
    # forward after the step's first; a step with one forward passes it on to the next)
    faults: tuple[int, ...] = ()
    num_requests: int = 0


def make_workload(num_requests: int = 32, seed: int = 0, vocab: int = 128) -> Workload:
    """Prompts: one of two shared prefixes (8 and 12 tokens, i.e. 2 and 3 blocks of 4) plus a tail; a
    repeated motif in some tails so n-gram drafts are sometimes right. Every 5th request samples
    (seeded), the rest are greedy; every 7th has parallel samples (n = 3 or 2, one of them with
    max_new_tokens = 1); two requests are aborted (running ones where any run); the model's forward
    raises twice, mid-step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(n)] for n in (8, 12)]
    w = Workload(num_requests=num_requests)
    for i in range(num_requests):
        shared = prefixes[i % 3] if i % 3 < 2 else []
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 8))]
        if i % 4 == 1:
            tail = (tail[:3] * 3)[: max(len(tail), 4)]
        n = 3 if i % 14 == 3 else 2 if i % 7 == 3 else 1
        params = SamplingParams(temperature=0.8 if i % 5 == 4 else 0.0, seed=i, n=n)
        step = rng.randint(0, num_requests)
        max_new = 16 if i % 6 == 5 else rng.randint(3, 8)
        w.arrivals.setdefault(step, []).append((f"r{i}", shared + tail, 1 if i % 14 == 10 else max_new, params))
    w.aborts = (12, 25)
    w.faults = (num_requests // 4, num_requests * 2 // 3)
    return w


def pool_blocks(model, requests: int = 3, kv_blocks: int = 8, k: int = 2) -> int:
    """A pool for ``requests`` requests' state sets (live + ``k`` speculative) and ``kv_blocks`` KV blocks."""
    probe = plan(model_spec(model), 1 << 40, block_size=4)
    return 1 + requests * probe.num_state_blocks_per_request * (1 + k) + kv_blocks


def make_engine(
    model, engine_cls=HFEngine, num_blocks: int | None = None, num_host_blocks: int = 64, drafter=None
) -> HFEngine:
    """A pool of ``num_blocks`` blocks of 4 tokens (small: preemption by recompute and swap), prefix
    caching with checkpoints at branch points and at the last token and a host tier, 2 speculative tokens (drafter:
    default the model itself without cache, right for greedy requests and mostly wrong for sampled ones)."""
    config = EngineConfig(
        num_blocks=num_blocks or pool_blocks(model),
        block_size=4,
        num_host_blocks=num_host_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        num_speculative_tokens=2,
        preemption_mode=PreemptionMode.SWAP,
        # the host tier on: evicted prefixes offloaded to the host pool (shared with swap) and hit there
        prefix_cache=PrefixCacheConfig(checkpoint="branch_and_last", eviction="lru", host_tier=True),
        record_logits=True,
        # admit on the first chunk: the most admissions, so running requests run out of blocks and preempt
        scheduler_options={"admission": "first_chunk"},
    )
    engine = engine_cls(model, config, drafter=drafter or ModelDrafter(model))
    engine.scheduler.preemptor = AlternatingPreemptor(engine.manager)
    return engine


def run_workload(engine: HFEngine, workload: Workload, max_steps: int = 2000) -> HFEngine:
    """Run ``workload``; an injected fault must abort the requests of its step (``engine.failed``) and
    leave the books balanced, and the run goes on."""
    step = 0
    last = max(workload.arrivals)
    model, armed, step_start = engine.model, [0], [0]
    forward, own = model.forward, model.__dict__.get("forward")

    def faulty_forward(*args, **kwargs):
        # the engine's forwards only (the model drafter runs the same model without a cache)
        if armed[0] and kwargs.get("use_cache") and engine.events.forwards > step_start[0]:
            armed[0] -= 1
            raise InjectedFault(f"injected into a forward of step {engine.events.steps}")
        return forward(*args, **kwargs)

    model.forward = faulty_forward
    try:
        while step <= last or engine.has_unfinished:
            for rid, prompt, n, params in workload.arrivals.get(step, ()):
                engine.add_request(rid, prompt, n, params)
            victims = engine.scheduler.running or engine.scheduler.waiting  # (waiting: all were preempted)
            if step in workload.aborts and victims:
                engine.abort(victims[0].request_id)
            armed[0] += step in workload.faults
            if engine.has_unfinished:
                step_start[0] = engine.events.forwards
                failed = len(engine.failed)
                try:
                    engine.step()
                except InjectedFault:
                    assert len(engine.failed) > failed, "a step raised and aborted nothing"
                engine.manager.check_integrity()
            step += 1
            assert step < max_steps, "the workload did not finish"
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
    return engine


# ---- HF alone: the oracle ---------------------------------------------------------------------------


@torch.no_grad()
def hf_one_forward(model, tokens: list[int]) -> torch.Tensor:
    """Logits ``[n, vocab]`` of the request alone in HF: one forward over all its tokens."""
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def hf_chunked(model, tokens: list[int], num_prompt: int, chunk: int) -> torch.Tensor:
    """The request alone in HF as generate runs it, prompt in chunks of ``chunk``: each chunk a forward
    on the cache, then one token per forward (HF's own chunking noise against :func:`hf_one_forward`)."""
    cache = None
    out, pos = [], 0
    cuts = list(range(0, num_prompt, chunk)) + list(range(num_prompt, len(tokens)))
    for i, start in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < len(cuts) else len(tokens)
        ids = torch.tensor([tokens[start:end]])
        res = model(input_ids=ids, position_ids=torch.arange(start, end)[None], cache=cache, use_cache=True)
        cache = res.past_key_values
        out.append(res.logits[0].float())
        pos = end
    assert pos == len(tokens)
    return torch.cat(out)


def max_error(engine: HFEngine, model, refs: dict | None = None) -> tuple[float, object, int]:
    """Largest |engine logit - HF alone (one forward)| over every recorded logit: (error, request, position)."""
    refs = {} if refs is None else refs
    worst = (0.0, None, -1)
    for rid, entries in engine.logits.items():
        toks = engine.tokens[rid][: 1 + max(p for p, _ in entries)]
        key = tuple(toks)
        if key not in refs:
            refs[key] = hf_one_forward(model, toks)
        ref = refs[key]
        for pos, lg in entries:
            err = float((lg - ref[pos]).abs().max())
            if not err <= worst[0]:  # NaN counts as the worst
                worst = (err if err == err else float("inf"), rid, pos)
    return worst


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread for a module's tests (imported by the serving test modules: autouse there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

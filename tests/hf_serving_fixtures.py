"""Tiny random transformers models of seven hybrid families, a serving workload, and HF-alone references.

Used by tests/test_hf_serving.py. The configs follow tests/test_models_hf.py's (2-4 layers, hidden 64,
vocab 128, a few heads, two experts), with small SSM chunk sizes so the CPU runs fast. Models are
fp32 with transformers' own random init (seed 0).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import torch
import transformers

from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.transformers import EngineConfig, HFEngine, ModelDrafter, SamplingParams, model_spec
from hybridkv.planner.layout import plan
from hybridkv.scheduler_adapter import H200, PreemptionMode, Preemptor

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16)

FAMILY_CONFIGS: dict[str, dict] = {
    "qwen3_5_text": dict(
        BASE,
        num_hidden_layers=4,
        head_dim=16,
        linear_conv_kernel_dim=4,
        **GDN,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    "mamba2": dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        state_size=8,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=8,
    ),
    "nemotron_h": dict(
        BASE,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
    ),
    "jamba": dict(
        BASE,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
    ),
    "minimax": dict(
        BASE,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        block_size=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    "falcon_h1": dict(BASE, num_hidden_layers=2, head_dim=16, mamba_d_ssm=128, mamba_chunk_size=8, **MAMBA),
    "bamba": dict(BASE, num_hidden_layers=3, attn_layer_indices=[1], mamba_chunk_size=8, **MAMBA),
    "granitemoehybrid": dict(
        BASE,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=2,
        num_experts_per_tok=1,
        shared_intermediate_size=32,
        mamba_chunk_size=8,
        **MAMBA,
    ),
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


@dataclass
class Workload:
    """Requests with shared prefixes arriving at steps; some forked (``n = 2``), some aborted."""

    arrivals: dict[int, list[tuple[str, list[int], int, SamplingParams]]] = field(default_factory=dict)
    aborts: tuple[int, ...] = ()  # steps at which the oldest running request is aborted
    num_requests: int = 0


def make_workload(num_requests: int = 32, seed: int = 0, vocab: int = 128) -> Workload:
    """Prompts: one of two shared prefixes (8 and 12 tokens, i.e. 2 and 3 blocks of 4) plus a tail; a
    repeated motif in some tails so n-gram drafts are sometimes right. Every 5th request samples
    (seeded), the rest are greedy; every 7th is forked (n = 2); two running requests are aborted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(n)] for n in (8, 12)]
    w = Workload(num_requests=num_requests)
    for i in range(num_requests):
        shared = prefixes[i % 3] if i % 3 < 2 else []
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 8))]
        if i % 4 == 1:
            tail = (tail[:3] * 3)[: max(len(tail), 4)]
        params = SamplingParams(temperature=0.8 if i % 5 == 4 else 0.0, seed=i, n=2 if i % 7 == 3 else 1)
        step = rng.randint(0, num_requests)
        w.arrivals.setdefault(step, []).append(
            (f"r{i}", shared + tail, 16 if i % 6 == 5 else rng.randint(3, 8), params)
        )
    w.aborts = (12, 25)
    return w


def pool_blocks(model, requests: int = 3, kv_blocks: int = 8, k: int = 2) -> int:
    """A pool for ``requests`` requests' state sets (live + ``k`` speculative) and ``kv_blocks`` KV blocks."""
    probe = plan(model_spec(model), 1 << 40, block_size=4)
    return 1 + requests * probe.num_state_blocks_per_request * (1 + k) + kv_blocks


def make_engine(
    model, engine_cls=HFEngine, num_blocks: int | None = None, num_host_blocks: int = 64, drafter=None
) -> HFEngine:
    """A pool of ``num_blocks`` blocks of 4 tokens (small: preemption by recompute and swap), prefix
    caching with checkpoints at branch points and at the last token, 2 speculative tokens (drafter:
    default the model itself without cache, right for greedy requests and mostly wrong for sampled ones)."""
    config = EngineConfig(
        num_blocks=num_blocks or pool_blocks(model),
        block_size=4,
        num_host_blocks=num_host_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        num_speculative_tokens=2,
        preemption_mode=PreemptionMode.SWAP,
        prefix_cache=PrefixCacheConfig(checkpoint="branch_and_last", eviction="lru"),
        record_logits=True,
        # admit on the first chunk: the most admissions, so running requests run out of blocks and preempt
        scheduler_options={"admission": "first_chunk"},
    )
    engine = engine_cls(model, config, drafter=drafter or ModelDrafter(model))
    engine.scheduler.preemptor = AlternatingPreemptor(engine.manager)
    return engine


def run_workload(engine: HFEngine, workload: Workload, max_steps: int = 2000) -> HFEngine:
    step = 0
    last = max(workload.arrivals)
    while step <= last or engine.has_unfinished:
        for rid, prompt, n, params in workload.arrivals.get(step, ()):
            engine.add_request(rid, prompt, n, params)
        if step in workload.aborts and engine.scheduler.running:
            engine.abort(engine.scheduler.running[0].request_id)
        if engine.has_unfinished:
            engine.step()
            engine.manager.check_integrity()
        step += 1
        assert step < max_steps, "the workload did not finish"
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

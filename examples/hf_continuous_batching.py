"""Continuous batching of two unmodified HuggingFace hybrid models (random weights) through hybridkv.

A tiny Qwen3.5 (Gated DeltaNet + attention) and a tiny Nemotron-H (Mamba2 + attention), built from
config objects (no hub access), each serve 24 requests with shared prefixes on a small pool with a
host pool: requests are preempted (recompute and swap), hit the prefix cache (live state restored
from a checkpoint), are forked (parallel sampling, n=2) and decode speculatively (n-gram drafts).

    pip install 'hybridkv[hf]'
    python examples/hf_continuous_batching.py
"""

from __future__ import annotations

import random
import sys
import warnings

import torch
import transformers
from tqdm import tqdm

from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.integrations.transformers import LLM, SamplingParams

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "qwen3_5_text": dict(
        COMMON,
        num_hidden_layers=4,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    "nemotron_h": dict(
        COMMON,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
    ),
}


def serve(model_type: str) -> None:
    cfg = transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **MODELS[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    llm = LLM(
        model,
        num_blocks=48,
        block_size=4,
        num_host_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        num_speculative_tokens=2,
        preemption_mode="swap",
        prefix_cache=PrefixCacheConfig(checkpoint="branch_and_last", eviction="lru"),
        scheduler_options={"admission": "first_chunk"},
    )
    rng = random.Random(0)
    system = [rng.randrange(1, 128) for _ in range(12)]
    for i in range(24):
        tail = [rng.randrange(1, 128) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(temperature=0.7 if i % 3 else 0.0, seed=i, n=2 if i % 8 == 0 else 1)
        llm.add_request(f"r{i}", (system if i % 4 else system[:8]) + tail, 12 if i % 5 == 0 else 6, params)
    total = 24 + sum(1 for i in range(24) if i % 8 == 0)
    with tqdm(total=total, desc=model_type, unit="req", file=sys.stderr) as bar:
        outputs = llm.run(progress=bar.update)
    ev = llm.events
    print(f"{model_type}: {len(outputs)} requests in {ev.steps} steps, {ev.forwards} HF forwards")
    print(f"  preemptions: {ev.preempted_recompute} recompute, {ev.preempted_swap} swap ({ev.swapped_in} swapped in)")
    print(f"  prefix-hit tokens: {ev.prefix_hit_tokens}; forks: {ev.forks}")
    print(f"  drafts: {ev.drafts}, accepted {ev.accepted}, rejected {ev.rejected}")
    print(f"  r0 -> {outputs['r0']}")


def main() -> None:
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they save
    try:
        for model_type in MODELS:
            serve(model_type)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()

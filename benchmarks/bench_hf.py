"""hybridkv's transformers engine against transformers' own ``generate``, on the CPU, one torch thread.

Two tiny hidden-256 hybrid models with random weights (Qwen3.5: Gated DeltaNet + attention;
Nemotron-H: Mamba2 + attention), two workloads of greedy requests:

- ``mixed``: 16 requests, prompts of 64-256 tokens (seeded), 32 new tokens each;
- ``shared_prefix``: 16 requests, one 768-token prefix shared by all + 16-48 tokens of their own,
  32 new tokens each; hybridkv gets the first request one step ahead of the other 15 (a system
  prompt a server has seen: its first chunk is computed and checkpointed, the others hit it), and
  its time counts from that request's submission; ``generate`` gets all 16 at once (it has no
  cache to reuse).

Three ways, interleaved in one process (the order rotates every repeat, so the load of other work
on the machine falls on each alike and cancels in the ratios): hybridkv's ``LLM`` in its default
configuration (the pool sized for the workload, as a user sizes it to memory), ``generate`` on the
16 prompts batched (left padded, with the attention mask), and ``generate`` one request at a time.
Tokens are checked identical to one-at-a-time ``generate`` (the exact reference). Reported: median
seconds (wall clock, and the process's CPU seconds, which other jobs on a shared machine disturb
less), ratios to batched ``generate``, tokens/s, HF forwards per run, and where hybridkv's time goes
(the HF forward, building and storing the cache, the scheduler, the rest).

    python benchmarks/bench_hf.py [--repeats 5] [--quick]

Saves ``benchmarks/results/hf_<date>_<time>.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import save  # noqa: E402
from hybridkv.integrations.transformers import LLM, model_spec  # noqa: E402
from hybridkv.planner.layout import plan  # noqa: E402

COMMON = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
MODELS = {
    "qwen3_5_text": dict(
        COMMON,
        num_hidden_layers=4,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "nemotron_h": dict(
        COMMON,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"],
        head_dim=32,
        mamba_num_heads=16,
        mamba_head_dim=32,
        ssm_state_size=32,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
    ),
}
NEW_TOKENS = 32
BLOCK_SIZE = 16


def tiny(model_type: str) -> torch.nn.Module:
    cfg = transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **MODELS[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def workload(name: str, num: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if name == "mixed":
        return [[rng.randrange(1, 4096) for _ in range(rng.randint(64, 256))] for _ in range(num)]
    prefix = [rng.randrange(1, 4096) for _ in range(768)]
    return [prefix + [rng.randrange(1, 4096) for _ in range(rng.randint(16, 48))] for _ in range(num)]


def pool_blocks(model, prompts: list[list[int]]) -> int:
    """Room for every request at once, twice over (KV, state sets and checkpoints)."""
    probe = plan(model_spec(model), 1 << 40, block_size=BLOCK_SIZE)
    kv = sum(-(-(len(p) + NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    return 2 * (kv + len(prompts) * probe.num_state_blocks_per_request) + 1


class Counter:
    """HF forwards of ``model`` and the seconds inside them (a forward hook pair)."""

    def __init__(self, model) -> None:
        self.n, self.seconds, self._t0 = 0, 0.0, 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *a) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *a) -> None:
        self.n += 1
        self.seconds += time.perf_counter() - self._t0


def timed(obj, name: str, acc: dict[str, float], key: str) -> None:
    """Wrap ``obj.name`` so its seconds add up in ``acc[key]``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


@torch.no_grad()
def run_hybridkv(
    model, prompts, counter: Counter, num_blocks: int, lead: int = 0, **options
) -> tuple[list[list[int]], dict]:
    llm = LLM(model, num_blocks=num_blocks, **options)
    acc: dict[str, float] = defaultdict(float)
    eng = llm.engine
    timed(eng.cache, "build", acc, "cache_build")
    timed(eng.cache, "store", acc, "cache_store")
    timed(eng.scheduler, "step", acc, "scheduler")
    timed(eng.scheduler, "update", acc, "scheduler")
    timed(eng, "run_copies", acc, "copies")
    n0, f0 = counter.n, counter.seconds
    t0, c0 = time.perf_counter(), time.process_time()
    llm.add_request(0, prompts[0], NEW_TOKENS)
    for _ in range(lead):  # the first request runs ``lead`` steps ahead of the others
        llm.step()
    for i, p in enumerate(prompts[1:], 1):
        llm.add_request(i, p, NEW_TOKENS)
    out = llm.run()
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    acc["hf_forward"] = counter.seconds - f0
    acc["other"] = total - sum(acc.values())
    info = dict(
        seconds=total,
        cpu_seconds=cpu,
        forwards=counter.n - n0,
        prefix_hit_tokens=llm.events.prefix_hit_tokens,
        steps=llm.events.steps,
        time_split={k: v / total for k, v in acc.items()},
    )
    return [out[i] for i in range(len(prompts))], info


@torch.no_grad()
def run_generate_batched(model, prompts, counter: Counter) -> tuple[list[list[int]], dict]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    n0 = counter.n
    t0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out[:, width:].tolist(), dict(seconds=total, cpu_seconds=cpu, forwards=counter.n - n0)


@torch.no_grad()
def run_generate_one_by_one(model, prompts, counter: Counter) -> tuple[list[list[int]], dict]:
    n0 = counter.n
    t0, c0 = time.perf_counter(), time.process_time()
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return outs, dict(seconds=total, cpu_seconds=cpu, forwards=counter.n - n0)


def bench(model_type: str, wl: str, repeats: int) -> dict:
    model = tiny(model_type)
    counter = Counter(model)
    prompts = workload(wl)
    blocks = pool_blocks(model, prompts)
    runs = {
        "hybridkv": lambda: run_hybridkv(model, prompts, counter, blocks, lead=1 if wl == "shared_prefix" else 0),
        "generate_batched": lambda: run_generate_batched(model, prompts, counter),
        "generate_one_by_one": lambda: run_generate_one_by_one(model, prompts, counter),
    }
    names = list(runs)
    samples: dict[str, list[dict]] = {k: [] for k in names}
    tokens: dict[str, list[list[int]]] = {}
    runs["hybridkv"]()  # warm-up (first-call costs of every path)
    runs["generate_batched"]()
    for r in range(repeats):
        for k in names[r % 3 :] + names[: r % 3]:
            toks, info = runs[k]()
            tokens[k] = toks
            samples[k].append(info)
    med = {k: statistics.median(s["seconds"] for s in samples[k]) for k in names}
    cpu = {k: statistics.median(s["cpu_seconds"] for s in samples[k]) for k in names}
    ref = tokens["generate_one_by_one"]
    generated = len(prompts) * NEW_TOKENS
    hk = samples["hybridkv"][-1]
    split = {key: statistics.median(s["time_split"][key] for s in samples["hybridkv"]) for key in hk["time_split"]}
    return dict(
        model_type=model_type,
        workload=wl,
        num_requests=len(prompts),
        prompt_tokens=[len(p) for p in prompts],
        new_tokens=NEW_TOKENS,
        num_blocks=blocks,
        median_seconds=med,
        seconds=({k: [s["seconds"] for s in samples[k]] for k in names}),
        ratio_to_generate_batched={k: med[k] / med["generate_batched"] for k in names},
        median_cpu_seconds=cpu,
        cpu_ratio_to_generate_batched={k: cpu[k] / cpu["generate_batched"] for k in names},
        tokens_per_second={k: generated / med[k] for k in names},
        forwards={k: samples[k][-1]["forwards"] for k in names},
        hybridkv_steps=hk["steps"],
        hybridkv_prefix_hit_tokens=hk["prefix_hit_tokens"],
        hybridkv_time_split=split,
        tokens_equal_one_by_one={k: tokens[k] == ref for k in names},
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one repeat, the mixed workload only")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    args = ap.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for wl in ["mixed"] if args.quick else ["mixed", "shared_prefix"]:
        for mt in args.models:
            row = bench(mt, wl, 1 if args.quick else args.repeats)
            rows.append(row)
            r, t = row["ratio_to_generate_batched"], row["tokens_per_second"]
            split = ", ".join(f"{k} {v:.0%}" for k, v in row["hybridkv_time_split"].items())
            print(
                f"{mt:13s} {wl:13s} hybridkv {r['hybridkv']:.2f}x of batched generate "
                f"(CPU seconds {row['cpu_ratio_to_generate_batched']['hybridkv']:.2f}x) "
                f"(one by one {r['generate_one_by_one']:.2f}x); tokens/s hybridkv {t['hybridkv']:.0f}, "
                f"batched {t['generate_batched']:.0f}, one by one {t['generate_one_by_one']:.0f}; forwards "
                f"{row['forwards']}; same tokens as one by one {row['tokens_equal_one_by_one']}; hybridkv: {split}",
                flush=True,
            )
    path = save(
        "hf",
        dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            torch_threads=1,
            note="shared machine (2 cores, other engineers' jobs running); runs interleaved, compare ratios",
            rows=rows,
        ),
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()

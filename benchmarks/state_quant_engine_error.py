"""Logit error of a quantized recurrent state through the transformers engine: transformers' own
model code with RANDOM weights (trained weights were not available here, so this measures the
quantizer inside real model code, not the accuracy of a real model), float32 compute; the engine
stores the states int8 / fp8 (float32 row scales in the set) or float16 between forwards
(``EngineConfig.state_dtype``) and is compared with the same run storing them float32.

Per family and state dtype: prompts of ``--prompt`` tokens prefilled in 8 chunks (each chunk's
state stored and read back), then ``--new`` greedy tokens, one forward each. Per position, the
largest |logit difference| against the float32-state run; reported as worst and median over the
prompt positions (teacher-forced: same tokens) and over the decoded positions up to the first token
where the greedy choices differ (after it the two runs read different tokens), and the greedy-token
agreement (share of decoded positions equal). JSON under benchmarks/results/ and one plot.

    PYTHONPATH=. python benchmarks/state_quant_engine_error.py --prompt 256 --new 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import RESULTS_DIR, save  # noqa: E402
from hybridkv.integrations.transformers import model_spec  # noqa: E402
from hybridkv.integrations.transformers.engine import EngineConfig, HFEngine  # noqa: E402
from hybridkv.integrations.transformers.sampling import SamplingParams  # noqa: E402
from hybridkv.models.spec import with_state_dtype  # noqa: E402
from tests.hf_serving_fixtures import FAMILY_CONFIGS, tiny_model  # noqa: E402

DTYPES = [
    "float16",
    "int8",
    "fp8",
]  # bfloat16 storage of a float32 state: refused by the engine (the buffers would be bf16)


def run(model, state_dtype, prompts, new, chunk):
    cfg = EngineConfig(
        num_blocks=4096,
        block_size=16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=chunk * len(prompts),
        record_logits=True,
        prefix_cache=None,
        state_dtype=state_dtype,
    )
    engine = HFEngine(model, cfg)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, new, SamplingParams(temperature=0.0))
    engine.run()
    out = {}
    for i in range(len(prompts)):
        entries = sorted(engine.logits[i], key=lambda e: e[0])
        out[i] = (torch.stack([lg for _, lg in entries]), engine.tokens[i])
    return out


def compare(ref, got, prompt_len):
    rows = []
    for i in ref:
        lr, tr = ref[i]
        lg, tg = got[i]
        n = min(len(lr), len(lg))
        diff = (lg[:n] - lr[:n]).abs().amax(dim=1)
        new_r, new_g = tr[prompt_len:], tg[prompt_len:]
        first = next((j for j, (a, b) in enumerate(zip(new_r, new_g, strict=True)) if a != b), len(new_r))
        rows.append(
            {
                "prefill_diff": [float(f"{v:.3g}") for v in diff[:prompt_len].tolist()],
                # the logits that chose the decoded tokens, up to the first divergence (3 significant digits)
                "decode_diff": [float(f"{v:.3g}") for v in diff[prompt_len - 1 : prompt_len + first].tolist()],
                "agreement": sum(a == b for a, b in zip(new_r, new_g, strict=True)) / len(new_r),
                "first_divergence": first,
                "logit_scale": float(lr.abs().amax()),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument(
        "--families", default=None, help="comma-separated model_types (default: every served family with a state)"
    )
    p.add_argument("--plot", default=None, help="plot file (default: beside the JSON, .png)")
    args = p.parse_args()
    torch.set_num_threads(1)
    chunk = args.prompt // 8
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]
    results = []
    families = args.families.split(",") if args.families else sorted(FAMILY_CONFIGS)
    for family in families:
        model = tiny_model(family)
        spec = model_spec(model)
        if with_state_dtype(spec, "int8") == spec:  # (conv windows stay as they are)
            print(f"{family:14s} keeps no state but conv windows or none: nothing to quantize", flush=True)
            continue
        t0 = time.perf_counter()
        ref = run(model, None, prompts, args.new, chunk)
        for dtype in DTYPES:
            rows = compare(ref, run(model, dtype, prompts, args.new, chunk), args.prompt)
            pre = [d for r in rows for d in r["prefill_diff"]]
            dec = [d for r in rows for d in r["decode_diff"]]
            summary = {
                "family": family,
                "state_dtype": dtype,
                "prefill_diff_worst": max(pre),
                "prefill_diff_median": statistics.median(pre),
                "decode_diff_worst": max(dec),
                "decode_diff_median": statistics.median(dec),
                "greedy_agreement": statistics.mean(r["agreement"] for r in rows),
                "first_divergence": [r["first_divergence"] for r in rows],
                "logit_scale": max(r["logit_scale"] for r in rows),
                "curves": rows,
            }
            results.append(summary)
            print(
                f"{family:14s} {dtype:8s} prefill worst {summary['prefill_diff_worst']:.2e} median "
                f"{summary['prefill_diff_median']:.2e}  decode worst {summary['decode_diff_worst']:.2e} median "
                f"{summary['decode_diff_median']:.2e}  agreement {summary['greedy_agreement']:.3f} first "
                f"{summary['first_divergence']}  (logits up to {summary['logit_scale']:.2f}, "
                f"{time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    path = save(
        "state_quant_engine_error",
        {
            "weights": "random (transformers' model code, tiny configs of tests/hf_tiny_configs.py); trained weights "
            "were not available, so the accuracy of a real model is not measured",
            "compute_dtype": "float32",
            "prompt_tokens": args.prompt,
            "prefill_chunks": 8,
            "new_tokens": args.new,
            "requests": args.requests,
            "results": results,
        },
    )
    print(path)
    plot(results, Path(args.plot) if args.plot else RESULTS_DIR / (path.stem + ".png"), args.prompt)


def plot(results, out: Path, prompt_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in results}, key=[r["family"] for r in results].index)
    cols = min(5, len(families))
    rows = -(-len(families) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(families) :]:
        ax.set_visible(False)
    for ax, family in zip(axes.flat, families, strict=False):
        for r in (r for r in results if r["family"] == family):
            c = r["curves"][0]
            y = c["prefill_diff"] + c["decode_diff"][1:]
            ax.semilogy(range(len(y)), [max(v, 1e-9) for v in y], label=r["state_dtype"], lw=0.8)
        ax.axvline(prompt_len, color="grey", lw=0.5)
        ax.set_title(family, fontsize=9)
        ax.set_xlabel("position (prefill | decode, to first divergence)", fontsize=7)
    for row in axes:
        row[0].set_ylabel("max |logit - fp32-state logit|", fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("quantized state vs float32 state, random weights (not a trained model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()

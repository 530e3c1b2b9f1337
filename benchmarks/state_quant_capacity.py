"""Requests that fit per GPU with the recurrent state in float32 / bfloat16 / int8 / fp8 (int8 and fp8
with their float32 row scales inside the state set), with bf16 and with fp8 KV, paged (hybridkv)
beside padded (vLLM v1's one-state-per-page layout), as ``hybridkv plan`` computes them: H200 at
0.9 of its memory less the bf16 weights and the 6 GiB reserve, each preset at its default TP.

    PYTHONPATH=. python benchmarks/state_quant_capacity.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import save  # noqa: E402
from hybridkv.cli.plan import add_plan_parser, build_plan  # noqa: E402

PRESETS = ["qwen3-next-80b-a3b", "nemotron-h-8b", "mamba2-2.7b", "minimax-m1", "jamba-1.5-mini"]
STATE_DTYPES = ["float32", "bfloat16", "int8", "fp8"]
KV_DTYPES = ["bfloat16", "fp8"]
CONTEXTS = ["8k", "32k"]


def plan_json(model: str, context: str, state: str, kv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["plan", "--model", model, "--gpu", "h200", "--context", context, "--state-dtype", state, "--kv-dtype", kv]
    )
    return build_plan(args)[0]


def main() -> None:
    rows = []
    for model in PRESETS:
        for context in CONTEXTS:
            for kv in KV_DTYPES:
                base = None
                for state in STATE_DTYPES:
                    out = plan_json(model, context, state, kv)
                    lay = out["layouts"]
                    row = {
                        "model": model,
                        "tp": out["tp_size"],
                        "context_tokens": out["context_tokens"],
                        "kv_dtype": kv,
                        "state_dtype": state,
                        "budget_bytes": out["budget_bytes"],
                        "state_bytes_per_request": out["state_bytes_per_request"],
                        "state_scale_bytes_per_request": out["state_scale_bytes_per_request"],
                        "kv_bytes_per_token": out["kv_bytes_per_token"],
                        "paged_requests": lay["paged"]["max_requests"],
                        "padded_requests": lay["padded"]["max_requests"],
                        "paged_block_size": lay["paged"]["block_size"],
                        "padded_block_size": lay["padded"]["block_size"],
                    }
                    base = base or row
                    for kind in ("paged", "padded"):
                        b = base[f"{kind}_requests"]
                        row[f"{kind}_vs_fp32_state"] = round(row[f"{kind}_requests"] / b, 3) if b else None
                    rows.append(row)
                    print(
                        f"{model:20s} TP{row['tp']} {context:>3s} kv {kv:8s} state {state:8s} "
                        f"paged {row['paged_requests']:5d} ({row['paged_vs_fp32_state']}x)  "
                        f"padded {row['padded_requests']:5d} ({row['padded_vs_fp32_state']}x)",
                        flush=True,
                    )
    # fp8 KV against bf16 KV at the same state dtype: the padded layout's page is pinned by the state
    for r in rows:
        if r["kv_dtype"] == "fp8":
            b = next(
                x
                for x in rows
                if x["kv_dtype"] == "bfloat16"
                and (x["model"], x["context_tokens"], x["state_dtype"])
                == (r["model"], r["context_tokens"], r["state_dtype"])
            )
            for kind in ("paged", "padded"):
                r[f"{kind}_fp8_kv_vs_bf16_kv"] = round(r[f"{kind}_requests"] / b[f"{kind}_requests"], 3)
    path = save(
        "state_quant_capacity",
        {"gpu": "h200 (0.9 utilization, bf16 weights, 6 GiB reserve; hybridkv plan's rule)", "rows": rows},
    )
    print(path)


if __name__ == "__main__":
    main()

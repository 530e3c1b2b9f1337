"""Issue 40: a `hybridkv simulate` report concludes before it tabulates. It names the best configuration
on TTFT, throughput and prefix hits and by how much, says what hybridkv does unlike vLLM 0.33 and
what that changed, and names every setting that had no effect on the run (docs/simulate.md's own
`--compare preemption=recompute,swap` example used to give two identical columns, unexplained)."""

import json

import pytest

from hybridkv.cli import main

# 40 requests at once on a small MiniMax-M1 TP8 pool: at 4 GiB admission reserved never preempts them,
# first_chunk does at 1 GiB (and then swap and recompute differ)
SMALL = ["--rate", "1000", "--prompt-median", "2000", "--output-median", "1500"]
SMALL += ["--seed", "1", "--no-progress"]
ROOMY, TIGHT = ["--gpu-memory", "4GiB"], ["--gpu-memory", "1GiB"]


def _report(tmp_path, *argv: str) -> tuple[list[dict], str]:
    out = tmp_path / "r"
    requests = [] if "--requests" in argv else ["--requests", "40"]
    assert main(["simulate", *SMALL, *requests, *argv, "--out", str(out)]) == 0
    return json.loads((out / "report.json").read_text())["configs"], (out / "report.md").read_text()


def test_a_preemption_mode_that_never_ran_is_named_with_what_would_show_it(tmp_path, capsys):
    configs, md = _report(tmp_path, *ROOMY, "--workers", "1", "--compare", "preemption=recompute,swap")
    rec, swap = configs
    assert rec["totals"]["preemptions_recompute"] == swap["totals"]["preemptions_swap"] == 0
    printed = capsys.readouterr().out
    for text in (md, printed):
        assert (
            f"No effect in {swap['label']}: preemption=swap and host-memory 256GiB: nothing was preempted under "
            "admission=reserved (it admits only what it can finish); use --admission first_chunk to see preemption."
        ) in text
        assert (
            f"preemption=recompute and preemption=swap gave identical results ({rec['label']}; {swap['label']}): "
            "preemption had no effect on this run."
        ) in text


def test_under_first_chunk_admission_the_modes_differ_and_nothing_is_called_a_no_op(tmp_path):
    configs, md = _report(tmp_path, *TIGHT, "--admission", "first_chunk", "--compare", "preemption=recompute,swap")
    rec, swap = configs
    assert rec["totals"]["preemptions_recompute"] > 0 and swap["totals"]["preemptions_swap"] > 0
    assert "gave identical results" not in md and "nothing was preempted" not in md
    # the recompute run's host pool did nothing; the swap run's did
    assert f"No effect in {rec['label']}: host-memory 256GiB: no swap used it (preemption=recompute never swaps)." in md
    assert f"No effect in {swap['label']}: host-memory" not in md


def test_the_verdict_comes_first_and_names_the_best_by_its_own_figures(tmp_path):
    # (prefix caching off and on: they differ in hits; paged and padded did too until MiniMax's
    # lightning prefill exported its checkpoints, which brought them within 1% of each other)
    configs, md = _report(tmp_path, *TIGHT, "--workers", "1", "--compare", "prefix=none,lru")
    summary = md.split("## Summary\n\n")[1].split("\n\n")
    assert summary[0].startswith("Verdict. TTFT p50: ")
    figures = (
        ("TTFT p50", [c["latency_s"]["ttft"]["p50"] for c in configs], False, lambda v: f"{v:.3g} s"),
        ("output tokens / s", [c["totals"]["output_tokens_per_s"] for c in configs], True, lambda v: f"{v:,.0f}"),
        ("prefix hit rate", [100 * c["totals"]["prefix_hit_rate"] for c in configs], True, lambda v: f"{v:.1f}%"),
    )
    said_best = 0
    for name, vals, higher, fmt in figures:
        if max(vals) - min(vals) <= 0.01 * max(vals):
            assert f"{name}: every configuration within 1%" in summary[0]
            continue
        best = vals.index(max(vals) if higher else min(vals))
        other = 1 - best
        assert f"{name}: best {configs[best]['label']}, {fmt(vals[best])} against {fmt(vals[other])} " in summary[0]
        said_best += 1
    assert said_best >= 1  # no prefix cache hits nothing


@pytest.mark.parametrize("engine_flag", [[], ["--engine", "hybridkv"]])
def test_the_default_run_puts_vllm_beside_hybridkv_and_says_what_differs(tmp_path, engine_flag):
    configs, md = _report(tmp_path, *TIGHT, *engine_flag)
    labels = [c["label"] for c in configs]
    if engine_flag:
        assert len(labels) == 1 and "What differs" not in md
        return
    assert labels == ["vLLM 0.33 (emulated)", "hybridkv, vLLM's prefix caching", "hybridkv"]
    vllm, mid, ours = configs
    assert vllm["config"]["engine"] == "vllm" and vllm["layout"]["kind"] == "padded"
    assert ours["config"] == {**ours["config"], "engine": "hybridkv", "layout": "paged", "prefix": "lru"}
    summary = md.split("## Summary\n\n")[1].split("\n\n")
    assert summary[0].startswith("Verdict, hybridkv against vLLM 0.33 (emulated): TTFT p50 ")
    assert summary[1].startswith("What differs. hybridkv against vLLM 0.33 (emulated) on the same workload: layout ")
    assert f"padded at {vllm['layout']['block_size']}-token blocks" in summary[1]
    # the split adds up: engine share + prefix-policy share = the whole change, per figure
    a, m, b = (c["latency_s"]["ttft"]["p50"] for c in configs)
    assert summary[2].startswith("Why, measured with hybridkv, vLLM's prefix caching run beside them: ")
    assert f"TTFT p50 {a:.3g} s -> {b:.3g} s: " in summary[2]


def test_the_configuration_table_shows_what_ran_once_each(tmp_path):
    configs, md = _report(tmp_path, *TIGHT, "--engine", "hybridkv")
    table = md.split("## Configurations\n\n")[1].splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[2:] if line.startswith("|")}
    assert "None" not in "\n".join(table)
    assert rows["state dtype"].endswith("| lightning.kv bfloat16 |")
    assert rows["block size"].endswith(f"| {configs[0]['layout']['block_size']} |")
    assert [k for k in rows if k.lower() == "gpu"] == ["gpu"]


def test_the_default_run_says_which_flags_only_hybridkv_takes(tmp_path, capsys):
    configs, md = _report(tmp_path, *TIGHT, "--requests", "8", "--preemption", "swap")
    vllm, *ours = configs
    assert vllm["config"]["preemption"] == "recompute" and all(c["config"]["preemption"] == "swap" for c in ours)
    note = "--preemption: set for hybridkv's columns only; vLLM 0.33 (emulated) keeps vLLM's own policies"
    assert note in capsys.readouterr().err and note in md
    # --prefix none reaches vLLM's column too (its Mamba cache mode none): no note
    configs, md = _report(tmp_path, *TIGHT, "--requests", "8", "--prefix", "none")
    assert {c["config"]["prefix"] for c in configs} == {"none"} and "columns only" not in md

"""What a report concludes, in words, before any table: which configuration is best on TTFT,
throughput and prefix hits and by how much (:func:`verdict`), what hybridkv's engine does unlike
vLLM 0.33's and what that changed in the run (:func:`engine_differences`), and every setting that
had no effect on a run (:func:`no_effect`), so that two identical columns never go unexplained.

Every sentence is computed from the summaries (:func:`hybridkv.sim.report.summarize`); nothing here
is a recorded result.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["engine_differences", "no_effect", "resolved_rows", "verdict"]

# (name, value of a summary, higher is better, format)
_HEADLINE: tuple[tuple[str, Any, bool, Any], ...] = (
    ("TTFT p50", lambda s: s["latency_s"]["ttft"].get("p50", 0.0), False, lambda v: f"{v:.3g} s"),
    ("output tokens / s", lambda s: s["totals"]["output_tokens_per_s"], True, lambda v: f"{v:,.0f}"),
    ("prefix hit rate", lambda s: 100 * s["totals"]["prefix_hit_rate"], True, lambda v: f"{v:.1f}%"),
)


def _ratio(best: float, other: float, higher: bool) -> str:
    if other == best:
        return "the same"
    if higher:
        return f"{best / other:.2f}x" if other else "against none"
    return f"{other / best:.2f}x lower" if best else "against none"


def verdict(summaries: list[dict[str, Any]]) -> list[str]:
    """One sentence per headline figure (TTFT p50, output tokens / s, prefix hit rate): the best
    configuration, its value, and the next best's with the ratio; a figure on which every
    configuration agrees within 1% says so. Empty for a single configuration."""
    if len(summaries) < 2:
        return []
    vllm, ours = _engines(summaries)
    if vllm is not None and ours is not None:
        return [_head_to_head(ours, vllm)]
    out = []
    for name, value, higher, fmt in _HEADLINE:
        vals = [float(value(s)) for s in summaries]
        order = sorted(range(len(vals)), key=lambda i: -vals[i] if higher else vals[i])
        best, second = order[0], order[1]
        lo, hi = min(vals), max(vals)
        if hi - lo <= 0.01 * max(abs(hi), 1e-12):
            out.append(f"{name}: every configuration within 1% ({fmt(vals[best])}).")
            continue
        label = summaries[best]["label"]
        diff = (
            "tied"
            if vals[best] == vals[second]
            else f"{vals[best] - vals[second]:+.1f} percentage points"
            if name == "prefix hit rate"
            else _ratio(vals[best], vals[second], higher)
        )
        other = summaries[second]["label"]
        line = f"{name}: best {label}, {fmt(vals[best])} against {fmt(vals[second])} ({other}): {diff}"
        if len(vals) > 2:
            line += f"; worst {summaries[order[-1]]['label']}, {fmt(vals[order[-1]])}"
        out.append(line + ".")
    return ["Verdict. " + " ".join(out)]


def _engines(summaries: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The vLLM 0.33 (emulated) run and the last run of hybridkv's engine, where both are there."""
    vllm = next((s for s in summaries if s["config"]["engine"] == "vllm"), None)
    ours = next((s for s in reversed(summaries) if s["config"]["engine"] == "hybridkv"), None)
    return vllm, ours


def _head_to_head(ours: dict[str, Any], vllm: dict[str, Any]) -> str:
    """The verdict of hybridkv against vLLM: per headline figure, who is better and by how much."""
    parts = []
    for name, value, higher, fmt in _HEADLINE:
        b, a = float(value(ours)), float(value(vllm))
        if abs(b - a) <= 0.01 * max(abs(a), abs(b), 1e-12):
            parts.append(f"{name} {fmt(b)} against {fmt(a)}: the same within 1%")
            continue
        better = ours if (b > a) == higher else vllm
        if name == "prefix hit rate":
            by = f"{abs(b - a):.1f} percentage points"
        else:
            big, small = max(a, b), min(a, b)
            by = f"{big / small:.2f}x" if small else "against none"
        parts.append(f"{name} {fmt(b)} against {fmt(a)}: {better['label']} better by {by}")
    return f"Verdict, {ours['label']} against {vllm['label']}: " + "; ".join(parts) + "."


def _resolved(s: dict[str, Any]) -> dict[str, Any]:
    """The config a run used: defaults (``None``) resolved, state dtypes per component."""
    resolved = s.get("resolved", {})
    out = s["config"] | {k: v for k, v in resolved.items() if s["config"].get(k) is None}
    return out | ({"state_dtype": resolved["state_dtype"]} if "state_dtype" in resolved else {})


def engine_differences(summaries: list[dict[str, Any]]) -> list[str]:
    """For a report holding vLLM 0.33 (emulated) and hybridkv's engine: the policies that differ
    (resolved values) and what each changed in this run, from the run's own counters."""
    vllm, ours = _engines(summaries)
    if vllm is None or ours is None:
        return []
    a, b = _resolved(vllm), _resolved(ours)
    fields = (
        ("layout", lambda c: f"{c['layout']} at {c['block_size']}-token blocks"),
        ("admission", lambda c: c["admission"]),
        ("preemption", lambda c: f"{c['preemption']}, host pool {c['host_memory']}, watermark {c['watermark']:g}"),
        (
            "prefix cache",
            lambda c: "off" if c["prefix"] == "none" else f"{c['prefix']} eviction, {c['checkpoint']} checkpoints",
        ),
        ("state dtype", lambda c: c["state_dtype"]),
    )
    differ = [f"{n} {f(b)} (vLLM: {f(a)})" for n, f in fields if f(a) != f(b)]
    if not differ:
        return []
    ta, tb = vllm["totals"], ours["totals"]
    pa, pb = vllm["pressure"], ours["pressure"]
    what = [
        f"prefix hits {100 * tb['prefix_hit_rate']:.1f}% against {100 * ta['prefix_hit_rate']:.1f}% "
        f"({tb['prefix_hit_tokens']:,} and {ta['prefix_hit_tokens']:,} prompt tokens served from cache)",
        f"preemptions {tb['preemptions_recompute'] + tb['preemptions_swap']:,} against "
        f"{ta['preemptions_recompute'] + ta['preemptions_swap']:,} ({pb['recomputed_tokens']:,} and "
        f"{pa['recomputed_tokens']:,} tokens recomputed)",
        f"requests queued for memory {pb['queued_memory_request_s']:,.1f} request-s against "
        f"{pa['queued_memory_request_s']:,.1f}, behind full batches {pb['queued_batch_request_s']:,.1f} against "
        f"{pa['queued_batch_request_s']:,.1f}",
        f"pool {ours['layout']['num_blocks'] - 1:,} blocks of {ours['layout']['block_size']} tokens against "
        f"{vllm['layout']['num_blocks'] - 1:,} of {vllm['layout']['block_size']}",
    ]
    return [
        f"What differs. {ours['label']} against {vllm['label']} on the same workload: " + "; ".join(differ) + ".",
        *_split(summaries, vllm, ours),
        "What it changed here (hybridkv first): " + "; ".join(what) + ". To give each difference its one cause, "
        "--compare engine=hybridkv,vllm runs one column per policy switched from vLLM's to hybridkv's.",
    ]


_PREFIX_FIELDS = {"prefix", "checkpoint", "checkpoint_export"}


def _split(summaries: list[dict[str, Any]], vllm: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Where a run of hybridkv's engine with vLLM's prefix caching sits between the two: each headline
    figure's change split into the engine's share (layout, admission, preemption) and the prefix
    policy's. Empty without such a run."""
    keys = [k for k in ours["config"] if k != "label"]
    mid = next(
        (s for s in summaries if s is not ours and s["config"]["engine"] == "hybridkv"
         and {k for k in keys if s["config"][k] != ours["config"][k]} <= _PREFIX_FIELDS | {"speculative"}
         and any(s["config"][k] != ours["config"][k] for k in _PREFIX_FIELDS)),
        None,
    )  # fmt: skip
    if mid is None:
        return []
    parts = []
    for name, value, _, fmt in _HEADLINE:
        a, m, b = (float(value(s)) for s in (vllm, mid, ours))
        unit = " points" if name == "prefix hit rate" else ""
        show = (lambda v: f"{v:+.1f}") if unit else (lambda v, f=fmt: ("+" if v >= 0 else "-") + f(abs(v)))
        parts.append(
            f"{name} {fmt(a)} -> {fmt(b)}: {show(m - a)}{unit} from the engine (layout, admission, preemption), "
            f"{show(b - m)}{unit} from the prefix policy"
        )
    return [f"Why, measured with {mid['label']} run beside them: " + "; ".join(parts) + "."]


def _why_no_preemption(c: dict[str, Any]) -> str:
    if c["admission"] != "first_chunk":
        return (
            f"nothing was preempted under admission={c['admission']} (it admits only what it can finish); "
            "use --admission first_chunk to see preemption"
        )
    return "nothing was preempted: the pool never ran out (lower --gpu-memory to see preemption)"


def _config_no_effect(s: dict[str, Any]) -> list[str]:
    c, t = _resolved(s), s["totals"]
    out = []
    preempted = t["preemptions_recompute"] + t["preemptions_swap"]
    if not preempted:
        host = f" and host-memory {c['host_memory']}" if c["host_memory"] not in ("0", "") else ""
        out.append(f"preemption={c['preemption']}{host}: {_why_no_preemption(c)}")
    elif c["host_memory"] not in ("0", "") and not t["preemptions_swap"]:
        why = "never swaps" if c["preemption"] == "recompute" else "recomputed every victim"
        out.append(f"host-memory {c['host_memory']}: no swap used it (preemption={c['preemption']} {why})")
    if c["host_cache"] not in ("0", "") and c["prefix"] != "none" and not t.get("host_tier_offload_bytes", 0):
        out.append(
            f"host-cache {c['host_cache']}: the device's prefix cache never evicted, so nothing reached the tier"
        )
    if c["prefix"] != "none" and not t["prefix_hit_tokens"]:
        out.append(f"prefix={c['prefix']}: no prompt reused a cached prefix (hit rate 0%)")
    return out


def _fingerprint(s: dict[str, Any]) -> str:
    return json.dumps([s["totals"], s["latency_s"], s["pressure"]], sort_keys=True)


def no_effect(summaries: list[dict[str, Any]]) -> list[str]:
    """Every setting that had no effect: per configuration (a preemption mode with nothing preempted,
    a host pool no swap used, a host tier nothing reached, a prefix cache with no hit), and, for a
    comparison, every pair of configurations that differ in one field and gave identical results."""
    out = []
    who: dict[str, list[str]] = {}  # each line once, with the configurations it is true of
    for s in summaries:
        for line in _config_no_effect(s):
            who.setdefault(line, []).append(s["label"])
    for line, labels in who.items():
        where = "every configuration" if len(labels) == len(summaries) > 1 else " and ".join(labels)
        out.append(f"No effect in {where}: {line}.")
    keys = [k for k in summaries[0]["config"] if k != "label"]
    for i in range(len(summaries)):
        for j in range(i + 1, len(summaries)):
            a, b = summaries[i], summaries[j]
            diff = [k for k in keys if a["config"][k] != b["config"][k]]
            if len(diff) == 1 and _fingerprint(a) == _fingerprint(b):
                k = diff[0]
                out.append(
                    f"{k}={a['config'][k]} and {k}={b['config'][k]} gave identical results ({a['label']}; "
                    f"{b['label']}): {k} had no effect on this run."
                )
    return out


def resolved_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """The configuration table: one row per setting with the value each run used (defaults resolved:
    state dtype, block size, GPU figures), the GPU once, fields that are bookkeeping left out."""
    skip = {"label", "integrity_every", "checkpoint_export"}
    configs = [_resolved(s) for s in summaries]
    keys = [k for k in configs[0] if k not in skip]
    rows = [["", *[s["label"] for s in summaries]]]
    for k in keys:
        vals = [str(c[k]) for c in configs]
        if k == "gpu":
            vals = [f"{s['gpu']['name']} ({c['gpu']})" if s["gpu"]["name"].lower() != str(c["gpu"]).lower()
                    else s["gpu"]["name"] for s, c in zip(summaries, configs, strict=True)]  # fmt: skip
        if k == "accept_rate" and all(c["speculative"] == 0 for c in configs):
            continue  # (no draft: nothing to accept)
        rows.append([k.replace("_", " "), *vals])
    rows.append(
        ["blocks x bytes", *[f"{s['layout']['num_blocks']:,} x {s['layout']['bytes_per_block']:,}" for s in summaries]]
    )
    return rows

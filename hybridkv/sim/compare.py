"""Run several configurations on one workload: in this process, in worker processes, or on Ray.

``--compare KEY=V1,V2 [KEY=V1,V2 ...]`` builds the cartesian product of the given values over a base
:class:`~hybridkv.sim.config.SimConfig` (:func:`expand`); ``engine=hybridkv,vllm`` becomes, per
combination of the other keys, vLLM 0.33 (emulated) and one column per policy switched towards
hybridkv's (:func:`~hybridkv.sim.engines.ladder`). :func:`run_all` runs them in parallel
processes (``concurrent.futures``), or as Ray tasks when given a Ray address (``ray`` is an
optional extra: ``pip install 'hybridkv[ray]'``). Results come back in the order of the configs.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from hybridkv.sim.config import SimConfig
from hybridkv.sim.engines import ENGINES, ladder
from hybridkv.sim.report import summarize
from hybridkv.sim.simulator import simulate
from hybridkv.sim.workload import Workload

# --compare keys: flag-style spelling -> SimConfig field, and how to read a value
_KEYS: dict[str, tuple[str, type]] = {
    "layout": ("layout", str),
    "preemption": ("preemption", str),
    "prefix": ("prefix", str),
    "checkpoint": ("checkpoint", str),
    "gpu-memory": ("gpu_memory", str),
    "budget": ("gpu_memory", str),
    "host-memory": ("host_memory", str),
    "block-size": ("block_size", int),
    "speculative": ("speculative", int),
    "max-num-seqs": ("max_num_seqs", int),
    "max-batched-tokens": ("max_num_batched_tokens", int),
    "model": ("model", str),
    "tp": ("tp", int),
    "gpu": ("gpu", str),
    "watermark": ("watermark", float),
    "admission": ("admission", str),
    "engine": ("engine", str),
}


def expand(base: SimConfig, axes: Sequence[str]) -> list[SimConfig]:
    """``["layout=paged,padded", "preemption=recompute,swap"]`` -> 4 configs (cartesian product).

    Raises ``ValueError`` naming a bad key or value."""
    fields: list[str] = []
    values: list[list[Any]] = []
    for axis in axes:
        key, sep, text = axis.partition("=")
        key = key.strip().replace("_", "-")
        if not sep or not text.strip():
            raise ValueError(f"--compare {axis!r}: use KEY=V1,V2 (keys: {', '.join(_KEYS)})")
        if key not in _KEYS:
            raise ValueError(f"--compare: unknown key {key!r}: use one of {', '.join(_KEYS)}")
        field, kind = _KEYS[key]
        try:
            vals = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--compare {key}: {text!r} is not a list of {kind.__name__} values") from None
        if field in fields:
            raise ValueError(f"--compare: {key} given twice")
        fields.append(field)
        values.append(vals)
    engines = None
    if "engine" in fields:  # one column per switch from vLLM's policies to hybridkv's (engines.ladder)
        i = fields.index("engine")
        engines = values.pop(i)
        fields.pop(i)
        bad = [e for e in engines if e not in ENGINES]
        if bad:
            raise ValueError(f"--compare engine: {bad[0]!r} is not an engine: use {', '.join(ENGINES)}")
    out: list[SimConfig] = []
    for combo in itertools.product(*values):
        cfg = base.with_changes(**dict(zip(fields, combo, strict=True)))
        if engines is None:
            out.append(cfg)
        elif set(engines) == set(ENGINES):
            out += ladder(cfg.with_changes(engine="hybridkv"))
        else:
            out += [cfg.with_changes(engine=e) for e in engines]
    return out


def _one(cfg: SimConfig, workload: Workload, progress: bool, position: int) -> dict[str, Any]:
    return summarize(simulate(cfg, workload, progress=progress, position=position))


def run_all(
    configs: Sequence[SimConfig],
    workload: Workload,
    workers: int | None = None,
    progress: bool = False,
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """Summaries of ``configs`` on ``workload``, in order. ``workers``: processes (default: the CPU
    count, at most one per config; 1 runs in this process). ``ray_address``: run on a Ray cluster
    (``"local"`` starts a local instance). A workload without a request raises ``ValueError``
    before anything runs."""
    if not isinstance(workload, Workload):
        raise TypeError(f"run_all needs a Workload, got {type(workload).__name__}")
    workload.check_runnable()
    if ray_address is not None:
        return _run_ray(configs, workload, ray_address)
    n = min(len(configs), workers or os.cpu_count() or 1)
    if n <= 1:
        return [_one(c, workload, progress, 0) for c in configs]
    with ProcessPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(_one, c, workload, progress, i) for i, c in enumerate(configs)]
        return [f.result() for f in futures]


def _run_ray(configs: Sequence[SimConfig], workload: Workload, address: str) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'hybridkv[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(_one)
        ref = ray.put(workload)
        return ray.get([task.remote(c, ref, False, 0) for c in configs])
    finally:
        if started:
            ray.shutdown()

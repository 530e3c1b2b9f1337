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
import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from hybridkv.blockmgr.prefix import CheckpointPolicy
from hybridkv.planner.layout import LayoutKind
from hybridkv.scheduler_adapter.gpu import PreemptionMode, load_gpu
from hybridkv.scheduler_adapter.requests import AdmissionPolicy
from hybridkv.sim.config import SimConfig
from hybridkv.sim.engines import ENGINES, ladder
from hybridkv.sim.report import summarize
from hybridkv.sim.settings import PREFIX_POLICIES
from hybridkv.sim.simulator import simulate
from hybridkv.sim.workload import Workload
from hybridkv.units import parse_bytes

# --compare keys: flag-style spelling -> SimConfig field, and how to read a value
_KEYS: dict[str, tuple[str, type]] = {
    "layout": ("layout", str),
    "preemption": ("preemption", str),
    "prefix": ("prefix", str),
    "checkpoint": ("checkpoint", str),
    "checkpoint-export": ("checkpoint_export", int),
    "gpu-memory": ("gpu_memory", str),
    "budget": ("gpu_memory", str),
    "host-memory": ("host_memory", str),
    "host-cache": ("host_cache", str),
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
    "state-dtype": ("state_dtype", str),
}
# the values a key's field takes where they are a fixed set (checked with the key named, before any run)
_CHOICES: dict[str, tuple[str, ...]] = {
    "layout": tuple(k.value for k in LayoutKind),
    "preemption": tuple(m.value for m in PreemptionMode),
    "prefix": PREFIX_POLICIES,
    "checkpoint": tuple(c.value for c in CheckpointPolicy),
    "admission": tuple(a.value for a in AdmissionPolicy),
    "engine": ENGINES,
    "state-dtype": ("float32", "bfloat16", "float16", "int8", "fp8"),  # int8 / fp8: row scales in the set
}
_MINIMUM = {"checkpoint_export": 0, "block_size": 1, "speculative": 0, "max_num_seqs": 1, "max_num_batched_tokens": 1,
            "tp": 1}


def parse_axis(axis: str) -> tuple[str, str, list[Any], list[str]]:
    """One ``--compare`` argument, ``KEY=V1,V2``: ``(key, field, values, texts)`` with each value
    read and checked (``texts``: as written, for labels). Raises ``ValueError`` naming the key and,
    for a fixed set, the valid values; also for an empty value or one given twice."""
    key, sep, text = axis.partition("=")
    key = key.strip().replace("_", "-")
    if not sep or not text.strip():
        raise ValueError(f"--compare {axis!r}: use KEY=V1,V2 (keys: {', '.join(_KEYS)})")
    if key not in _KEYS:
        raise ValueError(f"--compare: unknown key {key!r}: use one of {', '.join(_KEYS)}")
    field, kind = _KEYS[key]
    texts = [v.strip() for v in text.split(",")]
    if "" in texts:
        raise ValueError(f"--compare {key}={text}: an empty value (a stray comma?)")
    values: list[Any] = []
    seen: dict[Any, str] = {}
    for t in texts:
        v = _value(key, field, kind, t)
        same = _identity(field, v)
        if same in seen:
            also = f" (as {seen[same]!r})" if seen[same] != t else ""
            raise ValueError(f"--compare {key}: {t!r} is given twice{also}")
        seen[same] = t
        values.append(v)
    return key, field, values, texts


def _value(key: str, field: str, kind: type, text: str) -> Any:
    choices = _CHOICES.get(key)
    if choices is not None:
        if text not in choices:
            raise ValueError(f"--compare {key}: {text!r} is not one of {', '.join(choices)}")
        return text
    if kind is int:
        try:
            v = int(text)
        except ValueError:
            raise ValueError(f"--compare {key}: {text!r} is not a whole number") from None
        if v < _MINIMUM[field]:
            raise ValueError(f"--compare {key}: must be >= {_MINIMUM[field]}, got {v}")
        return v
    if kind is float:
        try:
            f = float(text)
        except ValueError:
            raise ValueError(f"--compare {key}: {text!r} is not a number") from None
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"--compare {key}: must be in [0, 1], got {text}")
        return f
    if field in ("gpu_memory", "host_memory", "host_cache"):
        if not (field in ("host_memory", "host_cache") and text == "0"):
            try:
                parse_bytes(text)
            except ValueError as e:
                raise ValueError(f"--compare {key}: {e}") from None
    elif field == "gpu":
        try:
            load_gpu(text)
        except ValueError as e:
            raise ValueError(f"--compare gpu: {' '.join(str(e).split())}") from None
    return text


def _identity(field: str, value: Any) -> Any:
    """What makes two values of ``field`` the same configuration (``8GiB`` and ``8192MiB`` are one)."""
    if field in ("gpu_memory", "host_memory", "host_cache"):
        return 0 if value == "0" else parse_bytes(value)
    if field in ("gpu", "model"):
        return value.lower()
    return value


def expand(base: SimConfig, axes: Sequence[str]) -> list[SimConfig]:
    """``["layout=paged,padded", "preemption=recompute,swap"]`` -> 4 configs (cartesian product).

    Each configuration's label names every key that varies (more than one value), as written:
    ``gpu=h100 checkpoint=branch_and_last``; with ``engine=hybridkv,vllm`` that goes before the
    label of the :func:`~hybridkv.sim.engines.ladder` column. Without a varying key the base label
    stays. Raises ``ValueError`` naming a bad key or value (:func:`parse_axis`), or a key given twice."""
    fields: list[str] = []
    keys: list[str] = []
    values: list[list[Any]] = []
    texts: list[list[str]] = []
    for axis in axes:
        key, field, vals, written = parse_axis(axis)
        if field in fields:
            raise ValueError(f"--compare: {key} given twice")
        keys.append(key)
        fields.append(field)
        values.append(vals)
        texts.append(written)
    engines = None
    if "engine" in fields:  # one column per switch from vLLM's policies to hybridkv's (engines.ladder)
        i = fields.index("engine")
        engines = values.pop(i)
        fields.pop(i)
        keys.pop(i)
        texts.pop(i)
    out: list[SimConfig] = []
    for combo in itertools.product(*(range(len(v)) for v in values)):
        cfg = base.with_changes(**{f: values[k][j] for k, (f, j) in enumerate(zip(fields, combo, strict=True))})
        head = " ".join(f"{keys[k]}={texts[k][j]}" for k, j in enumerate(combo) if len(values[k]) > 1)
        if engines is None:
            out.append(cfg.with_changes(label=head) if head else cfg)
        elif set(engines) == set(ENGINES):
            out += [c.with_changes(label=f"{head} {c.label}") if head else c
                    for c in ladder(cfg.with_changes(engine="hybridkv"))]
        else:  # one engine (a subset of ENGINES other than all of it)
            out += [cfg.with_changes(engine=e, **({"label": head} if head else {})) for e in engines]
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
    (``"local"`` starts a local instance; any other value is ``ray.init``'s ``address``, e.g.
    ``auto`` or ``HOST:6379``). A workload without a request raises ``ValueError`` before anything
    runs. On ``KeyboardInterrupt`` (Ctrl-C) the worker processes or Ray tasks are stopped before
    it propagates; nothing is returned."""
    if not isinstance(workload, Workload):
        raise TypeError(f"run_all needs a Workload, got {type(workload).__name__}")
    workload.check_runnable()
    if ray_address is not None:
        check_ray_address(ray_address)
        return _run_ray(configs, workload, ray_address)
    n = min(len(configs), workers or os.cpu_count() or 1)
    if n <= 1:
        return [_one(c, workload, progress, 0) for c in configs]
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(max_workers=n, initializer=_ignore_sigint)
    try:
        futures = [pool.submit(_one, c, workload, progress, i) for i, c in enumerate(configs)]
        results = [f.result() for f in futures]
    except BaseException:  # Ctrl-C or a failed run: stop the others now, not after they finish
        pool.shutdown(wait=False, cancel_futures=True)
        ours = [p for p in multiprocessing.active_children() if p not in before]
        for p in ours:
            p.terminate()
        for p in ours:
            p.join(1.0)
        raise
    pool.shutdown()
    return results


def _ignore_sigint() -> None:
    """Worker processes leave Ctrl-C to the parent (which stops them): a terminal sends SIGINT to the
    whole process group, and a worker would otherwise print its own traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def check_ray_address(address: str, timeout_s: float = 3.0) -> None:
    """Raise ``ValueError`` (one line) unless Ray imports and, for a ``HOST:PORT`` (or
    ``ray://HOST:PORT``) address, something answers on that port within ``timeout_s`` seconds:
    ``ray.init`` would otherwise retry for minutes. ``local`` and ``auto`` are not probed."""
    import importlib.util
    import socket

    if importlib.util.find_spec("ray") is None:
        raise ValueError("--ray needs Ray: pip install 'hybridkv[ray]'")
    if address in ("local", "auto"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ray {address!r}: use local, auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"--ray {address}: no Ray head answers there ({e.strerror or e}); start one with "
            f"`ray start --head --port={port}`, or use --ray local"
        ) from None


def _run_ray(configs: Sequence[SimConfig], workload: Workload, address: str) -> list[dict[str, Any]]:
    """The configs as Ray tasks (one CPU each) on the cluster at ``address`` (``"local"``: a local
    instance started here and stopped after), the workload put into the object store once. Ray must
    import, and on a cluster every node needs hybridkv installed (the tasks import it)."""
    import ray  # (check_ray_address: it imports)

    started = not ray.is_initialized()
    if started:
        ray.init(
            address=None if address == "local" else address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    refs: list[Any] = []
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_one)
        ref = ray.put(workload)
        refs = [task.remote(c, ref, False, 0) for c in configs]
        return ray.get(refs)
    except BaseException:
        for r in refs:  # Ctrl-C or a failed task: the others stop too
            ray.cancel(r, force=True)
        raise
    finally:
        if started:
            ray.shutdown()

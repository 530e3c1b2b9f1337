"""Shared helpers of the benchmarks: machine facts, timing statistics, saving results as JSON."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    from hybridkv.blockmgr import kernels

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        # hybridkv's compiled paths (blockmgr/kernels.py): on with numba unless HYBRIDKV_JIT=0
        "hybridkv_jit": kernels.ENABLED,
        "numba": getattr(kernels.numba, "__version__", None),
        "platform": platform.platform(),
        "load_average_1min": os.getloadavg()[0],  # other work on the machine inflates timings
    }


def time_us(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> dict[str, float]:
    """Run ``fn`` ``number`` times per repeat; per-call microseconds: best, median, worst repeat."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number * 1e6)
    return {"best_us": min(samples), "median_us": statistics.median(samples), "worst_us": max(samples)}


def result_path(name: str, now: _dt.datetime, results_dir: Path = RESULTS_DIR) -> Path:
    """``<results_dir>/<name>_<YYYY-MM-DD>_<HHMMSS>.json`` for ``now`` (UTC): date and time, so a second
    run the same day keeps the first; a second run in the same second gets ``_2``, ``_3``, ..."""
    stamp = now.astimezone(_dt.UTC).strftime("%Y-%m-%d_%H%M%S")
    path = results_dir / f"{name}_{stamp}.json"
    n = 2
    while path.exists():
        path = results_dir / f"{name}_{stamp}_{n}.json"
        n += 1
    return path


def save(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>_<date>_<time>.json`` (UTC, :func:`result_path`) with the date,
    time and machine added; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.UTC)
    payload = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "machine": machine_info(), **payload}
    path = result_path(name, now)
    with path.open("x") as f:  # never over an earlier result
        f.write(json.dumps(payload, indent=2) + "\n")
    return path

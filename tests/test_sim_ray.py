"""`hybridkv simulate --compare ... --ray`: the grid as Ray tasks, on a local instance (`--ray local`)
and on a cluster started by the test (`ray start --head`, then `--ray ADDRESS`); the report files
must equal the process-pool run's byte for byte. Skips without Ray (`pip install 'hybridkv[ray]'`)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybridkv.cli import main

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hybridkv[ray]')")

GRID = ["--requests", "6", "--no-progress", "--compare", "layout=paged,padded", "preemption=recompute,swap"]
FILES = ("report.json", "report.md", "report.html")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pool_reports(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pool") / "r"
    assert main(["simulate", *GRID, "--workers", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def head() -> str:
    """A one-node Ray cluster of 2 CPUs in a temporary folder (short: Ray's socket paths have a limit),
    stopped by killing the process group it started, never `ray stop` (that stops every Ray on the host)."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip(f"no `ray` command beside {sys.executable}")
    temp = tempfile.mkdtemp(prefix="hkray", dir="/tmp")
    port = _free_port()
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}", "--node-ip-address=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # up once its GCS answers on the port
            if proc.poll() is not None:
                pytest.fail(f"ray start --head exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("ray start --head did not come up in 120 s")
        yield address
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def _same(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_ray_local_equals_the_process_pool_byte_for_byte(pool_reports, tmp_path):
    out = tmp_path / "r"
    assert main(["simulate", *GRID, "--ray", "local", "--out", str(out)]) == 0
    assert not ray.is_initialized()  # the instance it started is stopped again
    _same(out, pool_reports)


def test_ray_address_runs_on_an_existing_cluster(head, pool_reports, tmp_path):
    out = tmp_path / "r"
    proc = subprocess.run(  # a driver of its own, as a user runs it against a cluster
        [sys.executable, "-m", "hybridkv", "simulate", *GRID, "--ray", head, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _same(out, pool_reports)

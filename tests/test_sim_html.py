"""report.html in headless Chromium: a screenshot shows every plot, drawn (skips without Chromium).

Each plot's figure has a frame in its own marker colour (``hybridkv.sim.plots.PLOTS``). The test
finds each frame in the screenshot, checks that it has the size the page gives the image (so the
embedded PNG decoded and was laid out), and that the inside holds a drawing (many non-white
pixels in several colours), not a blank or a broken-image icon.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from hybridkv.sim.compare import expand, run_all
from hybridkv.sim.config import SimConfig
from hybridkv.sim.plots import PLOTS
from hybridkv.sim.report import write_reports
from hybridkv.sim.workload import SyntheticConfig, synthetic

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium)")

WIDTH, HEIGHT = 1100, 6000


def _screenshot(page, out, profile) -> np.ndarray:
    image = pytest.importorskip("matplotlib.image")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--screenshot={out}",
        page.as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    rgb = image.imread(str(out))[..., :3]
    return np.rint(rgb * 255).astype(np.int16)


def test_every_plot_draws_in_headless_chromium(tmp_path):
    pytest.importorskip("matplotlib")
    workload = synthetic(SyntheticConfig(num_requests=40, rate=1000.0, prompt_median=4000, output_median=256, seed=1))
    configs = expand(SimConfig(gpu_memory="2GiB"), ["preemption=swap,recompute"])
    paths = write_reports(run_all(configs, workload, workers=1), tmp_path / "report")
    page = paths[2]
    text = page.read_text()
    sizes = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"<img id='plot-(\w+)'[^>]*width='(\d+)' height='(\d+)'", text)
    }
    assert set(sizes) == {p for p, _, _ in PLOTS}
    shot = _screenshot(page, tmp_path / "shot.png", tmp_path / "profile")
    assert shot.shape[:2] == (HEIGHT, WIDTH)
    for plot_id, _, colour in PLOTS:
        mask = (np.abs(shot - np.array(colour)) <= 3).all(axis=-1)
        ys, xs = np.nonzero(mask)
        assert ys.size > 1000, f"plot {plot_id}: its frame is not on the screenshot"
        top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
        w, h = sizes[plot_id]
        assert abs((right - left + 1) - w) <= 2 and abs((bottom - top + 1) - h) <= 2, (plot_id, (w, h))
        inside = shot[top + 12 : bottom - 12, left + 12 : right - 12].reshape(-1, 3)
        ink = (inside < 235).any(axis=-1)
        assert ink.mean() > 0.02, f"plot {plot_id}: nearly blank"
        colours = np.unique(inside[ink] // 32, axis=0)
        assert len(colours) >= 4, f"plot {plot_id}: drawn in {len(colours)} colour(s) only"

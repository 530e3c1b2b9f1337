"""report.html in headless Chromium, read through the DOM (Selenium + Debian's chromium-driver).

For the report of a small default run and of a ``--compare layout=paged,padded
preemption=recompute,swap`` run, every ``<img>`` must have finished decoding with the natural size
of the PNG it embeds, and the region of a full-page screenshot that the DOM gives as its bounding
box must hold a drawing (many non-white pixels in several colours). The page must show the
summary, the pressure-cost figures, the definitions and the memory plot's event legend. The same
check must fail on a page whose plots are all-white PNGs and on one whose PNG data is corrupt.

Selenium rather than Playwright: Debian's ``chromium-driver`` matches its ``chromium`` exactly, so
nothing is downloaded (Playwright wants its own browser build, or a pinned one). Skips, with the
reason, without selenium, chromium, chromedriver or matplotlib.
"""

from __future__ import annotations

import base64
import io
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hybridkv.sim.plots as plots
from hybridkv.cli import main

webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
pytest.importorskip("matplotlib", reason="needs matplotlib (the reports extra)")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None, reason="needs chromium and chromium-driver (Debian packages)"
)

# 40 requests at once, long outputs, a 1 GiB MiniMax-M1 TP8 pool: a few preemptions in every mode
SMALL = ["--requests", "40", "--rate", "1000", "--prompt-median", "2000", "--output-median", "1500"]
SMALL += ["--gpu-memory", "1GiB", "--seed", "1", "--no-progress"]
COMPARE = ["--compare", "layout=paged,padded", "preemption=recompute,swap", "--workers", "1"]
COST_ROWS = (
    "bounded by",
    "memory-held / batch-full / nothing waiting",
    "swap time on the host link / added to steps",
    "recomputed tokens (compute)",
    "request-s swapped / awaiting recompute",
    "request-s queued for memory / batch",
)

# every <img>: decoding state, natural size, the src, and its box in page coordinates
_IMAGES_JS = """
return Array.from(document.images).map(img => {
  const r = img.getBoundingClientRect();
  return {id: img.id, complete: img.complete, nw: img.naturalWidth, nh: img.naturalHeight, src: img.src,
          x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height};
});
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                "--force-device-scale-factor=1", "--window-size=1200,900", "--no-first-run",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):  # fmt: skip
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    pages = {}
    for name, extra in (("default", []), ("compare", COMPARE)):
        assert main(["simulate", *SMALL, *extra, "--out", str(out / name)]) == 0
        pages[name] = out / name / "report.html"
    return pages


def _png_size(src: str) -> tuple[int, int] | None:
    """Width and height from the IHDR of a ``data:image/png;base64,`` URI; None if it is not one."""
    head, _, data = src.partition(",")
    if head != "data:image/png;base64":
        return None
    raw = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4))
    if raw[:8] != b"\x89PNG\r\n\x1a\n" or raw[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", raw[16:24])


def _screenshot(d: Any) -> np.ndarray:
    """The whole page as RGB uint8 ``[height, width, 3]`` (Chrome DevTools, beyond the viewport)."""
    from matplotlib.image import imread

    m = d.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": m["width"], "height": m["height"], "scale": 1}
    shot = d.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
    rgb = imread(io.BytesIO(base64.b64decode(shot["data"])), format="png")[..., :3]
    return np.rint(rgb * 255).astype(np.uint8)


def page_problems(d: Any, page: Path) -> list[str]:
    """What is wrong with the plots of ``page`` as Chromium shows it (empty: nothing)."""
    d.get(page.as_uri())
    d.execute_async_script(
        "const done = arguments[0];"
        "Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null))).then(() => done(true));"
    )
    images = d.execute_script(_IMAGES_JS)
    if not images:
        return ["no <img> on the page"]
    shot = _screenshot(d)
    problems = []
    for img in images:
        name, size = img["id"] or "?", _png_size(img["src"])
        if size is None:
            problems.append(f"{name}: src is not a base64 PNG")
            continue
        if not img["complete"] or img["nw"] <= 0 or img["nh"] <= 0:
            problems.append(f"{name}: did not decode (naturalWidth {img['nw']})")
            continue
        if (img["nw"], img["nh"]) != size:
            problems.append(f"{name}: natural size {img['nw']}x{img['nh']}, the PNG says {size[0]}x{size[1]}")
        x, y, w, h = (int(round(img[k])) for k in ("x", "y", "w", "h"))
        region = shot[y : y + h, x : x + w].reshape(-1, 3).astype(np.int16)
        if region.shape[0] < 0.9 * w * h:
            problems.append(f"{name}: its box {w}x{h} at ({x}, {y}) lies outside the screenshot")
            continue
        ink = (region < 235).any(axis=-1)
        colours = len(np.unique(region[ink] // 32, axis=0))
        if ink.mean() < 0.02 or colours < 4:
            problems.append(f"{name}: blank ({100 * ink.mean():.2f}% non-white pixels in {colours} colours)")
    return problems


def _text(d: Any, css: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in d.find_elements(By.CSS_SELECTOR, css)]


def _cells(d: Any, row: str) -> list[str]:
    from selenium.webdriver.common.by import By

    for tr in d.find_elements(By.CSS_SELECTOR, "table.pressure tbody tr"):
        tds = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        if tds and tds[0] == row:
            return tds[1:]
    return []


@pytest.mark.parametrize("name", ["default", "compare"])
def test_every_plot_decodes_and_draws_and_the_costs_show(driver, reports, name):
    page = reports[name]
    assert page_problems(driver, page) == []
    ids = [i["id"] for i in driver.execute_script(_IMAGES_JS)]
    every = [f"plot-{p}" for p, _ in plots.PLOTS]
    assert ids == [i for i in every if i in ids] and {"plot-memory", "plot-latency", "plot-capacity"} <= set(ids)
    # the default: vLLM 0.33 (emulated), hybridkv with vLLM's prefix caching, hybridkv
    n = 4 if name == "compare" else 3
    summary = _text(driver, "#summary p")
    assert len(summary) >= n and all(summary), summary
    if name == "compare":
        assert summary[0].startswith("Verdict. TTFT p50: ")
        assert any(p.startswith("The 4 configurations differ in layout, preemption") for p in summary)
    else:
        assert summary[0].startswith("Verdict, hybridkv against vLLM 0.33 (emulated): TTFT p50 ")
        assert summary[1].startswith("What differs. hybridkv against vLLM 0.33 (emulated) on the same workload: ")
        assert summary[2].startswith("Why, measured with hybridkv, vLLM's prefix caching run beside them: ")
    # conclusions before definitions: every plot lies above the definitions on the page
    first_dl = driver.execute_script("return document.querySelector('dl.figures').getBoundingClientRect().top")
    plot_tops = driver.execute_script("return Array.from(document.images).map(i => i.getBoundingClientRect().top)")
    assert max(plot_tops) < first_dl
    # the configurations as run: every value resolved, each setting once
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('table.configurations tbody tr'))"
        ".map(tr => Array.from(tr.cells).map(td => td.textContent))"
    )
    assert not any("None" in cells for cells in rows), rows
    settings = [cells[0].lower() for cells in rows]
    assert settings.count("gpu") == 1 and len(set(settings)) == len(settings), settings
    assert {"state dtype", "block size", "gpu calibration"} <= set(settings)
    for row in COST_ROWS:
        cells = _cells(driver, row)
        assert len(cells) == n and all(cells), (row, cells)
    assert all(re.match(r"(memory|compute|arrivals) \(\d", c) for c in _cells(driver, "bounded by"))
    terms = _text(driver, "dl.categories dt")
    assert terms == list(plots.CATEGORY_DEFINITIONS) and all(_text(driver, "dl.categories dd"))
    assert set(COST_ROWS) <= set(_text(driver, "dl.figures dt"))
    events = {e.get_attribute("data-event"): e for e in driver.find_elements("css selector", "li.event")}
    # an event no configuration had gets no legend line (the page says what did not happen instead)
    assert list(events) == [k for k, *_ in plots.EVENTS if k in events] and all(e.text for e in events.values())
    if name == "compare":
        assert list(events) == [k for k, *_ in plots.EVENTS]
    counts = {k: [int(c) for c in e.get_attribute("data-counts").split(",")] for k, e in events.items()}
    assert all(len(c) == n for c in counts.values()), counts
    if name == "compare":  # the marked events: recompute configs recompute, swap configs swap and resume
        assert counts["preempt_recompute"][0] > 0 and counts["preempt_recompute"][2] > 0
        assert counts["preempt_swap"][1] > 0 and counts["preempt_swap"][3] > 0 and counts["resumed"][1] > 0


def test_the_check_fails_for_blank_and_for_broken_plots(driver, reports, tmp_path, monkeypatch):
    def white(plot_id, summaries):  # the renderer emits an all-white PNG of the plot's size
        from matplotlib.figure import Figure

        fig = Figure(figsize=(plots.WIDTH_IN, 3.0), dpi=plots.DPI)
        return plots._png(fig), int(plots.WIDTH_IN * plots.DPI), 300

    monkeypatch.setattr(plots, "render_plot", white)
    blank = tmp_path / "blank"
    assert main(["simulate", *SMALL, "--requests", "4", "--out", str(blank)]) == 0
    problems = page_problems(driver, blank / "report.html")
    assert len(problems) == len(plots.PLOTS) and all(": blank (" in p for p in problems), problems
    monkeypatch.undo()

    text = reports["default"].read_text()
    start = text.index("data:image/png;base64,") + len("data:image/png;base64,") + 400
    # the first plot's base64 stops being base64 / its PNG header stays and its image data is garbage
    for garbage, problem in (("!" * 2000, "did not decode (naturalWidth 0)"), ("A" * 2000, "blank (")):
        broken = tmp_path / "broken.html"
        broken.write_text(text[:start] + garbage + text[start + 2000 :])
        problems = page_problems(driver, broken)
        assert len(problems) == 1 and problems[0].startswith(f"plot-memory: {problem}"), problems

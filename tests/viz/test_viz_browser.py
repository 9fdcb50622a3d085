"""Drives the explorer page in headless Chromium (Debian's, through the playwright package):
click a path, undo a step, and check the traffic the page shows against the Python model.
Opt-in: `make test BROWSER=1` (what CI runs) or `make browser` installs Chromium and
playwright; without them these tests skip and say why, except under FLASHFLOW_BROWSER=1 (set by
`make test BROWSER=1`), where a missing piece fails them. Saves artifacts/viz-explorer.png."""
import importlib.util
import os
from pathlib import Path

import pytest

from flashflow.dataflow.model import simulate
from flashflow.dataflow.shape import GemmShape
from flashflow.viz.server import serve_in_thread

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
REQUIRED = os.environ.get("FLASHFLOW_BROWSER", "") not in ("", "0")


def missing_pieces() -> list[str]:
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} is not installed")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package is not installed")
    return missing


@pytest.fixture(autouse=True)
def _browser_available():
    missing = missing_pieces()
    if missing:
        reason = "; ".join(missing)
        if REQUIRED:
            pytest.fail(f"FLASHFLOW_BROWSER=1 but {reason} (run `make browser`)")
        pytest.skip(f"browser test is opt-in: {reason} (`make test BROWSER=1` installs both)")


@pytest.fixture()
def page():
    from playwright.sync_api import sync_playwright

    server, url = serve_in_thread()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                pg = browser.new_page(viewport={"width": 1280, "height": 820})
                # generous: a fresh machine's first Chromium start builds its font caches
                pg.set_default_timeout(60_000)
                errors = []
                pg.on("pageerror", lambda e: errors.append(str(e)))
                pg.goto(url)
                pg.wait_for_selector("rect.tile")
                yield pg
                assert not errors, errors
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


def _settled(pg, length):
    pg.wait_for_selector(f'#traffic[data-path-length="{length}"]:not([data-pending])')
    return int(pg.get_attribute("#traffic", "data-read-bytes")), \
        int(pg.get_attribute("#traffic", "data-dram-bytes"))


def test_click_path_undo_and_compare_with_model(page):
    # a 4x4 grid of 4 K-steps with 160 KiB of cache: 16 KiB blocks, so it holds 10 of them,
    # a little more than one tile's 8
    page.fill("#M", "512")
    page.fill("#N", "512")
    page.fill("#K", "256")
    page.fill("#cache_kib", "160")
    page.dispatch_event("#shape-form", "change")
    _settled(page, 0)
    path = [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0)]
    for i, (m, n) in enumerate(path):
        page.click(f'rect.tile[data-m="{m}"][data-n="{n}"]')
        _settled(page, i + 1)
    page.click("#undo")
    read, dram = _settled(page, 4)

    shape = GemmShape(512, 512, 256, 128, 128, 64, 2)
    model = simulate(shape, path[:4], 160 * 1024, num_sms=1, policy="lru")
    assert (read, dram) == (model.read_bytes, model.dram_bytes)
    assert 0 < model.hits and model.read_bytes < 4 * 8 * 16 * 1024   # some reuse to show
    assert page.locator("#steps tbody tr").count() == 4
    assert page.locator("line.arrow").count() == 3
    assert "DRAM traffic" in page.inner_text("#traffic")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viz-explorer.png"), full_page=True)

    # a named order loads as a whole path, and the total again matches the model
    page.select_option("#order-select", "hilbert")
    page.click("#load-order")
    read, _ = _settled(page, 16)
    from flashflow.dataflow.orders import hilbert
    assert read == simulate(shape, hilbert(4, 4), 160 * 1024).read_bytes


def test_slow_click_after_editing_a_field_still_takes_the_tile(page):
    # Regression: the press blurs the edited field, whose change event re-renders the grid;
    # with the tile taken on "click", a render between press and release lost the tile
    # (CI saw it as a timeout waiting for the path to grow).
    page.fill("#M", "384")
    page.fill("#N", "256")
    page.locator("#N").blur()              # fires the change (filling #N blurred #M: another)
    _settled(page, 0)                      # the latest answer drawn: the grid stays put now
    page.fill("#cache_kib", "96")          # left focused and edited: the press will blur it
    box = page.locator('rect.tile[data-m="2"][data-n="1"]').bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.wait_for_timeout(300)             # the change's answer lands before the release
    page.mouse.up()
    _settled(page, 1)
    assert page.locator("#steps tbody tr").count() == 1
    assert "(2,1)" in page.inner_text("#steps tbody")
    # a right press takes nothing
    box = page.locator('rect.tile[data-m="0"][data-n="0"]').bounding_box()
    page.mouse.click(box["x"] + 5, box["y"] + 5, button="right")
    page.wait_for_timeout(200)
    assert page.get_attribute("#traffic", "data-path-length") == "1"

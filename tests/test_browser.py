"""A real browser: Debian's Chromium, driven by Playwright, runs the default Compare.

Playwright never downloads a browser here: it drives /usr/bin/chromium (installed by
.ci/run with apt-get). Set KVPLAY_SCREENSHOT=docs/screenshot.png to refresh the README's picture,
KVPLAY_BROWSER_TEST=0 to skip it. On an idle 2-core machine the first card shows after ~4 s and all
cards and plots after ~20 s; the time-outs leave room for a loaded CI machine.
"""
import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium"),
              pytest.mark.skipif(os.environ.get("KVPLAY_BROWSER_TEST") == "0", reason="KVPLAY_BROWSER_TEST=0")]
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def url():
    import torch

    from kvplay.ui import build_app, launch_kwargs

    # Chromium runs on the same small machine: leave it a core, as KVPLAY_TORCH_THREADS=1 would
    # (two torch threads spinning against the browser made the run 2.5x slower on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = build_app()
    kwargs = {**launch_kwargs(), "server_port": None}
    app.launch(**kwargs, prevent_thread_lock=True, quiet=True)
    try:
        yield app.local_url
    finally:
        app.close()
        torch.set_num_threads(threads)


def test_default_compare_in_a_real_browser(url, tmp_path):
    from playwright.sync_api import sync_playwright

    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1750})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="load")
        page.get_by_role("button", name="Compare", exact=True).click()
        t0 = time.perf_counter()
        page.wait_for_selector(".kv-card", timeout=600_000)                       # first partial result
        first = time.perf_counter() - t0
        page.wait_for_function("document.querySelectorAll('.kv-card').length === 5", timeout=600_000)
        page.wait_for_selector("#kv-kl .js-plotly-plot", timeout=60_000)
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=60_000)
        total = time.perf_counter() - t0
        cards = page.locator(".kv-card")
        assert cards.count() == 5
        assert "baseline" in cards.nth(0).inner_text() and "kvplay-int2" in page.locator("#kv-cards").inner_text()
        shot = Path(os.environ.get("KVPLAY_SCREENSHOT") or tmp_path / "screenshot.png")
        page.screenshot(path=str(shot), full_page=False)
        browser.close()
    print(f"\nfirst card after {first:.1f}s, all cards and plots after {total:.1f}s; screenshot {shot}")
    assert shot.stat().st_size > 10_000
    assert errors == []

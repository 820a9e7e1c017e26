"""The demo as a stakeholder meets it, on the real model: a recorded verdict the moment the page opens, then the
same verdict live.

Debian's Chromium through Playwright (as tests/test_browser.py). The page opens on SmolLM2-135M-Instruct, whose
default task (a pass code in The Tempest) ships as a recording; pressing Compare runs it live. With
KVPLAY_SCREENSHOT=docs/screenshot.png the live result is the README's picture.
"""
import os
import time
from pathlib import Path

import pytest
from test_browser import CHROMIUM, FLAGS

REAL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.real_model,
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium"),
              pytest.mark.skipif(os.environ.get("KVPLAY_BROWSER_TEST") == "0", reason="KVPLAY_BROWSER_TEST=0")]
# The bound, the recorded verdict within 3 s of opening the page, is a timing and so was measured by
# scripts/time_app.py --opens, at 67f210d (docs/benchmarks.md: 1.6-1.9 s here, 3.5 s once on a slower CI machine). This
# test checks what makes it "at once" on any machine: the page asks the server for nothing before the verdict shows.
COMPUTE = ("/queue/", "/run/", "/call/", "/api/")  # the routes through which a page would get anything computed


@pytest.fixture(scope="module")
def page():
    import torch
    from playwright.sync_api import sync_playwright

    from kvplay.app.settings import Settings
    from kvplay.ui.app import build_app, launch_kwargs
    from kvplay.ui.common import warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                     # leave the browser a core on a 2-core machine
    settings = Settings(default_model=REAL)
    app = build_app(settings)
    app.launch(**{**launch_kwargs(), "server_port": None}, prevent_thread_lock=True, quiet=True)
    warm_start(settings, REAL).join(timeout=600)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.kvplay_url = app.local_url
            yield page
            browser.close()
    finally:
        app.close()
        torch.set_num_threads(threads)


def _verdict(page) -> dict:
    """What the verdict says per cache: its colour and whether its answer is right. A wrong answer's own text is
    left out: a broken cache's words depend on the CPU's bfloat16 kernels (quanto-int2's read "The old, the
    code. [The next..." where the recording was made and "The ship's the code of the..." on a CPU with AMX)."""
    answers = page.locator(".kv-card .kv-task").all_inner_texts()
    return {"colours": page.locator(".kv-verdict-line").evaluate_all("els => els.map(e => e.className)"),
            "answers": [a if "✓" in a else "✗" for a in answers]}


def test_the_recorded_verdict_shows_at_once_and_a_live_run_agrees(page):
    asked = []
    page.on("request", lambda r: asked.append(r.url))
    t0 = time.monotonic()
    page.goto(page.kvplay_url, wait_until="commit")
    page.locator(".kv-card .kv-task").first.wait_for(timeout=30_000)
    opened = time.monotonic() - t0
    computed = [u for u in asked if any(route in u for route in COMPUTE)]
    recorded = _verdict(page)
    assert "Recorded on a 2-core CPU" in page.locator(".kv-status-line").first.inner_text()
    assert recorded["answers"][0] == "answer: 27611 ✓"              # the 16-bit card gets the task right
    assert any("✗" in a for a in recorded["answers"])              # and some cache does not
    print(f"\nrecorded verdict on screen {opened:.2f} s after opening the page, after {len(asked)} requests")
    assert any("/assets/" in u for u in asked)                      # the check sees the page's own requests
    assert not computed, f"the page asked the server to compute before its verdict showed: {computed}"

    t0 = time.monotonic()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_function("document.querySelector('.kv-status-line')?.innerText.startsWith('Done:')",
                           timeout=600_000)
    live = time.monotonic() - t0
    print(f"live default Compare done {live:.1f} s after the click: "
          f"{page.locator('.kv-status-line').first.inner_text()}")
    assert _verdict(page) == recorded                               # the same verdict, live
    if os.environ.get("KVPLAY_SCREENSHOT"):
        page.evaluate("document.querySelector('.kv-status-line').scrollIntoView()")     # the verdict and cards
        page.screenshot(path=os.environ["KVPLAY_SCREENSHOT"], full_page=False)

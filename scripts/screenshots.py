"""Screenshot every tab's first screen at 1440x900 and 390x844, as a stakeholder opens the page: docs/screenshots/.

    python scripts/screenshots.py                 # the default model (SmolLM2; its recorded run on Compare)
    python scripts/screenshots.py --out /tmp/shots

The app is launched here on loopback, without its background warm-up (nothing runs a model: Compare shows its
recording, Quality its recorded three-model grid, every other tab its inputs), and each tab is clicked in
Debian's headless chromium, the one the browser tests use. docs/screenshots/README.md says what each shows.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvplay.app.settings import Settings  # noqa: E402
from kvplay.ui import app as ui  # noqa: E402

TABS = ["Compare", "Deploy", "Memory", "Throughput", "Quality", "Generate", "Trade-offs", "Inside", "About"]
SCREENS = [(1440, 900), (390, 844)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ui.warm_start = lambda settings, name: None              # screenshots of the page, not of a warm-up's load
    app = ui.build_app(Settings.from_env())
    app.launch(**{**ui.launch_kwargs(), "server_port": None}, prevent_thread_lock=True, quiet=True)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", headless=True,
                                     args=["--no-sandbox"])
        for width, height in SCREENS:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(app.local_url)
            page.wait_for_selector(".kv-card", timeout=60_000)                  # the recorded run is drawn
            for tab in TABS:
                page.get_by_role("tab", name=tab, exact=True).click()
                page.wait_for_timeout(800)                                    # Gradio's layout settles
                out = args.out / f"{width}-{tab.lower()}.png"
                page.screenshot(path=str(out))
                print(f"wrote {out}")
                if tab == "Quality":                                          # and its across-models grid
                    page.locator("#kv-across").scroll_into_view_if_needed()
                    page.wait_for_timeout(400)
                    page.screenshot(path=str(args.out / f"{width}-quality-across-models.png"))
            page.close()
        browser.close()
    app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

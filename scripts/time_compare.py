"""The default Compare in a browser, as a stakeholder's demo runs it: is every cache's speed timed?

    PYTHONPATH=. python scripts/time_compare.py            # 3 runs, writes docs/results/compare-in-browser.json
    PYTHONPATH=. python scripts/time_compare.py --runs 1 --json /tmp/c.json

The app is built and launched as `python app.py` builds it (SmolLM2-135M-Instruct, 2 torch threads), warmed up, and
Debian's Chromium opens it at 1440x900 (the only other process: issue 41's "only the app and a browser"). Each run
reloads the page and presses Compare with the page's defaults, then reads the page: seconds until the first live
card, until every answer is checked (✓/✗), and until "Done"; and how many of the verdict's caches have a speed or say
"speed not timed" (with the reason). docs/benchmarks.md quotes the file.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
MODEL = "smollm2-135m-instruct"


def one_run(page, url: str) -> dict:
    page.goto(url, wait_until="load")
    page.get_by_role("button", name="Compare", exact=True).wait_for()
    t0 = time.perf_counter()
    page.get_by_role("button", name="Compare", exact=True).click()
    # live cards say "answer: checked when decoding ends" until their answers are checked (the recording's are)
    page.wait_for_function("() => [...document.querySelectorAll('.kv-card .kv-task')]"
                           ".some(e => e.innerText.includes('checked when'))", timeout=600_000)
    first = time.perf_counter() - t0
    page.wait_for_function("() => { const tasks = [...document.querySelectorAll('.kv-card .kv-task')]; "
                           "return tasks.length > 0 && tasks.every(e => /[✓✗]/.test(e.innerText)); }",
                           timeout=600_000)
    answers = time.perf_counter() - t0
    page.wait_for_function("() => document.querySelector('#kv-status').innerText.includes('Done:')", timeout=600_000)
    done = time.perf_counter() - t0
    verdict = page.locator("#kv-verdict").inner_text()
    lines = [line for line in verdict.splitlines() if re.search(r"the 16-bit speed|speed not timed", line)]
    untimed = [line for line in lines if "speed not timed" in line]
    return {"first_result_s": round(first, 1), "answers_s": round(answers, 1), "done_s": round(done, 1),
            "caches_in_verdict": len(lines), "not_timed": len(untimed),
            "reasons": sorted({line.split("speed not timed: ", 1)[1] for line in untimed}),
            "status": page.locator("#kv-status").inner_text().strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("docs/results/compare-in-browser.json"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from kvplay.app import startup
    from kvplay.app.settings import Settings
    from kvplay.lab.bench import cpu_name
    from kvplay.ui.app import build_app, launch_kwargs
    from kvplay.ui.common import warm_start

    settings = Settings.from_env()
    startup.apply_settings(settings)
    app = build_app(settings)
    app.launch(**{**launch_kwargs(), "server_port": None}, prevent_thread_lock=True, quiet=True)
    warm_start(settings, MODEL).join(timeout=600)
    runs = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            for _ in range(args.runs):
                runs.append(one_run(page, app.local_url))
                print(json.dumps(runs[-1], ensure_ascii=False), flush=True)
            browser.close()
    finally:
        app.close()
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "model": MODEL, "cpu": cpu_name(),
           "load_average_1m_at_end": round(os.getloadavg()[0], 2), "runs": runs}
    args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

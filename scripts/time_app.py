"""Time the default Compare in the launched app, as a visitor's click: first result on screen, and done.

    python scripts/time_app.py --runs 2            # prints one line per run and a JSON summary

Starts `python app.py` on a free port (the default model, fetched already), waits until the page serves and
its background warm-up (ui.common.warm_start: one 2-token Compare of the default caches) has finished, then
calls the Compare button's endpoint (`/compare`) with the page's own defaults through gradio_client, `runs`
times, one after the other. Each run reports the seconds from the call to its first streamed result (the
16-bit card and a first verdict line) and to the last. The app is stopped afterwards. issue 24's app targets:
first result <= 4 s, done <= 15 s on an idle 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import psutil
from gradio_client import Client
from smoke import ROOT, free_port


def wait_idle(pid: int, timeout: float, quiet_s: float = 3.0) -> float:
    """Seconds waited until the process used under 10% of a core for `quiet_s` seconds (its warm-up done)."""
    proc, t0, quiet = psutil.Process(pid), time.monotonic(), 0.0
    before = sum(proc.cpu_times()[:2])
    while time.monotonic() - t0 < timeout and quiet < quiet_s:
        time.sleep(1.0)
        now = sum(proc.cpu_times()[:2])
        quiet = quiet + 1.0 if now - before < 0.1 else 0.0
        before = now
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the page and its warm-up")
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port)}
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    url, runs = f"http://127.0.0.1:{port}", []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.timeout:
            try:
                httpx.get(f"{url}/config", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        warm = wait_idle(app.pid, args.timeout)
        client = Client(url, verbose=False)
        for n in range(args.runs):
            start = time.perf_counter()
            job = client.submit(api_name="/compare")
            first = None
            for _ in job:                                   # each streamed update of the outputs
                first = first or time.perf_counter() - start
            done = time.perf_counter() - start
            job.result()                                    # raises if the run failed
            runs.append({"first_result_s": round(first or done, 2), "done_s": round(done, 2)})
            print(f"run {n + 1}: first result after {runs[-1]['first_result_s']} s, done after {runs[-1]['done_s']} s",
                  flush=True)
    finally:
        app.terminate()
        app.wait(30)
    print(json.dumps({"page_and_warm_up_s": round(time.monotonic() - t0, 1), "warm_wait_s": round(warm, 1),
                      "runs": runs, "median_done_s": statistics.median(r["done_s"] for r in runs),
                      "median_first_result_s": statistics.median(r["first_result_s"] for r in runs)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())

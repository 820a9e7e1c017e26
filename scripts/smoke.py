"""Start `python app.py` as a user does, wait until the page serves, and check which model it opens on.

    python scripts/smoke.py --expect smollm2-135m-instruct     # exit 0 when the page opens on that model

.ci/run calls it twice: as a Space starts (SPACE_ID set, no model cached: the app fetches the real model
first) and as the README's `python app.py` starts on a laptop. Only requirements.txt need be installed.
It prints how long the page took to serve and stops the app again. Exit 1 with the app's last output
when the page never serves, or serves another model (the fallback note, if any, is printed).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def opened_on(config: dict) -> tuple[str | None, str]:
    """(the Compare tab's model, the page's notes) from Gradio's /config."""
    comps = {c["id"]: c for c in config["components"]}
    dep = next(d for d in config["dependencies"] if d.get("api_name") == "compare")
    model = comps[dep["inputs"][0]].get("props", {}).get("value")
    notes = [str(c["props"].get("value")) for c in comps.values()
             if "Cannot fetch" in str(c.get("props", {}).get("value"))]
    return model, " ".join(notes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect", required=True, help="the model the page must open on")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the page (a fetch included)")
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.timeout and proc.poll() is None:
            try:
                config = httpx.get(f"http://127.0.0.1:{port}/config", timeout=5).json()
                break
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
        else:
            print(f"smoke: app.py did not serve within {args.timeout:g} s (exit {proc.poll()})", file=sys.stderr)
            return 1
        model, note = opened_on(config)
        where = "hosted (SPACE_ID set)" if os.environ.get("SPACE_ID") else "local"
        print(f"smoke: {where}: app.py served after {time.monotonic() - t0:.1f} s, opened on {model}")
        if model != args.expect:
            print(f"smoke: expected {args.expect}; the page says: {note or 'no note'}", file=sys.stderr)
            return 1
        return 0
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode not in (0, -15) and out:
            print(out[-3000:], file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

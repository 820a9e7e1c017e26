"""Time the Trade-offs tab's two long views with the UI's defaults, as a user waits for them: issue 41's targets.

    PYTHONPATH=. python scripts/time_tradeoffs.py                     # writes docs/results/tradeoffs-times.json
    PYTHONPATH=. python scripts/time_tradeoffs.py --repeats 1 --json /tmp/t.json --sweep-json /tmp/w.json

The last Window and sinks result is written too (docs/results/window-sweep-smollm2.json; docs/tradeoffs.md reads it).

One process, the model loaded and its calibrations read (or measured) by a warm-up run first, as the app's start-up
and first click do; then each view's defaults in turn, the repeats interleaved (equal bytes, window, equal bytes, ...),
each through the same entry point the tab's button calls (kvplay.app.tradeoffs), wall seconds. Targets: Equal bytes
(quick) at most 60 s, Window and sinks at most 120 s, on SmolLM2 and 2 idle cores. docs/benchmarks.md quotes the file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from kvplay.app import tradeoffs as jobs
from kvplay.app.settings import Settings
from kvplay.lab.bench import machine
from kvplay.results import to_dict
from kvplay.ui.tradeoffs import UI_TOKENS, WINDOW_DEFAULTS

MODEL = "smollm2-135m-instruct"
TARGETS = {"equal_bytes_quick": 60.0, "window_and_sinks": 120.0}


def views(settings: Settings) -> dict:
    return {"equal_bytes_quick": lambda: jobs.pareto(MODEL, quick=True, tokens=UI_TOKENS, settings=settings),
            "window_and_sinks": lambda: jobs.window_sweep(MODEL, settings=settings, **WINDOW_DEFAULTS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("docs/results/tradeoffs-times.json"))
    ap.add_argument("--sweep-json", type=Path, default=Path("docs/results/window-sweep-smollm2.json"))
    args = ap.parse_args()
    settings = Settings(default_model=MODEL)
    t0 = time.perf_counter()
    jobs.pareto(MODEL, quick=True, tokens=128, settings=settings)     # load the model, read its calibrations
    warm = time.perf_counter() - t0
    seconds: dict[str, list[float]] = {name: [] for name in TARGETS}
    results = {}
    for _ in range(args.repeats):
        for name, run in views(settings).items():
            t0 = time.perf_counter()
            results[name] = run()
            seconds[name].append(round(time.perf_counter() - t0, 1))
            print(f"{name}: {seconds[name][-1]} s", flush=True)
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "model": MODEL,
           "machine": {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
           "warm_up_s": round(warm, 1), "defaults": {"equal_bytes_quick_tokens": UI_TOKENS, **WINDOW_DEFAULTS},
           "seconds": seconds,
           "targets": {name: {"at_most_s": TARGETS[name], "median_s": statistics.median(s),
                              "met": statistics.median(s) <= TARGETS[name]} for name, s in seconds.items()}}
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    args.sweep_json.write_text(json.dumps(to_dict(results["window_and_sinks"]), indent=1) + "\n")
    print(json.dumps(out["targets"]))


if __name__ == "__main__":
    main()

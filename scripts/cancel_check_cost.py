"""What the per-layer cancel check costs a decode step: kvplay-int4 decode steps of SmolLM2 at 256 tokens with and
without guard.stops_inside's hooks (kvplay/app/guard.py), taking turns; each run's median step, then the median of
those, in milliseconds.

    PYTHONPATH=. python scripts/cancel_check_cost.py --repeats 4
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from kvplay.app import guard
from kvplay.app.models import load_model
from kvplay.cache import build_cache
from kvplay.lab.generate import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=33, help="decode steps per run; the first is left out as warm-up")
    args = ap.parse_args()

    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct", device="cpu")
    ids = torch.randint(100, 10000, (1, args.context), generator=torch.Generator().manual_seed(0))   # (1, T)
    token = guard.CancelToken()
    variants = {"without the check": contextlib.nullcontext, "with the check": lambda: guard.stops_inside(model, token)}
    steps: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, around in variants.items():
            cache = build_cache("kvplay-int4", model, tok)
            with around():
                trace = generate(model, ids, cache, args.steps, keep_logits=False)
            steps[name].append(1e3 * statistics.median(trace.decode_s[1:]))
    for name, ms in steps.items():
        print(f"{name}: {statistics.median(ms):.2f} ms a step (runs: {', '.join(f'{m:.2f}' for m in ms)})")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes besides attention (issue 24, part 6): threads, float32 against bfloat16
products, and packed weights, on the real model, each pair measured side by side in one run.

    PYTHONPATH=. python scripts/step_profile.py --context 1300 --repeats 5

1. The linear products of one step alone: every nn.Linear of the model (211 on SmolLM2: 7 per layer and the
   head) applied once to random rows, as a step at batch 1 and at Compare's lockstep batch of 9 rows calls
   them: bfloat16 nn.Linear (what transformers runs), float32 weights (twice the bytes, MKL's sgemv), and
   bfloat16 weights packed for oneDNN (kvplay.app.packing).
2. Whole decode steps at `context` tokens through the fastest 16-bit path (preallocated, fused kernel), batch 1
   and 9: the model as loaded by default (packed) against KVPLAY_PACK_WEIGHTS=0, and 2 threads against 1.
Variants take turns `repeats` times; medians in milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvplay.app.models import load_model
from kvplay.app.packing import PackedLinear
from kvplay.app.settings import Settings
from kvplay.cache import build_cache

SPEC = "baseline:store=prealloc,attention=fused"


def _ms(fn, n: int = 5) -> float:
    """Median milliseconds of n calls after one discarded."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def products(model, rows: int, repeats: int) -> dict[str, float]:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dense = [m.weight for m in linears]
    dense32 = [w.float() for w in dense]
    packed = [m if isinstance(m, PackedLinear) else PackedLinear.of(m) for m in linears]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in dense}
    runs = {"bfloat16 nn.Linear": lambda: [nn.functional.linear(xs[w.shape[1]], w) for w in dense],
            "float32 weights": lambda: [nn.functional.linear(xs[w.shape[1]].float(), w).to(torch.bfloat16)
                                        for w in dense32],
            "bfloat16 packed (kvplay)": lambda: [p(xs[p.in_features]) for p in packed]}
    out = {k: [] for k in runs}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in runs.items():
                out[name].append(_ms(fn, 3))
    return {k: statistics.median(v) for k, v in out.items()}


def step_ms(model, ids: torch.Tensor, batch: int, steps: int = 8) -> float:
    cache = build_cache(SPEC, model)
    with torch.no_grad():
        nxt = model(ids.expand(batch, -1), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=1300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    packed, _ = load_model(args.model, device="cpu")
    plain, _ = load_model(args.model, device="cpu", settings=Settings(pack_weights=False))
    threads = torch.get_num_threads()
    print(f"{args.model}, {threads} threads, medians of {args.repeats} turns (ms)")
    for rows in (1, 9):
        line = ", ".join(f"{k} {v:.1f}" for k, v in products(plain, rows, args.repeats).items())
        print(f"products of one step, {rows} row(s): {line}", flush=True)
    ids = torch.randint(100, 10000, (1, args.context))
    for batch in (1, 9):
        cells = {"packed": [], "not packed": [], "packed, 1 thread": []}
        for _ in range(args.repeats):
            cells["packed"].append(step_ms(packed, ids, batch))
            cells["not packed"].append(step_ms(plain, ids, batch))
            torch.set_num_threads(1)
            cells["packed, 1 thread"].append(step_ms(packed, ids, batch))
            torch.set_num_threads(threads)
        line = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in cells.items())
        print(f"decode step at {args.context} tokens, batch {batch}: {line}", flush=True)


if __name__ == "__main__":
    main()

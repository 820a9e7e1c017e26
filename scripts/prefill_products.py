"""Time one prefill of Compare's default prompt with bfloat16 products against float32 ones (kvplay.app.packing's
`wide` path), interleaved, on this CPU; and a short generation, where decode steps dominate.

    PYTHONPATH=. python scripts/prefill_products.py --repeats 3

Prints medians, and whether this CPU has bfloat16 arithmetic (where it does, kvplay keeps bfloat16 products).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvplay.app import packing, prompts
from kvplay.app.models import load_model
from kvplay.cache import build_cache
from kvplay.lab.generate import generate, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tok = load_model(args.model)[:2]
    linears = [m for m in model.modules() if isinstance(m, packing.PackedLinear)]
    wide = {m: m.wide or packing._widen(m) for m in linears}
    ids = torch.tensor([prompts.encode(tok, prompts.default_prompt(args.model), True)])           # (1, T)
    times: dict[str, dict[str, list[float]]] = {"bfloat16": {}, "float32": {}}

    def timed(what, fn):
        t0 = time.perf_counter()
        fn()
        return what, time.perf_counter() - t0

    for r in range(args.repeats + 1):                       # the first round warms up and is dropped
        for products in times:
            for m in linears:
                m.wide = wide[m] if products == "float32" else None
            for what, s in (timed(f"prefill {ids.shape[1]:,} tokens",
                                  lambda: prefill(model, ids, torch.ones_like(ids), build_cache("baseline", model))),
                            timed("64-token prompt + 32 new tokens",
                                  lambda: generate(model, ids[:, :64], build_cache("baseline", model), 32,
                                                   keep_logits=False))):
                if r:
                    times[products].setdefault(what, []).append(s)
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, bfloat16 arithmetic: {packing.BFLOAT16_ARITHMETIC}, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats}, interleaved")
    for what in times["bfloat16"]:
        b, f = (statistics.median(times[p][what]) for p in times)
        print(f"  {what}: bfloat16 products {b:.2f} s, float32 products {f:.2f} s ({b / f:.2f}x)")


if __name__ == "__main__":
    main()

"""Decode speed of the bit-budget presets against kvplay-int4, side by side: 8,000 tokens of the play, batch 1.

    PYTHONPATH=. python scripts/decode_presets.py [--json PATH]

A spot check for when the whole `python -m kvplay bench` is too long for the machine (on a 2-core AVX2 CPU without
bfloat16 arithmetic its batch-4 cells alone ran past 20 minutes): the bench's own decode_speeds(), every cache filled
first, then 4 rounds in which each decodes 8 steps in turn (one more first, discarded); tokens/s over the median
step. docs/benchmarks.md has the record.
"""
from __future__ import annotations

import argparse
import json
import time

from kvplay.app.models import load_model
from kvplay.lab.bench import decode_speeds
from kvplay.lab.texts import HELD_OUT_TEXT

SPECS = ["kvplay-int4", "kvplay-2.5bit", "kvplay-2.5bit:rotation=hadamard", "kvplay-3bit",
         "kvplay-3bit:rotation=hadamard"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write {spec: tokens/s, update share, peak bytes} here")
    args = parser.parse_args()
    model, tok = load_model("smollm2-135m-instruct")
    ids = tok(HELD_OUT_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :8000]
    began = time.time()
    out = decode_speeds(model, ids, SPECS, context=8000, batch=1, steps=8, repeats=4)
    print(f"{time.time() - began:.0f} s")
    base = out["kvplay-int4"][0]
    for spec, (rate, share, peak) in out.items():
        print(f"{spec:34s} {rate:7.2f} tok/s  {rate / base:.2f}x kvplay-int4  update share {share:.2f}  "
              f"peak {peak / 2**20:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({s: {"tokens_per_s": v[0], "update_share": v[1], "peak_bytes": v[2]} for s, v in out.items()},
                      f, indent=1)


if __name__ == "__main__":
    main()

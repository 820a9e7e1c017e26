"""Why kvplay-int4 needed 8-bit keys in one of Qwen2.5's layers and in none of SmolLM2's or Gemma 3's: for each
catalogue model and each full-attention layer, the mean KL of the logits when that layer alone reads its keys as
kvplay-int4 stores them (4 bits) and as its outlier layers store them (8 bits, 16-bit scales and zeros), every other
layer exact, over the last 512 tokens of the play; beside it the share of the layer's attention its 4-bit keys move
and its largest key channel over the median one (kvplay/cache/outliers.py, which decides from the share alone).

    PYTHONPATH=. python scripts/outlier_layers.py     # writes docs/results/outlier-layers.json (about 4 min, 2 cores)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from kvplay.app.models import load_model
from kvplay.cache import fragile, key_outliers, outliers, parse_spec
from kvplay.cache.engine import KVPlayLayer
from kvplay.lab.bench import machine

MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m")


def measure(name: str) -> dict:
    start = time.perf_counter()
    model, tok = load_model(name, device="cpu")
    spec = parse_spec(outliers.REFERENCE)
    storage = {"4-bit": KVPlayLayer(spec), "8-bit": KVPlayLayer(spec, key_bits=outliers.BITS, key_meta=outliers.META)}
    ids = fragile.calibration_ids(tok, outliers.TOKENS).to(model.device)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        layers = {}
        for x in key_outliers(model, tok):
            row = {"shift": round(x.shift, 4), "largest_channel": round(x.channel, 1)}
            for what, layer in storage.items():
                def probe(idx, q, k, v, s, i=x.layer, layer=layer):
                    return fragile.stored_attention(layer, q, k, v, s, "keys") if idx == i else None
                row[f"kl_{what}"] = round(fragile.mean_kl(reference, model(ids, use_cache=False,
                                                                           kvplay_probe=probe).logits), 5)
            layers[x.layer] = row
    return {"outlier_layers": list(outliers.outlier_layers(outliers.kept(model))), "layers": layers,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--json", type=Path, default=Path("docs/results/outlier-layers.json"))
    args = ap.parse_args()
    found = {}
    for name in args.models:
        found[name] = measure(name)
        print(name, found[name]["outlier_layers"], f"{found[name]['seconds']} s", flush=True)
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "text": "the last 512 tokens of "
           "assets/texts/tempest.txt", "storage": outliers.REFERENCE, "shift_bound": outliers.SHIFT,
           "machine": {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}, "models": found}
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

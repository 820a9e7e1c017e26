"""The fast key-rotation fit against the thorough one (issue 49: a fast calibration must keep each preset's KL
within 10% of the thorough calibration's): kvplay-3bit's and kvplay-2.5bit's mean KL from the 16-bit cache and
top-1 agreement over the play's first 1,024 tokens read 16 at a time, with the catalogue models' shipped thorough
fits, with fast fits made now (timed), and with the Hadamard matrix the fits start from.

    PYTHONPATH=. python scripts/rotation_quality.py           # writes docs/results/rotation-quality.json
    PYTHONPATH=. python scripts/rotation_quality.py --models gemma-3-270m --json /tmp/r.json

The fragile rankings are the shipped ones in all three rows, so only the key rotations differ. The same figures
from the CLI, a cache at a time:

    KVPLAY_ROTATIONS=thorough python -m kvplay ppl --model M --caches kvplay-3bit kvplay-2.5bit --max-tokens 1024 \\
        --chunk 16
    KVPLAY_ROTATIONS=fast KVPLAY_ROTATION_DIR=$(mktemp -d) python -m kvplay ppl --model M ... (the same)
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from kvplay.app.models import load_model
from kvplay.cache import build_cache, parse_spec, rotations
from kvplay.cache.methods.kvplay import _full_attention
from kvplay.lab.bench import machine
from kvplay.lab.metrics import kl_per_step, top1_agree
from kvplay.lab.quality import chunked_logits, text_ids

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
PRESETS = ("kvplay-3bit", "kvplay-2.5bit")
TOKENS, CHUNK = 1024, 16


def measure(name: str) -> dict:
    model, tok = load_model(name, device="cpu")
    layers = _full_attention(model.config.get_text_config(decoder=True))
    ids, _ = text_ids(tok, None, TOKENS, CHUNK, model.device)
    base = chunked_logits(model, ids, build_cache("baseline", model), CHUNK)

    def score(spec) -> dict:
        logits = chunked_logits(model, ids, build_cache(spec, model, tok), CHUNK)
        return {"mean_kl": round(kl_per_step(base, logits).mean().item(), 6),
                "top1": round(top1_agree(base, logits).float().mean().item(), 4)}

    out = {"layers": len(layers), "presets": {}}
    for preset in PRESETS:
        spec = parse_spec(preset)
        rows = {"hadamard": score(spec.with_options(rotation="hadamard"))}
        os.environ["KVPLAY_ROTATIONS"] = "thorough"
        assert rotations.rotations_kept(model, spec, layers), f"{name} ships no thorough fit for {preset}"
        rows["thorough (shipped)"] = score(spec)
        os.environ["KVPLAY_ROTATIONS"], os.environ["KVPLAY_ROTATION_DIR"] = "fast", tempfile.mkdtemp()
        rotations._FITTED.pop(model, None)
        start = time.perf_counter()
        rotations.key_rotations(model, tok, spec, layers)          # the fit, timed alone
        seconds = time.perf_counter() - start
        rows["fast (fitted now)"] = {**score(spec), "fit_seconds": round(seconds, 1)}
        reference = rows["thorough (shipped)"]["mean_kl"]
        for row in rows.values():
            row["kl_vs_thorough"] = round(row["mean_kl"] / reference - 1, 4)
        out["presets"][preset] = rows
        print(name, preset, json.dumps(rows), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--json", type=Path, default=Path("docs/results/rotation-quality.json"))
    args = ap.parse_args()
    results = {name: measure(name) for name in args.models}
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "text": "assets/texts/tempest.txt",
           "tokens": TOKENS, "chunk": CHUNK, "fitters": {k: vars(v) for k, v in rotations.FITTERS.items()},
           "machine": {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}, "models": results}
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Key rotations calibrated on the model's own queries and keys, screened (an experiment for issue 27).

    PYTHONPATH=. python scripts/screen_rotation.py kvplay-2.5bit        # 2-bit keys, blocks of 64
    PYTHONPATH=. python scripts/screen_rotation.py --bits 3 --block 128 kvplay-3bit
    PYTHONPATH=. python scripts/screen_rotation.py --unweighted kvplay-2.5bit   # every score alike

The engine rotates keys and values by one fixed Hadamard matrix before quantizing them. Here each layer and KV head
learns its own orthogonal key rotation R, started at that Hadamard matrix (R = H expm(A - A^T), Adam on A): a
key channel c quantized per block of T tokens at b bits carries noise of variance scale_c^2 / 12, scale_c being the
channel's range over the block / (2^b - 1), and a query q turns it into score noise sum_c (q R)_c^2 scale_c^2 / 12.
The loss sums that over the calibration text's queries, each block weighted by the attention mass the query puts
on it (a block no query looks at costs nothing; --unweighted drops the weights). Calibration: the queries and keys
(after RoPE, as attention sees them) of 2,048 tokens from the end of the play, fragile.py's calibration text.

Then each spec runs through scripts/screen_bits.py's simulation of `kvplay ppl --chunk 16` twice, with the
Hadamard keys and with the calibrated ones (screen_bits.KEY_ROTATIONS; values keep the Hadamard rotation), on the
first 2,048 tokens of the play and of each --text. The engine and its kernel do not store keys this way: the kernel
reads one (D, D) rotation per part. (The engine now does: rotation=calibrated, kvplay/cache/rotations.py, whose
fit this script uses.) Prints delta ppl %, mean KL and top-1 per spec, text and rotation;
docs/quality-ablation.md has the record.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import scripts.screen_bits as S
from kvplay.app.models import load_model
from kvplay.cache import build_cache, rotations
from kvplay.cache.arch import Arch
from kvplay.cache.fragile import calibration_ids, mean_kl
from kvplay.lab.metrics import perplexity, token_logprob
from kvplay.lab.texts import HELD_OUT_TEXT

SINK = 4          # the presets' sink tokens, never quantized


def calibrate(seen, bits: int, block: int, steps: int, weighted: bool) -> dict[int, torch.Tensor]:
    """{layer: (Hkv, D, D)} key rotations, each started at the Hadamard matrix (rotations.fit)."""
    fitted = {}
    for idx, (q, k) in seen.items():
        fitted[idx], before, after = rotations.fit(q, k, block, SINK, steps, weighted)
        print(f"layer {idx}: score noise {before / (2 ** bits - 1) ** 2:.4g} -> {after / (2 ** bits - 1) ** 2:.4g}",
              flush=True)
    return fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--bits", type=int, default=2, help="the key bits the rotation is fitted for")
    parser.add_argument("--block", type=int, default=64, help="the key block (the spec's group)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--unweighted", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--text", type=Path, action="append", default=[], help="more texts to screen on")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m-instruct")
    n_layers = Arch.from_config(model.config).layers

    began = time.time()
    fitted = calibrate(rotations.queries_and_keys(model, calibration_ids(tok, 2048)), args.bits, args.block, args.steps,
                          not args.unweighted)
    print(f"calibration: {time.time() - began:.0f} s", flush=True)

    for text in (HELD_OUT_TEXT, *args.text):
        ids = tok(text.read_text(encoding="utf-8"), return_tensors="pt", verbose=False).input_ids[:, :args.tokens]
        targets = ids[0, 1:]
        reference = S.run(model, ids, [None] * n_layers, 16)
        base_ppl = perplexity(-token_logprob(reference[:-1], targets))
        for name in args.specs:
            for label in ("hadamard", "calibrated"):
                layers = build_cache(name, model, tok).layers
                S.KEY_ROTATIONS.clear()
                if label == "calibrated":
                    S.KEY_ROTATIONS.update({id(layer): fitted[i] for i, layer in enumerate(layers)})
                logits = S.run(model, ids, layers, 16)
                ppl = perplexity(-token_logprob(logits[:-1], targets))
                top1 = float((reference.argmax(-1) == logits.argmax(-1)).float().mean())
                print(f"{text.name:24s} {label:10s} {name}: dPPL {100 * (ppl / base_ppl - 1):+.2f}%  "
                      f"KL {mean_kl(reference[None], logits[None]):.4f}  top-1 {top1:.3f}", flush=True)


if __name__ == "__main__":
    main()

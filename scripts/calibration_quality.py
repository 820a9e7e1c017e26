"""The Fisher ranking against the exhaustive one (issue 49: each preset's KL within 10% of the exhaustive ranking's):
each ranking preset's mean KL from the 16-bit cache over the play's first 1,024 tokens read 16 at a time, with the
catalogue models' shipped exhaustive rankings and with Fisher rankings measured now, and the fragile layers they share.

    PYTHONPATH=. python scripts/calibration_quality.py         # writes docs/results/calibration-quality.json
    PYTHONPATH=. python scripts/calibration_quality.py --models gemma-3-270m --seeds 0 --json /tmp/q.json

--seeds: the seeds of the labels the Fisher pass draws (kvplay uses FISHER_SEED, 0; the others show the spread).
--fisher-passes: the passes' lengths in tokens (kvplay's: 1024,2048; docs/results/calibration-quality-int2-pass.json
joins --presets kvplay-int2 runs with 512,2048, 1024,2048 and 2048).
The key rotations are the shipped ones in both, so only the rankings differ. The same figures from the CLI, a
cache at a time (the play is the default text):

    KVPLAY_RANKING=exhaustive python -m kvplay ppl --model M --caches kvplay-int2 kvplay-3bit kvplay-2.5bit \\
        --max-tokens 1024 --chunk 16
    KVPLAY_RANKING=fisher KVPLAY_RANKING_DIR=$(mktemp -d) python -m kvplay ppl --model M ... (the same)
"""
from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from kvplay.app.models import load_model
from kvplay.cache import build_cache, fragile, parse_spec, rotations
from kvplay.cache.engine import KVPlayCache
from kvplay.cache.methods.kvplay import _full_attention
from kvplay.lab.bench import machine
from kvplay.lab.metrics import kl_per_step, top1_agree
from kvplay.lab.quality import chunked_logits, text_ids

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
PRESETS = ("kvplay-int2", "kvplay-3bit", "kvplay-2.5bit")
TOKENS, CHUNK = 1024, 16


def measure(name: str, seeds: list[int], presets: tuple[str, ...] = PRESETS) -> dict:
    model, tok = load_model(name, device="cpu")
    config = model.config.get_text_config(decoder=True)
    layers = _full_attention(config)
    shipped = json.loads(fragile.SEEDS.read_text())[fragile.fingerprint(model)]
    ids, _ = text_ids(tok, None, TOKENS, CHUNK, model.device)
    base = chunked_logits(model, ids, build_cache("baseline", model), CHUNK)
    scored: dict[tuple, dict] = {}

    def score(spec, bits: dict[str, dict[int, int]]) -> dict:
        key = (str(spec), tuple(sorted(bits["keys"])), tuple(sorted(bits["values"])))
        if key not in scored:
            fits = rotations.key_rotations(model, tok, spec, layers) if spec.rotation == "calibrated" else None
            logits = chunked_logits(model, ids, KVPlayCache(spec, config, bits["keys"], bits["values"], fits), CHUNK)
            scored[key] = {"mean_kl": round(kl_per_step(base, logits).mean().item(), 6),
                           "top1": round(top1_agree(base, logits).float().mean().item(), 4)}
        return scored[key]

    def chosen(spec, order) -> dict[str, dict[int, int]]:
        return {part: {i: fragile.fragile_bits(spec, part)[2]
                       for i in order[part][:fragile.fragile_count(spec, len(layers), part)]} for part in fragile.PARTS}

    rankings = {"exhaustive": {}, **{f"fisher seed {s}": {} for s in seeds}}
    for preset in presets:
        spec = parse_spec(preset)
        for part in fragile.PARTS:
            if fragile.ranks(spec, part):
                rankings["exhaustive"][f"{preset} {part}"] = shipped[fragile.storage_key(spec, layers, part)]
    for seed in seeds:
        fragile.FISHER_SEED = seed
        fragile._FISHERS.pop(model, None)
        for preset in presets:
            spec = parse_spec(preset)
            for part in fragile.PARTS:
                if fragile.ranks(spec, part):
                    rankings[f"fisher seed {seed}"][f"{preset} {part}"] = fragile.rank_layers_fisher(
                        model, tok, spec, layers, part)
    out = {"layers": layers, "rankings": rankings, "presets": {}}
    for preset in presets:
        spec = parse_spec(preset)
        rows = {}
        for how, ranked in rankings.items():
            order = {part: ranked.get(f"{preset} {part}", []) for part in fragile.PARTS}
            bits = chosen(spec, order)
            rows[how] = {"fragile_keys": sorted(bits["keys"]), "fragile_values": sorted(bits["values"]),
                         **score(spec, bits)}
        reference = rows["exhaustive"]
        for row in rows.values():
            row["kl_vs_exhaustive"] = round(row["mean_kl"] / reference["mean_kl"] - 1, 4)
            row["shared"] = {part: len(set(row[f"fragile_{part}"]) & set(reference[f"fragile_{part}"]))
                             for part in fragile.PARTS}
        out["presets"][preset] = rows
        print(name, preset, json.dumps(rows), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--json", type=Path, default=Path("docs/results/calibration-quality.json"))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), help="the ranking presets to score")
    ap.add_argument("--fisher-passes", default=",".join(map(str, fragile.FISHER_PASSES)),
                    help="the Fisher passes' lengths (fragile.FISHER_PASSES), to score others, e.g. 512,2048")
    args = ap.parse_args()
    fragile.FISHER_PASSES = tuple(int(n) for n in args.fisher_passes.split(","))
    results = {name: measure(name, args.seeds, tuple(args.presets)) for name in args.models}
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "text": "assets/texts/tempest.txt",
           "tokens": TOKENS, "chunk": CHUNK, "fisher_passes": fragile.FISHER_PASSES,
           "machine": {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}, "models": results}
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

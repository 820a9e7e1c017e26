"""Measure what the presets calibrate on the catalogue's models and ship it: the fragile-layer rankings and the outlier
layers (kvplay/cache/outliers.py) in assets/fragile_rankings.json, the key rotations of rotation=calibrated presets in
assets/key_rotations/.

    PYTHONPATH=. python scripts/rank_fragile.py          # only what the seeds and this machine's cache lack
    PYTHONPATH=. python scripts/rank_fragile.py --all    # everything again (SmolLM2 on 2 CPU cores: 43 s a
                                                         # ranking over 512 tokens, about 125 s over 2,048 and for
                                                         # each block size's key rotations)

kvplay measures a model's ranking (rotations) the first time a spec with `fragile` or `vfragile`
(`rotation=calibrated`) needs it (kvplay/cache/fragile.py, rotations.py) and keeps it in ~/.cache/kvplay; the seeds
spare a fresh install (a Space, CI) those minutes for the presets on the catalogue's models, loaded as kvplay loads
them (CPU, bfloat16), the key rotations fitted by the thorough fitter (rotations.FITTERS). Each run writes the seeds
the presets use now, and no others. tests/test_fragile.py and tests/test_rotations.py check that the bundled model's
seeds are what the code measures now.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from kvplay.app.catalogue import MODELS
from kvplay.app.models import load_model
from kvplay.cache import cache_schemes, fragile, outliers, parse_spec, rotations
from kvplay.cache.methods.kvplay import _full_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="measure every seed again, kept or not")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="measure these catalogue models only (the others' seeds are kept as shipped)")
    args = parser.parse_args()
    os.environ["KVPLAY_ROTATIONS"] = "thorough"       # the seeds are thorough fits (rotations.FITTERS)
    specs = [s for s in map(parse_spec, cache_schemes())        # the caches with fragile layers and rotations
             if {"fragile", "rotation"} <= {o.name for o in s.method.option_specs()}]
    shipped = json.loads(fragile.SEEDS.read_text()) if fragile.SEEDS.exists() and not args.all else {}
    seeds = dict(shipped) if set(args.models) != set(MODELS) else {}
    rotations.SEEDS.mkdir(exist_ok=True)
    for name in args.models:
        model, tok = load_model(name, device="cpu")
        fp = fragile.fingerprint(model)
        layers = _full_attention(model.config.get_text_config(decoder=True))   # the layers kvplay's cache quantizes
        fits = {}
        for spec in specs:
            if spec.rotation != "calibrated":
                continue
            key = rotations.storage_key(spec, layers)
            if key not in fits:   # --all fits again; otherwise what is kept, fitting only what is not
                fitted = (rotations.calibrate if args.all else rotations.key_rotations)(model, tok, spec, layers)
                fits[key] = rotations.pack(fitted, layers)
                print(f"{name} {spec}: key rotations for {key}", flush=True)
        if fits:
            torch.save(fits, rotations.SEEDS / f"{fp}.pt")
        kept = {**shipped.get(fp, {}), **({} if args.all else fragile.stored_rankings(fp))}
        rankings = {}
        for spec in specs:
            for part in fragile.PARTS:
                if fragile.ranks(spec, part):
                    key = fragile.storage_key(spec, layers, part)
                    if key not in kept:
                        kept[key] = fragile.rank_layers(model, tok, spec, layers, part)
                    rankings[key] = kept[key]
                    print(f"{name} {spec} {part}: {rankings[key]}", flush=True)
        found = fragile.kept_value(model, outliers.STORE_KEY)      # the loader found the outlier layers (outliers.py)
        if found is not None:
            rankings[outliers.STORE_KEY] = found
            print(f"{name}: outlier layers {outliers.outlier_layers(outliers.kept(model))}", flush=True)
        seeds[fp] = rankings
    fragile.SEEDS.write_text("{\n" + ",\n".join(
        f" {json.dumps(fp)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in r.items()) + "\n }"
        for fp, r in seeds.items()) + "\n}\n")
    print(f"wrote {fragile.SEEDS} and {rotations.SEEDS}")


if __name__ == "__main__":
    main()

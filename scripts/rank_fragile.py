"""Measure the fragile-layer rankings of the catalogue's models and write them to assets/fragile_rankings.json.

    PYTHONPATH=. python scripts/rank_fragile.py     # on SmolLM2, 2 CPU cores: 43 s a ranking over 512 tokens
                                                    # (blocks of 32), about 125 s over 2,048 (blocks of 128)

kvplay measures a model's ranking the first time a spec with `fragile` or `vfragile` needs it
(kvplay/cache/fragile.py) and keeps it in ~/.cache/kvplay/fragile; the seeds spare a fresh install (a Space, CI)
those minutes for the presets
on the catalogue's models, loaded as kvplay loads them (CPU, bfloat16). tests/test_fragile.py checks that the
bundled model's seed is what rank_layers() measures now.
"""
from __future__ import annotations

import json

from kvplay.app.catalogue import MODELS
from kvplay.app.models import load_model
from kvplay.cache import SCHEMES, parse_spec
from kvplay.cache.fragile import PARTS, SEEDS, fingerprint, rank_layers, ranks, storage_key


def main() -> None:
    specs = [parse_spec(name) for name in SCHEMES]
    seeds = {}
    for name in MODELS:
        model, tok = load_model(name, device="cpu")
        layers = list(range(model.config.num_hidden_layers))
        rankings = {}
        for spec in specs:
            for part in PARTS:
                if ranks(spec, part):
                    key = storage_key(spec, layers, part)
                    rankings[key] = ranking = rank_layers(model, tok, spec, layers, part)
                    print(f"{name} {spec} {part}: {ranking}", flush=True)
        seeds[fingerprint(model)] = rankings
    SEEDS.write_text("{\n" + ",\n".join(
        f" {json.dumps(fp)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in r.items()) + "\n }"
        for fp, r in seeds.items()) + "\n}\n")
    print(f"wrote {SEEDS}")


if __name__ == "__main__":
    main()

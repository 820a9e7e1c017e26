"""Measure the fragile-layer rankings of the catalogue's models and write them to assets/fragile_rankings.json.

    PYTHONPATH=. python scripts/rank_fragile.py            # about a minute per ranking on SmolLM2, 2 CPU cores

kvplay measures a model's ranking the first time a spec with `fragile` needs it (kvplay/cache/fragile.py) and
keeps it in ~/.cache/kvplay/fragile; the seeds spare a fresh install (a Space, CI) that minute for the presets
on the catalogue's models, loaded as kvplay loads them (CPU, bfloat16). tests/test_fragile.py checks that the
bundled model's seed is what rank_layers() measures now.
"""
from __future__ import annotations

import json

from kvplay.app.catalogue import MODELS
from kvplay.app.models import load_model
from kvplay.cache import SCHEMES, parse_spec
from kvplay.cache.fragile import SEEDS, fingerprint, rank_layers, storage_key


def main() -> None:
    specs = [parse_spec(name) for name in SCHEMES if parse_spec(name).fragile]
    seeds = {}
    for name in MODELS:
        model, tok = load_model(name, device="cpu")
        layers = list(range(model.config.num_hidden_layers))
        rankings = {}
        for spec in specs:
            rankings[storage_key(spec, layers)] = ranking = rank_layers(model, tok, spec, layers)
            print(f"{name} {spec}: {ranking}")
        seeds[fingerprint(model)] = rankings
    SEEDS.write_text("{\n" + ",\n".join(
        f" {json.dumps(fp)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in r.items()) + "\n }"
        for fp, r in seeds.items()) + "\n}\n")
    print(f"wrote {SEEDS}")


if __name__ == "__main__":
    main()

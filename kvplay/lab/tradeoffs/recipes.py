"""Settings for other engines (assets/engine_recipes.json) and published reference points
(assets/published_points.json), each figure with its source."""
from __future__ import annotations

import json
from pathlib import Path

from kvplay.cache import CacheSpec, parse_spec
from kvplay.lab.texts import ASSETS

RECIPES = ASSETS / "engine_recipes.json"
PUBLISHED = ASSETS / "published_points.json"


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def spec_features(spec: CacheSpec) -> dict[str, bool]:
    """What a spec asks for that an engine may not express."""
    kbits, vbits = spec.kbits or spec.scheme.bits, spec.vbits or spec.scheme.bits
    return {"window": bool(spec.residual), "sink": bool(spec.sink),
            "per_channel_keys": spec.is_quantized and spec.method.key_grouping(spec)[0] == "channel",
            "rotation": (spec.rotation or "none") != "none", "mixed_bits": kbits != vbits,
            "group": spec.group not in (None, 32)}


def recipe(spec_text) -> dict:
    """The nearest settings in each engine for a spec, and what each cannot express (assets/engine_recipes.json)."""
    spec = parse_spec(spec_text)
    data = _load_json(RECIPES)
    kbits, vbits = spec.kbits or spec.scheme.bits, spec.vbits or spec.scheme.bits
    key = "fp8" if spec.scheme.fmt == "fp8" else "bf16" if not spec.is_quantized else f"int{max(kbits, vbits)}"
    features = spec_features(spec)
    own = spec.method.own_recipe(spec)           # (engine, setting) when the spec is that engine's own cache
    engines = []
    for name, eng in data["engines"].items():
        row = dict(eng["by_format"].get(key) or eng["by_format"]["default"])
        same = own is not None and own[0] == name
        if same:
            row = {"setting": own[1], "exact": True, "source": eng["source"]}
        if name == "exllamav3" and spec.is_quantized and spec.scheme.fmt == "int":
            row["setting"] = eng["bits_template"].format(k=kbits, v=vbits)
        lacks = [] if same else [eng["cannot"][f] for f, wanted in features.items() if wanted and f in eng["cannot"]]
        engines.append({"engine": name, "setting": row["setting"], "exact": bool(row.get("exact")) and not lacks,
                        "note": row.get("note", ""), "cannot": lacks, "source": row.get("source", eng["source"])})
    return {"kind": "recipe", "spec": str(spec), "engines": engines}


def published_points() -> list[dict]:
    """Published reference figures (other model, other text), each with its source; [] when the file is absent."""
    return _load_json(PUBLISHED)["points"] if PUBLISHED.is_file() else []

"""Settings for other engines (assets/engine_recipes.json) and published reference points
(assets/published_points.json), each figure with its source."""
from __future__ import annotations

import json
from pathlib import Path

from kvplay.cache import CacheSpec, parse_spec
from kvplay.lab.texts import ASSETS

RECIPES = ASSETS / "engine_recipes.json"
PUBLISHED = ASSETS / "published_points.json"
# The real llama.cpp on SmolLM2-135M-Instruct, each cache type against its own f16 cache (scripts/engines_parity.py,
# docs/engines.md): what the llama.cpp row of a recipe measured, where its setting is one of these types.
PARITY = ASSETS / "engines_parity.json"
NEAREST_GGML = {"int8": "q8_0", "int4": "q4_0", "int3": "q4_0", "int2": "q4_0", "bf16": "f16"}   # the recipes' picks


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _option(spec: CacheSpec, name: str, default=None):
    """One option of the spec's method, or `default` where its method has no such option."""
    return getattr(spec.options, name, default)


def _bits(spec: CacheSpec) -> tuple[int, int]:
    """(key bits, value bits): the method's own kbits/vbits, else the scheme's nominal bits."""
    return _option(spec, "kbits") or spec.scheme.bits, _option(spec, "vbits") or spec.scheme.bits


def spec_features(spec: CacheSpec) -> dict[str, bool]:
    """What a spec asks for that an engine may not express."""
    kbits, vbits = _bits(spec)
    return {"window": bool(_option(spec, "residual")), "sink": bool(_option(spec, "sink")),
            "per_channel_keys": spec.is_quantized and spec.method.key_grouping(spec)[0] == "channel",
            "rotation": _option(spec, "rotation") == "hadamard",
            "calibrated_rotation": _option(spec, "rotation") == "calibrated", "mixed_bits": kbits != vbits,
            "group": _option(spec, "group") not in (None, 32)}


def measured(engine: str, ggml_type: str | None, path: Path = PARITY) -> dict | None:
    """What `engine`'s setting measured on SmolLM2 (the first text of PARITY), or None where nothing was measured:
    {"kl", "delta_ppl_pct", "top1", "model", "text", "protocol"}."""
    if engine != "llama.cpp" or ggml_type is None or not path.is_file():
        return None
    data = _load_json(path)
    text = data["texts"][0]
    row = next((r for r in text["real"] if (r["type"] or "f16") == ggml_type), None)
    if row is None:
        return None
    return {"kl": row["mean_kl"], "delta_ppl_pct": row["delta_ppl_pct"], "top1": row["top1_agreement"],
            "model": data["model"], "text": f"{text['name']}, {text['tokens']} tokens", "protocol": data["protocol"]}


def _ggml_type(spec: CacheSpec, key: str) -> str | None:
    """The llama.cpp type a recipe names for this spec: its own (llamacpp-*, same type for K and V), else the
    nearest the recipe picks for its format."""
    ctk, ctv = _option(spec, "ctk"), _option(spec, "ctv")
    if ctk is not None:
        return ctk if ctk == ctv else None
    return NEAREST_GGML.get(key)


def recipe(spec_text) -> dict:
    """The nearest settings in each engine for a spec, and what each cannot express (assets/engine_recipes.json)."""
    spec = parse_spec(spec_text)
    data = _load_json(RECIPES)
    kbits, vbits = _bits(spec)
    key = "fp8" if spec.scheme.fmt == "fp8" else "bf16" if not spec.is_quantized else f"int{max(kbits, vbits)}"
    features = spec_features(spec)
    own = spec.method.own_recipe(spec)           # (engine, setting) when the spec is that engine's own cache
    engines = []
    for name, eng in data["engines"].items():
        row = dict(eng["by_format"].get(key) or eng["by_format"]["default"])
        same = own is not None and own[0] == name
        if same:
            row = {"setting": own[1], "exact": True, "source": eng["source"]}
        if "bits_template" in eng and spec.is_quantized and spec.scheme.fmt == "int":   # an engine set in bits
            row["setting"] = eng["bits_template"].format(k=kbits, v=vbits)
        lacks = [] if same else [eng["cannot"][f] for f, wanted in features.items() if wanted and f in eng["cannot"]]
        engines.append({"engine": name, "setting": row["setting"], "exact": bool(row.get("exact")) and not lacks,
                        "note": row.get("note", ""), "cannot": lacks, "source": row.get("source", eng["source"]),
                        "measured": measured(name, _ggml_type(spec, key))})
    return {"kind": "recipe", "spec": str(spec), "engines": engines}


def published_points() -> list[dict]:
    """Published reference figures (other model, other text), each with its source; [] when the file is absent."""
    return _load_json(PUBLISHED)["points"] if PUBLISHED.is_file() else []

"""Cache specs: a scheme from the registry plus its method's options, and their one canonical string.

    parse_spec("kvplay-int2:rotation=hadamard,sink=4")   # -> CacheSpec
    str(spec)                                            # -> "kvplay-int2:rotation=hadamard,sink=4"
    spec.with_options(group=64, sink=None)               # -> a validated variant (None keeps the value)
    baseline_first(["kvplay-int4", "baseline"])          # -> [baseline, kvplay-int4], parsed once

Schemes and their options are declared by the cache methods (kvplay/cache/methods/);
this module only reads the registry, so it never names a method.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvplay.cache.methods.base import METHODS, SCHEMES, OptionSpec, Scheme
from kvplay.errors import KvplayError

__all__ = ["SCHEMES", "DEFAULT_SPECS", "CacheSpec", "Scheme", "parse_spec", "defaults", "baseline_first",
           "cache_schemes", "advanced_options", "spec_help"]

# Presets shown first in the UI and used as CLI defaults: each of transformers' caches next to kvplay's at the same
# bits, so the first Compare a visitor runs shows a 2-bit cache that breaks the text and one that keeps it.
DEFAULT_SPECS = ("quanto-int4", "quanto-int2", "kvplay-int4", "kvplay-int2")
BASELINE = "baseline"


@dataclass(frozen=True, eq=False)
class CacheSpec:
    """A fully resolved cache spec: a registered scheme and its method's Options instance.

    Options read as attributes (spec.group, spec.rotation); an option of another method is an
    AttributeError, so code outside a method asks `spec.options` what it may not have. A spec equals
    (and hashes as) its canonical string (its method's spec_text), so `spec == "baseline"` works.
    """

    name: str
    options: Any = field(default=None, compare=True)

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise _unknown_name(self.name)
        if self.options is None:
            object.__setattr__(self, "options", SCHEMES[self.name].defaults())

    def __getattr__(self, key: str):
        if key.startswith("__") or key == "options":
            raise AttributeError(key)
        options = self.__dict__.get("options")
        if options is not None and key in {f.name for f in fields(options)}:
            return getattr(options, key)
        raise AttributeError(f"{self.name} has no option {key!r}")

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.name]

    @property
    def method(self):
        return self.scheme.method

    @property
    def backend(self) -> str:
        return self.scheme.backend

    @property
    def is_quantized(self) -> bool:
        return self.method.quantized

    @property
    def is_reference(self) -> bool:
        """A 16-bit reference the other rows are measured against (the baseline, llama.cpp's own f16 cache)."""
        return self.method.is_reference(self)

    def option_values(self) -> dict:
        """Every option this scheme takes, with its value here, in canonical order."""
        return {o.name: getattr(self.options, o.name) for o in self.scheme.options()}

    def __eq__(self, other) -> bool:
        if isinstance(other, (CacheSpec, str)):
            return str(self) == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    def __repr__(self) -> str:
        return f"CacheSpec({str(self)!r})"

    def __str__(self) -> str:
        return self.method.spec_text(self)

    def with_options(self, **overrides) -> CacheSpec:
        """A validated variant. None, "" and "default" keep the current value; options this scheme
        does not take are ignored, so one set of Advanced controls can apply to every preset."""
        taken = {o.name: o for o in self.scheme.options()}
        given = {k: taken[k].parse(v, str(self)) for k, v in overrides.items()
                 if k in taken and v is not None and str(v).strip().lower() not in ("", "default")}
        return replace(self, options=replace(self.options, **given)) if given else self


def defaults(name: str) -> CacheSpec:
    """The spec a bare scheme name stands for."""
    return CacheSpec(name)


def _join(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _unknown_name(name: str) -> KvplayError:
    backend, _, fmt = name.partition("-")
    offered = [s for s in SCHEMES.values() if s.name.startswith(backend + "-")]
    if offered and fmt:
        same_format = [s.name for s in SCHEMES.values() if s.name.endswith("-" + fmt) and s.name != name]
        hint = f"; try {' or '.join(same_format)}" if same_format else ""
        formats = _join(s.name.split("-", 1)[1] for s in offered)
        return KvplayError(f"Unknown cache {name!r}: {backend} offers {formats}{hint}.")
    close = difflib.get_close_matches(name, SCHEMES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return KvplayError(f"Unknown cache {name!r}; valid names are {', '.join(SCHEMES)}.{hint}")


def parse_spec(text: str | CacheSpec) -> CacheSpec:
    """Parse 'name' or 'name:key=value,key=value' into a resolved CacheSpec (a CacheSpec is returned as is)."""
    if isinstance(text, CacheSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise KvplayError("A cache spec must be a non-empty string such as 'kvplay-int4'.")
    name, _, opts = text.strip().partition(":")
    name = name.strip().lower()
    if name not in SCHEMES:
        raise _unknown_name(name)
    allowed = {o.name: o for o in SCHEMES[name].options()}
    method = SCHEMES[name].method
    given: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in opts.split(","))) if opts.strip() else ():
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        short = method.shorthand(item, text.strip()) if not eq else None      # llama.cpp:q4_0
        if short is not None:
            values = short
        elif not eq or not raw.strip():
            raise KvplayError(f"Option {item!r} in {text!r} must look like key=value.")
        elif key not in allowed:
            raise KvplayError(f"Unknown option {key!r} for {name}; valid options: {', '.join(allowed) or 'none'}.")
        else:
            values = {key: allowed[key].parse(raw, text.strip())}
        if set(values) & set(given):
            raise KvplayError(f"Option {sorted(set(values) & set(given))[0]!r} is given twice in {text!r}.")
        given.update(values)
    if opts.strip() and not given:
        raise KvplayError(f"Spec {text!r} has a colon but no options.")
    spec = CacheSpec(name)
    return replace(spec, options=replace(spec.options, **given)) if given else spec


def cache_schemes() -> list[str]:
    """The schemes whose method builds a transformers cache (every in-process view runs these), registry order."""
    return [name for name, scheme in SCHEMES.items() if scheme.method.builds_cache]


def baseline_first(specs) -> list[CacheSpec]:
    """Parsed specs (strings or CacheSpecs), de-duplicated, the 16-bit baseline first and exactly once (a baseline
    that is not a reference, one that evicts tokens, is a compressed cache like any other)."""
    parsed = list(dict.fromkeys(parse_spec(s) for s in specs))
    given = [s for s in parsed if s.name == BASELINE and s.is_reference]
    return (given or [CacheSpec(BASELINE)]) + [s for s in parsed if s not in given]


# ---------------------------------------------------------------------------- what the UI, CLI and docs read

def advanced_options() -> dict[str, OptionSpec]:
    """Every option of every registered method, by name, first declaration first: the UI's Advanced
    controls. Options of the same name in several methods merge their choices (quanto's and HQQ's axes)."""
    out: dict[str, OptionSpec] = {}
    for method in (m for m in METHODS.values() if m.advanced):
        for o in method.option_specs():
            if o.name not in out:
                out[o.name] = o
            elif o.choices:
                out[o.name] = replace(out[o.name], choices=tuple(dict.fromkeys(out[o.name].choices + o.choices)))
    return out


def spec_help() -> str:
    """The CLI's help for --caches: the syntax, the names and each method's options."""
    per_method = "; ".join(f"{m.name}: {', '.join(o.name for o in m.option_specs()) or 'no options'}"
                           for m in METHODS.values())
    return (f"cache specs, e.g. kvplay-int4 or 'kvplay-int2:rotation=hadamard,sink=4'; names: {', '.join(SCHEMES)}; "
            f"options ({per_method})")

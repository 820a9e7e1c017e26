"""Cache specs: the registry of schemes and the one canonical string form of each spec.

    parse_spec("kvplay-int2:rotation=hadamard,sink=4")   # -> CacheSpec
    str(spec)                                            # -> "kvplay-int2:rotation=hadamard,sink=4"

The registry below is the single place schemes are listed: the CLI's choices,
the UI's checkboxes and the test matrix all read SCHEMES.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace

from ..errors import KvplayError


@dataclass(frozen=True)
class Scheme:
    name: str
    backend: str  # "dynamic" (transformers' DynamicCache), "quanto", "hqq" (transformers' QuantizedCache) or "kvplay"
    fmt: str      # "bf16", "int" or "fp8"
    bits: int
    summary: str


SCHEMES: dict[str, Scheme] = {s.name: s for s in [
    Scheme("baseline", "dynamic", "bf16", 16, "transformers' DynamicCache in the model's 16-bit dtype: the reference"),
    Scheme("quanto-int4", "quanto", "int", 4, "transformers' QuantizedCache, optimum-quanto backend, 4-bit"),
    Scheme("quanto-int2", "quanto", "int", 2, "transformers' QuantizedCache, optimum-quanto backend, 2-bit"),
    Scheme("hqq-int8", "hqq", "int", 8, "transformers' QuantizedCache, HQQ backend, 8-bit"),
    Scheme("hqq-int4", "hqq", "int", 4, "transformers' QuantizedCache, HQQ backend, 4-bit"),
    Scheme("hqq-int2", "hqq", "int", 2, "transformers' QuantizedCache, HQQ backend, 2-bit"),
    Scheme("kvplay-int8", "kvplay", "int", 8, "kvplay's engine, 8-bit integers"),
    Scheme("kvplay-int4", "kvplay", "int", 4, "kvplay's engine, 4-bit: keys per channel, values per token (KIVI)"),
    Scheme("kvplay-int3", "kvplay", "int", 3, "kvplay's engine, 3-bit, bit-packed"),
    Scheme("kvplay-int2", "kvplay", "int", 2, "kvplay's engine, 2-bit: keys per channel, values per token (KIVI)"),
    Scheme("kvplay-fp8", "kvplay", "fp8", 8, "kvplay's engine, float8 e4m3 with a per-token scale"),
]}

# Presets shown first in the UI and used as CLI defaults.
DEFAULT_SPECS = ("quanto-int4", "hqq-int4", "kvplay-int4", "kvplay-int2")

GROUPINGS = ("channel", "token")
ROTATIONS = ("none", "hadamard")
KVPLAY_INT_BITS = (2, 3, 4, 8)
HF_AXES = {"quanto": (0, -1), "hqq": (0, 1)}        # transformers' own validation
HF_PER_TOKEN_AXIS = {"quanto": 0, "hqq": 1}         # per-token grouping in each backend's convention

# Which options each backend takes, in canonical order.
OPTIONS = {
    "dynamic": (),
    "quanto": ("group", "residual", "axis_key", "axis_value"),
    "hqq": ("group", "residual", "axis_key", "axis_value"),
    "kvplay": ("group", "residual", "keys", "values", "rotation", "sink", "kbits", "vbits"),
}
_RANGES = {"group": (1, 4096), "residual": (0, 65536), "sink": (0, 65536)}


@dataclass(frozen=True)
class CacheSpec:
    """A fully resolved cache spec; options a backend does not take stay None."""

    name: str
    group: int | None = None      # elements per quantization group (kvplay channel grouping: tokens per block)
    residual: int | None = None   # recent tokens kept in full precision
    axis_key: int | None = None   # HF backends: the backend's own axis convention
    axis_value: int | None = None
    keys: str | None = None       # kvplay: "channel" (KIVI) or "token"
    values: str | None = None
    rotation: str | None = None   # kvplay: "none" or "hadamard"
    sink: int | None = None       # kvplay: first tokens kept in full precision
    kbits: int | None = None      # kvplay integer formats: key and value bit widths
    vbits: int | None = None

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.name]

    @property
    def backend(self) -> str:
        return self.scheme.backend

    @property
    def is_quantized(self) -> bool:
        return self.backend != "dynamic"

    def __str__(self) -> str:
        default = defaults(self.name)
        opts = [f"{k}={getattr(self, k)}" for k in OPTIONS[self.backend]
                if getattr(self, k) is not None and getattr(self, k) != getattr(default, k)]
        return self.name + (":" + ",".join(opts) if opts else "")

    def to_json(self) -> str:
        return str(self)


def defaults(name: str) -> CacheSpec:
    """The spec a bare scheme name stands for."""
    s = SCHEMES[name]
    if s.backend == "dynamic":
        return CacheSpec(name)
    if s.backend in HF_AXES:
        axis = HF_PER_TOKEN_AXIS[s.backend]
        return CacheSpec(name, group=64, residual=128, axis_key=axis, axis_value=axis)
    if s.fmt == "fp8":  # one scale per token: no groups, no grouping axis, one bit width
        return CacheSpec(name, residual=128, rotation="none", sink=0)
    return CacheSpec(name, group=64 if s.bits >= 4 else 32, residual=128, keys="channel", values="token",
                     rotation="none", sink=0, kbits=s.bits, vbits=s.bits)


def _join(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _unknown_name(name: str) -> KvplayError:
    backend, _, fmt = name.partition("-")
    offered = [s for s in SCHEMES.values() if s.name.startswith(backend + "-")]
    if offered and fmt:
        same_format = [s.name for s in SCHEMES.values() if s.name.endswith("-" + fmt) and s.name != name]
        hint = f"; try {' or '.join(same_format)}" if same_format else ""
        return KvplayError(f"Unknown cache {name!r}: {backend} offers {_join(s.name.split('-', 1)[1] for s in offered)}{hint}.")
    close = difflib.get_close_matches(name, SCHEMES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return KvplayError(f"Unknown cache {name!r}; valid names are {', '.join(SCHEMES)}.{hint}")


def _parse_value(spec_name: str, backend: str, key: str, raw: str):
    where = f"in {spec_name!r}"
    if key in ("keys", "values"):
        if raw not in GROUPINGS:
            raise KvplayError(f"Option {key}={raw!r} {where} is invalid; choose channel or token.")
        return raw
    if key == "rotation":
        if raw not in ROTATIONS:
            raise KvplayError(f"Unknown rotation {raw!r} {where}; choose none or hadamard.")
        return raw
    try:
        value = int(raw)
    except ValueError:
        raise KvplayError(f"Option {key}={raw!r} {where} must be an integer.") from None
    if key in ("axis_key", "axis_value"):
        if value not in HF_AXES[backend]:
            choices = " or ".join(map(str, HF_AXES[backend]))
            raise KvplayError(f"Option {key}={value} {where} is invalid; {backend} takes axis {choices}.")
    elif key in ("kbits", "vbits"):
        if value not in KVPLAY_INT_BITS:
            raise KvplayError(f"Option {key}={value} {where} is invalid; kvplay offers "
                              f"{', '.join(map(str, KVPLAY_INT_BITS))} bits.")
    else:
        lo, hi = _RANGES[key]
        if not lo <= value <= hi:
            raise KvplayError(f"Option {key}={value} {where} is out of range; it must be between {lo} and {hi}.")
    return value


def parse_spec(text: str | CacheSpec) -> CacheSpec:
    """Parse 'name' or 'name:key=value,key=value' into a resolved CacheSpec."""
    if isinstance(text, CacheSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise KvplayError("A cache spec must be a non-empty string such as 'kvplay-int4'.")
    name, _, opts = text.strip().partition(":")
    name = name.strip().lower()
    if name not in SCHEMES:
        raise _unknown_name(name)
    spec = defaults(name)
    backend = spec.backend
    allowed = tuple(k for k in OPTIONS[backend] if getattr(spec, k) is not None)
    given: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in opts.split(","))) if opts.strip() else ():
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        if not eq or not raw.strip():
            raise KvplayError(f"Option {item!r} in {text!r} must look like key=value.")
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise KvplayError(f"Unknown option {key!r} for {name}; valid options: {valid}.")
        if key in given:
            raise KvplayError(f"Option {key!r} is given twice in {text!r}.")
        given[key] = _parse_value(text.strip(), backend, key, raw.strip().lower())
    if opts.strip() and not given:
        raise KvplayError(f"Spec {text!r} has a colon but no options.")
    return replace(spec, **given)


def spec_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(CacheSpec))

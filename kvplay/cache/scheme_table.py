"""The Markdown tables of schemes and options that README.md and kvplay/ui/about.md carry, generated from the
registry (tests/test_methods.py checks the two copies match)."""
from __future__ import annotations

from kvplay.cache.accounting import analytic_nbytes, bits_per_element
from kvplay.cache.arch import Arch
from kvplay.cache.methods.base import METHODS, SCHEMES, OptionSpec
from kvplay.errors import KvplayError


def _values(o: OptionSpec) -> str:
    if o.choices:
        return ", ".join(map(str, o.choices))
    return f"{o.lo:g} to {o.hi:g}" if o.lo is not None else "any name"


TABLE_TOKENS = 8192    # the scheme table quotes bits per element at this many tokens


def table_bits(name: str, tokens: int = TABLE_TOKENS) -> str:
    """All-in bits per element of a scheme at `tokens` tokens on SmolLM2-135M's cache shape (30 layers, 3 KV heads
    of 64), from its byte formula: codes, scales, zero points, sinks and window; 'n/a' where it has none."""
    arch = Arch("SmolLM2-135M", layers=30, kv_heads=3, head_dim=64)
    try:
        return f"{bits_per_element(analytic_nbytes(name, arch, tokens), arch, tokens):.2f}"
    except (KvplayError, NotImplementedError):
        return "n/a"


def scheme_table() -> str:
    """The Markdown tables of schemes and options that README.md and about.md carry (a test checks they match)."""
    rows = [f"| spec | method | what it is | preset | bits per element at {TABLE_TOKENS:,} tokens, all-in "
            "(SmolLM2-135M) |", "|---|---|---|---|---|"]
    for s in SCHEMES.values():
        preset = ", ".join(f"{k}={v}" for k, v in s.preset.items() if v is not None)
        unused = [k for k, v in s.preset.items() if v is None]
        preset = "; ".join(filter(None, [preset, unused and "takes no " + ", ".join(unused)])) or "method defaults"
        rows.append(f"| `{s.name}` | {s.method.name} | {s.summary} | {preset} | {table_bits(s.name)} |")
    rows += ["", "| method | option | default | valid values | what it does |", "|---|---|---|---|---|"]
    for m in METHODS.values():
        for o in m.option_specs():
            rows.append(f"| {m.name} | `{o.name}` | {o.default} | {_values(o)} | {o.help} |")
    return "\n".join(rows)

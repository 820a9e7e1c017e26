"""The Markdown that README.md, docs/options.md and kvplay/ui/about.md carry about the schemes, generated from the
registry, so a new method changes no document by hand.

Each generated block sits between two marker comments, named by a key of BLOCKS:

    <!-- generated: scheme table (python scripts/docs_tables.py) -->
    ...
    <!-- end generated: scheme table -->

refresh(text) re-renders every block in a document; `python scripts/docs_tables.py` rewrites the documents that
carry one, and tests/test_methods.py fails, naming that command, when one is stale.
"""
from __future__ import annotations

import re
from collections.abc import Callable

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
    arch = Arch("SmolLM2-135M", layers=30, kv_heads=3, head_dim=64, key_outliers=())   # none (outliers.py)
    try:
        return f"{bits_per_element(analytic_nbytes(name, arch, tokens), arch, tokens):.2f}"
    except (KvplayError, NotImplementedError):
        return "n/a"


def scheme_table() -> str:
    """The Markdown tables of schemes and of every method's options (about.md, docs/options.md)."""
    return schemes_only() + "\n\n" + option_table()


def schemes_only() -> str:
    """One row per scheme: its method, what it is, its preset and its bits per element all-in."""
    rows = [f"| spec | method | what it is | preset | bits per element at {TABLE_TOKENS:,} tokens, all-in "
            "(SmolLM2-135M) |", "|---|---|---|---|---|"]
    for s in SCHEMES.values():
        preset = ", ".join(f"{k}={v}" for k, v in s.preset.items() if v is not None)
        unused = [k for k, v in s.preset.items() if v is None]
        preset = "; ".join(filter(None, [preset, unused and "takes no " + ", ".join(unused)])) or "method defaults"
        rows.append(f"| `{s.name}` | {s.method.name} | {s.summary} | {preset} | {table_bits(s.name)} |")
    return "\n".join(rows)


def option_table() -> str:
    """One row per option of every method: default, valid values, what it does."""
    rows = ["| method | option | default | valid values | what it does |", "|---|---|---|---|---|"]
    for m in METHODS.values():
        for o in m.option_specs():
            rows.append(f"| {m.name} | `{o.name}` | {o.default} | {_values(o)} | {o.help} |")
    return "\n".join(rows)


def scheme_list() -> str:
    """The README's short list: each family's schemes, one line a family, in registry order."""
    families: dict[str, list[str]] = {}
    for s in SCHEMES.values():
        families.setdefault(s.method.family, []).append(f"`{s.name}`")
    return "\n".join(f"- {family}: {', '.join(names)}" for family, names in families.items())


BLOCKS: dict[str, Callable[[], str]] = {"scheme table": scheme_table, "scheme list": scheme_list}
REFRESH = "python scripts/docs_tables.py"       # the one command that rewrites every generated block
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w ]+?) \([^)]*\) -->\n)(?P<body>(?:.*?\n)?)"
                    r"(<!-- end generated: (?P=name) -->)", re.S)


def refresh(text: str) -> str:
    """`text` with every generated block re-rendered from the registry; an unknown block name is an error."""
    def render(found: re.Match) -> str:
        if found["name"] not in BLOCKS:
            raise KvplayError(f"Unknown generated block {found['name']!r}; known: {', '.join(BLOCKS)}.")
        return found.group(1) + BLOCKS[found["name"]]() + "\n" + found.group(4)
    return _BLOCK.sub(render, text)


def blocks_in(text: str) -> list[str]:
    """The names of the generated blocks a document carries."""
    return [found["name"] for found in _BLOCK.finditer(text)]

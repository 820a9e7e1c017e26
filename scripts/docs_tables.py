"""Rewrite the generated blocks of the docs (the scheme list, scheme and option tables) from the registry.

    python scripts/docs_tables.py            # rewrite every document that carries a block
    python scripts/docs_tables.py --check    # exit 1, naming the stale documents, without writing

The blocks sit between marker comments (kvplay/cache/scheme_table.py says how); tests/test_methods.py runs
--check, so a new method or option fails the tests until this has been run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))                    # run from a checkout, installed or not

from kvplay.cache.scheme_table import REFRESH, blocks_in, refresh  # noqa: E402

DOCUMENTS = ("README.md", "CONTRIBUTING.md", "docs/**/*.md", "kvplay/**/*.md")


def documents() -> list[Path]:
    """Every Markdown document of the repository that carries a generated block."""
    found = sorted({p for pattern in DOCUMENTS for p in ROOT.glob(pattern)})
    return [p for p in found if blocks_in(p.read_text(encoding="utf-8"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which documents are stale (exit 1)")
    args = parser.parse_args()
    stale = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        fresh = refresh(text)
        if fresh != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(fresh, encoding="utf-8")
    if stale and args.check:
        print(f"Stale generated blocks in {', '.join(stale)}; run `{REFRESH}`.", file=sys.stderr)
        return 1
    print(f"rewrote {', '.join(stale)}" if stale else f"{len(documents())} documents up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where kvplay's data lives: the bundled model, the texts, the published architectures, the engine recipes, the
recorded runs and the calibration seeds.

    from kvplay.paths import assets
    assets("texts", "tempest.txt")

In a checkout (and an editable install) they are assets/ at the repository root; a built wheel carries the same
folder as kvplay/_assets (setup.py and pyproject.toml map it), so an installed kvplay runs from any directory.
Every module that reads them asks assets(); tests/test_packaging.py installs a wheel and loads them from elsewhere.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def assets(*parts: str) -> Path:
    """The path of `parts` under kvplay's assets: an installed wheel's kvplay/_assets, else the checkout's assets/."""
    installed = _PACKAGE / "_assets"
    return (installed if installed.is_dir() else _PACKAGE.parent / "assets").joinpath(*parts)

"""Where a result was measured: the model, dtype, device and library versions (every result with an env)."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


package_version = _version     # public: scripts/engines_parity.py records versions the same way


@dataclass
class Environment:
    model: str
    dtype: str
    device: str
    gpu: str | None = None
    weights: str = "16-bit"        # or "quanto int8" / "quanto int4" when weights are quantized too
    torch: str = field(default_factory=lambda: _version("torch"))
    transformers: str = field(default_factory=lambda: _version("transformers"))
    optimum_quanto: str = field(default_factory=lambda: _version("optimum-quanto"))
    hqq: str = field(default_factory=lambda: _version("hqq"))
    python: str = field(default_factory=platform.python_version)
    machine: str = field(default_factory=lambda: f"{platform.machine()} {platform.processor() or ''}".strip())

"""Where a result was measured: the model, dtype, device and library versions (every result with an env)."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field, replace
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
    key_outliers: list[int] | None = None   # the model's outlier layers as measured (kvplay.cache.outliers), which
                                            # kvplay's adapting presets store at 8 bits; None: not measured (older)

    def arch(self, arch):
        """`arch` (a kvplay.cache.arch.Arch from the model's config alone) with the outlier layers this run measured,
        so bits computed from it count an adapting preset's 8-bit keys as the run stored them."""
        if self.key_outliers is None or arch.key_outliers is not None:
            return arch
        return replace(arch, key_outliers=tuple(self.key_outliers))

"""The Quality tab's result: perplexity, KL and per-layer error on a held-out text (kvplay.lab.quality)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplay.results.environment import Environment


@dataclass
class PplRun:
    spec: str
    ppl: float
    delta_ppl_pct: float
    mean_kl: float
    top1_agreement: float
    kl_along_text: list[float]         # mean KL per window of the text, for plotting
    layer_key_error: list[float]       # relative reconstruction error of K per layer
    layer_value_error: list[float]


@dataclass
class PplResult:
    kind: ClassVar[str] = "ppl"
    title: ClassVar[str] = "Quality on held-out text"

    text_name: str
    tokens: int
    chunk: int
    env: Environment
    caches: list[PplRun]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "ppl": round(c.ppl, 4), "delta_ppl_pct": round(c.delta_ppl_pct, 3),
                 "mean_kl": round(c.mean_kl, 5), "top1_agreement": round(c.top1_agreement, 4)} for c in self.caches]

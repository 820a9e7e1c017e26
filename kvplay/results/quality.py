"""The Quality tab's result: perplexity, KL and per-layer error on a held-out text (kvplay.lab.quality)."""
from __future__ import annotations

from dataclasses import dataclass, field
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
    # As llama.cpp's perplexity --kl-divergence reports them (kvplay.lab.metrics.distribution_stats); None where a
    # backend gives no full distributions (a server's top-k), or for results saved before these were measured.
    kl_sem: float | None = None        # standard error of mean_kl, from the spread over chunks
    kl_median: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_sem: float | None = None      # standard error of top1_agreement
    delta_p_mean: float | None = None  # change in p of the 16-bit model's top token, percentage points
    delta_p_rms: float | None = None


@dataclass
class PplResult:
    kind: ClassVar[str] = "ppl"
    title: ClassVar[str] = "Quality on held-out text"

    text_name: str
    tokens: int
    chunk: int
    env: Environment
    caches: list[PplRun]
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence.
    refused: dict[str, str] = field(default_factory=dict)

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "ppl": round(c.ppl, 4), "delta_ppl_pct": round(c.delta_ppl_pct, 3),
                 "mean_kl": round(c.mean_kl, 5), "kl_sem": _round(c.kl_sem, 5), "kl_median": _round(c.kl_median, 5),
                 "kl_p99": _round(c.kl_p99, 4), "kl_max": _round(c.kl_max, 4),
                 "top1_agreement": round(c.top1_agreement, 4), "top1_sem": _round(c.top1_sem, 4),
                 "delta_p_mean": _round(c.delta_p_mean, 3), "delta_p_rms": _round(c.delta_p_rms, 3)}
                for c in self.caches]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class ModelRow:
    model: str
    spec: str
    delta_ppl_pct: float | None      # None where the model refused the cache
    mean_kl: float | None
    top1_agreement: float | None
    bits_long: float | None          # all-in bits per element at ModelsResult.long_tokens (byte formulas)
    refused: str = ""                # why this cache cannot run on this model (one sentence), "" when it ran
    # Find the number (kvplay.lab.inside.needle, its quick grid) when asked for: cells found, of those 16-bit found.
    needle_found: int | None = None
    needle_counted: int | None = None


@dataclass
class ModelsResult:
    """The same caches on several models (`ppl --models`): does a verdict carry over from one model to another?"""
    kind: ClassVar[str] = "ppl_models"
    title: ClassVar[str] = "The same caches on several models"

    long_tokens: int                 # where bits_long is counted (each model's context limit, if shorter)
    runs: list[PplResult]            # one per model, in the order given
    rows: list[ModelRow]

    def summary_rows(self) -> list[dict]:
        """One row per cache and model, caches in the order run, models in the order given."""
        order = list(dict.fromkeys(r.spec for r in self.rows))
        return [{"spec": r.spec, "model": r.model, "delta_ppl_pct": _round(r.delta_ppl_pct, 3),
                 "mean_kl": _round(r.mean_kl, 5), "top1_agreement": _round(r.top1_agreement, 4),
                 f"bits_at_{self.long_tokens}": _round(r.bits_long, 2),
                 "needle": "-" if r.needle_counted is None else f"{r.needle_found}/{r.needle_counted}",
                 "refused": r.refused or "-"}
                for r in sorted(self.rows, key=lambda r: order.index(r.spec))]

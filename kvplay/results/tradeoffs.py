"""The Trade-offs views' results: the equal-bytes chart, the window sweep and drift (kvplay.lab.tradeoffs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvplay.errors import KvplayError
from kvplay.results.environment import Environment

METRICS = {"mean_kl": ("mean KL to the 16-bit run (nats)", False),      # label, higher is better
           "top1_agreement": ("top-1 agreement with the 16-bit run", True),
           "delta_ppl_pct": ("perplexity change against 16-bit (%)", False)}


@dataclass
class ParetoPoint:
    spec: str
    backend: str
    bits_per_element: float          # exact bytes at context_tokens, metadata and 16-bit window included
    mean_kl: float
    top1_agreement: float
    delta_ppl_pct: float
    on_frontier: bool                # on the frontier of bits_per_element against mean_kl
    ppl: float = 0.0
    cache_bytes: dict = field(default_factory=dict)     # payload, metadata, full_precision, total
    seconds: float = 0.0
    bits_long: float | None = None   # the same format at ParetoResult.long_tokens (byte formulas); None: not covered


def frontier(xs, ys, higher_is_better: bool = False) -> list[bool]:
    """Which points no other point dominates (x no larger, y no worse, one of them strictly better)."""
    sign = -1.0 if higher_is_better else 1.0
    pts = [(float(x), sign * float(y)) for x, y in zip(xs, ys)]
    return [not any(a <= x and b <= y and (a < x or b < y) for a, b in pts) for x, y in pts]


@dataclass
class ParetoResult:
    kind: ClassVar[str] = "pareto"
    title: ClassVar[str] = "Quality against bytes (equal-bytes chart)"

    context_tokens: int
    chunk: int
    mode: str
    text_name: str
    baseline_ppl: float
    env: Environment
    points: list[ParetoPoint]
    long_tokens: int | None = None   # a long context (8,192 or the model's limit) where bits_long counts the bytes

    def summary_rows(self) -> list[dict]:
        long = {f"bits_at_{self.long_tokens}": lambda p: None if p.bits_long is None else round(p.bits_long, 3)} \
            if self.long_tokens else {}
        return [{"spec": p.spec, "backend": p.backend, "bits_per_element": round(p.bits_per_element, 3),
                 **{k: f(p) for k, f in long.items()},
                 "mean_kl": round(p.mean_kl, 5), "top1_agreement": round(p.top1_agreement, 4),
                 "delta_ppl_pct": round(p.delta_ppl_pct, 3), "on_frontier": "yes" if p.on_frontier else ""}
                for p in sorted(self.points, key=lambda p: p.bits_per_element)]

    def bits(self, at: str = "run") -> list[float | None]:
        """Each point's bits per element: at the text's length ("run", measured) or at long_tokens ("long",
        from the byte formulas; None for a point they do not cover)."""
        if at not in BYTES_AT:
            raise KvplayError(f"Count bytes at one of {', '.join(BYTES_AT)}, not {at!r}.")
        if at == "long" and not self.long_tokens:
            raise KvplayError("This chart predates bytes at long context; measure it again to draw them.")
        return [p.bits_per_element if at == "run" else p.bits_long for p in self.points]

    def with_frontier(self, metric: str = "mean_kl", at: str = "run") -> list[bool]:
        """Which points are on the frontier of bits (counted `at`) against `metric`; a point without bits is not."""
        _, higher = METRICS[metric]
        xs = self.bits(at)
        kept = [i for i, x in enumerate(xs) if x is not None]
        on = frontier([xs[i] for i in kept], [getattr(self.points[i], metric) for i in kept], higher)
        flags = [False] * len(xs)
        for i, f in zip(kept, on):
            flags[i] = f
        return flags


BYTES_AT = ("run", "long")       # bits per element at the text's length (measured) or at a long context (formulas)


@dataclass
class WindowCache:
    spec: str
    backend: str
    semantics: str                   # "slide" (kvplay) or "flush" (transformers' QuantizedCache)
    points: list[list[float]]        # [[residual, sink, mean_kl, top1_agreement], ...]


@dataclass
class WindowSweepResult:
    kind: ClassVar[str] = "window_sweep"
    title: ClassVar[str] = "Residual window and sinks"

    context_tokens: int
    chunk: int
    residuals: list[int]
    sinks: list[int]
    note: str
    env: Environment
    caches: list[WindowCache]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "semantics": c.semantics, "residual": int(p[0]), "sink": int(p[1]),
                 "mean_kl": round(p[2], 5), "top1_agreement": round(p[3], 4)} for c in self.caches for p in c.points]


@dataclass
class DriftCache:
    spec: str
    kl_smoothed: list[list[float]]   # [[position, mean KL over the window ending there], ...]
    by_context: list[list[float]]    # [[context_tokens, mean KL over positions (context/2, context]], ...]
    mean_kl: float


@dataclass
class DriftResult:
    kind: ClassVar[str] = "drift"
    title: ClassVar[str] = "Drift over long context"

    context_tokens: int
    chunk: int
    window: int                      # tokens per smoothing window
    note: str
    env: Environment
    caches: list[DriftCache]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "mean_kl": round(c.mean_kl, 5),
                 **{f"KL@{int(n)}": round(v, 5) for n, v in c.by_context}} for c in self.caches]

"""The Inside views' results: outlier channels, find the number, error per head, attention shift (kvplay.lab.inside)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

SHIFT_ROWS = 12               # context positions an attention shift's table lists (largest moves)


@dataclass
class HeadStats:
    head: int
    key_kurtosis: float
    value_kurtosis: float
    key_max_ratio: float
    key_outlier_channels: int
    key_kurtosis_rotated: float
    key_max_ratio_rotated: float
    key_outlier_channels_rotated: int
    value_max_ratio: float
    value_outlier_channels: int
    key_top_channels: list[int] = field(default_factory=list)    # largest channels first (up to 3)


@dataclass
class LayerStats:
    layer: int
    heads: list[HeadStats]


@dataclass
class SchemeRisk:
    spec: str
    at_risk: bool
    reason: str


@dataclass
class OutliersResult:
    kind: ClassVar[str] = "outliers"
    title: ClassVar[str] = "Inside: outlier channels per layer and KV head"

    model: str
    tokens: int
    outlier_factor: float
    definition: str
    layers: list[LayerStats]
    schemes: list[SchemeRisk]
    verdict: str


    def summary_rows(self) -> list[dict]:
        return [{"layer": lay.layer, "head": h.head, "key_max_ratio": round(h.key_max_ratio, 1),
                 "key_outliers": h.key_outlier_channels, "key_kurtosis": round(h.key_kurtosis, 1),
                 "rotated_ratio": round(h.key_max_ratio_rotated, 1),
                 "rotated_kurtosis": round(h.key_kurtosis_rotated, 1),
                 "value_max_ratio": round(h.value_max_ratio, 1)} for lay in self.layers for h in lay.heads]

    def matrix(self, key: str) -> list[list[float]]:
        """One statistic as a layer x head matrix (for heatmaps)."""
        return [[float(getattr(h, key)) for h in lay.heads] for lay in self.layers]


@dataclass
class NeedleCache:
    spec: str
    grid: list[list]                 # [context_tokens, depth_fraction, correct]; correct None where the baseline failed
    answers: list[str] = field(default_factory=list)   # the decoded answer per cell, grid order
    found: int = 0
    counted: int = 0                 # cells the baseline passed


@dataclass
class NeedleResult:
    kind: ClassVar[str] = "needle"
    title: ClassVar[str] = "Inside: find the number"

    model: str
    seed: int
    chat: bool
    lengths: list[int]
    depths: list[float]
    prompt_tokens: list[int]         # the real prompt length per cell, grid order
    caches: list[NeedleCache]
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence.
    refused: dict[str, str] = field(default_factory=dict)


    def summary_rows(self) -> list[dict]:
        rows = []
        for c in self.caches:
            row = {"spec": c.spec, "found": f"{c.found}/{c.counted}"}
            for n in self.lengths:
                cells = [g for g in c.grid if g[0] == n]
                row[f"{n} tok"] = "".join("-" if g[2] is None else ("Y" if g[2] else "n") for g in cells)
            rows.append(row)
        return rows


@dataclass
class HeadErrors:
    spec: str
    key_error: list[list[float]]      # layer x KV head, relative Frobenius error
    value_error: list[list[float]]


@dataclass
class ErrorMaps:
    kind: ClassVar[str] = "head_errors"
    title: ClassVar[str] = "Inside: reconstruction error per layer and KV head"

    model: str
    tokens: int
    caches: list[HeadErrors]
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence.
    refused: dict[str, str] = field(default_factory=dict)


    def summary_rows(self) -> list[dict]:
        """Per cache: the median and worst head's key and value error, in %, and where the worst key head is."""
        rows = []
        for c in self.caches:
            keys = [(e, n, h) for n, row in enumerate(c.key_error) for h, e in enumerate(row)]
            values = sorted(e for row in c.value_error for e in row)
            worst, layer, head = max(keys)
            key_median = _median(sorted(e for e, _, _ in keys))
            rows.append({"spec": c.spec, "key_error_median_pct": round(100 * key_median, 2),
                         "key_error_worst_pct": round(100 * worst, 2), "worst_key_head": f"L{layer}h{head}",
                         "value_error_median_pct": round(100 * _median(values), 2),
                         "value_error_worst_pct": round(100 * values[-1], 2)})
        return rows


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


@dataclass
class AttentionShift:
    kind: ClassVar[str] = "attention_shift"
    title: ClassVar[str] = "Inside: attention shift"

    spec: str
    step: int                        # the generated token whose attention is shown (its query is the token before)
    token: str
    layer: int
    head: int                        # query head
    context_tokens: int
    baseline: list[float]            # attention weights over the context, 16-bit cache
    quantized: list[float]           # the same query through the spec's cache
    sink: int                        # leading tokens kept in 16-bit
    window: int                      # trailing tokens kept in 16-bit (at most)
    tokens: list[str] = field(default_factory=list)
    model: str = ""

    @property
    def difference(self) -> list[float]:
        return [q - b for q, b in zip(self.quantized, self.baseline)]


    def summary_rows(self, top: int = SHIFT_ROWS) -> list[dict]:
        """The context positions whose attention weight moved most, largest move first."""
        where = sorted(range(len(self.baseline)), key=lambda i: -abs(self.quantized[i] - self.baseline[i]))[:top]
        start = self.context_tokens - self.window
        return [{"position": i, "token": self.tokens[i].replace("\n", "⏎") if i < len(self.tokens) else "",
                 "held_in": "sink (16-bit)" if i < self.sink else ("16-bit window" if i >= start else "quantized"),
                 "weight_16bit": round(self.baseline[i], 5), "weight_cache": round(self.quantized[i], 5),
                 "difference": round(self.quantized[i] - self.baseline[i], 5)} for i in where]


@dataclass
class KeptCache:
    spec: str
    kept: str                        # what it keeps, in words ("keeps 256 of 1,024 prompt tokens (SnapKV, ...)")
    layers: list[int]                # the layers that evict (full-attention ones)
    shares: list[list[float]]        # per such layer, the share of its KV heads that kept each prompt position
    answer: str = ""
    found: bool = False              # its answer names the pass code


@dataclass
class KeptResult:
    kind: ClassVar[str] = "kept"
    title: ClassVar[str] = "Inside: what eviction kept"

    model: str
    tokens: int                      # the prompt's length
    depth: float
    seed: int
    passkey: str
    needle: list[int]                # [start, end) token positions of the pass-code sentence
    question_start: int              # where the question (after the filler) begins
    caches: list[KeptCache]

    def summary_rows(self) -> list[dict]:
        a, b = self.needle
        return [{"spec": c.spec, "kept": c.kept, "found": "yes" if c.found else "no",
                 "pass code kept (share of heads, mean over layers)":
                     round(sum(sum(s[a:b]) / max(b - a, 1) for s in c.shares) / max(len(c.shares), 1), 3),
                 "answer": c.answer[:60]} for c in self.caches]

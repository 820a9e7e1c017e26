"""Memory's and Throughput's results: a series of points per spec (kvplay.lab.memory, kvplay.lab.throughput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvplay.results.environment import Environment


@dataclass
class SeriesResult:
    """One spec's series of [x, y] points (memory against context, tokens/s against batch)."""

    spec: str
    points: list[list[float]]
    context_points: list[list[float]] = field(default_factory=list)   # throughput against context length
    extra: dict = field(default_factory=dict)


@dataclass
class MemoryResult:
    kind: ClassVar[str] = "memory"
    title: ClassVar[str] = "Memory against context"

    max_context: int
    chunk: int
    env: Environment
    caches: list[SeriesResult]        # points: [[context_tokens, bytes], ...]
    projections: dict = field(default_factory=dict)   # arch -> spec -> [[tokens, bytes], ...]
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence.
    refused: dict[str, str] = field(default_factory=dict)

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "context_tokens": int(c.points[-1][0]), "bytes": int(c.points[-1][1]),
                 "bits_per_element": round(c.extra.get("bits_per_element", 0.0), 3)} for c in self.caches]


@dataclass
class ThroughputResult:
    kind: ClassVar[str] = "throughput"
    title: ClassVar[str] = "Throughput"

    batch_sizes: list[int]
    context: int
    new_tokens: int
    env: Environment
    caches: list[SeriesResult]        # points: [[batch_size, tokens_per_s]], context_points: [[context, tokens_per_s]]
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence.
    refused: dict[str, str] = field(default_factory=dict)

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, **{f"batch {int(b)}": round(t, 2) for b, t in c.points},
                 **{f"context {int(n)}": round(t, 2) for n, t in c.context_points}} for c in self.caches]

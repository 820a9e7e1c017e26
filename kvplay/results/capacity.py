"""Capacity's result: the longest context and largest batch each spec fits on a GPU."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar


@dataclass
class CapacityRow:
    spec: str
    bits_per_element: float
    bytes_per_token: float
    max_context: int                   # batch 1, cache-only bound, capped at the model's trained context
    max_batch: int                     # at `context`
    cache_fits: int | None = None      # the cache-only bound where the model's limit capped max_context


@dataclass
class CapacityResult:
    kind: ClassVar[str] = "capacity"
    title: ClassVar[str] = "What fits on the GPU"

    arch: str
    gpu_gib: float
    weight_dtype: str
    weight_bytes: int
    context: int
    note: str
    caches: list[CapacityRow]
    context_limit: int | None = None   # the architecture's trained context (None: not known)

    def summary_rows(self) -> list[dict]:
        return [asdict(r) for r in self.caches]

"""Tasks with answers (kvplay.lab.tasks): per cache, each task's score, gated by the 16-bit ceiling, and its bits."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

TASK_LABELS = {"niah_single": "needle (1 key)", "niah_multikey": "needle (4 keys)",
               "variable_tracking": "variable tracking", "common_words": "common words (CWE)",
               "frequent_words": "frequent words (FWE)"}      # RULER's two word tasks, kept apart by their names


@dataclass
class TaskCell:
    context: int                  # the target context length in tokens
    kind: str                     # a kvplay.lab.tasks.suite KINDS entry
    seed: int
    score: float                  # the share of the task's answers found in the cache's answer, 0..1
    counted: bool                 # the 16-bit cache scored above 0 on this task, so it counts
    answer: str = ""


@dataclass
class TaskCache:
    spec: str
    lever: str                    # "16-bit", "quantized", "evicted" or "both"
    bits: list[float]             # measured bits per element after the prompt, one per context
    cells: list[TaskCell]
    relative: float | None        # its score over the 16-bit cache's on the counted tasks (None: none counted)
    kept: list[str] = field(default_factory=list)    # what an evicting cache keeps, per context, in words

    def counted_total(self, context: int | None = None) -> float:
        """The sum of its scores on the tasks that count (16-bit got anything right), at one context or all: over
        the 16-bit cache's same sum, its score against 16-bit's."""
        return sum(c.score for c in self.cells if c.counted and (context is None or c.context == context))

    def score(self, context: int | None = None, kind: str | None = None, *, counted: bool = True) -> float | None:
        """Mean score over the cells of this context and kind (None: all), only the counted ones by default."""
        cells = [c for c in self.cells if (context is None or c.context == context) and (kind is None or c.kind == kind)
                 and (c.counted or not counted)]
        return round(sum(c.score for c in cells) / len(cells), 4) if cells else None


@dataclass
class TasksResult:
    kind: ClassVar[str] = "tasks"
    title: ClassVar[str] = "Tasks: accuracy against the 16-bit ceiling"

    model: str
    seed: int
    chat: bool
    contexts: list[int]
    kinds: list[str]
    samples: int                  # tasks per kind and context
    prompt_tokens: list[int]      # the real prompt length at each context (the last task's)
    caches: list[TaskCache]       # the 16-bit baseline first

    def failed_by_16bit(self) -> list[str]:
        """The task kinds the 16-bit cache scored 0 on every time: the model cannot do them, so they count for none."""
        base = self.caches[0]
        return [k for k in self.kinds if not any(c.counted for c in base.cells if c.kind == k)]

    def summary_rows(self) -> list[dict]:
        rows = []
        for c in self.caches:
            row = {"spec": c.spec, "lever": c.lever}
            for n, b in zip(self.contexts, c.bits):
                row[f"bits@{n}"] = b
            for n in self.contexts:
                for k in self.kinds:
                    row[f"{k}@{n}"] = c.score(n, k, counted=False)
            row["relative_accuracy"] = c.relative
            rows.append(row)
        return rows

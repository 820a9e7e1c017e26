"""Memory's command: measured cache bytes against context (kvplay.lab.memory.memory_sweep; the UI's Memory tab)."""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.app import guard
from kvplay.app.checks import check_int, parse_specs
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings
from kvplay.cache import CacheSpec
from kvplay.lab.memory import memory_sweep


@dataclass
class MemoryPlan(Plan):
    specs: list[CacheSpec]
    max_context: object
    chunk: object

    def check(self, job: Job) -> tuple[int, int]:
        tokens = check_int(self.max_context, "Max context", 64, job.limit)
        step = check_int(self.chunk, "Chunk", 1, tokens // 2)
        job.need(tokens)
        return tokens, step

    def run(self, job: Job, checked, progress):
        tokens, step = checked
        yield memory_sweep(job.model, job.tokenizer, self.specs, tokens, step, model_name=job.name,
                           weights=job.weights, progress=progress)


def memory(model_name, specs, max_context, *, chunk=32, device=None, dtype=None, weights=None,
           settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Measured cache bytes against context (kvplay.lab.memory.memory_sweep)."""
    settings = settings or Settings.from_env()
    return run_plan(model_name, MemoryPlan(parse_specs(specs, settings), max_context, chunk), settings=settings,
                    device=device, dtype=dtype, weights=weights, progress=progress, cancel=cancel)

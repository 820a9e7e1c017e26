"""Throughput's command: decode tokens/s against batch size and context (kvplay.lab.throughput; the UI's
Throughput tab)."""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.app import guard
from kvplay.app.checks import check_int, parse_specs
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings
from kvplay.cache import CacheSpec
from kvplay.errors import KvplayError
from kvplay.lab.throughput import throughput_sweep

MAX_SWEEP_POINTS = 8           # extra contexts in one throughput sweep


@dataclass
class ThroughputPlan(Plan):
    specs: list[CacheSpec]
    batch_sizes: list[int]
    context: object
    new_tokens: object
    contexts: list
    max_new_tokens: int

    def check(self, job: Job) -> tuple[int, int, list[int]]:
        new = check_int(self.new_tokens, "New tokens", 2, min(self.max_new_tokens, job.limit - 1))
        ctx = check_int(self.context, "Context", 1, job.limit - new)
        more = list(dict.fromkeys(check_int(c, "Context", 1, job.limit - new) for c in self.contexts))
        job.need(max([ctx] + more) + new, max(self.batch_sizes))
        return ctx, new, more

    def run(self, job: Job, checked, progress):
        ctx, new, more = checked
        yield throughput_sweep(job.model, job.tokenizer, self.specs, self.batch_sizes, ctx, new, more,
                               model_name=job.name, weights=job.weights, progress=progress)


def throughput(model_name, specs, batch_sizes, context, new_tokens, *, contexts=(), device=None, dtype=None,
               weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Decode tokens/s against batch size and context (kvplay.lab.throughput.throughput_sweep)."""
    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(batch_sizes, (list, tuple)) or not isinstance(contexts, (list, tuple)):
        raise KvplayError("Batch sizes and contexts must be lists of whole numbers.")
    batch_sizes = list(dict.fromkeys(check_int(b, "Batch size", 1, settings.max_batch) for b in batch_sizes))
    if not batch_sizes:
        raise KvplayError("Give at least one batch size.")
    if len(contexts) > MAX_SWEEP_POINTS:
        raise KvplayError(f"At most {MAX_SWEEP_POINTS} extra contexts per sweep, got {len(contexts)}.")
    plan = ThroughputPlan(specs, batch_sizes, context, new_tokens, list(contexts), settings.max_new_tokens)
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)

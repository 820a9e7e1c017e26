"""The benchmark's command: kvplay.lab.bench.run_bench behind the same checks as every command (model, memory,
one run per device); `python -m kvplay bench` writes its page."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplay.app import guard
from kvplay.app.guard import cache_bytes
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.models import BUNDLED_NAME
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError
from kvplay.lab.bench import BENCH_SPECS, REAL_BENCH_SPECS, BenchConfig, run_bench


@dataclass
class BenchPlan(Plan):
    load_progress: ClassVar[bool] = True
    quick: bool
    model_name: str

    def check(self, job: Job) -> tuple[BenchConfig, tuple]:
        if job.limit >= max(BenchConfig().memory_lengths):     # the bundled model: 16,384 positions
            config, specs = BenchConfig.quick() if self.quick else BenchConfig(), BENCH_SPECS
        else:                                                  # a real model with fewer positions
            config, specs = BenchConfig.real(self.quick), REAL_BENCH_SPECS
        for tokens, batch in config.largest_runs():
            if tokens > job.limit:
                raise KvplayError(f"The benchmark needs {tokens} tokens of context; this model allows {job.limit}.")
            job.need(tokens, batch)
        tokens, batch = config.decode_cell()        # the specs' caches are all held while they take turns
        job.need(tokens, batch, extra=(len(specs) - 1) * cache_bytes(job.model.config, tokens, batch,
                                                                      job.model.dtype.itemsize))
        return config, specs

    def run(self, job: Job, checked, progress):
        config, specs = checked
        yield run_bench(job.model, job.tokenizer, config=config, specs=specs, quick=self.quick, progress=progress,
                        model_name=self.model_name)


def bench(model_name=None, *, quick=False, device=None, dtype=None, settings: Settings | None = None,
          progress=None, cancel: guard.CancelToken | None = None) -> dict:
    """kvplay.lab.bench.run_bench behind the same checks as every command: model, memory, one run per device."""
    return run_plan(model_name or BUNDLED_NAME, BenchPlan(quick, model_name or BUNDLED_NAME), settings=settings,
                    device=device, dtype=dtype, progress=progress, cancel=cancel)

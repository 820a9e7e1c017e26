"""Calibrate a model ahead of a run (`python -m kvplay calibrate`): what the presets measure on a model nothing is
kept for (kvplay's outlier layers, fragile rankings and key rotations), said before it starts with its estimated
time (kvplay.cache.calibration_time), then kept by the hash of the weights, so that the first Compare, Quality or
Trade-offs run on the model (a demo's first click) waits for none of it."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvplay.app.checks import parse_specs
from kvplay.app.jobs import Job, Plan, stream_plan
from kvplay.app.settings import Settings
from kvplay.cache import cache_schemes, calibrate, calibration_seconds, runnable_specs


@dataclass
class Calibrated:
    """What a calibration run measured: the caches it calibrated now (their estimate said first, with seconds None
    until done) and those it found kept."""
    model: str
    measured: list[str]
    kept: list[str]
    estimated_s: float
    seconds: float | None = None


@dataclass
class CalibratePlan(Plan):
    specs: list | None              # None: every registered preset the model can run

    def check(self, job: Job):
        specs, _ = runnable_specs(self.specs or cache_schemes(), job.model.config)
        return [s for s in specs if s != "baseline"]

    def run(self, job: Job, specs, progress):
        todo = [s for s in specs if not s.method.calibrated(s, job.model)]
        plan = Calibrated(job.name, [str(s) for s in todo], [str(s) for s in specs if s not in todo],
                          round(calibration_seconds(todo, job.model), 1))
        yield plan
        start = time.perf_counter()
        calibrate(todo, job.model, job.tokenizer, progress)
        yield Calibrated(**{**vars(plan), "seconds": round(time.perf_counter() - start, 1)})


def calibrate_model(model_name=None, specs=None, *, settings=None, **envelope):
    """Stream the plan (a Calibrated with seconds None: what will be measured and its estimate), then the
    finished Calibrated. specs: cache specs (default: every registered preset the model can run); envelope:
    stream_plan's device, dtype, progress and cancel."""
    settings = settings or Settings.from_env()
    chosen = [s for s in parse_specs(list(specs), settings) if s != "baseline"] if specs else None
    return stream_plan(model_name, CalibratePlan(chosen), settings=settings, **envelope)

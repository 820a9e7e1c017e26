"""The one envelope every command runs in: load the model, check what depends on it, hold the device, watch.

    def memory(model_name, specs, max_context, *, settings=None, **run):
        specs = checks.parse_specs(specs, settings)                  # checks that need no model: at the edge
        def prepare(job):                                            # checks that need the loaded model
            n = checks.check_int(max_context, "Max context", 64, job.limit)
            job.need(n)                                              # refused when it will not fit in memory
            return lambda progress: memory_sweep(job.model, job.tokenizer, specs, n, progress=progress)
        return run_job(model_name, prepare, settings=settings, **run)

run_job loads the model (kvplay.app.models, optionally with quantized weights), calls prepare(job), then runs
the work it returns while holding the device (guard.exclusive: one run per device), with a progress callback
that raises KvplayError at the next step once the run's cancel token is set (the UI's Stop, a closed page,
the time limit), and the same check before each decoder layer (guard.stops_inside), so one long forward stops
too. stream_job does the same for work that yields partial results, holding the device only
while a step runs, never across a yield.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvplay.app import guard
from kvplay.app.checks import _short
from kvplay.app.models import WEIGHT_FORMATS, check_allowed, check_name, load_model, quantized_model
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError

Progress = Callable[[float, str], None]


def model_limit(model, settings: Settings) -> int:
    """The most tokens a run may hold: the settings' limit or the model's trained positions, whichever is less."""
    return min(settings.max_context, getattr(model.config, "max_position_embeddings", settings.max_context))


def chosen_model(name, settings: Settings) -> str:
    """The model a run uses: the name given, or the settings' default when it is empty."""
    check_name(name)
    return (name or "").strip() or settings.default_model


def get_run_model(name, settings: Settings, device=None, dtype=None, weights=None, progress=None):
    """(model, tokenizer, display name), with optional weight quantization (optimum-quanto int8 or int4)."""
    name = chosen_model(name, settings)
    check_allowed(name, settings)
    model, tok = load_model(name, device=device, dtype=dtype, settings=settings, progress=progress)
    if weights:
        if weights not in WEIGHT_FORMATS:
            raise KvplayError(f"Unknown weight format {_short(weights)}; choose {' or '.join(WEIGHT_FORMATS)}.")
        model = quantized_model(model, weights, before_quantizing=lambda: guard.check_memory(
            guard.model_bytes(model), model.device, what=f"Quantizing the weights of {name!r}",
            advice="choose a smaller model or skip weight quantization"))
    return model, tok, name


@dataclass
class Job:
    """A loaded model and the run's settings, handed to a command's prepare()."""

    model: Any
    tokenizer: Any
    name: str                  # the model's display name, as results record it
    settings: Settings

    @property
    def limit(self) -> int:
        return model_limit(self.model, self.settings)

    @property
    def device(self):
        return self.model.device

    def need(self, tokens: int, batch: int = 1, *, extra: int = 0) -> None:
        """Refuse the run when `tokens` x `batch` (plus `extra` bytes) will not fit in free memory (kvplay.app.guard).
        """
        guard.check_run(self.model, tokens, batch, extra=extra)


def load_job(model, settings: Settings | None = None, *, device=None, dtype=None, weights=None,
             progress: Progress | None = None) -> Job:
    settings = settings or Settings.from_env()
    loaded, tok, name = get_run_model(model, settings, device, dtype, weights, progress=progress)
    return Job(loaded, tok, name, settings)


def run_job(model, prepare: Callable[[Job], Callable[[Progress], Any]], *, settings: Settings | None = None,
            device=None, dtype=None, weights=None, progress: Progress | None = None,
            cancel: guard.CancelToken | None = None, load_progress: bool = False):
    """Load `model`, let prepare(job) check what needs it and return the work, then run the work on the
    device alone, with progress that stops the run once `cancel` is set. load_progress: report the
    model's loading (a first fetch) through `progress` too."""
    job = load_job(model, settings, device=device, dtype=dtype, weights=weights,
                   progress=progress if load_progress else None)
    work = prepare(job)
    with guard.exclusive(job.device), guard.stops_inside(job.model, cancel):
        return work(guard.watch(progress, cancel))


def stream_job(model, prepare: Callable[[Job], Callable[[Progress], Iterator]], *,
               settings: Settings | None = None, device=None, dtype=None, weights=None,
               progress: Progress | None = None, cancel: guard.CancelToken | None = None,
               load_progress: bool = False) -> Iterator:
    """As run_job, for work that yields partial results: the device is held while each one is computed, never
    across a yield, so a consumer that stops iterating cannot block other runs."""
    job = load_job(model, settings, device=device, dtype=dtype, weights=weights,
                   progress=progress if load_progress else None)
    steps = prepare(job)(guard.watch(progress, cancel))
    while True:
        with guard.exclusive(job.device), guard.stops_inside(job.model, cancel):
            item = next(steps, None)
        if item is None:
            return
        yield item

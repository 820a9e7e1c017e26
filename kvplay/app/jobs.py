"""The one envelope every command runs in: load the model, check what depends on it, hold the device, watch.

A command checks what needs no model into a Plan, a dataclass whose fields are its checked inputs, and hands it to
run_plan (or stream_plan, for results that arrive as the run goes):

    @dataclass
    class MemoryPlan(Plan):
        specs: list
        max_context: int
        def check(self, job):                                       # what needs the loaded model
            n = checks.check_int(self.max_context, "Max context", 64, job.limit)
            job.need(n)                                             # refused when it will not fit in memory
            return n                                                # what run() reads
        def run(self, job, tokens, progress):                       # yields results; the last is the final one
            yield memory_sweep(job.model, job.tokenizer, self.specs, tokens, progress=progress)

    def memory(model_name, specs, max_context, *, settings=None, **run):
        plan = MemoryPlan(checks.parse_specs(specs, settings), max_context)       # checks that need no model
        return run_plan(model_name, plan, settings=settings, **run)

stream_plan loads the model (kvplay.app.models, optionally with quantized weights), calls plan.check(job) before
it holds the device, then steps plan.run while holding it (guard.exclusive: one run per device), never across a
yield, so a consumer that stops iterating cannot block other runs. Its progress callback raises KvplayError at the
next step once the run's cancel token is set (the UI's Stop, a closed page, the time limit), and the same check
runs before each decoder layer (guard.stops_inside), so one long forward stops too. run_plan is its last result
(kvplay.lab.progress.last: the one way to drain a stream).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvplay.app import guard
from kvplay.app.checks import _short
from kvplay.app.models import WEIGHT_FORMATS, LoadedModel, check_allowed, check_name, load_model, quantized_model
from kvplay.app.settings import Settings
from kvplay.cache.arch import context_limit
from kvplay.errors import KvplayError
from kvplay.lab.progress import last, no_progress

Progress = Callable[[float, str], None]


def model_limit(model, settings: Settings) -> int:
    """The most tokens a run may hold: the settings' limit or the model's trained positions, whichever is less."""
    return min(settings.max_context, context_limit(model.config) or settings.max_context)


def chosen_model(name, settings: Settings) -> str:
    """The model a run uses: the name given, or the settings' default when it is empty."""
    check_name(name)
    return (name or "").strip() or settings.default_model


def get_run_model(name, settings: Settings, device=None, dtype=None, weights=None, progress=None) -> LoadedModel:
    """The run's LoadedModel (model, tokenizer, display name, weight format), with optional weight quantization
    (optimum-quanto int8 or int4)."""
    name = chosen_model(name, settings)
    check_allowed(name, settings)
    model, tok = load_model(name, device=device, dtype=dtype, settings=settings, progress=progress)
    if weights:
        if weights not in WEIGHT_FORMATS:
            raise KvplayError(f"Unknown weight format {_short(weights)}; choose {' or '.join(WEIGHT_FORMATS)}.")
        model = quantized_model(model, weights, before_quantizing=lambda: guard.check_memory(
            guard.model_bytes(model), model.device, what=f"Quantizing the weights of {name!r}",
            advice="choose a smaller model or skip weight quantization"))
    return LoadedModel(model, tok, name, weights or None)


@dataclass
class Job:
    """A loaded model and the run's settings, handed to a command's prepare()."""

    model: Any
    tokenizer: Any
    name: str                  # the model's display name, as results record it
    settings: Settings
    weights: str | None = None # "int8" / "int4": optimum-quanto weights (LoadedModel.weights); None: 16-bit

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
    loaded = get_run_model(model, settings, device, dtype, weights, progress=progress)
    return Job(loaded.model, loaded.tokenizer, loaded.name, settings, loaded.weights)


class Plan:
    """A command's checked inputs (a dataclass's fields) and its work. load_progress: report the model's loading (a
    first fetch) through the run's progress too."""

    load_progress: ClassVar[bool] = False

    def check(self, job: Job) -> Any:
        """Refuse, in one sentence, what does not fit the loaded model (its context, free memory); what it returns
        is handed to run(). Runs before the device is held."""
        return None

    def run(self, job: Job, checked: Any, progress: Progress) -> Iterator:
        """The work: yields results, the last one final (a run with nothing partial to show yields once)."""
        raise NotImplementedError


def stream_plan(model, plan: Plan, *, settings: Settings | None = None, device=None, dtype=None, weights=None,
                progress: Progress | None = None, cancel: guard.CancelToken | None = None) -> Iterator:
    """Load `model`, check the plan against it, then step its results, the device held while each is computed."""
    job = load_job(model, settings, device=device, dtype=dtype, weights=weights,
                   progress=progress if plan.load_progress else None)
    checked = plan.check(job)
    steps = plan.run(job, checked, guard.watch(progress, cancel) or no_progress)
    while True:
        with guard.exclusive(job.device), guard.stops_inside(job.model, cancel):
            item = next(steps, None)
        if item is None:
            return
        yield item


def run_plan(model, plan: Plan, **envelope):
    """The plan's final result (stream_plan's last), for callers that show nothing partial."""
    return last(stream_plan(model, plan, **envelope))

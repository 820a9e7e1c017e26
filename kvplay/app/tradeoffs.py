"""The Trade-offs runs as the app and the CLI call them: input checked once, then run in the job envelope
(kvplay.app.jobs), alone on the device."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from kvplay.app import prompts
from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.quality import MEASURED_NOW, beside_name
from kvplay.app.settings import Settings
from kvplay.cache import DEFAULT_SPECS, CacheSpec, check_spec_for_model, parse_spec
from kvplay.errors import KvplayError
from kvplay.lab.tasks.run import SAMPLES, tasks_run
from kvplay.lab.tasks.suite import check_kinds
from kvplay.lab.tradeoffs.measure import (
    FULL,
    QUICK,
    RESIDUALS,
    SINKS,
    DriftResult,
    ParetoResult,
    WindowSweepResult,
    drift_run,
    pareto_run,
    window_sweep_run,
)
from kvplay.paths import assets
from kvplay.results import TasksResult, from_dict

MAX_DRIFT_SPECS = 6
# The tasks view's defaults, within a hosted run's 6 specs: each eviction budget next to the quantized cache of about
# the same bytes (a quarter at 16 bits beside 4-bit, an eighth beside 2-bit), 4 bits keeping half, and StreamingLLM
# at SnapKV's budget (which tokens, not how many): with 16-bit, 7 caches.
TASK_SPECS = ("kvplay-int4", "baseline:evict=snapkv,keep=0.25", "kvplay-int2", "baseline:evict=snapkv,keep=0.125",
              "kvplay-int4:evict=snapkv,keep=0.5", "baseline:evict=streamingllm,keep=0.25")
TASK_CONTEXTS = (1024, 2048)
MAX_TASK_SPECS = 10


def _need(job: Job, tokens: int) -> None:
    """Refuse a run that will not fit in memory: the baseline's and one cache's N x vocab float32 logits are kept
    at a time."""
    vocab = int(job.model.config.get_text_config(decoder=True).vocab_size)
    job.need(tokens, extra=2 * tokens * vocab * 4)


def _text(text):
    return None if text is None or (isinstance(text, str) and not text.strip()) else clean_text(text, what="The text")


@dataclass
class ParetoPlan(Plan):
    quick: bool
    specs: list[CacheSpec] | None
    tokens: object
    chunk: object
    text: str | None

    def check(self, job: Job) -> tuple[int, int]:
        mode = QUICK if self.quick else FULL
        n = check_int(self.tokens if self.tokens is not None else mode.tokens, "Tokens", 64, job.limit)
        step = check_int(self.chunk if self.chunk is not None else mode.chunk, "Chunk", 1, n // 2)
        for s in self.specs or ():
            check_spec_for_model(s, job.model.config)
        _need(job, n)
        return n, step

    def run(self, job: Job, checked, progress):
        n, step = checked
        yield pareto_run(job.model, job.tokenizer, quick=self.quick, specs=self.specs, tokens=n, chunk=step,
                         text=self.text, model_name=job.name, progress=progress)


def pareto(model_name=None, *, quick=True, specs=None, tokens=None, chunk=None, text=None, device=None, dtype=None,
           settings=None, progress=None, cancel=None) -> ParetoResult:
    settings = settings or Settings.from_env()
    chosen = [s for s in parse_specs(specs, settings) if s != "baseline"] if specs else None
    return run_plan(model_name, ParetoPlan(quick, chosen, tokens, chunk, _text(text)), settings=settings,
                    device=device, dtype=dtype, progress=progress, cancel=cancel)


def _int_list(values, what: str, lo: int, hi: int) -> list[int]:
    if isinstance(values, str):
        values = values.replace(",", " ").split()
    if not isinstance(values, (list, tuple)) or not values or len(values) > 8:
        raise KvplayError(f"{what} must be a list of 1 to 8 whole numbers.")
    return sorted(dict.fromkeys(check_int(v, what, lo, hi) for v in values))


@dataclass
class WindowSweepPlan(Plan):
    scheme: str
    residuals: object
    sinks: object
    tokens: object
    chunk: object
    transformers_schemes: list[str]
    text: str | None

    def check(self, job: Job):
        n = check_int(self.tokens, "Tokens", 64, job.limit)
        windows = _int_list(self.residuals, "Residual windows", 0, n)
        counts = _int_list(self.sinks, "Sink counts", 0, n)
        step = check_int(self.chunk, "Chunk", 1, n // 2)
        _need(job, n)
        return n, windows, counts, step

    def run(self, job: Job, checked, progress):
        n, windows, counts, step = checked
        yield window_sweep_run(job.model, job.tokenizer, self.scheme, residuals=windows, sinks=counts,
                               transformers_schemes=self.transformers_schemes, tokens=n, chunk=step, text=self.text,
                               model_name=job.name, progress=progress)


@dataclass
class DriftPlan(Plan):
    specs: list[CacheSpec]
    tokens: object
    chunk: object
    window: object
    text: str | None

    def check(self, job: Job):
        n = check_int(self.tokens if self.tokens is not None else min(job.limit, 2048), "Tokens", 128, job.limit)
        step = check_int(self.chunk, "Chunk", 1, n // 2)
        smooth = check_int(self.window, "Smoothing window", 1, n)
        _need(job, n)
        return n, step, smooth

    def run(self, job: Job, checked, progress):
        n, step, smooth = checked
        yield drift_run(job.model, job.tokenizer, self.specs, tokens=n, chunk=step, window=smooth, text=self.text,
                        model_name=job.name, progress=progress)


def window_sweep(model_name=None, scheme="kvplay-int2", *, residuals=RESIDUALS, sinks=SINKS, tokens=1024, chunk=32,
                 transformers_schemes=("quanto-int2", "hqq-int2"), text=None, device=None, dtype=None,
                 settings=None, progress=None, cancel=None) -> WindowSweepResult:
    settings = settings or Settings.from_env()
    if not isinstance(scheme, str) or not parse_spec(scheme).is_quantized:
        raise KvplayError("Choose a quantized scheme to sweep, such as kvplay-int2.")
    transformers_schemes = [str(parse_spec(s)) for s in (transformers_schemes or ())]
    plan = WindowSweepPlan(scheme, residuals, sinks, tokens, chunk, transformers_schemes, _text(text))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, progress=progress,
                    cancel=cancel)


def drift(model_name=None, specs=None, *, tokens=None, chunk=64, window=64, text=None, device=None, dtype=None,
          settings=None, progress=None, cancel=None) -> DriftResult:
    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs) if specs else list(DEFAULT_SPECS), settings)
    return run_plan(model_name, DriftPlan(specs, tokens, chunk, window, _text(text)), settings=settings,
                    device=device, dtype=dtype, progress=progress, cancel=cancel)


@dataclass
class TasksPlan(Plan):
    specs: list[CacheSpec]
    contexts: object
    kinds: object
    samples: object
    seed: object

    def check(self, job: Job):
        contexts = _int_list(self.contexts, "Context lengths", 256, job.limit)
        kinds = check_kinds(self.kinds)
        samples = check_int(self.samples, "Tasks per kind", 1, 20)
        seed = check_int(self.seed, "Seed", 0, 2**31 - 1)
        for spec in self.specs:
            check_spec_for_model(spec, job.model.config)
        job.need(max(contexts) + 64)
        return contexts, kinds, samples, seed, prompts.is_chat(job.name, job.tokenizer)

    def run(self, job: Job, checked, progress):
        contexts, kinds, samples, seed, chat = checked
        yield tasks_run(job.model, job.tokenizer, self.specs, contexts, kinds=kinds, samples=samples, seed=seed,
                        chat=chat, model_name=job.name, progress=progress)


def tasks(model_name=None, specs=TASK_SPECS, *, contexts=TASK_CONTEXTS, kinds=None, samples=SAMPLES, seed=0,
          device=None, dtype=None, settings=None, progress=None, cancel=None):
    """Tasks with answers (RULER-style, generated here) through each cache, against the 16-bit ceiling."""
    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs) if specs else list(TASK_SPECS), settings)
    if len(specs) > MAX_TASK_SPECS:
        raise KvplayError(f"At most {MAX_TASK_SPECS} caches per tasks run, got {len(specs)}.")
    return run_plan(model_name, TasksPlan(specs, contexts, kinds, samples, seed), settings=settings, device=device,
                    dtype=dtype, progress=progress, cancel=cancel)


# docs/results/tasks-{smollm2,qwen2.5,gemma3}-needles.json (docs/eviction.md), shipped together with the package
TASKS_RECORDED = assets("recorded", "tasks-three-models.json")


def _recorded(path, kind: type) -> list:
    """The runs of a shipped recording ({"runs": [result, ...]}), or [] when the file is missing or its runs no
    longer read as results of `kind`."""
    try:
        runs = [from_dict(run) for run in json.loads(path.read_text(encoding="utf-8"))["runs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return runs if runs and all(isinstance(r, kind) for r in runs) else []


def recorded_tasks() -> list[TasksResult]:
    """The catalogue models' recorded task runs, or [] when there are none to read."""
    return _recorded(TASKS_RECORDED, TasksResult)


def shared_setup(recorded: list[TasksResult]) -> dict:
    """What a model measured beside the recordings runs: the caches every recording ran (the first's order, 16-bit
    left to the run), their contexts, kinds and seed, and the fewest tasks per kind any of them has."""
    first = recorded[0]
    if any((r.contexts, r.kinds, r.seed) != (first.contexts, first.kinds, first.seed) for r in recorded):
        raise KvplayError("The recorded task runs differ in their lengths, kinds or seed, so no one run matches them.")
    specs = [c.spec for c in first.caches[1:] if all(c.spec in {d.spec for d in r.caches} for r in recorded)]
    return dict(specs=specs, contexts=first.contexts, kinds=first.kinds, seed=first.seed,
                samples=min(r.samples for r in recorded))


def tasks_beside_recorded(model_name, recorded: list[TasksResult], *, settings=None, progress=None, cancel=None
                          ) -> list[TasksResult]:
    """A model of one's own beside the recorded task runs: shared_setup()'s caches and tasks on it, named
    "NAME (measured now)" after the recordings, whose scores stay theirs."""
    name = beside_name(model_name)
    if not recorded:
        raise KvplayError("No recorded task runs ship with this copy of kvplay: run the tasks on each model instead.")
    result = tasks(name, settings=settings, progress=progress, cancel=cancel, **shared_setup(recorded))
    return [*recorded, replace(result, model=name + MEASURED_NOW)]


# docs/results/pareto-engines-{smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m}.json (docs/engines.md)
PARETO_RECORDED = assets("recorded", "pareto-three-models.json")


def recorded_pareto() -> list[ParetoResult]:
    """The catalogue models' recorded equal-bytes runs, or [] when there are none to read."""
    return _recorded(PARETO_RECORDED, ParetoResult)


def shared_caches(recorded: list[ParetoResult]) -> list[str]:
    """The caches (16-bit aside) every recorded equal-bytes run has, in the first's order."""
    return [p.spec for p in recorded[0].points if p.spec != "baseline"
            and all(any(q.spec == p.spec for q in r.points) for r in recorded)] if recorded else []


def pareto_beside_recorded(model_name, recorded: list[ParetoResult], *, settings=None, progress=None, cancel=None
                           ) -> list[ParetoResult]:
    """A model of one's own beside the recorded equal-bytes runs: the caches every recording has (the first's
    order), over the same tokens of the same text in the same chunks, named "NAME (measured now)" after them."""
    name = beside_name(model_name)
    if not recorded:
        raise KvplayError("No recorded equal-bytes runs ship with this copy of kvplay: run the chart on each model.")
    first = recorded[0]
    if any((r.context_tokens, r.chunk, r.text_name) != (first.context_tokens, first.chunk, first.text_name)
           for r in recorded):
        raise KvplayError("The recorded equal-bytes runs differ in their text, tokens or chunk, so no one run "
                          "matches them.")
    specs = shared_caches(recorded)
    result = pareto(name, specs=specs, tokens=first.context_tokens, chunk=first.chunk, settings=settings,
                    progress=progress, cancel=cancel)
    return [*recorded, replace(result, env=replace(result.env, model=name + MEASURED_NOW))]

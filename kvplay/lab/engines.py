"""Caches that run in another engine than transformers, reached through their method's own hook, never by name.

    inside, elsewhere = split(specs)                  # kvplay's transformers caches; the others, checked now
    check(elsewhere, batch_size=1, temperature=0.0)   # what their engine cannot run as asked: one sentence
    rows = compare_runs(elsewhere, job, base_tokens, model_file, progress)   # CacheRun rows beside a Compare's
    rows = ppl_runs(elsewhere, ids, chunk, model_file, progress)             # PplRun rows beside a perplexity run
    result = compare_alone("server", ["a=URL", "b=URL"], prompt, 64, settings=s)   # an engine's caches alone

How a method says where it runs is its own class attributes (kvplay/cache/methods/base.py), as transformers'
cache_utils keeps each layer's behaviour on its class: `engine` ("transformers", "llama.cpp", "server"), and
`runner`, the lab module that runs its caches and defines RUNNER, an EngineRunner (kvplay.lab.llamacpp for the
real llama.cpp, kvplay.lab.servers for running servers). The cache library may import nothing of the lab (the
import contracts in pyproject.toml), so the method names that module as text and this module imports it the first
time one of its specs runs; a new engine is its method file and its runner module, with no line here or in the
app. The app hands over the specs, the checked run and `model_file(suffix)` (the model's file of a kind, fetched
if it must be: ".gguf" for llama.cpp), and appends whatever rows come back: kvplay.app holds no branch on a
backend and imports no runner.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvplay.cache import check_spec_for_model
from kvplay.cache.spec import SCHEMES
from kvplay.errors import KvplayError

if TYPE_CHECKING:
    from kvplay.lab.compare import CompareJob
    from kvplay.results import CacheRun, CompareResult, PplRun

ModelFile = Callable[[str], Path]       # suffix (".gguf") -> the model's file of that kind


class EngineRunner:
    """What runs one engine's caches. Each hook gets that engine's specs only, in the order given; the defaults
    refuse, so an engine offers only the runs it has."""

    def check(self, specs: list, *, batch_size: int, temperature: float) -> None:
        """Refuse, before any model loads, a run this engine cannot make as asked (one sentence)."""

    def compare_runs(self, specs: list, job: CompareJob, base_tokens: list[int], model_file: ModelFile,
                     progress) -> list[CacheRun]:
        """Rows appended to a model's Compare (`base_tokens`: the 16-bit baseline's text)."""
        raise KvplayError(f"{specs[0]} does not run beside a model's own caches.")

    def ppl_runs(self, specs: list, ids: list[int], chunk: int, model_file: ModelFile, progress) -> list[PplRun]:
        """Rows appended to a model's perplexity run, on the same token ids."""
        raise KvplayError(f"{specs[0]} does not run beside a model's own caches.")

    def compare_alone(self, targets: list[str], prompt: str, max_new_tokens: int, *, settings,
                      progress) -> CompareResult:
        """This engine's caches compared with each other on one prompt, the first the reference."""
        raise KvplayError("This engine's caches run beside a model's own, not on their own.")


def runner(method) -> EngineRunner:
    """The runner its method names (`method.runner`), imported on first use."""
    if method.runner is None:
        raise KvplayError(f"{method.name} runs as a transformers cache, in kvplay's own runners.")
    return importlib.import_module(method.runner).RUNNER


def split(specs) -> tuple[list, list]:
    """(the specs kvplay runs as transformers caches, those another engine runs), by each method's builds_cache.
    The latter are checked now, before any model loads: the real llama.cpp without llama-cpp-python, or a server
    in a model's run, gets its one sentence at once."""
    elsewhere = [s for s in specs if not s.method.builds_cache]
    for spec in elsewhere:
        check_spec_for_model(spec, None)
    return [s for s in specs if s.method.builds_cache], elsewhere


def _by_runner(specs) -> list[tuple[EngineRunner, list]]:
    groups: dict[str, list] = {}
    for spec in specs:
        groups.setdefault(spec.method.runner, []).append(spec)
    return [(runner(group[0].method), group) for group in groups.values()]


def check(specs, *, batch_size: int, temperature: float) -> None:
    for engine, group in _by_runner(specs):
        engine.check(group, batch_size=batch_size, temperature=temperature)


def compare_runs(specs, job: CompareJob, base_tokens: list[int], model_file: ModelFile, progress) -> list[CacheRun]:
    return [row for engine, group in _by_runner(specs)
            for row in engine.compare_runs(group, job, base_tokens, model_file, progress)]


def ppl_runs(specs, ids: list[int], chunk: int, model_file: ModelFile, progress) -> list[PplRun]:
    return [row for engine, group in _by_runner(specs) for row in engine.ppl_runs(group, ids, chunk, model_file,
                                                                                   progress)]


def compare_alone(scheme: str, targets, prompt: str, max_new_tokens: int, *, settings, progress) -> CompareResult:
    """The caches of `scheme`'s engine compared with each other (the running servers: scheme "server")."""
    return runner(SCHEMES[scheme].method).compare_alone(list(targets or []), prompt, max_new_tokens,
                                                        settings=settings, progress=progress)

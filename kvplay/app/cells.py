"""A sweep's cells as Ray runs them (kvplay.app.scale drives them): the work on one model, the worker that keeps the
model loaded, and the finished cells kept on disk.

A cell of `ppl --models` is one model x cache x text (kvplay.lab.quality.cache_run, judged against the baseline's
logits, which the worker computes once and keeps); one of `pareto` is one configuration (kvplay.lab.tradeoffs.
measure.pareto_point, the same way); one of `needle` is one cache x one prompt (kvplay.lab.inside.needle_answer);
one of `tasks` is one task (context, kind, seed) through every cache in lockstep (kvplay.lab.tasks.run.task_cell:
the caches share the task's 16-bit prefill and decode as one batch, so they stay one cell).

A Worker is a Ray actor's class: it loads its model once, checks the run against it with the command's own
Plan.check, calibrates, and runs the model's cells one at a time. Nothing here imports ray: the driver wraps Worker
with ray.remote. Finished cells are JSON files under cell_dir(), keyed by the model's files, kvplay's measuring code
(MEASURING), the cell and what its figures depend on.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvplay.app import models
from kvplay.app.checks import parse_specs
from kvplay.app.inside import NeedlePlan
from kvplay.app.jobs import load_job
from kvplay.app.quality import PplPlan
from kvplay.app.tradeoffs import ParetoPlan, TasksPlan
from kvplay.cache import calibrate, check_specs, fragile, parse_spec, rotations, runnable_specs
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.compare import environment
from kvplay.lab.inside.needle import needle_answer, needle_grid, needle_prompt
from kvplay.lab.quality import cache_run, text_ids
from kvplay.lab.tasks.run import task_cell, tasks_work
from kvplay.lab.tradeoffs.measure import grid, one_pass, pareto_point
from kvplay.lab.tradeoffs.measure import text_ids as pareto_ids

PACKAGE = Path(__file__).resolve().parents[1]          # kvplay/: its measuring code is part of every cell's key


def sentence(exc: BaseException) -> str:
    """An exception as one sentence: a KvplayError's own, else its type and first line."""
    if isinstance(exc, KvplayError):
        return str(exc).strip()
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# ---------------------------------------------------------------------------- the work on one model

@dataclass(frozen=True)
class PplWork:
    """`ppl --models` on one model: a cell per cache the model runs, each judged against the baseline's logits."""

    specs: tuple[str, ...]
    text: str | None
    text_name: str
    max_tokens: object
    chunk: int

    def prepare(self, job) -> dict:
        """PplPlan's checks and perplexity_run's, then calibration: what every cell and the merge read."""
        plan = PplPlan(parse_specs(list(self.specs), job.settings), [], self.text, self.text_name, self.max_tokens,
                       self.chunk)
        tokens = plan.check(job)
        specs, refused = runnable_specs(plan.specs, job.model.config, teacher_forced=True)
        ids, name = text_ids(job.tokenizer, self.text, tokens, self.chunk, job.device)
        calibrate(specs, job.model, job.tokenizer)
        env = environment(job.model, job.name, job.weights)
        return {"cells": [str(s) for s in specs], "refused": refused, "max_tokens": tokens, "tokens": ids.shape[1],
                "text_name": self.text_name or name, "env": asdict(env)}

    def run(self, job, meta: dict, kept: dict, cell: str) -> dict:
        if "ids" not in kept:
            kept["ids"] = text_ids(job.tokenizer, self.text, meta["max_tokens"], self.chunk, job.device)[0]
        reference = meta["cells"][0]                     # the baseline, always first
        if "base" not in kept:
            run, logits = cache_run(job.model, kept["ids"], parse_spec(reference), self.chunk)
            kept["base"], kept["reference"] = (logits, run.ppl), asdict(run)
        if cell == reference:
            return kept["reference"]
        return asdict(cache_run(job.model, kept["ids"], parse_spec(cell), self.chunk, kept["base"])[0])

    def key(self) -> dict:
        """What a cell's figures depend on besides the model and its cache: the text and how it is read."""
        text = None if self.text is None else hashlib.sha256(self.text.encode()).hexdigest()
        return {"sweep": "ppl", "text": text, "text_name": self.text_name, "max_tokens": self.max_tokens,
                "chunk": self.chunk}

    def meta_cell(self) -> dict:
        return {"meta": list(self.specs)}               # which caches run, and which the model refuses

    @staticmethod
    def label(cell) -> str:
        return cell


@dataclass(frozen=True)
class TasksWork:
    """`tasks` on one model: a cell per task, every cache through it in lockstep."""

    specs: tuple[str, ...]
    contexts: object
    kinds: object
    samples: object
    seed: object

    def prepare(self, job) -> dict:
        """TasksPlan's checks and tasks_run's, then calibration."""
        plan = TasksPlan(parse_specs(list(self.specs), job.settings), self.contexts, self.kinds, self.samples,
                         self.seed)
        contexts, kinds, samples, seed, chat = plan.check(job)
        specs = check_specs(plan.specs, job.model.config)
        calibrate(specs, job.model, job.tokenizer)
        return {"cells": [list(w) for w in tasks_work(contexts, kinds, samples)], "specs": [str(s) for s in specs],
                "contexts": contexts, "kinds": list(kinds), "samples": samples, "seed": seed, "chat": chat,
                "model": job.name}

    def run(self, job, meta: dict, kept: dict, cell) -> list:
        if "specs" not in kept:
            kept["specs"] = [parse_spec(s) for s in meta["specs"]]
        n, kind, i = cell
        tokens, out = task_cell(job.model, job.tokenizer, kept["specs"], n, kind, i, seed=meta["seed"],
                                chat=meta["chat"])
        return [tokens, [[asdict(c), bits] for c, bits in out]]

    def key(self) -> dict:
        """Everything: a task's cell holds every cache's answer."""
        return {"sweep": "tasks", **asdict(self)}

    def meta_cell(self) -> dict:
        return {"meta": True}

    @staticmethod
    def label(cell) -> str:
        n, kind, i = cell
        return f"{kind} at {n} #{i + 1}"


@dataclass(frozen=True)
class ParetoWork:
    """`pareto` on one model: a cell per configuration, each pass judged against the baseline's, which the worker
    runs once and keeps. A point's `seconds` is its own pass's time, wherever it ran."""

    specs: tuple[str, ...] | None
    quick: bool
    tokens: object
    chunk: object
    text: str | None

    def prepare(self, job) -> dict:
        """ParetoPlan's checks and pareto_run's, then calibration."""
        specs = [parse_spec(s) for s in self.specs] if self.specs else None
        tokens, chunk = ParetoPlan(self.quick, specs, self.tokens, self.chunk, self.text).check(job)
        checked = check_specs(specs or grid(self.quick), job.model.config, teacher_forced=True)
        calibrate(checked, job.model, job.tokenizer)
        return {"cells": [str(s) for s in checked], "tokens": tokens, "chunk": chunk,
                "env": asdict(environment(job.model, job.name))}

    def run(self, job, meta: dict, kept: dict, cell: str) -> list:
        if "base" not in kept:
            kept["ids"] = pareto_ids(job.tokenizer, meta["tokens"], self.text)
            kept["base"] = one_pass(job.model, kept["ids"], parse_spec(meta["cells"][0]), meta["chunk"])
        base, ids = kept["base"], kept["ids"]
        run = base if cell == meta["cells"][0] else one_pass(job.model, ids, parse_spec(cell), meta["chunk"])
        point, at = pareto_point(job.model, Arch.from_config(job.model.config), base, run,
                                 ids[0, 1:].to(job.model.device), meta["tokens"])
        return [asdict(point), at]

    def key(self) -> dict:
        return {"sweep": "pareto", "quick": self.quick, "tokens": self.tokens, "chunk": self.chunk,
                "text": None if self.text is None else hashlib.sha256(self.text.encode()).hexdigest()}

    def meta_cell(self) -> dict:
        return {"meta": list(self.specs or ())}

    @staticmethod
    def label(cell) -> str:
        return cell


@dataclass(frozen=True)
class NeedleWork:
    """`needle` on one model: a cell per cache and prompt (context length x depth). Every cell runs, those the
    16-bit cache fails too (a grid is small); the merge reads only those that count, as one process does."""

    specs: tuple[str, ...]
    quick: bool
    lengths: tuple | None
    depths: tuple | None
    seed: int

    def prepare(self, job) -> dict:
        """NeedlePlan's checks and needle_run's, then calibration."""
        plan = NeedlePlan(parse_specs(list(self.specs), job.settings), self.quick, self.lengths, self.depths,
                          self.seed)
        chat = plan.check(job)
        lengths, depths = needle_grid(job.model.config, plan.lengths, plan.depths, plan.quick)
        specs, refused = runnable_specs(plan.specs, job.model.config)
        calibrate(specs, job.model, job.tokenizer)
        tokens = [len(needle_prompt(job.tokenizer, n, d, seed=self.seed, chat=chat).ids)
                  for n in lengths for d in depths]
        return {"cells": [[str(s), j] for s in specs for j in range(len(tokens))], "specs": [str(s) for s in specs],
                "refused": refused, "lengths": lengths, "depths": depths, "prompt_tokens": tokens, "chat": chat,
                "model": job.name}

    def run(self, job, meta: dict, kept: dict, cell) -> list:
        if "prompts" not in kept:
            kept["prompts"] = [needle_prompt(job.tokenizer, n, d, seed=self.seed, chat=meta["chat"])
                               for n in meta["lengths"] for d in meta["depths"]]
        spec, j = cell
        return list(needle_answer(job.model, job.tokenizer, parse_spec(spec), kept["prompts"][j]))

    def key(self) -> dict:
        return {"sweep": "needle", "quick": self.quick, "lengths": self.lengths, "depths": self.depths,
                "seed": self.seed}

    def meta_cell(self) -> dict:
        return {"meta": list(self.specs)}

    @staticmethod
    def label(cell) -> str:
        return f"{cell[0]}, prompt {cell[1] + 1}"


# ---------------------------------------------------------------------------- the worker (a Ray actor)

def _calibration_files(model) -> dict[str, bytes]:
    """This model's calibration as kept on disk (fragile-layer rankings, fitted key rotations): name -> bytes."""
    fp = fragile.fingerprint(model)
    found = {}
    for folder, name in (("fragile", f"{fp}.json"), ("rotations", f"{fp}.pt")):
        path = _calibration_dir(folder) / name
        if path.is_file():
            found[f"{folder}/{name}"] = path.read_bytes()
    return found


def _calibration_dir(folder: str) -> Path:
    return fragile.ranking_dir() if folder == "fragile" else rotations.rotation_dir()


def _install(files: dict[str, bytes]) -> None:
    """Keep another worker's calibration files here, merged with what this machine has measured itself."""
    for key, data in files.items():
        folder, name = key.split("/", 1)
        path = _calibration_dir(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            mine = json.loads(path.read_text()) if path.is_file() else {}
            data = json.dumps({**json.loads(data), **mine}, indent=1).encode()
        elif path.is_file():
            tmp = path.with_suffix(".incoming")
            tmp.write_bytes(data)
            torch.save({**torch.load(tmp), **torch.load(path)}, path)
            tmp.unlink()
            continue
        path.write_bytes(data)


class Worker:
    """One model loaded once (on a GPU or `threads` cores), running its cells one at a time; ray.remote wraps it.
    Nothing here raises: a failure comes back as {"error": its one sentence}."""

    def __init__(self, model: str, load: dict, threads: int):
        if threads:
            torch.set_num_threads(threads)
        self.job, self.error, self.work, self.meta, self.kept = None, "", None, None, {}
        try:
            self.job = load_job(model, **load)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence
            self.error = sentence(exc)

    def prepare(self, work, files: dict | None) -> dict:
        """Check the work against the model and calibrate (with the model's first worker's files, if given)."""
        if self.error:
            return {"error": self.error}
        where = f"{platform.node()} {self.job.device.type}"
        try:
            if files:
                _install(files)
            self.work, self.meta = work, work.prepare(self.job)
            return {"meta": self.meta, "files": _calibration_files(self.job.model), "where": where}
        except Exception as exc:  # noqa: BLE001
            return {"error": sentence(exc)}

    def cell(self, cell) -> dict:
        start = time.perf_counter()
        try:
            value = self.work.run(self.job, self.meta, self.kept, cell)
        except Exception as exc:  # noqa: BLE001
            return {"error": sentence(exc)}
        return {"value": value, "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------- finished cells, kept on disk

def cell_dir() -> Path:
    """Where finished cells are kept between runs: $KVPLAY_CELL_DIR, else ~/.cache/kvplay/cells."""
    return Path(os.environ.get("KVPLAY_CELL_DIR") or Path.home() / ".cache" / "kvplay" / "cells").expanduser()


def _hash_files(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


# The code a cell's figures come from: the caches and kernels, the measurements, the result classes, how a model
# loads and what a cell runs. A change there never reads an old cell; the pages, tables and CLI can change freely.
MEASURING = ("cache", "lab", "results", "app/models.py", "app/packing.py", "app/cells.py")


@functools.cache
def source_key() -> str:
    """The hash of the measuring code (MEASURING's .py, .c and .h files)."""
    files = [p for part in MEASURING for p in ([PACKAGE / part] if part.endswith(".py") else
                                               (PACKAGE / part).rglob("*")) if p.suffix in (".py", ".c", ".h")]
    return _hash_files(sorted(files))[:16]


@functools.cache
def model_key(name: str) -> str:
    """What the model's weights are: a catalogue model's pinned SHA-256, else its files' hash (a folder, the bundled
    model, a GGUF file), else a Hub id with its cached revision."""
    source = models.resolve_name(name)
    if source.entry is not None and source.entry.wheel is not None:
        return source.entry.wheel.member_sha256
    where = Path(source.where)
    if where.is_dir():
        files = [where / source.gguf_file] if source.gguf_file else sorted(p for p in where.iterdir() if p.is_file())
        return _hash_files(files)
    return f"hub:{name}"


@dataclass
class CellStore:
    """Finished cells on disk, one JSON file per cell."""

    shared: dict                     # what every cell of the run depends on: the device, dtype and weights

    def path(self, model: str, work, cell) -> Path:
        key = json.dumps({"kvplay": source_key(), "model": model_key(model), "cell": cell, **work.key(),
                          **self.shared}, sort_keys=True, default=str)
        return cell_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def get(self, model: str, work, cell):
        try:
            return json.loads(self.path(model, work, cell).read_text(encoding="utf-8"))["value"]
        except (OSError, ValueError, KeyError):
            return None

    def put(self, model: str, work, cell, value) -> None:
        path = self.path(model, work, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": model, "cell": cell, "value": value}), encoding="utf-8")
        tmp.replace(path)

    def kept(self, model: str, work, cells) -> dict:
        """The cells finished before: json.dumps(cell) -> value."""
        found = {json.dumps(c): self.get(model, work, c) for c in cells}
        return {k: v for k, v in found.items() if v is not None}

"""Sweeps spread over Ray (`--ray [ADDRESS]`, docs/scale.md): every independent cell of a sweep runs on a Ray worker
that keeps its model loaded, and the cells merge into the very result the sweep gives in one process.

    ppl_models(["smollm2-135m-instruct", "gemma-3-270m"], ["kvplay-int4"], ray="local")   # starts Ray here
    tasks("smollm2-135m-instruct", ray="10.0.0.5:6379")                                    # joins a cluster
    pareto("smollm2-135m-instruct", quick=False, ray="auto")                               # the one running here
    needle("qwen2.5-coder-0.5b-instruct", ["kvplay-int4", "kvplay-int2"], quick=False)

What a cell is, the workers and the finished cells kept on disk are kvplay.app.cells'. Here: the driver. Each model
gets a pool of Ray actors (kvplay.app.cells.Worker), each holding one GPU (num_gpus=1) or `cpus` CPU cores; the
cluster's workers are shared out between the models with cells left to run. The model's first worker checks the
run and calibrates; the others start with its calibration files, so none measures it again. A free worker takes
its model's next cell; a worker with none left lets its GPU or cores go. One progress callback counts every cell
and says how many run where. A failed cell is named with its one sentence once the others have finished, and kept
cells make the same command, run again, run only the rest.
"""
from __future__ import annotations

import json
import logging
import socket
from collections import deque
from dataclasses import dataclass, field

from kvplay.app import models
from kvplay.app.cells import (
    CellStore,
    NeedleWork,
    ParetoWork,
    PplWork,
    TasksWork,
    Worker,
    cell_dir,
    sentence,
)
from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.inside import INSIDE_SPECS
from kvplay.app.jobs import chosen_model
from kvplay.app.quality import bits_at
from kvplay.app.settings import Settings
from kvplay.app.tradeoffs import MAX_TASK_SPECS, TASK_CONTEXTS, TASK_SPECS, _text
from kvplay.cache import parse_spec, runnable_specs
from kvplay.cache.arch import Arch, context_limit
from kvplay.errors import KvplayError
from kvplay.lab.compare import LONG_CONTEXT
from kvplay.lab.inside.needle import needle_caches
from kvplay.lab.tasks.run import SAMPLES, tasks_result
from kvplay.lab.tradeoffs.measure import pareto_result
from kvplay.results import (
    ModelRow,
    ModelsResult,
    NeedleResult,
    ParetoPoint,
    ParetoResult,
    PplResult,
    PplRun,
    TaskCell,
    TasksResult,
)
from kvplay.results.environment import Environment

RAY_REQUIREMENTS = "requirements-ray.txt"
REACH_SECONDS = 5                  # how long a cluster's address may take to answer before the run is refused


def load_ray():
    """The ray module. Imported here to defer ray, an optional dependency: without it, one sentence."""
    try:
        import ray  # deferred: ray is optional (requirements-ray.txt) and slow to import
    except ImportError:
        raise KvplayError(f"--ray needs Ray, which is not installed: pip install -r {RAY_REQUIREMENTS}.") from None
    return ray


# ---------------------------------------------------------------------------- the fan-out

def _connect(ray, address: str) -> bool:
    """Start a local Ray instance ("local") or join the cluster at `address`, unless this process already runs
    Ray (a test's instance): True when this call connected, so the run disconnects at its end."""
    if ray.is_initialized():
        return False
    if address not in ("local", "auto"):
        _check_reachable(address)
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        ray.init(**quiet) if address == "local" else ray.init(address=address, **quiet)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence
        where = "a local Ray instance" if address == "local" else f"the Ray cluster at {address}"
        raise KvplayError(f"Could not start or reach {where}: {sentence(exc).rstrip('.')}.") from None
    return True


def _check_reachable(address: str) -> None:
    """One sentence, at once, when nothing listens at a cluster's HOST:PORT (ray.init would retry for minutes)."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise KvplayError(f"A Ray address is HOST:PORT (what `ray start --head` prints), auto or nothing, not "
                          f"{address!r}.")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_SECONDS).close()
    except OSError as exc:
        raise KvplayError(f"Nothing answers at {address} ({exc.strerror or type(exc).__name__}): start the cluster "
                          "there with `ray start --head`, or give --ray alone for a local instance.") from None


def _resources(ray, device, cpus: int) -> tuple[dict, int, str, str]:
    """(a worker's Ray options, how many workers the cluster holds at once, a worker's share in words, the device
    it loads its model on): GPU workers where the cluster has GPUs (or --device cuda asks), else `cpus` cores."""
    total = ray.cluster_resources()
    gpus, cores = int(total.get("GPU", 0)), int(total.get("CPU", 0))
    kind = str(device or ("cuda" if gpus else "cpu"))
    if kind.startswith("cuda"):
        if not gpus:
            raise KvplayError("--device cuda needs GPUs in the Ray cluster, and it has none.")
        return {"num_gpus": 1, "num_cpus": 1}, gpus, "1 GPU", "cuda"     # Ray picks the GPU: it is "cuda" there
    if not 1 <= cpus <= max(cores, 1):
        raise KvplayError(f"Each worker asks for {cpus} CPU cores; the Ray cluster has {cores}.")
    return {"num_cpus": cpus}, max(1, cores // cpus), f"{cpus} CPU core{'s' * (cpus > 1)}", kind


def _cells(n: int) -> str:
    return f"{n} cell{'s' * (n != 1)}"


def _key(cell) -> str:
    return json.dumps(cell)                             # as CellStore.kept keys its cells


@dataclass(eq=False)
class _Model:
    name: str
    work: object
    meta: dict | None = None
    todo: deque = field(default_factory=deque)
    done: dict = field(default_factory=dict)          # _key(cell) -> its value
    files: dict | None = None                         # the first worker's calibration, once it has prepared
    workers: list = field(default_factory=list)
    started: int = 0


class _Fanout:
    """The driver's loop: workers started per model, cells handed to whichever of its workers is free, results kept
    as they come, one progress bar over every cell."""

    def __init__(self, ray, store, options, threads, load, share, note, progress):
        self.ray, self.store, self.options, self.threads, self.load = ray, store, options, threads, load
        self.share, self.note, self.progress = share, note, progress
        self.worker_class = ray.remote(Worker)
        self.pending, self.where, self.names, self.placed = {}, {}, {}, {}
        self.failed: list[tuple[str, str]] = []
        self.total = self.finished = 0

    def start(self, m: _Model) -> None:
        actor = self.worker_class.options(**self.options).remote(m.name, self.load, self.threads)
        m.workers.append(actor)
        m.started += 1
        self.names[actor] = f"{m.name} #{m.started}"
        self.pending[actor.prepare.remote(m.work, m.files)] = ("prepare", m, actor, None)

    def stop(self, m: _Model, actor) -> None:
        if actor in m.workers:
            m.workers.remove(actor)
            self.ray.kill(actor)
        if not m.workers and m.todo and m.files is not None:      # every worker of the model gone, cells left
            self.fail(m, list(m.todo), "no worker of this model is left to run it")
            m.todo.clear()

    def fail(self, m: _Model, cells, why: str) -> None:
        for cell in cells:
            self.failed.append((m.name if cell is None else f"{m.name} x {m.work.label(cell)}", why))
            self.finished += cell is not None

    def dispatch(self, m: _Model, actor) -> None:
        """Hand the free worker its model's next cell, or let it go (its cores or GPU go to another model)."""
        if m.todo:
            cell = m.todo.popleft()
            self.pending[actor.cell.remote(cell)] = ("cell", m, actor, cell)
        else:
            self.stop(m, actor)

    def prepared(self, m: _Model, actor, out: dict) -> None:
        if "error" in out:
            first = m.files is None
            self.stop(m, actor)
            if first:                                   # the model's first worker: nothing of it can run
                self.fail(m, [None], out["error"])
            return
        self.where[actor] = out["where"]
        if m.files is None:                              # the first worker: the model's cells are known now
            m.meta, m.files = out["meta"], out["files"]
            self.store.put(m.name, m.work, m.work.meta_cell(), m.meta)
            m.done = self.store.kept(m.name, m.work, m.meta["cells"])
            m.todo = deque(c for c in m.meta["cells"] if _key(c) not in m.done)
            self.total += len(m.meta["cells"])
            self.finished += len(m.done)
            more = max(0, min(len(m.todo), self.share) - 1)
            self.note(f"  {m.name}: {len(m.meta['cells'])} cells, {len(m.done)} kept from an earlier run, "
                      f"{len(m.todo)} to run on {1 + more} worker{'s' * bool(more)} (calibrated once, on "
                      f"{out['where']})")
            for _ in range(more):
                self.start(m)
        self.dispatch(m, actor)

    def ran(self, m: _Model, actor, cell, out: dict) -> None:
        self.finished += 1
        if "error" in out:
            self.failed.append((f"{m.name} x {m.work.label(cell)}", out["error"]))
        else:
            m.done[_key(cell)] = out["value"]
            self.store.put(m.name, m.work, cell, out["value"])
            where = f"{self.names[actor]} on {self.where[actor]}"
            self.placed.setdefault(where, []).append(f"{m.work.label(cell)} ({out['seconds']:.1f} s)")
        self.dispatch(m, actor)

    def loop(self) -> None:
        while self.pending:
            ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=0.5)
            for ref in ready:
                what, m, actor, cell = self.pending.pop(ref)
                try:
                    out = self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:     # the worker died (out of memory, a lost node)
                    out = {"error": f"its Ray worker stopped ({sentence(exc).rstrip('.')})"}
                    if what == "cell":
                        self.finished += 1
                        self.failed.append((f"{m.name} x {m.work.label(cell)}", out["error"]))
                        self.stop(m, actor)
                        continue
                self.prepared(m, actor, out) if what == "prepare" else self.ran(m, actor, cell, out)
            self.report()

    def report(self) -> None:
        running: dict[str, int] = {}
        for what, _, actor, _ in self.pending.values():
            if what == "cell":
                running[self.where[actor]] = running.get(self.where[actor], 0) + 1
        now = ", ".join(f"{n} on {where}" for where, n in running.items())
        if not self.total:
            starting = sum(what == "prepare" for what, *_ in self.pending.values())
            self.progress(0.0, f"loading models on {starting} worker{'s' * (starting > 1)}")
            return
        self.progress(self.finished / self.total, f"{self.finished}/{self.total} cells" + (f"; {now}" if now else ""))


def run_cells(work: dict, ray_address: str, *, device=None, dtype=None, weights=None, settings: Settings,
              cpus: int = 1, note=None, progress=None) -> dict[str, tuple[dict, dict]]:
    """Every model's cells of `work` ({model name: its work}) on Ray: {model name: (its meta, {_key(cell): value})},
    or one sentence naming each failed cell once the others have finished (and are kept)."""
    note, progress = note or (lambda text: None), progress or (lambda fraction, what: None)
    ray = load_ray()
    cpus = check_int(cpus, "CPU cores per worker", 1, 4096)
    connected = _connect(ray, ray_address)
    models_ = [_Model(name, w) for name, w in work.items()]
    fanout = None
    try:
        options, slots, each, kind = _resources(ray, device, cpus)
        store = CellStore({"device": kind, "dtype": str(dtype), "weights": weights})
        load = dict(settings=settings, device=kind, dtype=dtype, weights=weights)
        for m in models_:                  # a model whose every cell finished before needs no worker
            m.meta = store.get(m.name, m.work, m.work.meta_cell())
            m.done = store.kept(m.name, m.work, m.meta["cells"]) if m.meta else {}
        busy = [m for m in models_ if m.meta is None or len(m.done) < len(m.meta["cells"])]
        share = max(1, slots // max(1, len(busy)))
        fanout = _Fanout(ray, store, options, cpus if "num_gpus" not in options else 0, load, share, note, progress)
        note(f"ray: {slots} worker{'s' * (slots > 1)} at once here ({each} each), {len(busy)} of {len(models_)} "
             f"model{'s' * (len(models_) > 1)} to run; finished cells kept in {cell_dir()}")
        for m in models_:
            if m in busy:
                fanout.start(m)
            else:
                fanout.total += len(m.done)
                fanout.finished += len(m.done)
                note(f"  {m.name}: {len(m.done)} cells, all kept from an earlier run")
        fanout.loop()
    finally:
        for m in models_:
            for actor in list(m.workers):
                ray.kill(actor)
        if connected:
            ray.shutdown()
    for where, cells in fanout.placed.items():
        note(f"  {where}: {', '.join(cells)}")
    if fanout.failed:
        shown = "; ".join(f"{what}: {why.rstrip('.')}" for what, why in fanout.failed[:3])
        more = f"; and {len(fanout.failed) - 3} more" if len(fanout.failed) > 3 else ""
        parts, kept = len(fanout.failed), sum(len(m.done) for m in models_)
        raise KvplayError(f"{parts} part{'s' * (parts > 1)} of the run failed ({shown}{more}); the {_cells(kept)} "
                          f"that finished {'is' if kept == 1 else 'are'} kept in {cell_dir()}, so the same command "
                          "again runs only the rest.")
    return {m.name: (m.meta, m.done) for m in models_}


# ---------------------------------------------------------------------------- the sweeps

def ppl_models(model_names, specs, *, ray: str = "local", cpus: int = 1, needle: bool = False, text=None,
               text_name: str = "", max_tokens=2048, chunk=16, device=None, dtype=None, weights=None,
               settings: Settings | None = None, note=None, progress=None) -> ModelsResult:
    """kvplay.app.quality.ppl_models with a cell per model and cache on Ray: the same ModelsResult."""
    load_ray()                           # without Ray, its one sentence before anything loads
    if needle:
        raise KvplayError("--needle does not run on Ray yet; drop --ray or --needle.")
    settings = settings or Settings.from_env()
    if isinstance(model_names, str):
        model_names = model_names.split()
    names = list(dict.fromkeys(str(n).strip() for n in model_names or () if str(n).strip()))
    if not 2 <= len(names) <= 4:
        raise KvplayError(f"Compare 2 to 4 different models, got {len(names)}.")
    parsed = parse_specs(specs, settings)
    elsewhere = [str(s) for s in parsed if not s.method.builds_cache]
    if elsewhere:
        raise KvplayError(f"--ray spreads kvplay's own caches over workers; run {elsewhere[0]} without --ray.")
    if text is not None:
        text = clean_text(text, what="The text")
    chunk = check_int(chunk, "Chunk", 1, 512)
    work, shapes = {}, {}
    for name in names:
        config = models.load_config(name)
        ran, refused = runnable_specs(parsed, config, teacher_forced=True, require_one=False)
        work[name] = PplWork(tuple(str(s) for s in ran), text, text_name, max_tokens, chunk)
        shapes[name] = Arch.from_config(config), min(LONG_CONTEXT, context_limit(config) or LONG_CONTEXT), refused
    done = run_cells(work, ray, device=device, dtype=dtype, weights=weights, settings=settings, cpus=cpus,
                     note=note, progress=progress)
    runs, rows = [], []
    for name in names:                   # as quality.ppl_models joins them
        (meta, values), (arch, tokens, refused) = done[name], shapes[name]
        result = PplResult(text_name=meta["text_name"], tokens=meta["tokens"], chunk=chunk,
                           env=Environment(**meta["env"]), caches=[PplRun(**values[_key(c)]) for c in meta["cells"]],
                           refused=meta["refused"])
        arch = result.env.arch(arch)                  # the outlier layers the worker found, in the bits it quotes
        runs.append(result)
        rows += [ModelRow(model=name, spec=c.spec, delta_ppl_pct=c.delta_ppl_pct, mean_kl=c.mean_kl,
                          top1_agreement=c.top1_agreement, bits_long=bits_at(c.spec, arch, tokens))
                 for c in result.caches]
        rows += [ModelRow(model=name, spec=s, delta_ppl_pct=None, mean_kl=None, top1_agreement=None,
                          bits_long=None, refused=why) for s, why in refused.items()]
    return ModelsResult(long_tokens=LONG_CONTEXT, runs=runs, rows=rows)


def tasks(model_name=None, specs=TASK_SPECS, *, ray: str = "local", cpus: int = 1, contexts=TASK_CONTEXTS,
          kinds=None, samples=SAMPLES, seed=0, device=None, dtype=None, settings: Settings | None = None, note=None,
          progress=None) -> TasksResult:
    """kvplay.app.tradeoffs.tasks with a cell per task on Ray: the same TasksResult."""
    load_ray()
    settings = settings or Settings.from_env()
    parsed = parse_specs(list(specs) if specs else list(TASK_SPECS), settings)
    if len(parsed) > MAX_TASK_SPECS:
        raise KvplayError(f"At most {MAX_TASK_SPECS} caches per tasks run, got {len(parsed)}.")
    name = chosen_model(model_name, settings)
    work = TasksWork(tuple(str(s) for s in parsed), contexts, kinds, samples, seed)
    meta, values = run_cells({name: work}, ray, device=device, dtype=dtype, settings=settings, cpus=cpus, note=note,
                             progress=progress)[name]
    done = [(tokens, [(TaskCell(**cell), bits) for cell, bits in outcomes])
            for tokens, outcomes in (values[_key(c)] for c in meta["cells"])]
    return tasks_result([parse_spec(s) for s in meta["specs"]], meta["contexts"], meta["kinds"], meta["samples"],
                        meta["seed"], meta["chat"], meta["model"], done)


def pareto(model_name=None, *, ray: str = "local", cpus: int = 1, quick=True, specs=None, tokens=None, chunk=None,
           text=None, device=None, dtype=None, settings: Settings | None = None, note=None,
           progress=None) -> ParetoResult:
    """kvplay.app.tradeoffs.pareto with a cell per configuration on Ray: the same ParetoResult, each point's
    `seconds` being its own pass's time on its worker."""
    load_ray()
    settings = settings or Settings.from_env()
    chosen = tuple(str(s) for s in parse_specs(specs, settings) if s != "baseline") if specs else None
    name, text = chosen_model(model_name, settings), _text(text)
    work = ParetoWork(chosen, bool(quick), tokens, chunk, text)
    meta, values = run_cells({name: work}, ray, device=device, dtype=dtype, settings=settings, cpus=cpus, note=note,
                             progress=progress)[name]
    done = [values[_key(c)] for c in meta["cells"]]
    long_tokens = next((at for _, at in done if at), None)
    return pareto_result([ParetoPoint(**point) for point, _ in done], long_tokens, Environment(**meta["env"]),
                         tokens=meta["tokens"], chunk=meta["chunk"], quick=bool(quick), text=text)


def needle(model_name=None, specs=INSIDE_SPECS, *, ray: str = "local", cpus: int = 1, quick=True, lengths=None,
           depths=None, seed=0, device=None, dtype=None, weights=None, settings: Settings | None = None, note=None,
           progress=None) -> NeedleResult:
    """kvplay.app.inside.needle with a cell per cache and prompt on Ray: the same NeedleResult."""
    load_ray()
    settings = settings or Settings.from_env()
    parsed = parse_specs(list(specs), settings)
    name = chosen_model(model_name, settings)
    work = NeedleWork(tuple(str(s) for s in parsed), bool(quick), tuple(lengths) if lengths else None,
                      tuple(depths) if depths else None, seed)
    meta, values = run_cells({name: work}, ray, device=device, dtype=dtype, weights=weights, settings=settings,
                             cpus=cpus, note=note, progress=progress)[name]
    prompts = [(n, d, None) for n in meta["lengths"] for d in meta["depths"]]
    caches = needle_caches(meta["specs"], prompts, lambda i, j: tuple(values[_key([meta["specs"][i], j])]))
    return NeedleResult(model=meta["model"], seed=seed, chat=meta["chat"], lengths=meta["lengths"],
                        depths=meta["depths"], prompt_tokens=meta["prompt_tokens"], caches=caches,
                        refused=meta["refused"])

"""Tasks with answers through every cache: the RULER-style suite (suite.py) at each context length, scored
against each task's answers and gated by the 16-bit ceiling.

Each task is one lockstep run (kvplay.lab.generate.lockstep): one 16-bit prefill shared by every cache that
can share it (eviction included: an evicting cache reads the whole prompt, then keeps its share), then greedy
decoding, all caches as one batch. A cell the 16-bit cache scores 0 on is shown as failed by 16-bit and never
counted against a cache; a cache's accuracy is its score over the 16-bit cache's, on the cells 16-bit got
anything right. Bits per element are measured: the cache's stored bytes right after the prompt over the
prompt's tokens times the elements per token (kvplay.cache.bits_per_element), so a 16-bit cache keeping a
quarter of the prompt reads 4.
"""
from __future__ import annotations

import torch

from kvplay.cache import bits_per_element, build_cache, calibrate, check_specs
from kvplay.cache.arch import Arch
from kvplay.cache.evict import kept_words, policy_of
from kvplay.lab.generate import Row, Sampler, lockstep
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.tasks.suite import KINDS, LABELS, Task, check_kinds, make_task, task_seed
from kvplay.results import TaskCache, TaskCell, TasksResult

SAMPLES = 2               # tasks per kind and context (seeds), by default


def lever(spec) -> str:
    """Which memory lever a cache pulls: "16-bit", "quantized", "evicted" or "both"."""
    evicts = policy_of(spec) is not None
    if spec.is_reference:
        return "16-bit"
    if evicts:
        return "both" if spec.is_quantized else "evicted"
    return "quantized"


def run_task(model, task: Task, specs, stop_token: int | None) -> list[tuple[list[int], int]]:
    """One task through every spec's cache, stepping together: per spec (the answer's token ids, the cache's bytes
    right after the prompt)."""
    caches = [build_cache(spec, model) for spec in specs]
    rows = [Row(cache=cache, sampler=Sampler(), name=str(spec), keep_logits=False)
            for spec, cache in zip(specs, caches)]
    ids = torch.tensor([task.ids], device=model.device)
    for _ in lockstep(model, ids, rows, task.max_new_tokens, stop_token=stop_token):
        pass
    out = []
    for row in rows:
        tokens = torch.cat(row.tokens, dim=1)[0].tolist() if row.tokens else []
        if stop_token is not None and stop_token in tokens:
            tokens = tokens[:tokens.index(stop_token)]
        out.append((tokens, row.cache_bytes[0]))
    return out


def task_cell(model, tokenizer, specs, context: int, kind: str, sample: int, *, seed: int = 0,
              chat: bool = True) -> tuple[int, list[tuple[TaskCell, float]]]:
    """One task (the `sample`-th of its kind at `context` tokens) through the baseline and each checked spec in
    lockstep: (its prompt's tokens, per spec (its cell, its bits per element after the prompt))."""
    task = make_task(kind, tokenizer, context, seed=task_seed(seed + sample, kind, context), chat=chat)
    arch = Arch.from_config(model.config)
    out, ceiling = [], None
    for tokens, nbytes in run_task(model, task, specs, tokenizer.eos_token_id):
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        score = task.score(text)
        if ceiling is None:
            ceiling = score
        out.append((TaskCell(context=context, kind=kind, seed=task.seed, score=score, counted=ceiling > 0,
                             answer=text[:200]), round(bits_per_element(nbytes, arch, len(task.ids)), 3)))
    return len(task.ids), out


def tasks_work(contexts, kinds, samples: int) -> list[tuple[int, str, int]]:
    """Every task of a run, in the order it runs: (context, kind, sample)."""
    return [(n, kind, i) for n in contexts for kind in kinds for i in range(samples)]


def tasks_result(specs, contexts, kinds, samples: int, seed: int, chat: bool, model_name: str,
                 done: list[tuple[int, list[tuple[TaskCell, float]]]]) -> TasksResult:
    """The run's result from task_cell's outcomes, one per tasks_work() entry in its order."""
    cells: dict[str, list[TaskCell]] = {str(s): [] for s in specs}
    bits: dict[str, dict[int, float]] = {str(s): {} for s in specs}
    prompt_tokens: dict[int, int] = {}
    for (n, _, _), (tokens, outcomes) in zip(tasks_work(contexts, kinds, samples), done, strict=True):
        prompt_tokens[n] = tokens
        for spec, (cell, cell_bits) in zip(specs, outcomes, strict=True):
            cells[str(spec)].append(cell)
            bits[str(spec)].setdefault(n, cell_bits)
    out = [TaskCache(spec=str(spec), lever=lever(spec), bits=[bits[str(spec)][n] for n in contexts],
                     kept=[kept_words(spec, prompt_tokens[n]) for n in contexts] if policy_of(spec) else [],
                     cells=cells[str(spec)], relative=None) for spec in specs]
    ceiling = out[0].counted_total()
    for cache in out:
        cache.relative = round(cache.counted_total() / ceiling, 4) if ceiling else None
    return TasksResult(model=model_name, seed=seed, chat=chat, contexts=list(contexts), kinds=list(kinds),
                       samples=samples, prompt_tokens=[prompt_tokens[n] for n in contexts], caches=out)


def tasks_run(model, tokenizer, specs, contexts, *, kinds=KINDS, samples: int = SAMPLES, seed: int = 0,
              chat: bool = True, model_name: str = "", progress: Progress | None = None) -> TasksResult:
    """Every kind of task at every context length, `samples` seeds each, through the baseline and each spec: each
    task is task_cell's, so a run spread task by task (kvplay.app.scale) gives the same result."""
    progress = progress or no_progress
    kinds = check_kinds(kinds)
    specs = check_specs(specs, model.config)
    calibrate(specs, model, tokenizer, progress)
    work, done = tasks_work(contexts, kinds, samples), []
    for k, (n, kind, i) in enumerate(work):
        progress(k / len(work), f"{LABELS[kind]} at {n:,} tokens, task {i + 1} of {samples}")
        done.append(task_cell(model, tokenizer, specs, n, kind, i, seed=seed, chat=chat))
    progress(1.0, "done")
    return tasks_result(specs, contexts, kinds, samples, seed, chat, model_name, done)

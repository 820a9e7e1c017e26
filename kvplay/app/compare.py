"""Compare's commands: the baseline and each cache on one prompt, finished (compare) or as it runs (compare_stream),
and running OpenAI-compatible servers compared with each other (compare_servers).

Every command here takes plain Python values and returns result dataclasses, so the UI never touches torch. Bad
input raises KvplayError with one sentence (kvplay.app.checks); each run enforces the limits in Settings, refuses a
run whose memory estimate exceeds free memory (kvplay.app.guard), runs one at a time per device and stops at the
next step once its `cancel` token is set (kvplay.app.jobs, the one envelope). The other views' commands are one
module each, named as on the other floors: generate, memory, capacity, throughput, quality, bench, inside,
tradeoffs, advise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

from kvplay.app import guard, prompts
from kvplay.app.checks import check_float, check_int, clean_text, fit_prompt, parse_specs
from kvplay.app.fetch import model_file
from kvplay.app.jobs import Job, Plan, run_plan, stream_plan
from kvplay.app.profile import brought_profile
from kvplay.app.settings import Settings
from kvplay.cache import CacheSpec
from kvplay.errors import KvplayError
from kvplay.lab import engines
from kvplay.lab.compare import CompareJob, Task
from kvplay.lab.generate import Sampler

SERVERS = "server"      # the scheme whose caches are running servers (kvplay/cache/methods/server.py)


@dataclass
class ComparePlan(Plan):
    """Compare's checked inputs: kvplay's specs (baseline first), those another engine runs (each method's own
    runner, kvplay.lab.engines: the real llama.cpp), and the decoding."""

    load_progress: ClassVar[bool] = True
    specs: list[CacheSpec]
    elsewhere: list[CacheSpec]
    prompt: str
    max_new_tokens: int
    batch_size: int
    sampler: Sampler
    weights: str | None
    chat: bool | None

    def check(self, job: Job) -> CompareJob:
        """What needs the model (its chat template, its context, its memory): the lab's job."""
        chat = prompts.is_chat(job.name, job.tokenizer) if self.chat is None else self.chat
        if chat and not getattr(job.tokenizer, "chat_template", None):
            raise KvplayError(f"Model {job.name!r} has no chat template; turn the chat template off.")
        n = self.max_new_tokens
        fit_prompt(job.tokenizer, self.prompt, n, job.limit)      # refuses absurd lengths before the template runs
        prompt_ids = prompts.encode(job.tokenizer, self.prompt, chat)
        if len(prompt_ids) + n > job.limit:
            raise KvplayError(f"The prompt ({len(prompt_ids)} tokens) plus {n} new tokens exceeds the limit of "
                              f"{job.limit} tokens.")
        job.need(len(prompt_ids) + n, self.batch_size)
        task = prompts.task_for(self.prompt, job.name)           # its answer is graded with the run, in the lab
        return CompareJob(model=job.model, tokenizer=job.tokenizer, specs=tuple(self.specs), prompt=self.prompt,
                          max_new_tokens=n, model_name=job.name, batch_size=self.batch_size, sampler=self.sampler,
                          weights=self.weights, prompt_ids=prompt_ids, chat=chat,
                          task=Task(task.title, task.expected, task.check) if task else None)

    def run(self, job: Job, compare: CompareJob, progress):
        """kvplay's partial results as its caches step, then the rows another engine's runner adds (the real
        llama.cpp's, its own f16 first), through each method's hook (kvplay.lab.engines)."""
        result, card = None, brought_profile(job)                # a brought model's card, beside every result
        for result in compare.stream(progress=progress):
            yield replace(result, profile=card)
        if self.elsewhere and result is not None:
            rows = engines.compare_runs(self.elsewhere, compare, result.caches[0].token_ids,
                                        functools.partial(model_file, compare.model_name), progress)
            if rows:
                yield replace(result, caches=result.caches + rows)


def _compare_plan(specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, chat,
                  settings: Settings) -> ComparePlan:
    """Compare's input, checked once."""
    specs, elsewhere = engines.split(parse_specs(specs, settings))
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    batch = check_int(batch_size, "Batch size", 1, settings.max_batch)
    temperature = check_float(temperature, "Temperature", 0.0, 5.0)
    seed = check_int(seed or 0, "Seed", 0, 2**63 - 1)
    if chat is not None and not isinstance(chat, bool):
        raise KvplayError(f"Chat must be true or false, not {chat!r:.40}.")
    engines.check(elsewhere, batch_size=batch, temperature=temperature)
    return ComparePlan(specs, elsewhere, prompt, n, batch, Sampler(temperature, 1.0, seed), weights, chat)


def compare(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0, weights=None,
            device=None, dtype=None, chat=None, settings: Settings | None = None, progress=None,
            cancel: guard.CancelToken | None = None):
    """Run the baseline and each spec on one prompt (kvplay.lab.compare), the finished CompareResult.

    chat: wrap the prompt in the model's chat template (None: yes for chat models, see kvplay.app.prompts.is_chat).
    """
    settings = settings or Settings.from_env()
    plan = _compare_plan(specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, chat, settings)
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def compare_stream(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0,
                   weights=None, device=None, dtype=None, chat=None, settings: Settings | None = None,
                   progress=None, cancel: guard.CancelToken | None = None):
    """As compare, yielding the partial result every few steps, then the finished one (the UI's live cards, the
    CLI's answers as they come)."""
    settings = settings or Settings.from_env()
    plan = _compare_plan(specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, chat, settings)
    return stream_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                       progress=progress, cancel=cancel)


def compare_servers(names, prompt, max_new_tokens, *, settings: Settings | None = None, progress=None,
                    cancel: guard.CancelToken | None = None):
    """Compare running OpenAI-compatible servers as the caches, the first the reference: the server method's own
    runner (kvplay.lab.engines.compare_alone). `names`: NAME=URL lines where settings.allow_server_urls, else only
    KVPLAY_SERVERS' names."""
    settings = settings or Settings.from_env()
    if isinstance(names, str):
        names = names.split()
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, min(settings.max_new_tokens, 4096))
    return engines.compare_alone(SERVERS, names, prompt, n, settings=settings, progress=guard.watch(progress, cancel))

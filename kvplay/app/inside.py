"""The Inside views' commands: the outlier scan, find the number, error per head and the attention shift, each
checked once and run in the job envelope (kvplay.app.jobs), so each can be stopped like any other run."""
from __future__ import annotations

from kvplay.app import prompts
from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.jobs import Job, run_job
from kvplay.app.settings import Settings
from kvplay.cache import calibrate, check_specs, parse_spec
from kvplay.errors import KvplayError
from kvplay.lab.inside import (
    NEW_TOKENS,
    QUICK_LENGTHS,
    SCAN_TOKENS,
    attention_shift,
    head_errors,
    needle_run,
    outlier_scan,
    scan_tokens,
)
from kvplay.results import AttentionShift, ErrorMaps, NeedleResult, OutliersResult

INSIDE_SPECS = ("kvplay-int4", "kvplay-int2")


def outliers(model_name=None, *, tokens: int = SCAN_TOKENS, device=None, dtype=None, weights=None, settings=None,
             progress=None, cancel=None) -> OutliersResult:
    """The outlier scan on the held-out play's first `tokens` tokens."""
    tokens = check_int(tokens, "Tokens", 16, SCAN_TOKENS * 8)

    def prepare(job: Job):
        job.need(tokens)
        return lambda progress: outlier_scan(job.model, job.tokenizer, tokens=tokens, model_name=job.name,
                                             progress=progress)
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, weights=weights,
                   progress=progress, cancel=cancel)


def needle(model_name=None, specs=INSIDE_SPECS, *, quick=True, lengths=None, depths=None, seed=0, device=None,
           dtype=None, weights=None, settings=None, progress=None, cancel=None) -> NeedleResult:
    """Find the number at context lengths x depths, through each cache."""
    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs), settings)

    def prepare(job: Job):
        chat = prompts.is_chat(job.name, job.tokenizer)
        limit = int(getattr(job.model.config.get_text_config(decoder=True), "max_position_embeddings", 2048))
        job.need((max(lengths) if lengths else (max(QUICK_LENGTHS) if quick else limit)) + NEW_TOKENS)
        return lambda progress: needle_run(job.model, job.tokenizer, specs, lengths=lengths, depths=depths,
                                           quick=quick, seed=seed, chat=chat, model_name=job.name, progress=progress)
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, weights=weights,
                   progress=progress, cancel=cancel)


def error_maps(model_name=None, specs=INSIDE_SPECS, *, tokens: int = SCAN_TOKENS, device=None, dtype=None,
               weights=None, settings=None, progress=None, cancel=None) -> ErrorMaps:
    """head_errors for each quantized spec on the held-out play's first `tokens` tokens."""
    settings = settings or Settings.from_env()
    names = parse_specs(list(specs), settings)
    tokens = check_int(tokens, "Tokens", 64, SCAN_TOKENS * 8)

    def prepare(job: Job):
        quantized = [s for s in check_specs(names, job.model.config) if s.is_quantized]
        if not quantized:
            raise KvplayError("Pick at least one quantized cache to map its error.")
        ids = scan_tokens(job.tokenizer, tokens)
        job.need(int(ids.shape[1]))

        def work(progress):
            calibrate(quantized, job.model, job.tokenizer, progress)
            out = []
            for i, spec in enumerate(quantized):
                if progress:
                    progress(i / len(quantized), f"{spec}: per-head error")
                out.append(head_errors(job.model, ids, spec))
            if progress:
                progress(1.0, "done")
            return ErrorMaps(model=job.name, tokens=int(ids.shape[1]), caches=out)
        return work
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, weights=weights,
                   progress=progress, cancel=cancel)


def attention_prompt(chat: bool) -> str:
    """The attention-shift view's default prompt: a pass code in filler for a chat model, the play otherwise."""
    return prompts.find_the_number(sentences=40) if chat else prompts.raw_default_prompt(1200)


def shift(model_name, prompt: str | None, spec, *, step: int, layer: int, head: int, new_tokens: int = 32,
          device=None, dtype=None, weights=None, settings=None, progress=None, cancel=None) -> AttentionShift:
    """attention_shift behind the usual checks; the prompt (None: attention_prompt) goes through the chat
    template for chat models."""
    settings = settings or Settings.from_env()
    prompt = None if prompt is None else clean_text(prompt)
    spec = next((parse_spec(s) for s in parse_specs([spec], settings) if parse_spec(s).is_quantized), None)
    if spec is None:
        raise KvplayError("Pick a quantized cache to compare its attention with the 16-bit cache's.")
    new_tokens = check_int(new_tokens, "New tokens", 2, 256)

    def prepare(job: Job):
        check_specs([spec], job.model.config)
        chat = prompts.is_chat(job.name, job.tokenizer)
        ids = prompts.encode(job.tokenizer, attention_prompt(chat) if prompt is None else prompt, chat)
        job.need(len(ids) + new_tokens)

        def work(progress):
            calibrate([spec], job.model, job.tokenizer, progress)
            result = attention_shift(job.model, job.tokenizer, ids, spec, step=int(step), layer=int(layer),
                                     head=int(head), new_tokens=new_tokens)
            result.model = job.name
            return result
        return work
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, weights=weights,
                   progress=progress, cancel=cancel)

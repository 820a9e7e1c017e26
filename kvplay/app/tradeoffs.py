"""The Trade-offs runs as the app and the CLI call them: input checked once, then run in the job envelope
(kvplay.app.jobs), alone on the device."""
from __future__ import annotations

from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.jobs import Job, run_job
from kvplay.app.settings import Settings
from kvplay.cache import DEFAULT_SPECS, check_spec_for_model, parse_spec
from kvplay.errors import KvplayError
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

MAX_DRIFT_SPECS = 6


def _need(job: Job, tokens: int) -> None:
    """Refuse a run that will not fit in memory: the baseline's and one cache's N x vocab float32 logits are kept
    at a time."""
    vocab = int(job.model.config.get_text_config(decoder=True).vocab_size)
    job.need(tokens, extra=2 * tokens * vocab * 4)


def _text(text):
    return None if text is None or (isinstance(text, str) and not text.strip()) else clean_text(text, what="The text")


def pareto(model_name=None, *, quick=True, specs=None, tokens=None, chunk=None, text=None, device=None, dtype=None,
           settings=None, progress=None, cancel=None) -> ParetoResult:
    settings = settings or Settings.from_env()
    mode = QUICK if quick else FULL
    text = _text(text)
    chosen = [s for s in parse_specs(specs, settings) if s != "baseline"] if specs else None

    def prepare(job: Job):
        n = check_int(tokens if tokens is not None else mode.tokens, "Tokens", 64, job.limit)
        step = check_int(chunk if chunk is not None else mode.chunk, "Chunk", 1, n // 2)
        for s in chosen or ():
            check_spec_for_model(parse_spec(s), job.model.config)
        _need(job, n)
        return lambda p: pareto_run(job.model, job.tokenizer, quick=quick, specs=chosen, tokens=n, chunk=step,
                                    text=text, model_name=job.name, progress=p)
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, progress=progress,
                   cancel=cancel)


def _int_list(values, what: str, lo: int, hi: int) -> list[int]:
    if isinstance(values, str):
        values = values.replace(",", " ").split()
    if not isinstance(values, (list, tuple)) or not values or len(values) > 8:
        raise KvplayError(f"{what} must be a list of 1 to 8 whole numbers.")
    return sorted(dict.fromkeys(check_int(v, what, lo, hi) for v in values))


def window_sweep(model_name=None, scheme="kvplay-int2", *, residuals=RESIDUALS, sinks=SINKS, tokens=1024, chunk=32,
                 transformers_schemes=("quanto-int2", "hqq-int2"), text=None, device=None, dtype=None,
                 settings=None, progress=None, cancel=None) -> WindowSweepResult:
    settings = settings or Settings.from_env()
    if not isinstance(scheme, str) or not parse_spec(scheme).is_quantized:
        raise KvplayError("Choose a quantized scheme to sweep, such as kvplay-int2.")
    transformers_schemes = [str(parse_spec(s)) for s in (transformers_schemes or ())]
    text = _text(text)

    def prepare(job: Job):
        n = check_int(tokens, "Tokens", 64, job.limit)
        windows = _int_list(residuals, "Residual windows", 0, n)
        counts = _int_list(sinks, "Sink counts", 0, n)
        step = check_int(chunk, "Chunk", 1, n // 2)
        _need(job, n)
        return lambda p: window_sweep_run(job.model, job.tokenizer, scheme, residuals=windows, sinks=counts,
                                          transformers_schemes=transformers_schemes, tokens=n, chunk=step, text=text,
                                          model_name=job.name, progress=p)
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, progress=progress,
                   cancel=cancel)


def drift(model_name=None, specs=None, *, tokens=None, chunk=64, window=64, text=None, device=None, dtype=None,
          settings=None, progress=None, cancel=None) -> DriftResult:
    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs) if specs else list(DEFAULT_SPECS), settings)
    text = _text(text)

    def prepare(job: Job):
        n = check_int(tokens if tokens is not None else min(job.limit, 2048), "Tokens", 128, job.limit)
        step = check_int(chunk, "Chunk", 1, n // 2)
        smooth = check_int(window, "Smoothing window", 1, n)
        _need(job, n)
        return lambda p: drift_run(job.model, job.tokenizer, specs, tokens=n, chunk=step, window=smooth, text=text,
                                   model_name=job.name, progress=p)
    return run_job(model_name, prepare, settings=settings, device=device, dtype=dtype, progress=progress,
                   cancel=cancel)

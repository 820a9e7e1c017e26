"""The Trade-offs runs as the app and the CLI call them: input checked once, then computed alone on the device."""
from __future__ import annotations

from kvplay.app import commands, guard
from kvplay.app.commands import check_int, clean_text, model_limit, parse_specs
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


def _model(model_name, settings, device=None, dtype=None):
    return commands.get_run_model(model_name, settings, device, dtype)


def _run(model, tokens: int, extra_passes: int, fn, progress, cancel):
    """Refuse a run that will not fit in memory (the baseline's and one cache's N x vocab float32 logits are
    kept at a time), then run it alone on the device."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    guard.check_run(model, tokens, extra=extra_passes * tokens * vocab * 4)
    with guard.exclusive(model.device):
        return fn(guard.watch(progress, cancel))


def _text(text):
    return None if text is None or (isinstance(text, str) and not text.strip()) else clean_text(text, what="The text")


def pareto(model_name=None, *, quick=True, specs=None, tokens=None, chunk=None, text=None, device=None, dtype=None,
           settings=None, progress=None, cancel=None) -> ParetoResult:
    settings = settings or Settings.from_env()
    mode = QUICK if quick else FULL
    text = _text(text)
    model, tok, name = _model(model_name, settings, device, dtype)
    tokens = check_int(tokens if tokens is not None else mode.tokens, "Tokens", 64, model_limit(model, settings))
    chunk = check_int(chunk if chunk is not None else mode.chunk, "Chunk", 1, tokens // 2)
    if specs:
        specs = [s for s in parse_specs(specs, settings) if s != "baseline"]
        for s in specs:
            check_spec_for_model(parse_spec(s), model.config)
    return _run(model, tokens, 2, lambda p: pareto_run(model, tok, quick=quick, specs=specs, tokens=tokens,
                                                               chunk=chunk, text=text, model_name=name, progress=p),
                progress, cancel)


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
    model, tok, name = _model(model_name, settings, device, dtype)
    tokens = check_int(tokens, "Tokens", 64, model_limit(model, settings))
    residuals = _int_list(residuals, "Residual windows", 0, tokens)
    sinks = _int_list(sinks, "Sink counts", 0, tokens)
    chunk = check_int(chunk, "Chunk", 1, tokens // 2)
    return _run(model, tokens, 2, lambda p: window_sweep_run(
        model, tok, scheme, residuals=residuals, sinks=sinks, transformers_schemes=transformers_schemes,
        tokens=tokens, chunk=chunk, text=text, model_name=name, progress=p), progress, cancel)


def drift(model_name=None, specs=None, *, tokens=None, chunk=64, window=64, text=None, device=None, dtype=None,
          settings=None, progress=None, cancel=None) -> DriftResult:
    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs) if specs else list(DEFAULT_SPECS), settings)
    text = _text(text)
    model, tok, name = _model(model_name, settings, device, dtype)
    limit = model_limit(model, settings)
    tokens = check_int(tokens if tokens is not None else min(limit, 2048), "Tokens", 128, limit)
    chunk = check_int(chunk, "Chunk", 1, tokens // 2)
    window = check_int(window, "Smoothing window", 1, tokens)
    return _run(model, tokens, 2, lambda p: drift_run(model, tok, specs, tokens=tokens, chunk=chunk, window=window,
                                                      text=text, model_name=name, progress=p), progress, cancel)

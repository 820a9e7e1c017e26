"""Trade-offs measurements: the grid, one teacher-forced pass per configuration, and the three runs.

Every measurement is one teacher-forced pass over the same text per cache (quality.chunked_logits),
judged against one 16-bit pass whose logits are computed once and reused for every configuration.
Bits per element are the live cache's exact bytes (cache_nbytes: payload, metadata and the 16-bit
window) over the elements it holds at the end of the text. The grid comes from the cache registry:
each scheme's preset, plus one-option variants along the options the methods declare a grid for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvplay.cache import (
    SCHEMES,
    CacheSpec,
    bits_per_element,
    build_cache,
    cache_nbytes,
    cache_schemes,
    calibrate,
    check_specs,
    parse_spec,
)
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.compare import environment, long_context_compression
from kvplay.lab.metrics import kl_per_step, perplexity, token_logprob, top1_agree
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.quality import chunked_logits
from kvplay.lab.texts import long_text_ids
from kvplay.results import (
    DriftCache,
    DriftResult,
    ParetoPoint,
    ParetoResult,
    WindowCache,
    WindowSweepResult,
)

VARIANT_OPTIONS = ("group", "residual", "kbits", "vbits", "rotation")   # the grid axes
SEMANTICS = ("kvplay's residual window slides: every token is quantized exactly once, when it leaves the "
             "16-bit window, and sinks stay 16-bit for good. transformers' quanto and HQQ caches flush instead: "
             "once residual_length 16-bit tokens have accumulated, the whole cache is re-quantized at once and "
             "the window starts empty, so their 'residual' is a flush period, not a sliding window; they have no "
             "sinks.")



@dataclass(frozen=True)
class Mode:
    """How big a run is: the text's length, tokens per forward pass, and the grid."""

    tokens: int
    chunk: int
    variants: str            # "quick": first grid value of each option on each backend's lowest-bit scheme; "full": all


QUICK = Mode(tokens=512, chunk=32, variants="quick")
FULL = Mode(tokens=1024, chunk=16, variants="full")


# ---------------------------------------------------------------------------- the grid, from the registry

def _variant_values(spec: CacheSpec, option, quick: bool) -> list:
    current = getattr(spec, option.name)
    if option.name in ("kbits", "vbits"):            # separate key / value bits: more bits on one side
        higher = [b for b in (option.grid or option.choices) if isinstance(b, int) and b > spec.scheme.bits]
        doubled = [b for b in higher if b == 2 * spec.scheme.bits]        # K4V2 / K8V4, as KIVI and exllama offer
        return (doubled or higher)[:1] if quick else higher
    values = [v for v in option.grid if v != current]
    return values[:1] if quick else values


def grid(quick: bool = True, schemes=None) -> list[CacheSpec]:
    """The configurations to measure: every registered quantized transformers cache's preset, plus one-option variants
    (group size, residual window, key/value bits, rotation) for the options each method declares a grid for.
    quick: variants only on each backend's lowest-bit scheme and only the first grid value of each option."""
    names = [n for n in (schemes or cache_schemes()) if SCHEMES[parse_spec(n).name].method.quantized]
    specs = [parse_spec(n) for n in names]
    chosen = specs
    if quick:                                         # each backend's lowest-bit integer scheme
        lowest: dict[str, CacheSpec] = {}
        for s in specs:
            if s.scheme.fmt == "int" and (s.backend not in lowest or s.scheme.bits < lowest[s.backend].scheme.bits):
                lowest[s.backend] = s
        chosen = list(lowest.values())
    out = list(specs)
    for base in chosen:
        for option in base.scheme.options():
            if option.name not in VARIANT_OPTIONS:
                continue
            for value in _variant_values(base, option, quick):
                try:
                    out.append(base.with_options(**{option.name: value}))
                except KvplayError:
                    continue
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------- one pass per configuration

@dataclass
class Pass:
    spec: CacheSpec
    logits: torch.Tensor         # (N, V) float32
    nbytes: object               # CacheBytes at the end of the text
    seconds: float


def text_ids(tokenizer, tokens: int, text: str | None = None) -> torch.Tensor:
    """(1, tokens): the held-out play (repeated as needed), or the first `tokens` tokens of `text`."""
    if text is None:
        return long_text_ids(tokenizer, tokens)
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise KvplayError(f"The text has {ids.shape[1]} tokens; this run needs {tokens}.")
    return ids


def one_pass(model, ids: torch.Tensor, spec: CacheSpec, chunk: int, on_chunk=None) -> Pass:
    t0 = time.perf_counter()
    cache = build_cache(spec, model)
    logits = chunked_logits(model, ids.to(model.device), cache, chunk, on_chunk)
    return Pass(spec, logits, cache_nbytes(cache), time.perf_counter() - t0)


def _passes(model, tokenizer, ids, specs, chunk: int, progress: Progress):
    """Yield one Pass per spec (the baseline first, computed once), reporting progress per chunk."""
    specs = check_specs(specs, model.config, teacher_forced=True)
    calibrate(specs, model, tokenizer, progress)          # before the passes, whose seconds it would swell
    for i, spec in enumerate(specs):
        def on_chunk(done, total, i=i, spec=spec):
            progress((i + done / total) / len(specs), f"{spec}, {i + 1} of {len(specs)} configurations")
        yield one_pass(model, ids, spec, chunk, on_chunk)


def _scores(base: Pass, run: Pass, targets: torch.Tensor) -> dict:
    kl = kl_per_step(base.logits, run.logits)
    base_ppl = perplexity(-token_logprob(base.logits[:-1], targets))
    ppl = perplexity(-token_logprob(run.logits[:-1], targets))
    agree = float(top1_agree(base.logits, run.logits).float().mean())
    return dict(kl=kl, mean_kl=float(kl.mean()), top1_agreement=agree, ppl=ppl,
                delta_ppl_pct=100 * (ppl / base_ppl - 1))


# ---------------------------------------------------------------------------- Pareto

def pareto_point(model, arch: Arch, base: Pass, run: Pass, targets: torch.Tensor,
                 tokens: int) -> tuple[ParetoPoint, int | None]:
    """One configuration's point against the baseline's pass (pareto_result sets on_frontier), and the long context
    its bits_long is counted at."""
    s = _scores(base, run, targets)
    at, ratio = long_context_compression(run.spec, arch, model.config)    # the format at 8k, by its formulas
    return ParetoPoint(spec=str(run.spec), backend=run.spec.backend,
                       bits_per_element=bits_per_element(run.nbytes, arch, tokens), mean_kl=s["mean_kl"],
                       top1_agreement=s["top1_agreement"], delta_ppl_pct=s["delta_ppl_pct"], on_frontier=False,
                       ppl=s["ppl"], cache_bytes=run.nbytes.to_dict(), seconds=run.seconds,
                       bits_long=16 / ratio if ratio else None), at


def pareto_result(points: list[ParetoPoint], long_tokens: int | None, env, *, tokens: int, chunk: int, quick: bool,
                  text: str | None, text_name: str = "") -> ParetoResult:
    """The chart's result from its points (the baseline's first), the frontier marked."""
    result = ParetoResult(context_tokens=tokens, chunk=chunk, mode="quick" if quick else "full",
                          text_name=text_name or ("held-out play" if text is None else "pasted text"),
                          baseline_ppl=points[0].ppl, env=env, points=points, long_tokens=long_tokens)
    for p, on in zip(points, result.with_frontier()):
        p.on_frontier = on
    return result


def pareto_run(model, tokenizer, *, quick: bool = True, specs=None, tokens: int | None = None,
               chunk: int | None = None, text: str | None = None, text_name: str = "", model_name: str = "",
               progress: Progress | None = None) -> ParetoResult:
    """Measure the grid (or `specs`) on one text: bits per element against mean KL, top-1 and delta perplexity.
    Each point is pareto_point's, so a run spread point by point (kvplay.app.scale) gives the same figures."""
    mode = QUICK if quick else FULL
    tokens, chunk = tokens or mode.tokens, chunk or mode.chunk
    progress = progress or no_progress
    ids = text_ids(tokenizer, tokens, text)
    configs = [parse_spec(s) for s in specs] if specs else grid(quick)
    arch = Arch.from_config(model.config)
    targets = ids[0, 1:].to(model.device)
    base, points, long_tokens = None, [], None
    for run in _passes(model, tokenizer, ids, configs, chunk, progress):
        base = base or run
        point, at = pareto_point(model, arch, base, run, targets, tokens)
        long_tokens = long_tokens or at
        points.append(point)
    result = pareto_result(points, long_tokens, environment(model, model_name), tokens=tokens, chunk=chunk,
                           quick=quick, text=text, text_name=text_name)
    progress(1.0, "done")
    return result


# ---------------------------------------------------------------------------- window and sink sweep

RESIDUALS = (0, 32, 128, 512)
SINKS = (0, 4, 16)


def window_sweep_run(model, tokenizer, scheme: str = "kvplay-int2", *, residuals=RESIDUALS, sinks=SINKS,
                     transformers_schemes=("quanto-int2", "hqq-int2"), tokens: int = 1024, chunk: int = 32,
                     text: str | None = None, model_name: str = "",
                     progress: Progress | None = None) -> WindowSweepResult:
    """Mean KL and top-1 of `scheme` over residual windows x sink counts; transformers' caches along residual only."""
    progress = progress or no_progress
    base_spec = parse_spec(scheme)
    ids = text_ids(tokenizer, tokens, text)
    plan: list[tuple[str, CacheSpec, int, int]] = []       # (cache label, spec, residual, sink)
    for name in [str(base_spec)] + [t for t in transformers_schemes if parse_spec(t).name != base_spec.name]:
        spec = parse_spec(name)
        takes = {o.name for o in spec.scheme.options()}
        if "residual" not in takes:
            raise KvplayError(f"{spec} has no residual window to sweep; choose a quantized scheme.")
        for r in residuals:
            for k in (sinks if "sink" in takes else (0,)):
                plan.append((name, spec.with_options(residual=r, sink=k if "sink" in takes else None), r, k))
    targets = ids[0, 1:].to(model.device)
    runs = _passes(model, tokenizer, ids, [p[1] for p in plan], chunk, progress)    # baseline first, one at a time
    base = next(runs)
    scores = {run.spec: _scores(base, run, targets) for run in runs}
    caches: dict[str, WindowCache] = {}
    for label, spec, r, k in plan:
        s = scores[spec]
        cache = caches.setdefault(label, WindowCache(label, spec.backend, spec.method.window, []))
        cache.points.append([r, k, s["mean_kl"], s["top1_agreement"]])
    progress(1.0, "done")
    return WindowSweepResult(context_tokens=tokens, chunk=chunk, residuals=list(residuals), sinks=list(sinks),
                             note=SEMANTICS, env=environment(model, model_name), caches=list(caches.values()))


# ---------------------------------------------------------------------------- drift over long context

def context_lengths(tokens: int, start: int = 128) -> list[int]:
    out, n = [], start
    while n < tokens:
        out.append(n)
        n *= 2
    return out + [tokens]


def smooth(values: torch.Tensor, window: int) -> list[list[float]]:
    """Trailing means over non-overlapping windows: [[last position, mean], ...]."""
    return [[min(i + window, len(values)), float(values[i:i + window].mean())] for i in range(0, len(values), window)]


def drift_run(model, tokenizer, specs, *, tokens: int = 2048, chunk: int = 64, window: int = 64,
              text: str | None = None, model_name: str = "", progress: Progress | None = None) -> DriftResult:
    """Per-position KL against the 16-bit pass from the text's start to `tokens`, smoothed over `window` tokens,
    and mean KL over the second half of each of several context lengths (does it worsen as the cache grows?)."""
    progress = progress or no_progress
    ids = text_ids(tokenizer, tokens, text)
    runs = _passes(model, tokenizer, ids, specs, chunk, progress)
    base, caches = next(runs), []
    for run in runs:
        kl = kl_per_step(base.logits, run.logits)
        caches.append(DriftCache(spec=str(run.spec), kl_smoothed=smooth(kl, window), mean_kl=float(kl.mean()),
                                 by_context=[[n, float(kl[n // 2:n].mean())] for n in context_lengths(tokens)]))
    progress(1.0, "done")
    note = (f"KL(16-bit || cache) per position, teacher-forced over the held-out play, {chunk} tokens per forward "
            f"pass, averaged over windows of {window} tokens.")
    return DriftResult(context_tokens=tokens, chunk=chunk, window=window, note=note,
                       env=environment(model, model_name), caches=caches)

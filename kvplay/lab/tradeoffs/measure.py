"""Trade-offs measurements: the grid, one teacher-forced pass per configuration, and the three runs.

Every measurement is one teacher-forced pass over the same text per cache (quality.chunked_logits),
judged against one 16-bit pass whose logits are computed once and reused for every configuration.
Bits per element are the live cache's exact bytes (cache_nbytes: payload, metadata and the 16-bit
window) over the elements it holds at the end of the text. The grid comes from the cache registry:
each scheme's preset, plus one-option variants along the options the methods declare a grid for.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvplay.cache import SCHEMES, CacheSpec, bits_per_element, build_cache, cache_nbytes, check_specs, parse_spec
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.compare import environment
from kvplay.lab.metrics import kl_per_step, perplexity, token_logprob, top1_agree
from kvplay.lab.quality import chunked_logits
from kvplay.lab.sweeps import long_text_ids
from kvplay.results import Environment

Progress = Callable[[float, str], None]

VARIANT_OPTIONS = ("group", "residual", "kbits", "vbits", "rotation")   # the grid axes
METRICS = {"mean_kl": ("mean KL to the 16-bit run (nats)", False),      # label, higher is better
           "top1_agreement": ("top-1 agreement with the 16-bit run", True),
           "delta_ppl_pct": ("perplexity change against 16-bit (%)", False)}
SEMANTICS = ("kvplay's residual window slides: every token is quantized exactly once, when it leaves the "
             "16-bit window, and sinks stay 16-bit for good. transformers' quanto and HQQ caches flush instead: "
             "once residual_length 16-bit tokens have accumulated, the whole cache is re-quantized at once and "
             "the window starts empty, so their 'residual' is a flush period, not a sliding window; they have no "
             "sinks.")


def _no_progress(fraction: float, description: str) -> None:
    pass


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
    """The configurations to measure: every registered quantized scheme's preset, plus one-option variants
    (group size, residual window, key/value bits, rotation) for the options each method declares a grid for.
    quick: variants only on each backend's lowest-bit scheme and only the first grid value of each option."""
    names = [n for n in (schemes or SCHEMES) if SCHEMES[parse_spec(n).name].method.quantized]
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


def _passes(model, ids, specs, chunk: int, progress: Progress):
    """Yield one Pass per spec (the baseline first, computed once), reporting progress per chunk."""
    specs = check_specs(specs, model.config)
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

@dataclass
class ParetoPoint:
    spec: str
    backend: str
    bits_per_element: float          # exact bytes at context_tokens, metadata and 16-bit window included
    mean_kl: float
    top1_agreement: float
    delta_ppl_pct: float
    on_frontier: bool                # on the frontier of bits_per_element against mean_kl
    ppl: float = 0.0
    cache_bytes: dict = field(default_factory=dict)     # payload, metadata, full_precision, total
    seconds: float = 0.0


def frontier(xs, ys, higher_is_better: bool = False) -> list[bool]:
    """Which points no other point dominates (x no larger, y no worse, one of them strictly better)."""
    sign = -1.0 if higher_is_better else 1.0
    pts = [(float(x), sign * float(y)) for x, y in zip(xs, ys)]
    return [not any(a <= x and b <= y and (a < x or b < y) for a, b in pts) for x, y in pts]


@dataclass
class ParetoResult:
    context_tokens: int
    chunk: int
    mode: str
    text_name: str
    baseline_ppl: float
    env: Environment
    points: list[ParetoPoint]
    kind: str = "pareto"

    def summary_rows(self) -> list[dict]:
        return [{"spec": p.spec, "backend": p.backend, "bits_per_element": round(p.bits_per_element, 3),
                 "mean_kl": round(p.mean_kl, 5), "top1_agreement": round(p.top1_agreement, 4),
                 "delta_ppl_pct": round(p.delta_ppl_pct, 3), "on_frontier": "yes" if p.on_frontier else ""}
                for p in sorted(self.points, key=lambda p: p.bits_per_element)]

    def with_frontier(self, metric: str = "mean_kl") -> list[bool]:
        _, higher = METRICS[metric]
        return frontier([p.bits_per_element for p in self.points], [getattr(p, metric) for p in self.points], higher)


def pareto_run(model, tokenizer, *, quick: bool = True, specs=None, tokens: int | None = None,
               chunk: int | None = None, text: str | None = None, text_name: str = "", model_name: str = "",
               progress: Progress | None = None) -> ParetoResult:
    """Measure the grid (or `specs`) on one text: bits per element against mean KL, top-1 and delta perplexity."""
    mode = QUICK if quick else FULL
    tokens, chunk = tokens or mode.tokens, chunk or mode.chunk
    progress = progress or _no_progress
    ids = text_ids(tokenizer, tokens, text)
    configs = [parse_spec(s) for s in specs] if specs else grid(quick)
    arch = Arch.from_config(model.config)
    targets = ids[0, 1:].to(model.device)
    base, points = None, []
    for run in _passes(model, ids, configs, chunk, progress):
        base = base or run
        s = _scores(base, run, targets)
        points.append(ParetoPoint(spec=str(run.spec), backend=run.spec.backend,
                                  bits_per_element=bits_per_element(run.nbytes, arch, tokens), mean_kl=s["mean_kl"],
                                  top1_agreement=s["top1_agreement"], delta_ppl_pct=s["delta_ppl_pct"],
                                  on_frontier=False, ppl=s["ppl"], cache_bytes=run.nbytes.to_dict(),
                                  seconds=run.seconds))
    result = ParetoResult(context_tokens=tokens, chunk=chunk, mode="quick" if quick else "full",
                          text_name=text_name or ("held-out play" if text is None else "pasted text"),
                          baseline_ppl=points[0].ppl, env=environment(model, model_name), points=points)
    for p, on in zip(points, result.with_frontier()):
        p.on_frontier = on
    progress(1.0, "done")
    return result


# ---------------------------------------------------------------------------- window and sink sweep

RESIDUALS = (0, 32, 128, 512)
SINKS = (0, 4, 16)


@dataclass
class WindowCache:
    spec: str
    backend: str
    semantics: str                   # "slide" (kvplay) or "flush" (transformers' QuantizedCache)
    points: list[list[float]]        # [[residual, sink, mean_kl, top1_agreement], ...]


@dataclass
class WindowSweepResult:
    context_tokens: int
    chunk: int
    residuals: list[int]
    sinks: list[int]
    note: str
    env: Environment
    caches: list[WindowCache]
    kind: str = "window_sweep"

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "semantics": c.semantics, "residual": int(p[0]), "sink": int(p[1]),
                 "mean_kl": round(p[2], 5), "top1_agreement": round(p[3], 4)} for c in self.caches for p in c.points]


def window_sweep_run(model, tokenizer, scheme: str = "kvplay-int2", *, residuals=RESIDUALS, sinks=SINKS,
                     transformers_schemes=("quanto-int2", "hqq-int2"), tokens: int = 1024, chunk: int = 32,
                     text: str | None = None, model_name: str = "",
                     progress: Progress | None = None) -> WindowSweepResult:
    """Mean KL and top-1 of `scheme` over residual windows x sink counts; transformers' caches along residual only."""
    progress = progress or _no_progress
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
    runs = _passes(model, ids, [p[1] for p in plan], chunk, progress)      # baseline first, one pass kept at a time
    base = next(runs)
    scores = {run.spec: _scores(base, run, targets) for run in runs}
    caches: dict[str, WindowCache] = {}
    for label, spec, r, k in plan:
        s = scores[spec]
        cache = caches.setdefault(label, WindowCache(label, spec.backend, "flush" if spec.backend in
                                                     ("quanto", "hqq") else "slide", []))
        cache.points.append([r, k, s["mean_kl"], s["top1_agreement"]])
    progress(1.0, "done")
    return WindowSweepResult(context_tokens=tokens, chunk=chunk, residuals=list(residuals), sinks=list(sinks),
                             note=SEMANTICS, env=environment(model, model_name), caches=list(caches.values()))


# ---------------------------------------------------------------------------- drift over long context

@dataclass
class DriftCache:
    spec: str
    kl_smoothed: list[list[float]]   # [[position, mean KL over the window ending there], ...]
    by_context: list[list[float]]    # [[context_tokens, mean KL over positions (context/2, context]], ...]
    mean_kl: float


@dataclass
class DriftResult:
    context_tokens: int
    chunk: int
    window: int                      # tokens per smoothing window
    note: str
    env: Environment
    caches: list[DriftCache]
    kind: str = "drift"

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "mean_kl": round(c.mean_kl, 5),
                 **{f"KL@{int(n)}": round(v, 5) for n, v in c.by_context}} for c in self.caches]


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
    progress = progress or _no_progress
    ids = text_ids(tokenizer, tokens, text)
    runs = _passes(model, ids, specs, chunk, progress)
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


# ---------------------------------------------------------------------------- results as JSON and CSV

RESULT_KINDS = {"pareto": ParetoResult, "window_sweep": WindowSweepResult, "drift": DriftResult}


def to_dict(result) -> dict:
    """The JSON contract: kind first, then the result's fields."""
    data = asdict(result)
    return {"kind": data.pop("kind"), **data}


def from_dict(data: dict):
    body = {k: v for k, v in data.items() if k != "kind"}
    body["env"] = Environment(**body["env"])
    cls = RESULT_KINDS[data["kind"]]
    item = {"pareto": ("points", ParetoPoint), "window_sweep": ("caches", WindowCache), "drift": ("caches", DriftCache)}
    key, item_cls = item[data["kind"]]
    body[key] = [item_cls(**x) for x in body[key]]
    return cls(**body)


def is_result(obj) -> bool:
    return isinstance(obj, tuple(RESULT_KINDS.values()))

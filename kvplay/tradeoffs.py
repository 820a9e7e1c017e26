"""Trade-offs: every cache on one quality-versus-bytes chart, window and sink sweeps, drift over long context.

    pareto_run(model, tok, quick=True)           # ParetoResult: bits per element against mean KL, frontier marked
    window_sweep_run(model, tok, "kvplay-int2")  # WindowSweepResult: residual window x sinks
    drift_run(model, tok, ["kvplay-int4"])       # DriftResult: smoothed KL along a long text
    recipe("kvplay-int4")                        # the nearest settings in other engines (assets/engine_recipes.json)

Every measurement is one teacher-forced pass over the same text per cache (quality.chunked_logits),
judged against one 16-bit pass whose logits are computed once and reused for every configuration.
Bits per element are the live cache's exact bytes (cache_nbytes: payload, metadata and the 16-bit
window) over the elements it holds at the end of the text. The grid comes from the cache registry:
each scheme's preset, plus one-option variants along the options the methods declare a grid for.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arch import Arch
from .cache import SCHEMES, CacheSpec, bits_per_element, build_cache, cache_nbytes, check_specs, parse_spec
from .errors import KvplayError
from .metrics import kl_per_step, perplexity, token_logprob, top1_agree
from .quality import chunked_logits
from .results import Environment
from .runner import environment
from .sweeps import long_text_ids

Progress = Callable[[float, str], None]
RECIPES = Path(__file__).resolve().parent.parent / "assets" / "engine_recipes.json"
PUBLISHED = Path(__file__).resolve().parent.parent / "assets" / "published_points.json"

VARIANT_OPTIONS = ("group", "residual", "kbits", "vbits", "rotation")   # the grid axes
METRICS = {"mean_kl": ("mean KL to the 16-bit run (nats)", False),      # label, higher is better
           "top1_agreement": ("top-1 agreement with the 16-bit run", True),
           "delta_ppl_pct": ("perplexity change against 16-bit (%)", False)}
BACKEND_COLOURS = {"dynamic": "#6e6e6e", "quanto": "#1f77b4", "hqq": "#ff7f0e", "kvplay": "#2ca02c"}
EXTRA_COLOURS = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
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
            progress((i + done / total) / len(specs), f"{spec}: {done}/{total} tokens")
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


# ---------------------------------------------------------------------------- settings for other engines

def _load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def spec_features(spec: CacheSpec) -> dict[str, bool]:
    """What a spec asks for that an engine may not express."""
    kbits, vbits = spec.kbits or spec.scheme.bits, spec.vbits or spec.scheme.bits
    return {"window": bool(spec.residual), "sink": bool(spec.sink), "per_channel_keys": spec.keys == "channel" or
            (spec.backend == "quanto" and spec.axis_key == -1) or (spec.backend == "hqq" and spec.axis_key == 0),
            "rotation": (spec.rotation or "none") != "none", "mixed_bits": kbits != vbits,
            "group": spec.group not in (None, 32)}


def recipe(spec_text) -> dict:
    """The nearest settings in each engine for a spec, and what each cannot express (assets/engine_recipes.json)."""
    spec = parse_spec(spec_text)
    data = _load_json(RECIPES)
    kbits, vbits = spec.kbits or spec.scheme.bits, spec.vbits or spec.scheme.bits
    key = "fp8" if spec.scheme.fmt == "fp8" else "bf16" if not spec.is_quantized else f"int{max(kbits, vbits)}"
    features = spec_features(spec)
    engines = []
    for name, eng in data["engines"].items():
        row = dict(eng["by_format"].get(key) or eng["by_format"]["default"])
        if name == "transformers" and spec.backend in ("quanto", "hqq"):
            row = {"setting": 'cache_implementation="quantized", cache_config=' + json.dumps(
                {"backend": spec.backend, "nbits": spec.scheme.bits, "q_group_size": spec.group,
                 "residual_length": spec.residual, "axis_key": spec.axis_key, "axis_value": spec.axis_value}),
                "exact": True, "source": eng["source"]}
        if name == "exllamav3" and spec.is_quantized and spec.scheme.fmt == "int":
            row["setting"] = eng["bits_template"].format(k=kbits, v=vbits)
        same = name == "transformers" and spec.backend in ("quanto", "hqq")   # the spec is this engine's own cache
        lacks = [] if same else [eng["cannot"][f] for f, wanted in features.items() if wanted and f in eng["cannot"]]
        engines.append({"engine": name, "setting": row["setting"], "exact": bool(row.get("exact")) and not lacks,
                        "note": row.get("note", ""), "cannot": lacks, "source": row.get("source", eng["source"])})
    return {"kind": "recipe", "spec": str(spec), "engines": engines}


def published_points() -> list[dict]:
    """Published reference figures (other model, other text), each with its source; [] when the file is absent."""
    return _load_json(PUBLISHED)["points"] if PUBLISHED.is_file() else []


# ---------------------------------------------------------------------------- service: validation, then compute

MAX_DRIFT_SPECS = 6


def _model(model_name, settings, device=None, dtype=None):
    from . import service

    return service.get_run_model(model_name, settings, device, dtype)


def _run(model, tokens: int, extra_passes: int, fn, progress, cancel):
    """Refuse a run that will not fit in memory (the baseline's and one cache's N x vocab float32 logits are
    kept at a time), then run it alone on the device."""
    from . import guard

    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    guard.check_run(model, tokens, extra=extra_passes * tokens * vocab * 4)
    with guard.exclusive(model.device):
        return fn(guard.watch(progress, cancel))


def _text(text):
    from .service import clean_text

    return None if text is None or (isinstance(text, str) and not text.strip()) else clean_text(text, what="The text")


def pareto(model_name=None, *, quick=True, specs=None, tokens=None, chunk=None, text=None, device=None, dtype=None,
           settings=None, progress=None, cancel=None) -> ParetoResult:
    from .service import check_int, model_limit, parse_specs
    from .settings import Settings

    settings = settings or Settings.from_env()
    mode = QUICK if quick else FULL
    text = _text(text)
    model, tok, name = _model(model_name, settings, device, dtype)
    tokens = check_int(tokens if tokens is not None else mode.tokens, "Tokens", 64, model_limit(model, settings))
    chunk = check_int(chunk if chunk is not None else mode.chunk, "Chunk", 1, tokens // 2)
    if specs:
        from .cache import check_spec_for_model

        specs = [s for s in parse_specs(specs, settings) if s != "baseline"]
        for s in specs:
            check_spec_for_model(parse_spec(s), model.config)
    return _run(model, tokens, 2, lambda p: pareto_run(model, tok, quick=quick, specs=specs, tokens=tokens,
                                                               chunk=chunk, text=text, model_name=name, progress=p),
                progress, cancel)


def _int_list(values, what: str, lo: int, hi: int) -> list[int]:
    from .service import check_int

    if isinstance(values, str):
        values = values.replace(",", " ").split()
    if not isinstance(values, (list, tuple)) or not values or len(values) > 8:
        raise KvplayError(f"{what} must be a list of 1 to 8 whole numbers.")
    return sorted(dict.fromkeys(check_int(v, what, lo, hi) for v in values))


def window_sweep(model_name=None, scheme="kvplay-int2", *, residuals=RESIDUALS, sinks=SINKS, tokens=1024, chunk=32,
                 transformers_schemes=("quanto-int2", "hqq-int2"), text=None, device=None, dtype=None,
                 settings=None, progress=None, cancel=None) -> WindowSweepResult:
    from .service import check_int, model_limit
    from .settings import Settings

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
    from .cache import DEFAULT_SPECS
    from .service import check_int, model_limit, parse_specs
    from .settings import Settings

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


# ---------------------------------------------------------------------------- figures (plotly, no torch)

def backend_colour(backend: str) -> str:
    """One fixed colour per backend; a backend registered later gets the next spare colour by its name."""
    import zlib

    return BACKEND_COLOURS.get(backend) or EXTRA_COLOURS[zlib.crc32(backend.encode()) % len(EXTRA_COLOURS)]


def _layout(fig, title: str, x: str, y: str, **kw):
    from .plots import LAYOUT

    fig.update_layout(**{**LAYOUT, **kw, "title": {**LAYOUT["title"], "text": title}}, xaxis_title=x, yaxis_title=y)
    return fig


def pareto_figure(result: ParetoResult, metric: str = "mean_kl", log_y: bool = True, published: bool = False):
    """Bits per element against `metric`, one colour per backend, the frontier as a step line through its points."""
    import plotly.graph_objects as go

    label, higher = METRICS[metric]
    pts = result.points
    on = result.with_frontier(metric)
    fig = go.Figure()
    for backend in dict.fromkeys(p.backend for p in pts):
        mine = [(p, f) for p, f in zip(pts, on) if p.backend == backend]
        fig.add_trace(go.Scatter(
            x=[p.bits_per_element for p, _ in mine], y=[getattr(p, metric) for p, _ in mine], mode="markers",
            name=backend, customdata=[p.spec for p, _ in mine],
            marker=dict(color=backend_colour(backend), size=[13 if f else 8 for _, f in mine],
                        line=dict(color="black", width=[2 if f else 0 for _, f in mine])),
            hovertemplate="%{customdata}<br>%{x:.2f} bits/element<br>" + metric + " %{y:.4g}<extra></extra>"))
    front = sorted((p.bits_per_element, getattr(p, metric)) for p, f in zip(pts, on) if f)
    fig.add_trace(go.Scatter(x=[x for x, _ in front], y=[y for _, y in front], mode="lines", name="Pareto frontier",
                             line=dict(color="black", dash="dot", width=1, shape="hv"), hoverinfo="skip"))
    if published:
        refs = [r for r in published_points() if r.get("metric") == metric]
        if refs:
            fig.add_trace(go.Scatter(x=[r["bits_per_element"] for r in refs], y=[r["value"] for r in refs],
                                     mode="markers", name="published (other model, other text)",
                                     marker=dict(symbol="x", color="#999999", size=9),
                                     customdata=[f"{r['label']} · {r['model']} · {r['source']}" for r in refs],
                                     hovertemplate="%{customdata}<extra></extra>"))
    # On a log axis the 16-bit baseline (KL 0) has no place; it stays in the table.
    log = log_y and metric == "mean_kl" and all(getattr(p, metric) > 0 for p in pts if p.spec != "baseline")
    title = (f"Quality against bytes at {result.context_tokens} tokens ({result.env.model or 'model'}; "
             f"frontier outlined)")
    return _layout(fig, title, "bits per cached element (metadata and 16-bit window included)", label,
                   yaxis_type="log" if log else "linear")


def window_figure(result: WindowSweepResult, metric: str = "mean_kl"):
    """mean KL (or top-1) against the residual window, one line per (cache, sink count)."""
    import plotly.graph_objects as go

    from .plots import colour_for

    col = 2 if metric == "mean_kl" else 3
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot", "longdash"]
    for c in result.caches:
        for j, sink in enumerate(dict.fromkeys(int(p[1]) for p in c.points)):
            pts = [p for p in c.points if int(p[1]) == sink]
            name = f"{c.spec} ({c.semantics})" + (f", {sink} sinks" if c.semantics == "slide" else "")
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[col] for p in pts], mode="lines+markers", name=name,
                                     line=dict(color=colour_for(c.spec), dash=dashes[j % len(dashes)])))
    title = f"Residual window and sinks at {result.context_tokens} tokens (quanto/HQQ flush, kvplay slides)"
    return _layout(fig, title, "residual window (tokens)", METRICS[metric][0])


def drift_figures(result: DriftResult):
    """(KL along the text, smoothed; mean KL over the second half of each context length)."""
    import plotly.graph_objects as go

    from .plots import colour_for

    along, by_ctx = go.Figure(), go.Figure()
    for c in result.caches:
        along.add_trace(go.Scatter(x=[p[0] for p in c.kl_smoothed], y=[p[1] for p in c.kl_smoothed], mode="lines",
                                   name=c.spec, line=dict(color=colour_for(c.spec))))
        by_ctx.add_trace(go.Scatter(x=[p[0] for p in c.by_context], y=[p[1] for p in c.by_context],
                                    mode="lines+markers", name=c.spec, line=dict(color=colour_for(c.spec))))
    _layout(along, f"KL along the text (mean over {result.window}-token windows)", "position (tokens)",
            "mean KL to the 16-bit run (nats)")
    _layout(by_ctx, "Does it get worse as the cache grows?", "context length (tokens, log scale)",
            "mean KL over the second half (nats)", xaxis_type="log")
    return along, by_ctx


# ---------------------------------------------------------------------------- command line

def add_parsers(sub, common) -> None:
    """The Trade-offs commands on the CLI's subparsers (`common` adds --model/--device/--json/...)."""
    p = sub.add_parser("pareto", help="every cache on one quality-versus-bytes chart, the frontier marked")
    common(p, caches=())          # --caches: measure only these specs instead of the grid
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help=f"presets plus a few variants, {QUICK.tokens} tokens (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help=f"every variant the registry declares, {FULL.tokens} tokens")
    p.add_argument("--tokens", type=int, default=None, help="context length the bits and KL are measured at")
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward pass")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the held-out play)")

    p = sub.add_parser("window-sweep", help="mean KL and top-1 against the 16-bit window and attention sinks")
    common(p, model=True)
    p.add_argument("--scheme", default="kvplay-int2")
    p.add_argument("--residuals", type=int, nargs="+", default=list(RESIDUALS))
    p.add_argument("--sinks", type=int, nargs="+", default=list(SINKS))
    p.add_argument("--transformers", nargs="*", default=["quanto-int2", "hqq-int2"], metavar="SPEC",
                   help="transformers' caches swept along residual_length (they flush rather than slide)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32)

    p = sub.add_parser("drift", help="KL along a long text, and at several context lengths")
    common(p, model=True)
    p.add_argument("--tokens", type=int, default=None, help="text length (default: 2048 or the model's limit)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=64, help="tokens per smoothing window")

    p = sub.add_parser("recipe", help="the nearest settings in transformers, llama.cpp, vLLM, SGLang and exllamav3")
    p.add_argument("spec")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH")


COMMANDS = ("pareto", "window-sweep", "drift", "recipe")


def _write(rows: list[dict], data: dict, args) -> None:
    import csv
    import io

    if args.json:
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    if args.csv and rows:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
        args.csv.write_text(buf.getvalue(), encoding="utf-8")


def run_cli(args) -> int:
    """Run one Trade-offs command: print its table, write --json / --csv. KvplayError propagates (exit 2)."""
    from .cli import _print_table, _progress, cli_settings

    if args.command == "recipe":
        data = recipe(args.spec)
        rows = [{"engine": e["engine"], "setting": e["setting"], "exact": "yes" if e["exact"] else "nearest",
                 "cannot express": "; ".join(e["cannot"])} for e in data["engines"]]
        _print_table(rows)
        _write(rows, data, args)
        return 0
    settings = cli_settings()
    update, close = _progress()
    common = dict(device=args.device, dtype=args.dtype, settings=settings, progress=update)
    try:
        if args.command == "pareto":
            from .service import read_text_file

            text = read_text_file(args.text) if args.text else None
            result = pareto(args.model, quick=args.quick, specs=args.caches or None, tokens=args.tokens,
                            chunk=args.chunk, text=text, **common)
        elif args.command == "window-sweep":
            result = window_sweep(args.model, args.scheme, residuals=args.residuals, sinks=args.sinks,
                                  transformers_schemes=args.transformers, tokens=args.tokens, chunk=args.chunk,
                                  **common)
        else:
            caches = None if args.caches == list(_default_specs()) else args.caches
            result = drift(args.model, caches, tokens=args.tokens, chunk=args.chunk, window=args.window, **common)
    finally:
        close()
    rows = result.summary_rows()
    _print_table(rows)
    if isinstance(result, WindowSweepResult):
        print(result.note)
    _write(rows, to_dict(result), args)
    return 0


def _default_specs():
    from .cache import DEFAULT_SPECS

    return DEFAULT_SPECS


def figures(result) -> list:
    """The figures of a Trade-offs result, for the HTML report."""
    if isinstance(result, ParetoResult):
        return [pareto_figure(result)]
    if isinstance(result, WindowSweepResult):
        return [window_figure(result)]
    return list(drift_figures(result))


TITLES = {"pareto": "Quality against bytes (equal-bytes chart)", "window_sweep": "Residual window and sinks",
          "drift": "Drift over long context"}


def is_result(obj) -> bool:
    return isinstance(obj, tuple(RESULT_KINDS.values()))

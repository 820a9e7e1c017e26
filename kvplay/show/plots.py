"""Plots as pure functions: results in, plotly figures out. No live models.

Colours, dashes and markers come from kvplay.show.style, the one palette every tab uses: each scheme keeps
one identity colour in every figure, tab and run, never a verdict colour (red, green, amber); the 16-bit
baseline is always the same grey; each method draws its own dash and marker, so lines that sit on top of
each other stay visible. Variants with options keep their scheme's colour. Bytes are in MiB everywhere,
as on the cards. A figure only draws what has data: a KL axis goes logarithmic when its values span
decades (log_if_spread), and Compare's figures are None until they have a quantized cache to show.
"""
from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from kvplay.cache import parse_spec
from kvplay.cache.evict import policy_of
from kvplay.results import (
    CompareResult,
    MemoryResult,
    ModelsResult,
    PplResult,
    ThroughputResult,
    speed_reason,
    timed,
)
from kvplay.show.cards import fmt_kl, tone_of
from kvplay.show.style import (  # noqa: F401  (re-exported)
    BASELINE_GREY,
    HEATMAP,
    VERDICT,
    colour_for,
    scheme_of,
    style_for,
)

MIB = 2**20
KL_WINDOW = 64          # tokens per point of PplRun.kl_along_text (kvplay.lab.quality.KL_WINDOW; a test pins it)
LOG_SPAN = 30           # a KL axis is logarithmic when its largest positive value is 30x its smallest
LAYOUT = dict(template="plotly_white", height=430, margin=dict(l=64, r=24, t=80, b=110),
              legend=dict(orientation="h", yanchor="top", y=-0.22, x=0, font=dict(size=11)),
              title=dict(x=0.01, xanchor="left", font=dict(size=15)))


def _title(title: str, sub: str = "") -> str:
    """A short title that fits a phone-width plot, the detail on a smaller second line."""
    return f"{title}<br><sup>{sub}</sup>" if sub else title


def _fig(title: str, x: str, y: str, sub: str = "", **kw) -> go.Figure:
    fig = go.Figure()
    layout = {**LAYOUT, **kw}
    layout["title"] = {**LAYOUT["title"], "text": _title(title, sub)}
    fig.update_layout(xaxis_title=x, yaxis_title=y, **layout)
    return fig


def _line(fig: go.Figure, spec, x, y, *, markers: bool = False, **kw) -> None:
    """One cache's line: `spec` is its run (a CacheRun draws from its resolved label) or its spec's text."""
    style = style_for(spec)
    n = len(y)
    fig.add_scatter(x=list(x), y=list(y), name=getattr(spec, "spec", spec),
                    mode="lines+markers" if markers or n <= 24 else "lines", line=style["line"],
                    marker={**style["marker"], "maxdisplayed": 24}, **kw)


def _fit(values, pad: float = 0.05, floor: float | None = None, ceiling: float | None = None) -> list[float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or max(abs(hi), 1e-9)
    lo, hi = lo - pad * span, hi + pad * span
    if floor is not None:
        lo = max(lo, floor)
    if ceiling is not None:
        hi = min(hi, ceiling)
    return [lo, hi]


def log_if_spread(values) -> bool:
    """Whether a KL axis should be logarithmic: its positive values span LOG_SPAN or more (decades)."""
    pos = [v for v in values if v is not None and v > 0]
    return bool(pos) and max(pos) >= LOG_SPAN * min(pos)


def kl_axis(fig: go.Figure, values) -> float | None:
    """Log y axis when the KL values span decades; returns the floor zeros are drawn at (None: linear)."""
    if not log_if_spread(values):
        fig.update_yaxes(rangemode="tozero")
        return None
    floor = min(v for v in values if v is not None and v > 0) / 2
    fig.update_yaxes(type="log", exponentformat="power", dtick=1)      # one label per decade
    fig.layout.yaxis.title.text = (fig.layout.yaxis.title.text or "") + ", log scale"
    return floor


def floored(values, floor: float | None) -> list:
    """Values for a log axis: zeros (exact agreement) drawn at the floor; hover reads the true value."""
    return list(values) if floor is None else [max(v, floor) for v in values]


def kl_figure(result: CompareResult) -> go.Figure | None:
    """Per-step KL(baseline || spec), each spec's first different token marked with an x; None before a
    quantized cache has run (nothing to draw)."""
    if len(result.caches) < 2:
        return None
    fig = _fig("Drift from 16-bit, per token", "generated token", "KL divergence (nats)",
               sub="KL of the next-token distribution, teacher-forced")
    floor = kl_axis(fig, [v for run in result.caches[1:] for v in run.kl])
    marked = False
    for run in result.caches[1:]:
        _line(fig, run, range(len(run.kl)), floored(run.kl, floor), customdata=list(run.kl),
              hovertemplate=f"{run.spec}<br>token %{{x}}: KL %{{customdata:.4g}} nats<extra></extra>")
        d = run.first_divergence
        if d is not None:
            y = floored([run.kl[d] if d < len(run.kl) else 0], floor)[0]
            fig.add_scatter(x=[d], y=[y], mode="markers", legendgroup="diverge", showlegend=False,
                            marker=dict(color=colour_for(run), size=13, symbol="x"),
                            name=f"{run.spec}: first different token",
                            hovertemplate=f"{run.spec}: its own text departs at token %{{x}}<extra></extra>")
            marked = True
    if marked:  # one legend entry explains every x
        fig.add_scatter(x=[None], y=[None], mode="markers", legendgroup="diverge", name="first different token",
                        marker=dict(color="#333", size=11, symbol="x"))
    return fig


def agreement_figure(result: CompareResult) -> go.Figure | None:
    """Cumulative share of steps where the spec's top-1 token equals the baseline's; None before a quantized
    cache has run."""
    if len(result.caches) < 2:
        return None
    fig = _fig("Top-1 agreement with 16-bit", "generated token", "agreement",
               sub="running share of steps, teacher-forced")
    every = []
    for run in result.caches[1:]:
        cum, hits = [], 0
        for i, ok in enumerate(run.top1):
            hits += ok
            cum.append(hits / (i + 1))
        every += cum
        _line(fig, run, range(len(cum)), cum,
              hovertemplate=f"{run.spec}<br>token %{{x}}: %{{y:.1%}}<extra></extra>")
    rng = _fit(every, floor=0, ceiling=1.01)
    if rng:
        fig.update_yaxes(range=[rng[0], max(rng[1], 1.005)], tickformat=".0%")
    return fig


def bytes_figure(result: CompareResult) -> go.Figure:
    """Exact cache size after every step of the run, in MiB."""
    fig = _fig("Cache size while generating", "tokens in cache", "MiB", sub="measured on the live cache")
    for run in result.caches:
        _line(fig, run, run.context_tokens, [b / MIB for b in run.cache_bytes_per_step],
              hovertemplate=f"{run.spec}<br>%{{x}} tokens: %{{y:.3f}} MiB<extra></extra>")
    fig.update_traces(line_shape="hv")
    return fig


def speed_figure(result: CompareResult) -> go.Figure | None:
    """Decode tokens/s per spec: the median over steps, the bar's whisker the middle half of steps; None while no
    cache has been timed (a partial result, or a run too short to time: the cards say so)."""
    runs = [r for r in result.caches if timed(r)]
    if not runs:
        return None
    fig = _fig("Decode speed", "", "tokens / s", sub=f"median over steps (whisker: middle half), {result.where}")
    short: dict[str, list[str]] = {}                     # each reason once, with the caches it holds for
    for r in result.caches:
        if not timed(r):
            short.setdefault(speed_reason(r), []).append(r.spec)
    notes = _not_timed_lines(short)
    med = [r.decode_tokens_per_s for r in runs]
    lo = [m - (r.decode_spread or [m, m])[0] for m, r in zip(med, runs)]
    hi = [(r.decode_spread or [m, m])[1] - m for m, r in zip(med, runs)]
    # the value sits at the bar's foot, clear of the whisker through its middle half
    fig.add_bar(x=[r.spec for r in runs], y=med, marker_color=[colour_for(r) for r in runs],
                error_y=dict(type="data", array=hi, arrayminus=lo, color="#444", thickness=1.2),
                text=[f"{m:.0f}" for m in med], textposition="inside", insidetextanchor="start", showlegend=False,
                hovertemplate="%{x}: %{y:.1f} tok/s<extra></extra>", cliponaxis=False)
    # the reasons' lines sit inside the plot, over head room kept clear of the bars
    fig.update_yaxes(range=[0, (1.12 + 0.1 * len(notes)) * max(m + h for m, h in zip(med, hi))])
    if notes:
        fig.add_annotation(text="<br>".join(notes), showarrow=False, xref="paper", yref="paper", x=0.5, y=1.0,
                           yanchor="top", font=dict(color="#777"), align="center")
    return fig


def _not_timed_lines(short: dict[str, list[str]]) -> list[str]:
    """"not timed (reason): specs" per reason, wrapped to lines a phone's plot holds (about 44 characters)."""
    return [line for why, specs in short.items()
            for line in textwrap.wrap(f"not timed ({why}): {', '.join(specs)}", 44)]


def memory_figure(result: MemoryResult) -> go.Figure:
    """Measured MiB against context length; the full-precision window's sawtooth shows."""
    sub = f"measured on the live cache: a {result.chunk}-token prompt, then steps of {result.chunk} tokens"
    if any(policy_of(parse_spec(s.spec)) for s in result.caches):
        sub += "<br>an evicting cache: one prompt of each length, evicted once, as when serving"
    fig = _fig("Cache size against context", "context tokens", "MiB", sub=sub)
    for s in result.caches:
        _line(fig, s.spec, [p[0] for p in s.points], [p[1] / MIB for p in s.points],
              hovertemplate=f"{s.spec}<br>%{{x}} tokens: %{{y:.3f}} MiB<extra></extra>")
    return fig


def projection_figure(result: MemoryResult | None, arch: str, log: bool = False) -> go.Figure | None:
    """Projected cache size for a real architecture, from bits per element measured here; None before a
    measurement (no empty axes)."""
    if result is None or not result.projections.get(arch):
        return None
    fig = _fig(f"{arch}: projected cache", "context tokens", "GiB", sub="from the bits per element measured here",
               xaxis_type="log" if log else "linear", yaxis_type="log" if log else "linear")
    for spec, pts in result.projections.get(arch, {}).items():
        _line(fig, spec, [p[0] for p in pts], [p[1] / 2**30 for p in pts], markers=True,
              hovertemplate="%{x} tokens: %{y:.2f} GiB<extra>" + spec + "</extra>")
    return fig


def throughput_figure(result: ThroughputResult, by: str = "batch") -> go.Figure:
    """Decode tokens/s against batch size (by="batch") or context length (by="context")."""
    x_title = "batch size" if by == "batch" else "context tokens"
    env = result.env
    fig = _fig(f"Throughput against {x_title} ({env.model})", x_title, "tokens / s (all sequences)",
               sub=f"decode, measured on {env.gpu or env.device} ({env.machine}), {env.dtype}")
    for s in result.caches:
        pts = s.points if by == "batch" else s.context_points
        _line(fig, s.spec, [p[0] for p in pts], [p[1] for p in pts], markers=True)
    return fig


def _wrap(name: str, width: int = 14) -> str:
    """A model name on short lines, broken after a hyphen, for a phone-width axis."""
    lines = [""]
    for part in name.split("-"):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines[-1] += "-"
            lines.append(part)
        else:
            lines[-1] += f"-{part}" if lines[-1] else part
    return "<br>".join(lines)


def models_figure(result: ModelsResult) -> go.Figure:
    """Does a verdict carry over? A cell per cache (rows) and model (columns), coloured by the verdict's rule on KL
    and top-1, with ΔPPL, bits at long context and, when run, the number found; a refused cell says so."""
    models = list(dict.fromkeys(r.model for r in result.rows))
    specs = [s for s in dict.fromkeys(r.spec for r in result.rows) if s != "baseline"]
    cell = {(r.spec, r.model): r for r in result.rows}
    rank = {"green": 0, "amber": 1, "red": 2}
    z, text = [], []
    for spec in specs:
        z.append([]), text.append([])
        for model in models:
            r = cell.get((spec, model))
            if r is None or r.refused:
                z[-1].append(None)
                text[-1].append("not run:<br>the model<br>refuses it" if r is not None else "")
                continue
            z[-1].append(rank[tone_of(r.mean_kl, r.top1_agreement)])
            lines = [f"KL {fmt_kl(r.mean_kl)}", f"top-1 {100 * r.top1_agreement:.0f}%", f"ΔPPL {r.delta_ppl_pct:+.1f}%"]
            lines += [] if r.bits_long is None else [f"{r.bits_long:.1f} bits"]
            lines += [] if r.needle_counted is None else [f"found {r.needle_found}/{r.needle_counted}"]
            text[-1].append("<br>".join(lines))
    run = result.runs[0] if result.runs else None
    where = f"{run.tokens:,} tokens of {run.text_name}; bits at {result.long_tokens:,}" if run else ""
    fig = _fig(f"The same caches on {len(models)} models", where, "",
               sub="green: KL ≤ 0.02 and top-1 ≥ 95%; red: KL > 0.5 or top-1 < 60%<br>amber: between; "
                   "grey: not run",
               height=170 + 100 * len(specs), margin=dict(l=84, r=8, t=90, b=90), showlegend=False)
    colours = [VERDICT["green"], VERDICT["amber"], VERDICT["red"]]
    scale = [[edge, colours[i]] for i in range(3) for edge in (i / 3, (i + 1) / 3)]    # one flat colour per tone
    fig.add_trace(go.Heatmap(z=z, x=[_wrap(m) for m in models], y=specs, text=text, texttemplate="%{text}",
                             textfont=dict(size=10, color="#222"), zmin=-0.5, zmax=2.5, colorscale=scale,
                             opacity=0.45, showscale=False, xgap=3, ygap=3, hoverinfo="skip"))
    fig.update_layout(plot_bgcolor="#f2f2f2", xaxis=dict(showgrid=False, title_font=dict(size=11)),
                      yaxis=dict(autorange="reversed", showgrid=False, tickfont=dict(size=11)))
    return fig


def ppl_kl_figure(result: PplResult) -> go.Figure:
    """Mean KL against 16-bit along the evaluated text, one point per KL_WINDOW tokens (x: the window's last
    token); a log axis when the caches' KL spans decades."""
    fig = _fig("KL against 16-bit along the text", "position in the text (tokens)", "mean KL (nats)",
               sub=f"mean over each {KL_WINDOW}-token window, teacher-forced on the raw text")
    floor = kl_axis(fig, [v for run in result.caches[1:] for v in run.kl_along_text])
    for run in result.caches[1:]:
        n = len(run.kl_along_text)
        x = [min((i + 1) * KL_WINDOW, result.tokens) for i in range(n)]
        _line(fig, run.spec, x, floored(run.kl_along_text, floor), customdata=list(run.kl_along_text),
              hovertemplate=f"{run.spec}<br>tokens up to %{{x}}: KL %{{customdata:.4g}} nats<extra></extra>")
    return fig


def layer_error_figure(result: PplResult) -> go.Figure:
    """Heatmap of relative K and V reconstruction error per layer and spec."""
    runs = [r for r in result.caches if r.layer_key_error]
    layers = len(runs[0].layer_key_error) if runs else 0
    labels = [f"K L{i}" for i in range(layers)] + [f"V L{i}" for i in range(layers)]
    z = [r.layer_key_error + r.layer_value_error for r in runs]
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=[r.spec for r in runs], colorscale=HEATMAP,
                               hovertemplate="%{y}, %{x}: %{z:.4f}<extra></extra>", colorbar=dict(title="rel. err")))
    layout = {**LAYOUT, "margin": dict(l=120, r=30, t=70, b=60)}
    text = _title("Error per layer", "relative error of keys (K) and values (V)")
    layout["title"] = {**LAYOUT["title"], "text": text}
    fig.update_layout(**layout)
    return fig


def compare_figures(result: CompareResult) -> dict[str, go.Figure | None]:
    """Compare's four figures; KL and agreement are None until a quantized cache has run."""
    return {"kl": kl_figure(result), "agreement": agreement_figure(result), "bytes": bytes_figure(result),
            "speed": speed_figure(result)}


def capacity_figure(result) -> go.Figure:
    """Longest context each spec fits after the weights (cache-only bound), as bars."""
    fig = _fig(f"{result.arch}: longest context", "", "tokens (batch 1, cache only)",
               sub=f"{result.gpu_gib:g} GiB, {result.weight_dtype} weights, cache-only bound")
    specs = [r.spec for r in result.caches]
    top = max([r.max_context for r in result.caches] or [1])
    fig.add_bar(x=specs, y=[r.max_context for r in result.caches], marker_color=[colour_for(s) for s in specs],
                text=[f"{r.max_context:,}" + (f"<br>(cache fits {r.cache_fits:,})" if r.cache_fits else "")
                      for r in result.caches], textposition="outside", cliponaxis=False, showlegend=False)
    if result.context_limit:      # bars stop at the positions the model was trained for, and the line says so
        fig.add_hline(y=result.context_limit, line=dict(color="#555555", dash="dash", width=1),
                      annotation_text=f"the model's limit: {result.context_limit:,} tokens",
                      annotation_position="top left")
        top = max(top, result.context_limit)
    fig.update_yaxes(range=[0, 1.25 * max(top, 1)])
    return fig

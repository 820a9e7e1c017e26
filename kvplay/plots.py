"""Plots as pure functions: results in, plotly figures out. No torch, no live models.

Each scheme keeps one colour in every figure, tab and run (colour_for), the 16-bit baseline is
always the same grey, and each method draws its own dash and marker (style_for), so lines that
sit on top of each other stay visible. Variants with options keep their scheme's colour.
Bytes are in MiB everywhere, as on the cards.
"""
from __future__ import annotations

import zlib

import plotly.graph_objects as go

from .results import CompareResult, MemoryResult, PplResult, ThroughputResult

BASELINE_GREY = "#6e6e6e"
SCHEME_COLOURS = {"baseline": BASELINE_GREY, "quanto-int4": "#1f77b4", "quanto-int2": "#17becf",
                  "hqq-int8": "#bcbd22", "hqq-int4": "#ff7f0e", "hqq-int2": "#8c564b", "kvplay-int8": "#9467bd",
                  "kvplay-int4": "#2ca02c", "kvplay-int3": "#e377c2", "kvplay-int2": "#d62728",
                  "kvplay-fp8": "#b8860b"}
EXTRA_COLOURS = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354"]
METHOD_STYLE = {"baseline": ("solid", "circle"), "quanto": ("dash", "square"), "hqq": ("dot", "diamond"),
                "kvplay": ("solid", "circle")}
MIB = 2**20
LAYOUT = dict(template="plotly_white", height=430, margin=dict(l=64, r=24, t=80, b=110),
              legend=dict(orientation="h", yanchor="top", y=-0.22, x=0, font=dict(size=11)),
              title=dict(x=0.01, xanchor="left", font=dict(size=15)))


def scheme_of(spec: str) -> str:
    return spec.split(":", 1)[0].strip()


def colour_for(spec: str) -> str:
    """One colour per scheme (a variant keeps its scheme's), the baseline always grey."""
    name = scheme_of(spec)
    if name in SCHEME_COLOURS:
        return SCHEME_COLOURS[name]
    return EXTRA_COLOURS[zlib.crc32(name.encode()) % len(EXTRA_COLOURS)]


def style_for(spec: str) -> dict:
    """Line colour, dash and width, and marker symbol: fixed per scheme; variants draw long dashes."""
    name = scheme_of(spec)
    dash, symbol = METHOD_STYLE.get(name.split("-", 1)[0], ("dashdot", "triangle-up"))
    if ":" in spec:
        dash = "longdash"
    width = 3 if name == "baseline" else 2
    return dict(line=dict(color=colour_for(spec), dash=dash, width=width),
                marker=dict(color=colour_for(spec), symbol=symbol, size=7))


def _title(title: str, sub: str = "") -> str:
    """A short title that fits a phone-width plot, the detail on a smaller second line."""
    return f"{title}<br><sup>{sub}</sup>" if sub else title


def _fig(title: str, x: str, y: str, sub: str = "", **kw) -> go.Figure:
    fig = go.Figure()
    layout = {**LAYOUT, **kw}
    layout["title"] = {**LAYOUT["title"], "text": _title(title, sub)}
    fig.update_layout(xaxis_title=x, yaxis_title=y, **layout)
    return fig


def _line(fig: go.Figure, spec: str, x, y, *, markers: bool = False, **kw) -> None:
    style = style_for(spec)
    n = len(y)
    fig.add_scatter(x=list(x), y=list(y), name=spec, mode="lines+markers" if markers or n <= 24 else "lines",
                    line=style["line"], marker={**style["marker"], "maxdisplayed": 24}, **kw)


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


def kl_figure(result: CompareResult) -> go.Figure:
    """Per-step KL(baseline || spec), each spec's first different token marked with an x."""
    fig = _fig("Drift from 16-bit, per token", "generated token", "KL divergence (nats)",
               sub="KL of the next-token distribution, teacher-forced", yaxis_rangemode="tozero")
    marked = False
    for run in result.caches[1:]:
        _line(fig, run.spec, range(len(run.kl)), run.kl,
              hovertemplate=f"{run.spec}<br>token %{{x}}: KL %{{y:.4f}} nats<extra></extra>")
        d = run.first_divergence
        if d is not None:
            y = run.kl[d] if d < len(run.kl) else 0
            fig.add_scatter(x=[d], y=[y], mode="markers", legendgroup="diverge", showlegend=False,
                            marker=dict(color=colour_for(run.spec), size=13, symbol="x"),
                            name=f"{run.spec}: first different token",
                            hovertemplate=f"{run.spec}: its own text departs at token %{{x}}<extra></extra>")
            marked = True
    if marked:  # one legend entry explains every x
        fig.add_scatter(x=[None], y=[None], mode="markers", legendgroup="diverge", name="first different token",
                        marker=dict(color="#333", size=11, symbol="x"))
    return fig


def agreement_figure(result: CompareResult) -> go.Figure:
    """Cumulative share of steps where the spec's top-1 token equals the baseline's."""
    fig = _fig("Top-1 agreement with 16-bit", "generated token", "agreement",
               sub="running share of steps, teacher-forced")
    every = []
    for run in result.caches[1:]:
        cum, hits = [], 0
        for i, ok in enumerate(run.top1):
            hits += ok
            cum.append(hits / (i + 1))
        every += cum
        _line(fig, run.spec, range(len(cum)), cum,
              hovertemplate=f"{run.spec}<br>token %{{x}}: %{{y:.1%}}<extra></extra>")
    rng = _fit(every, floor=0, ceiling=1.01)
    if rng:
        fig.update_yaxes(range=[rng[0], max(rng[1], 1.005)], tickformat=".0%")
    return fig


def bytes_figure(result: CompareResult) -> go.Figure:
    """Exact cache size after every step of the run, in MiB."""
    fig = _fig("Cache size while generating", "tokens in cache", "MiB", sub="measured on the live cache")
    for run in result.caches:
        _line(fig, run.spec, run.context_tokens, [b / MIB for b in run.cache_bytes_per_step],
              hovertemplate=f"{run.spec}<br>%{{x}} tokens: %{{y:.3f}} MiB<extra></extra>")
    fig.update_traces(line_shape="hv")
    return fig


def speed_figure(result: CompareResult) -> go.Figure:
    """Decode tokens/s per spec: the median over steps, the bar's whisker the middle half of steps."""
    from .render import timed

    fig = _fig("Decode speed", "", "tokens / s", sub="median over steps (whisker: middle half), this machine")
    runs = [r for r in result.caches if timed(r)]
    short = [r.spec for r in result.caches if not timed(r)]
    if runs:
        med = [r.decode_tokens_per_s for r in runs]
        lo = [m - (r.decode_spread or [m, m])[0] for m, r in zip(med, runs)]
        hi = [(r.decode_spread or [m, m])[1] - m for m, r in zip(med, runs)]
        # the value sits at the bar's foot, clear of the whisker through its middle half
        fig.add_bar(x=[r.spec for r in runs], y=med, marker_color=[colour_for(r.spec) for r in runs],
                    error_y=dict(type="data", array=hi, arrayminus=lo, color="#444", thickness=1.2),
                    text=[f"{m:.0f}" for m in med], textposition="inside", insidetextanchor="start", showlegend=False,
                    hovertemplate="%{x}: %{y:.1f} tok/s<extra></extra>", cliponaxis=False)
        fig.update_yaxes(range=[0, 1.12 * max(m + h for m, h in zip(med, hi))])
    if short:
        fig.add_annotation(text="too short to time: " + ", ".join(short), showarrow=False, xref="paper",
                           yref="paper", x=0.5, y=0.5 if not runs else 1.02, font=dict(color="#777"))
    return fig


def memory_figure(result: MemoryResult) -> go.Figure:
    """Measured MiB against context length; the full-precision window's sawtooth shows."""
    fig = _fig("Cache size against context", "context tokens", "MiB", sub="measured on the live cache")
    for s in result.caches:
        _line(fig, s.spec, [p[0] for p in s.points], [p[1] / MIB for p in s.points],
              hovertemplate=f"{s.spec}<br>%{{x}} tokens: %{{y:.3f}} MiB<extra></extra>")
    return fig


def projection_figure(result: MemoryResult | None, arch: str, log: bool = False) -> go.Figure:
    """Projected cache size for a real architecture, from bits per element measured here."""
    fig = _fig(f"{arch}: projected cache", "context tokens", "GiB", sub="from the bits per element measured here",
               xaxis_type="log" if log else "linear", yaxis_type="log" if log else "linear")
    if result is None:
        fig.add_annotation(text="Press Measure growth: the projection uses the bits per element it measures.",
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font=dict(color="#777"))
        return fig
    for spec, pts in result.projections.get(arch, {}).items():
        _line(fig, spec, [p[0] for p in pts], [p[1] / 2**30 for p in pts], markers=True,
              hovertemplate="%{x} tokens: %{y:.2f} GiB<extra>" + spec + "</extra>")
    return fig


def throughput_figure(result: ThroughputResult, by: str = "batch") -> go.Figure:
    """Decode tokens/s against batch size (by="batch") or context length (by="context")."""
    x_title = "batch size" if by == "batch" else "context tokens"
    fig = _fig(f"Throughput against {x_title}", x_title, "tokens / s (all sequences)",
               sub="decode, measured on this machine")
    for s in result.caches:
        pts = s.points if by == "batch" else s.context_points
        _line(fig, s.spec, [p[0] for p in pts], [p[1] for p in pts], markers=True)
    return fig


def ppl_kl_figure(result: PplResult) -> go.Figure:
    """Mean KL against 16-bit along the evaluated text."""
    fig = _fig("KL against 16-bit along the text", "window along the text", "mean KL (nats)",
               sub="teacher-forced on the raw text", yaxis_rangemode="tozero")
    for run in result.caches[1:]:
        _line(fig, run.spec, range(len(run.kl_along_text)), run.kl_along_text)
    return fig


def layer_error_figure(result: PplResult) -> go.Figure:
    """Heatmap of relative K and V reconstruction error per layer and spec."""
    runs = [r for r in result.caches if r.layer_key_error]
    layers = len(runs[0].layer_key_error) if runs else 0
    labels = [f"K L{i}" for i in range(layers)] + [f"V L{i}" for i in range(layers)]
    z = [r.layer_key_error + r.layer_value_error for r in runs]
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=[r.spec for r in runs], colorscale="Reds",
                               hovertemplate="%{y}, %{x}: %{z:.4f}<extra></extra>", colorbar=dict(title="rel. err")))
    layout = {**LAYOUT, "margin": dict(l=120, r=30, t=70, b=60)}
    text = _title("Error per layer", "relative error of keys (K) and values (V)")
    layout["title"] = {**LAYOUT["title"], "text": text}
    fig.update_layout(**layout)
    return fig


def compare_figures(result: CompareResult) -> dict[str, go.Figure]:
    return {"kl": kl_figure(result), "agreement": agreement_figure(result), "bytes": bytes_figure(result),
            "speed": speed_figure(result)}


def capacity_figure(result) -> go.Figure:
    """Longest context each spec fits after the weights (cache-only bound), as bars."""
    fig = _fig(f"{result.arch}: longest context", "", "tokens (batch 1, cache only)",
               sub=f"{result.gpu_gib:g} GiB, {result.weight_dtype} weights, cache-only bound")
    specs = [r.spec for r in result.caches]
    top = max([r.max_context for r in result.caches] or [1])
    fig.add_bar(x=specs, y=[r.max_context for r in result.caches], marker_color=[colour_for(s) for s in specs],
                text=[f"{r.max_context:,}" for r in result.caches], textposition="outside", cliponaxis=False,
                showlegend=False)
    fig.update_yaxes(range=[0, 1.15 * max(top, 1)])
    return fig

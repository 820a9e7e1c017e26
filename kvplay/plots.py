"""Plots as pure functions: results in, plotly figures out. No torch, no live models.

Each spec keeps one colour in every figure (colour_for), so a reader can follow
"kvplay-int2" from the divergence plot to the memory plot without a legend hunt.
"""
from __future__ import annotations

import zlib

import plotly.graph_objects as go

from .cache.spec import SCHEMES
from .results import CompareResult, MemoryResult, PplResult, ThroughputResult

PALETTE = ["#4d4d4d", "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#f7b6d2", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#98df8a", "#c5b0d5"]
_SCHEME_INDEX = {name: i for i, name in enumerate(SCHEMES)}
LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.2),
              height=380)


def colour_for(spec: str) -> str:
    """A stable colour per spec: registered names by registry order, variants by a hash of the string."""
    if spec in _SCHEME_INDEX:
        return PALETTE[_SCHEME_INDEX[spec] % len(PALETTE)]
    return PALETTE[(len(SCHEMES) + zlib.crc32(spec.encode())) % len(PALETTE)]


def _fig(title: str, x: str, y: str, **kw) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **{**LAYOUT, **kw})
    return fig


def kl_figure(result: CompareResult) -> go.Figure:
    """Per-step KL(baseline || spec), with each spec's first divergence marked."""
    fig = _fig("How far each cache's next-token distribution drifts from 16-bit (teacher-forced)",
               "generated token", "KL divergence (nats)")
    for run in result.caches[1:]:
        c = colour_for(run.spec)
        fig.add_scatter(x=list(range(len(run.kl))), y=run.kl, name=run.spec, mode="lines", line=dict(color=c))
        if run.first_divergence is not None:
            fig.add_vline(x=run.first_divergence, line=dict(color=c, dash="dot", width=1))
            fig.add_scatter(x=[run.first_divergence], y=[run.kl[run.first_divergence]] if run.first_divergence
                            < len(run.kl) else [0], mode="markers", marker=dict(color=c, size=10, symbol="x"),
                            name=f"{run.spec}: first different token", showlegend=False,
                            hovertemplate=f"{run.spec}: output departs from 16-bit at token %{{x}}<extra></extra>")
    return fig


def agreement_figure(result: CompareResult) -> go.Figure:
    """Cumulative share of steps where the spec's top-1 token equals the baseline's."""
    fig = _fig("Top-1 agreement with 16-bit, cumulative", "generated token", "agreement", yaxis_range=[0, 1.02])
    for run in result.caches[1:]:
        cum, hits = [], 0
        for i, ok in enumerate(run.top1):
            hits += ok
            cum.append(hits / (i + 1))
        fig.add_scatter(x=list(range(len(cum))), y=cum, name=run.spec, mode="lines",
                        line=dict(color=colour_for(run.spec)))
    return fig


def bytes_figure(result: CompareResult) -> go.Figure:
    """Exact cache bytes after every step of the run."""
    fig = _fig("Cache size during generation (measured)", "tokens in cache", "bytes")
    for run in result.caches:
        fig.add_scatter(x=run.context_tokens, y=run.cache_bytes_per_step, name=run.spec, mode="lines",
                        line=dict(color=colour_for(run.spec), shape="hv"))
    return fig


def speed_figure(result: CompareResult) -> go.Figure:
    """Decode tokens/s per spec, as bars."""
    fig = _fig("Decode speed", "", "tokens / s")
    specs = [r.spec for r in result.caches]
    fig.add_bar(x=specs, y=[r.decode_tokens_per_s for r in result.caches], marker_color=[colour_for(s) for s in specs],
                text=[f"{r.decode_tokens_per_s:.1f}" for r in result.caches], textposition="outside")
    return fig


def memory_figure(result: MemoryResult) -> go.Figure:
    """Measured bytes against context length; the full-precision window's sawtooth shows."""
    fig = _fig("Cache size against context length (measured)", "context tokens", "bytes")
    for s in result.caches:
        fig.add_scatter(x=[p[0] for p in s.points], y=[p[1] for p in s.points], name=s.spec, mode="lines",
                        line=dict(color=colour_for(s.spec)))
    return fig


def bits_figure(result: MemoryResult) -> go.Figure:
    """Average stored bits per element against context: the window's share shrinks as context grows."""
    fig = _fig("Bits per cached element (metadata and 16-bit window included)", "context tokens", "bits / element")
    for s in result.caches:
        bpe = s.extra.get("bits_per_point")
        if bpe:
            fig.add_scatter(x=[p[0] for p in s.points], y=bpe, name=s.spec, mode="lines",
                            line=dict(color=colour_for(s.spec)))
    return fig


def projection_figure(result: MemoryResult, arch: str, log: bool = False) -> go.Figure:
    """Projected cache size for a real architecture, from bits per element measured here."""
    fig = _fig(f"{arch}: projected KV cache (from measured bits per element)", "context tokens", "GiB",
               xaxis_type="log" if log else "linear", yaxis_type="log" if log else "linear")
    for spec, pts in result.projections.get(arch, {}).items():
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] / 2**30 for p in pts], name=spec, mode="lines+markers",
                        line=dict(color=colour_for(spec)),
                        hovertemplate="%{x} tokens: %{y:.2f} GiB<extra>" + spec + "</extra>")
    return fig


def throughput_figure(result: ThroughputResult, by: str = "batch") -> go.Figure:
    """Decode tokens/s against batch size (by="batch") or context length (by="context")."""
    x_title = "batch size" if by == "batch" else "context tokens"
    fig = _fig(f"Decode throughput against {x_title}", x_title, "tokens / s (all sequences)")
    for s in result.caches:
        pts = s.points if by == "batch" else s.context_points
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=s.spec, mode="lines+markers",
                        line=dict(color=colour_for(s.spec)))
    return fig


def ppl_kl_figure(result: PplResult) -> go.Figure:
    """Mean KL against 16-bit along the evaluated text."""
    fig = _fig("KL against 16-bit along the text", "window along the text", "mean KL (nats)")
    for run in result.caches[1:]:
        fig.add_scatter(y=run.kl_along_text, name=run.spec, mode="lines", line=dict(color=colour_for(run.spec)))
    return fig


def layer_error_figure(result: PplResult) -> go.Figure:
    """Heatmap of relative K and V reconstruction error per layer and spec."""
    runs = [r for r in result.caches if r.layer_key_error]
    layers = len(runs[0].layer_key_error) if runs else 0
    labels = [f"K L{i}" for i in range(layers)] + [f"V L{i}" for i in range(layers)]
    z = [r.layer_key_error + r.layer_value_error for r in runs]
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=[r.spec for r in runs], colorscale="Reds",
                               hovertemplate="%{y}, %{x}: %{z:.4f}<extra></extra>", colorbar=dict(title="rel. err")))
    fig.update_layout(title="Relative reconstruction error of keys (K) and values (V) per layer", **LAYOUT)
    return fig


def compare_figures(result: CompareResult) -> dict[str, go.Figure]:
    return {"kl": kl_figure(result), "agreement": agreement_figure(result), "bytes": bytes_figure(result),
            "speed": speed_figure(result)}


def capacity_figure(result) -> go.Figure:
    """Longest context each spec fits after the weights (cache-only bound), as bars."""
    fig = _fig(f"{result.arch} on {result.gpu_gib:g} GiB with {result.weight_dtype} weights: longest context",
               "", "tokens (batch 1, cache only)")
    specs = [r.spec for r in result.caches]
    fig.add_bar(x=specs, y=[r.max_context for r in result.caches], marker_color=[colour_for(s) for s in specs],
                text=[f"{r.max_context:,}" for r in result.caches], textposition="outside")
    return fig

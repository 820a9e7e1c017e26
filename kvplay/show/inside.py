"""The Inside views as plotly figures (results in, figures out; no Gradio, no torch): the app's Inside tab
and the HTML report draw the same pictures. Colours come from kvplay.show.style: caches in their identity colours,
magnitudes on one sequential scale (style.HEATMAP) with every colourbar at the right edge of its row, clear of
the next panel's tick labels; only the find-the-number grid, a verdict per cell, is green and red.

    fig = scan_figure(inside.outlier_scan(model, tok))
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvplay.show.plots import LAYOUT
from kvplay.show.style import HEATMAP, SINK_SHADE, VERDICT, WINDOW_SHADE, colour_for

if TYPE_CHECKING:
    from kvplay.results import inside

NEEDLE_COLOURS = [[0.0, VERDICT["red"]], [0.33, VERDICT["red"]], [0.34, "#c7c7c7"], [0.66, "#c7c7c7"],
                  [0.67, VERDICT["green"]], [1.0, VERDICT["green"]]]     # missed, baseline failed (not counted), found


def shown(spec: str) -> str:
    """A spec as a figure names it: the 16-bit reference is "16-bit", never "baseline"."""
    return "16-bit" + spec[len("baseline"):] if spec.split(":")[0] == "baseline" else spec


def _layer_step(layers: int) -> int:
    """Whole layer numbers on a heatmap's axis (plotly puts half layers there for a few layers)."""
    return 1 if layers <= 16 else 4


def _layout(fig: go.Figure, title: str, height: int = 460, below: int = 30) -> go.Figure:
    """The house layout, the title pinned to the top under the modebar (on a phone they share the width) with
    room under it for each of its lines, kept short to fit a phone, and `below` px for the first panels' titles."""
    lines = title.count("<br>")
    fig.update_layout(**{**LAYOUT, "height": height,
                         "title": {**LAYOUT["title"], "text": title, "yref": "container", "y": 1, "yanchor": "top",
                                   "pad": {"t": 34}}})             # under the modebar
    fig.update_layout(margin={"t": 60 + 15 * lines + below})
    return fig


def scan_figure(result: inside.OutliersResult) -> go.Figure:
    """Four layer x head heatmaps in a 2 x 2 grid: keys' max ratio as stored and after rotation (row 1), values'
    max ratio and keys' kurtosis (row 2). The three ratios share one colour scale (its bar right of row 1), the
    kurtosis has its own (right of row 2): no colourbar sits between two panels."""
    # Panel titles short enough for a phone's 110-px panels; what the colours mean is in the subtitle.
    panels = [("key_max_ratio", "keys"), ("key_max_ratio_rotated", "keys, rotated"), ("value_max_ratio", "values"),
              ("key_kurtosis", "key kurtosis")]
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for _, t in panels], horizontal_spacing=0.09,
                        vertical_spacing=0.16)
    ratio_max = max(max(max(r) for r in result.matrix(k)) for k in ("key_max_ratio", "key_max_ratio_rotated",
                                                                      "value_max_ratio"))
    heads = [f"h{h.head}" for h in result.layers[0].heads]
    for i, (key, title) in enumerate(panels):
        row, col = divmod(i, 2)
        ratio = "ratio" in key
        bar = dict(x=1.01, xanchor="left", y=0.79 if row == 0 else 0.21, len=0.42, thickness=14,
                   title="x" if ratio else "kurt.")
        fig.add_trace(go.Heatmap(z=result.matrix(key), x=heads, y=[lay.layer for lay in result.layers],
                                 colorscale=HEATMAP, zmin=1.0 if ratio else None, zmax=ratio_max if ratio else None,
                                 showscale=i in (1, 3), colorbar=bar,
                                 hovertemplate=f"layer %{{y}}, %{{x}}<br>{title}: %{{z:.1f}}"
                                               + ("x the median channel" if ratio else "") + "<extra></extra>"),
                      row=row + 1, col=col + 1)
        fig.update_yaxes(title_text="layer" if col == 0 else None, autorange="reversed",
                         dtick=_layer_step(len(result.layers)), row=row + 1, col=col + 1)
    fig.update_xaxes(title_text="KV head", row=2)
    fig = _layout(fig, f"Outlier channels per KV head<br><sup>largest channel / median channel (x), keys as stored"
                       f"<br>and after a Hadamard rotation; kurtosis: normal = 3<br>{result.tokens} tokens of the "
                       f"held-out play; an outlier is > {result.outlier_factor:g}x the median</sup>", height=800)
    fig.update_layout(margin=dict(l=64, r=80, b=60))
    return fig


def error_figure(maps: inside.ErrorMaps) -> go.Figure:
    """Relative key and value reconstruction error per layer x KV head, one row of two heatmaps per cache."""
    n = len(maps.caches)
    # One title per row, centred over its two panels ("kvplay-int2: keys | values"): two titles per row, one per
    # panel, ran into each other on a phone.
    fig = make_subplots(rows=n, cols=2, vertical_spacing=0.1 if n > 1 else 0.0, horizontal_spacing=0.06,
                        subplot_titles=[f"{shown(c.spec)}: keys | values" if part == "key" else ""
                                        for c in maps.caches for part in ("key", "value")])
    for a in fig.layout.annotations:                           # centred over the row, not over its left panel
        a.update(x=0.5)
    top = max(max(max(r) for r in m) for c in maps.caches for m in (c.key_error, c.value_error)) or 1.0
    for i, c in enumerate(maps.caches, start=1):
        for j, z in enumerate((c.key_error, c.value_error), start=1):
            fig.add_trace(go.Heatmap(z=[[100 * v for v in row] for row in z], x=[f"h{h}" for h in range(len(z[0]))],
                                     y=list(range(len(z))), zmin=0, zmax=100 * top, colorscale=HEATMAP,
                                     showscale=i == 1 and j == 2,
                                     colorbar=dict(title="%", x=1.01, xanchor="left", thickness=14),
                                     hovertemplate="layer %{y}, %{x}: %{z:.1f}%<extra></extra>"), row=i, col=j)
            fig.update_yaxes(title_text="layer" if j == 1 else None, autorange="reversed", dtick=_layer_step(len(z)),
                             row=i, col=j)
    return _layout(fig, f"Error per layer and KV head<br><sup>relative reconstruction error ||K̂ - K|| / ||K||, %; "
                        f"{maps.tokens} tokens</sup>", height=max(420, 340 * n))


def shift_figure(s: inside.AttentionShift) -> go.Figure:
    """16-bit and quantized attention weights over the context, and their difference; sink and window shaded."""
    x = list(range(s.context_tokens))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=["attention weight", "quantized - 16-bit"])
    hover = [t.replace("\n", "⏎") for t in s.tokens] or None
    fig.add_trace(go.Scatter(x=x, y=s.baseline, name="16-bit", line=dict(color=colour_for("baseline"), width=2),
                             text=hover, hovertemplate="%{x} %{text}: %{y:.4f}<extra>16-bit</extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=s.quantized, name=s.spec, line=dict(color=colour_for(s.spec), width=1.5),
                             text=hover, hovertemplate="%{x} %{text}: %{y:.4f}<extra>" + s.spec + "</extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=s.difference, name="difference", marker_color=colour_for(s.spec),
                         showlegend=False, hovertemplate="%{x}: %{y:+.4f}<extra></extra>"), row=2, col=1)
    start = max(s.context_tokens - s.window, 0)
    for row in (1, 2):          # the shading on both panels, its words once, at the top (short: they share a line)
        sink = dict(annotation_text="sink", annotation_position="top left") if row == 1 else {}
        window = dict(annotation_text="16-bit window", annotation_position="top right") if row == 1 else {}
        if s.sink:
            fig.add_vrect(x0=-0.5, x1=s.sink - 0.5, fillcolor=SINK_SHADE, opacity=0.15, line_width=0, row=row, col=1,
                          **sink)
        if s.window:
            fig.add_vrect(x0=start - 0.5, x1=s.context_tokens - 0.5, fillcolor=WINDOW_SHADE, opacity=0.12,
                          line_width=0, row=row, col=1, **window)
    fig.update_xaxes(title_text="context position (token)", row=2, col=1)
    shade = " and ".join(w for w, on in ((f"the first {s.sink} tokens", s.sink),
                                         (f"the newest {s.window}", s.window)) if on)
    return _layout(fig, f"Attention, layer {s.layer}, query head {s.head}<br><sup>generating token {s.step} "
                        f"({s.token!r}): 16-bit against {s.spec}" + (f"<br>shaded: {shade}, kept 16-bit" if shade
                                                                    else "") + "</sup>", height=580)


def needle_figure(result: inside.NeedleResult) -> go.Figure:
    """One heatmap per cache (16-bit first), two to a row: found / missed / 16-bit failed, per length x depth.
    Two to a row, not all in one: four side by side left a phone 70 px a panel, and their titles ran together."""
    n = len(result.caches)
    cols = 1 if n == 1 else 2
    rows = -(-n // cols)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, horizontal_spacing=0.05,
                        vertical_spacing=0.22 if rows > 1 else 0.0,
                        subplot_titles=[f"{shown(c.spec)}: {c.found}/{c.counted}" for c in result.caches])
    for i, c in enumerate(result.caches):
        row, col = divmod(i, cols)
        cell = {(g[0], g[1]): g[2] for g in c.grid}
        z = [[{True: 2, None: 1, False: 0}[cell[(length, d)]] for length in result.lengths] for d in result.depths]
        words = [[("missed", "16-bit failed", "found")[v] for v in row] for row in z]
        marks = [[("✗", "-", "✓")[v] for v in row] for row in z]      # the colours, said without colour
        fig.add_trace(go.Heatmap(z=z, x=[str(length) for length in result.lengths],
                                 y=[f"{d:g}" for d in result.depths], zmin=0, zmax=2, colorscale=NEEDLE_COLOURS,
                                 showscale=False, text=marks, texttemplate="%{text}", customdata=words, xgap=2,
                                 ygap=2, hovertemplate="%{x} tokens, depth %{y}: %{customdata}<extra></extra>"),
                      row=row + 1, col=col + 1)
        fig.update_xaxes(type="category", row=row + 1, col=col + 1)
        fig.update_yaxes(type="category", title_text="depth" if col == 0 else None, row=row + 1, col=col + 1)
    return _layout(fig, f"Find the number<br><sup>✓ found, ✗ missed, - the 16-bit cache fails too (not counted)"
                        f"<br>across: context (tokens); down: depth of the pass code<br>(0 = start); seed "
                        f"{result.seed}</sup>", height=240 + 240 * rows)


def kept_figure(result: inside.KeptResult) -> go.Figure:
    """One heatmap per evicting cache: the share of each layer's KV heads that kept each prompt position, the pass
    code's sentence and the question marked, the answer in the panel's title."""
    n = len(result.caches)
    a, b = result.needle
    # Short lines per panel title (the spec, its verdict, what it kept, how it chose), so that no title runs past
    # a phone's width or into the colour bar, which sits beside the first panel only.
    def title(c) -> str:
        kept, _, how = c.kept.partition(" (")
        return (f"{'found' if c.found else 'missed'} the pass code<br><span style='font-size:11px'>{shown(c.spec)}"
                f"<br>{kept}<br>({how}</span>")
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.2 if n > 1 else 0.1,
                        subplot_titles=[title(c) for c in result.caches])
    for i, c in enumerate(result.caches, start=1):
        fig.add_trace(go.Heatmap(z=c.shares, y=[str(layer) for layer in c.layers], zmin=0, zmax=1,
                                 colorscale=HEATMAP, showscale=i == 1,
                                 colorbar=dict(title=dict(text="share<br>of heads", side="top"), len=0.9 / n, y=1,
                                               yanchor="top", thickness=12),
                                 hovertemplate="position %{x}, layer %{y}: %{z:.0%} of heads kept it<extra></extra>"),
                      row=i, col=1)
        fig.add_vrect(x0=a - 0.5, x1=b - 0.5, line=dict(color="black", width=1.5), fillcolor="rgba(0,0,0,0)",
                      row=i, col=1)
        fig.add_vline(x=result.question_start - 0.5, line=dict(color=WINDOW_SHADE, width=1.5, dash="dot"),
                      row=i, col=1)
        fig.update_yaxes(title_text="layer", type="category", row=i, col=1)
    fig.update_xaxes(title_text=f"prompt position (tokens)<br><span style='font-size:11px'>box: the pass code "
                                f"{result.passkey} ({a:,}-{b:,}); dotted: the question</span>", row=n, col=1)
    return _layout(fig, f"What eviction kept<br><sup>{result.tokens:,} prompt tokens, {result.model or 'model'}</sup>",
                   height=340 + 280 * n, below=80)


FIGURES = {"outliers": scan_figure, "needle": needle_figure, "head_errors": error_figure,
           "attention_shift": shift_figure, "kept": kept_figure}     # by result kind (kvplay.results.INSIDE)


def figures(result) -> list[go.Figure]:
    """The figure of an Inside result, for the HTML report."""
    return [FIGURES[result.kind](result)]

"""Trade-offs figures (plotly): titles and units on every chart, colours from kvplay.show.style, the palette every tab
uses (each point, line and legend entry in its scheme's identity colour, never a verdict colour; one marker
symbol per method). KL axes go logarithmic where the values span decades."""
from __future__ import annotations

import plotly.graph_objects as go

from kvplay.cache import METHODS
from kvplay.results import METRICS, DriftResult, ParetoResult, TasksResult, WindowSweepResult, frontier
from kvplay.show.cards import VERDICT_THRESHOLDS
from kvplay.show.plots import LAYOUT, floored, kl_axis, log_if_spread
from kvplay.show.style import HEATMAP, LEVER_COLOURS, colour_for, marker_for_method, method_colour


def backend_colour(backend: str) -> str:
    """A method's own colour (kvplay.show.style.method_colour: the first shade of the family it declares)."""
    return method_colour(backend)


def _layout(fig, title: str, x: str, y: str, **kw):
    fig.update_layout(**{**LAYOUT, **kw, "title": {**LAYOUT["title"], "text": title}}, xaxis_title=x, yaxis_title=y)
    return fig


def pareto_figure(result: ParetoResult, metric: str = "mean_kl", log_y: bool = True, published: list | tuple = (),
                  at: str = "run", labels: bool = False):
    """Bits per element against `metric`, one colour per backend, the frontier as a step line through its points.

    at: count each cache's bytes at the text's length ("run", measured) or at result.long_tokens ("long", the
    byte formulas: where a cache's 16-bit window no longer dominates). Quality is the text's either way.
    labels: name the frontier's points on the chart, for a still image with no hover (scripts/chart_png.py); the
    app leaves them off, where a crowded grid's names would overlap and hover and the table name every point
    (_frontier_labels says which points get a name and where)."""
    label, higher = METRICS[metric]
    xs = result.bits(at)
    on = result.with_frontier(metric, at)
    shown = [(p, x, f) for p, x, f in zip(result.points, xs, on) if x is not None]
    left_out = len(xs) - len(shown)
    front = sorted((x, getattr(p, metric)) for p, x, f in shown if f)
    named = _frontier_labels(front) if labels else {}
    # A log axis has no place for 0 (the 16-bit cache, and 8-bit caches whose KL rounds to 0): those points sit on a
    # floor a decade under the smallest positive value, and their hover says the true value.
    log = log_y and metric == "mean_kl"
    floor = _log_floor([getattr(p, metric) for p, _, _ in shown]) if log else None
    front = [(x, max(y, floor) if log else y) for x, y in front]

    def y_of(p):
        y = getattr(p, metric)
        return max(y, floor) if log else y
    fig = go.Figure()
    for backend in dict.fromkeys(p.backend for p, _, _ in shown):
        mine = [(p, x, f) for p, x, f in shown if p.backend == backend]
        fig.add_trace(go.Scatter(
            x=[x for _, x, _ in mine], y=[y_of(p) for p, _, _ in mine],
            mode="markers+text" if labels else "markers",
            name=legend_name(backend), customdata=[p.spec for p, _, _ in mine],
            text=[p.spec if (x, getattr(p, metric)) in named and p.spec != "baseline" else "" for p, x, _ in mine],
            textposition=[named.get((x, getattr(p, metric)), "top right") for p, x, _ in mine],
            textfont=dict(size=11), cliponaxis=False,
            marker=dict(color=[colour_for(p.spec) for p, _, _ in mine], symbol=marker_for_method(backend),
                        size=[13 if f else 8 for _, _, f in mine],
                        line=dict(color="black", width=[2 if f else 0 for _, _, f in mine])),
            hovertext=[f"{label} {getattr(p, metric):.4g}" for p, _, _ in mine],
            hovertemplate="%{customdata}<br>%{x:.2f} bits/element<br>%{hovertext}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[x for x, _ in front], y=[y for _, y in front], mode="lines", name="Pareto frontier",
                             line=dict(color="black", dash="dot", width=1, shape="hv"), hoverinfo="skip"))
    if published:
        refs = [r for r in published if r.get("metric") == metric]
        if refs:
            fig.add_trace(go.Scatter(x=[r["bits_per_element"] for r in refs], y=[r["value"] for r in refs],
                                     mode="markers", name="published (other model, other text)",
                                     marker=dict(symbol="x", color="#999999", size=9),
                                     customdata=[f"{r['label']} · {r['model']} · {r['source']}" for r in refs],
                                     hovertemplate="%{customdata}<extra></extra>"))
    model = result.env.model or "model"
    if at == "run":
        title = f"Quality against bytes at {result.context_tokens:,} tokens ({model}; frontier outlined)"
        x_title = "bits per cached element (metadata and 16-bit window included)"
    else:
        title = (f"Quality at {result.context_tokens:,} tokens against bytes at {result.long_tokens:,} tokens "
                 f"({model}; frontier outlined" + (f"; {left_out} without a byte formula left out" if left_out else "")
                 + ")")
        x_title = f"bits per cached element at {result.long_tokens:,} tokens (metadata and 16-bit window included)"
    if log and any(getattr(p, metric) < floor for p, _, _ in shown):
        label = f"{label}, log scale (0 drawn at {floor:.0e})"
    elif log:
        label = f"{label}, log scale"
    return _layout(fig, title, x_title, label, yaxis_type="log" if log else "linear")


def pareto_models_figure(results: list[ParetoResult]) -> go.Figure:
    """The equal-bytes chart on several models, a panel each on shared axes: mean KL (log; 0 on a floor) against
    bits per element at each run's long context, each point in its scheme's colour and method's marker, the
    frontier outlined and drawn as a step line. Does the frontier keep its caches from model to model?"""
    from plotly.subplots import make_subplots

    cols, rows = 1, len(results)           # stacked: a model's name fits over its panel on a phone too
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, shared_yaxes=True,
                        vertical_spacing=0.24 / rows, subplot_titles=[r.env.model for r in results])
    floor = _log_floor([p.mean_kl for r in results for p in r.points])
    for i, r in enumerate(results):
        row, col = divmod(i, cols)
        xs, on = r.bits("long"), r.with_frontier("mean_kl", "long")
        shown = [(p, x, f) for p, x, f in zip(r.points, xs, on) if x is not None]
        fig.add_trace(go.Scatter(
            x=[x for _, x, _ in shown], y=[max(p.mean_kl, floor) for p, _, _ in shown], mode="markers",
            showlegend=False, customdata=[[p.spec, p.mean_kl] for p, _, _ in shown],
            marker=dict(color=[colour_for(p.spec) for p, _, _ in shown],
                        symbol=[marker_for_method(p.backend) for p, _, _ in shown],
                        size=[12 if f else 8 for *_, f in shown], line=dict(color="black",
                                                                             width=[2 if f else 0 for *_, f in shown])),
            hovertemplate="%{customdata[0]}<br>%{x:.2f} bits/element<br>mean KL %{customdata[1]:.4g}<extra></extra>"),
            row=row + 1, col=col + 1)
        front = sorted((x, max(p.mean_kl, floor)) for p, x, f in shown if f)
        fig.add_trace(go.Scatter(x=[x for x, _ in front], y=[y for _, y in front], mode="lines", showlegend=False,
                                 line=dict(color="black", dash="dot", width=1, shape="hv"), hoverinfo="skip"),
                      row=row + 1, col=col + 1)
    first = results[0]
    title = (f"Equal bytes on {len(results)} models<br><sup>mean KL over {first.context_tokens:,} tokens of the "
             f"{first.text_name};<br>bits at {first.long_tokens:,} tokens; frontier outlined; KL 0 at {floor:.0e}"
             "</sup>")
    _layout(fig, title, "", "", height=150 + 240 * rows, margin=dict(l=60, r=8, t=110, b=60), showlegend=False)
    fig.update_yaxes(type="log")
    fig.update_yaxes(title_text="mean KL (nats, log)", col=1)
    fig.update_xaxes(title_text=f"bits per element at {first.long_tokens:,} tokens", row=rows)
    return fig


def first_point(result: ParetoResult) -> str:
    """The point a finished chart opens on: the fewest-bit frontier cache that is not far from 16-bit (the verdict's
    red: mean KL above 0.5 nats or top-1 under 60%), which tells the most; the fewest-bit one when all are."""
    red = VERDICT_THRESHOLDS["red"]
    front = sorted((p for p in result.points if p.on_frontier and METHODS[p.backend].quantized),
                   key=lambda p: p.bits_per_element)
    fine = [p for p in front if p.mean_kl <= red["kl_above"] and p.top1_agreement >= red["top1_below"]]
    chosen = (fine or front or result.points)[:1]
    return chosen[0].spec if chosen else ""


def _log_floor(values) -> float:
    """Where a log axis draws zero: a decade under the smallest positive value (1e-6 when none is positive)."""
    positive = [v for v in values if v > 0]
    return min(positive) / 10 if positive else 1e-6


def legend_name(backend: str) -> str:
    """A method's name in a legend; the 16-bit reference is "16-bit" everywhere, never its cache class's name."""
    method = METHODS.get(backend)
    return "16-bit" if method is not None and not method.quantized else backend


def _frontier_labels(front: list[tuple[float, float]]) -> dict[tuple[float, float], str]:
    """Where each frontier point's name goes on a still image, by its (bits, value): to its left, where the
    staircase leaves room (every other point lies above or to the right of the frontier), the first one above
    right; none for a point with a frontier neighbour within NEAR bits and a factor of 2 in value, where names
    would run into each other (a cluster such as the 8-bit formats: hover and the table name them)."""
    def near(a, b):
        return abs(a[0] - b[0]) < NEAR and max(a[1], b[1]) <= 2 * max(min(a[1], b[1]), 1e-12)
    return {pt: ("top right" if i == 0 else "middle left") for i, pt in enumerate(front)
            if not any(near(pt, other) for other in front if other is not pt)}


NEAR = 0.6          # bits


def window_figure(result: WindowSweepResult, metric: str = "mean_kl"):
    """mean KL (or top-1) against the residual window, one line per (cache, sink count)."""
    col = 2 if metric == "mean_kl" else 3
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot", "longdash"]
    for c in result.caches:
        for j, sink in enumerate(dict.fromkeys(int(p[1]) for p in c.points)):
            pts = [p for p in c.points if int(p[1]) == sink]
            name = f"{c.spec} ({c.semantics})" + (f", {sink} sinks" if c.semantics == "slide" else "")
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[col] for p in pts], mode="lines+markers", name=name,
                                     line=dict(color=colour_for(c.spec), dash=dashes[j % len(dashes)])))

    log = metric == "mean_kl" and log_if_spread([p[col] for c in result.caches for p in c.points])
    title = f"Residual window and sinks at {result.context_tokens} tokens (quanto/HQQ flush, kvplay slides)"
    return _layout(fig, title, "residual window (tokens)", METRICS[metric][0] + (", log scale" if log else ""),
                   yaxis_type="log" if log else "linear")


def drift_figures(result: DriftResult):
    """(KL along the text, smoothed; mean KL over the second half of each context length)."""

    along, by_ctx = go.Figure(), go.Figure()
    _layout(along, f"KL along the text (mean over {result.window}-token windows)", "position (tokens)",
            "mean KL to the 16-bit run (nats)")
    _layout(by_ctx, "Does it get worse as the cache grows?", "context length (tokens, log scale)",
            "mean KL over the second half (nats)", xaxis_type="log")
    # On a log axis a KL of exactly 0 (a cache that agrees everywhere) sits on a floor; hover says the true value.
    low = kl_axis(along, [p[1] for c in result.caches for p in c.kl_smoothed])
    floor = kl_axis(by_ctx, [p[1] for c in result.caches for p in c.by_context])
    for c in result.caches:
        along.add_trace(go.Scatter(x=[p[0] for p in c.kl_smoothed], y=floored([p[1] for p in c.kl_smoothed], low),
                                   mode="lines", name=c.spec, line=dict(color=colour_for(c.spec)),
                                   customdata=[p[1] for p in c.kl_smoothed],
                                   hovertemplate="%{x:,} tokens: KL %{customdata:.3g}<extra>" + c.spec + "</extra>"))
        by_ctx.add_trace(go.Scatter(x=[p[0] for p in c.by_context], y=floored([p[1] for p in c.by_context], floor),
                                    mode="lines+markers", name=c.spec, line=dict(color=colour_for(c.spec)),
                                    customdata=[p[1] for p in c.by_context],
                                    hovertemplate="%{x:,} tokens: KL %{customdata:.3g}<extra>" + c.spec + "</extra>"))
    contexts = sorted({int(p[0]) for c in result.caches for p in c.by_context})
    by_ctx.update_xaxes(tickvals=contexts, ticktext=[f"{n:,}" for n in contexts])    # the lengths measured, no 2 3 4
    return along, by_ctx


LEVER_MARKERS = {"16-bit": "circle", "quantized": "square", "evicted": "diamond", "both": "star"}
LEVER_NAMES = {"16-bit": "16-bit", "quantized": "fewer bits (quantized)", "evicted": "fewer tokens (evicted)",
               "both": "both"}


def lever_points(result: TasksResult, context: int) -> list[tuple]:
    """(cache, bits per element, accuracy against 16-bit in %, on the frontier) at one context length; the
    accuracy is the cache's score over the 16-bit cache's on the tasks 16-bit got anything right there."""
    i = result.contexts.index(context)
    ceiling = result.caches[0].counted_total(context)
    pts = [(cache, cache.bits[i], 100 * cache.counted_total(context) / ceiling if ceiling else None)
           for cache in result.caches]
    shown = [p for p in pts if p[2] is not None]
    on = frontier([p[1] for p in shown], [p[2] for p in shown], higher_is_better=True)
    return [(c, x, y, f) for (c, x, y), f in zip(shown, on)]


def tasks_figure(result: TasksResult, context: int | None = None):
    """Both levers on one equal-bytes chart: bits per element (measured after the prompt) against task accuracy
    relative to 16-bit, one colour and marker per lever (16-bit, quantized, evicted, both), the frontier over all."""
    context = context or max(result.contexts)
    pts = lever_points(result, context)
    fig = go.Figure()
    for lever in LEVER_MARKERS:
        mine = [p for p in pts if p[0].lever == lever]
        if not mine:
            continue
        fig.add_trace(go.Scatter(       # every point named on the chart, outlined so a point at 0% still shows
            x=[x for _, x, _, _ in mine], y=[y for _, _, y, _ in mine], mode="markers+text", name=LEVER_NAMES[lever],
            customdata=[c.spec for c, _, _, _ in mine], text=[c.spec for c, _, _, _ in mine],
            textposition="top center", textfont=dict(size=10), cliponaxis=False,
            marker=dict(color=LEVER_COLOURS[lever], symbol=LEVER_MARKERS[lever],
                        size=[15 if f else 12 for *_, f in mine],
                        line=dict(color="black", width=[2 if f else 1 for *_, f in mine])),
            hovertemplate="%{customdata}<br>%{x:.2f} bits/element<br>%{y:.0f}% of 16-bit's score<extra></extra>"))
    front = sorted((x, y) for _, x, y, f in pts if f)
    fig.add_trace(go.Scatter(x=[x for x, _ in front], y=[y for _, y in front], mode="lines", name="frontier",
                             line=dict(color="black", dash="dot", width=1, shape="hv"), hoverinfo="skip"))
    counted = sum(1 for c in result.caches[0].cells if c.context == context and c.counted)
    above = " (over 100%: right where 16-bit was not)" if any(y > 100 for _, _, y, _ in pts) else ""
    title = (f"Fewer bits or fewer tokens at {context:,} tokens<br><sup>{result.model or 'model'}; "
             f"scored on the {counted} tasks 16-bit answered{above}</sup>")
    return _layout(fig, title, "bits per cached element<br><sup>measured after the prompt; metadata and 16-bit "
                   "window included</sup>", "score against 16-bit's (%)")


def against_16bit(result: TasksResult, spec: str, context: int) -> tuple[float | None, int]:
    """A cache's score over the 16-bit cache's on `result`'s tasks at one context (in %; None: the cache was not
    run, or 16-bit answered none), and how many tasks 16-bit answered there."""
    ceiling = result.caches[0].counted_total(context)
    counted = sum(1 for c in result.caches[0].cells if c.context == context and c.counted)
    cache = next((c for c in result.caches if c.spec == spec), None)
    if cache is None or not ceiling:
        return None, counted
    return 100 * cache.counted_total(context) / ceiling, counted


def tasks_models_figure(results: list[TasksResult], context: int | None = None) -> go.Figure:
    """Does a cache keep the answers on every model? A cell per cache (rows) and model (columns) with its score
    against that model's own 16-bit cache at one context and the tasks that counted, shaded by the score on a
    sequential scale (no verdict colour: this grid judges nothing by a rule)."""
    context = context or max(results[0].contexts)
    models = [r.model for r in results]
    specs = [c.spec for c in results[0].caches[1:] if all(any(d.spec == c.spec for d in r.caches) for r in results)]
    z, text = [], []
    for spec in specs:
        z.append([]), text.append([])
        for r in results:
            score, counted = against_16bit(r, spec, context)
            z[-1].append(None if score is None else min(score, 100))
            text[-1].append("16-bit answered<br>none" if score is None else f"{score:.0f}%<br>of {counted} tasks")
    samples = sorted({r.samples for r in results})
    each = " or ".join(map(str, samples))
    rows = [spec.replace(":", ":<br>", 1) if len(spec) > 16 else spec for spec in specs]   # narrow on a phone
    fig = go.Figure(go.Heatmap(z=z, x=[m.replace(" (", "<br>(") for m in models], y=rows, text=text,
                               texttemplate="%{text}", textfont=dict(size=10, color="#222"), zmin=0, zmax=100,
                               colorscale=HEATMAP, opacity=0.55, showscale=False, xgap=3, ygap=3, hoverinfo="skip"))
    title = (f"The same tasks on {len(models)} models at {context:,} tokens<br><sup>score against each model's own "
             f"16-bit cache<br>on the tasks it answered ({each} per kind and length)<br>darker: closer to 16-bit</sup>")
    _layout(fig, title, "", "", height=190 + 62 * len(specs), margin=dict(l=150, r=8, t=110, b=70), showlegend=False)
    fig.update_layout(plot_bgcolor="#f2f2f2", yaxis=dict(autorange="reversed", showgrid=False, tickfont=dict(size=11)),
                      xaxis=dict(showgrid=False, side="bottom"))
    return fig


def figures(result) -> list:
    """The figures of a Trade-offs result, for the HTML report."""
    if isinstance(result, TasksResult):
        return [tasks_figure(result, n) for n in result.contexts]
    if isinstance(result, ParetoResult):
        return [pareto_figure(result)] + ([pareto_figure(result, at="long")] if result.long_tokens else [])
    if isinstance(result, WindowSweepResult):
        return [window_figure(result)]
    return list(drift_figures(result))


def source_cell(source: str) -> str:
    """A recipe's source as a short markdown link (its host), so the table's columns keep their room."""
    url = source.split()[0] if source.startswith("http") else ""
    if not url:
        return source
    host = url.split("/")[2].removeprefix("www.")
    return f"[{host}]({url})"


def measured_cell(measured: dict | None) -> str:
    """A recipe row's measured figures in one cell ("KL 0.047, perplexity +5.1%, top-1 86%"), "-" when none."""
    if not measured:
        return "-"
    return (f"KL {measured['kl']:.3g}, perplexity {measured['delta_ppl_pct']:+.1f}%, "
            f"top-1 {100 * measured['top1']:.0f}% ({measured['model']}, {measured['text']})")

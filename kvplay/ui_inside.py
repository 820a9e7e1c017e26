"""The "Inside" tab: outlier channels, per-head error, attention shift and the find-the-number grid.

    with gr.Blocks() as app:
        inside_tab(settings, model)      # lays the tab out inside the caller's Blocks

Layout and wiring only; the work is in kvplay/inside.py, the figures are the plain functions below.
"""
from __future__ import annotations

import json

import gradio as gr
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import inside
from .errors import KvplayError
from .plots import LAYOUT, colour_for
from .ui_common import MODEL_JOB, download_folder, gpu, is_chat, model_box, preset_choices, progress_cb, user_errors

INSIDE_SPECS = ("quanto-int4", "kvplay-int4", "kvplay-int2")
NEEDLE_COLOURS = [[0.0, "#d62728"], [0.33, "#d62728"], [0.34, "#c7c7c7"], [0.66, "#c7c7c7"], [0.67, "#2ca02c"],
                  [1.0, "#2ca02c"]]     # missed, baseline failed (not counted), found


def _layout(fig: go.Figure, title: str, height: int = 460) -> go.Figure:
    fig.update_layout(**{**LAYOUT, "height": height, "title": {**LAYOUT["title"], "text": title}})
    return fig


# ---------------------------------------------------------------------------- figures (results in, plotly out)

def scan_figure(result: inside.OutliersResult) -> go.Figure:
    """Four layer x head heatmaps: key max ratio as stored and after rotation, key kurtosis, value max ratio."""
    panels = [("key_max_ratio", "Keys: max / median channel (x)"),
              ("key_max_ratio_rotated", "Keys after Hadamard: max / median (x)"),
              ("key_kurtosis", "Keys: kurtosis (normal = 3)"),
              ("value_max_ratio", "Values: max / median channel (x)")]
    fig = make_subplots(rows=1, cols=4, subplot_titles=[t for _, t in panels], horizontal_spacing=0.06)
    ratio_max = max(max(max(r) for r in result.matrix(k)) for k in ("key_max_ratio", "key_max_ratio_rotated",
                                                                      "value_max_ratio"))
    heads = [f"h{h.head}" for h in result.layers[0].heads]
    for i, (key, title) in enumerate(panels, start=1):
        z = result.matrix(key)
        ratio = "ratio" in key
        fig.add_trace(go.Heatmap(z=z, x=heads, y=[lay.layer for lay in result.layers], colorscale="Reds",
                                 zmin=1.0 if ratio else None, zmax=ratio_max if ratio else None,
                                 showscale=i in (1, 3), colorbar=dict(x=0.47 if i == 1 else 1.0, len=0.8,
                                                                      title="x" if i == 1 else "kurt."),
                                 hovertemplate=f"layer %{{y}}, %{{x}}<br>{title}: %{{z:.1f}}<extra></extra>"),
                      row=1, col=i)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    for i in range(2, 5):
        fig.update_yaxes(autorange="reversed", row=1, col=i)
    fig.update_xaxes(title_text="KV head")
    return _layout(fig, f"Outlier channels per layer and KV head ({result.tokens} tokens of the held-out play; "
                        f"outlier: > {result.outlier_factor:g}x the median channel)", height=520)


def error_figure(maps: inside.ErrorMaps) -> go.Figure:
    """Relative key and value reconstruction error per layer x KV head, one row of two heatmaps per cache."""
    n = len(maps.caches)
    fig = make_subplots(rows=n, cols=2, vertical_spacing=0.08 if n > 1 else 0.0,
                        subplot_titles=[f"{c.spec}: {part} error" for c in maps.caches for part in ("key", "value")])
    top = max(max(max(r) for r in m) for c in maps.caches for m in (c.key_error, c.value_error)) or 1.0
    for i, c in enumerate(maps.caches, start=1):
        for j, z in enumerate((c.key_error, c.value_error), start=1):
            fig.add_trace(go.Heatmap(z=[[100 * v for v in row] for row in z], x=[f"h{h}" for h in range(len(z[0]))],
                                     y=list(range(len(z))), zmin=0, zmax=100 * top, colorscale="Viridis",
                                     showscale=i == 1 and j == 2, colorbar=dict(title="%"),
                                     hovertemplate="layer %{y}, %{x}: %{z:.1f}%<extra></extra>"), row=i, col=j)
            fig.update_yaxes(title_text="layer" if j == 1 else None, autorange="reversed", row=i, col=j)
    return _layout(fig, f"Relative reconstruction error ||K̂ - K|| / ||K|| per layer and KV head, % "
                        f"({maps.tokens} tokens)", height=max(420, 340 * n))


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
    if s.sink:
        fig.add_vrect(x0=-0.5, x1=s.sink - 0.5, fillcolor="#9467bd", opacity=0.12, line_width=0,
                      annotation_text="sink (16-bit)", annotation_position="top left")
    start = max(s.context_tokens - s.window, 0)
    if s.window:
        fig.add_vrect(x0=start - 0.5, x1=s.context_tokens - 0.5, fillcolor="#2ca02c", opacity=0.10, line_width=0,
                      annotation_text=f"16-bit window (up to {s.window} tokens)", annotation_position="top right")
    fig.update_xaxes(title_text="context position (token)", row=2, col=1)
    return _layout(fig, f"Attention of layer {s.layer}, query head {s.head}, when generating token {s.step} "
                        f"({s.token!r}): 16-bit cache against {s.spec}", height=520)


def needle_figure(result: inside.NeedleResult) -> go.Figure:
    """One heatmap per cache (baseline first): found / missed / baseline failed, per length x depth."""
    n = len(result.caches)
    fig = make_subplots(rows=1, cols=n, shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[f"{c.spec}: {c.found}/{c.counted}" for c in result.caches])
    for i, c in enumerate(result.caches, start=1):
        cell = {(g[0], g[1]): g[2] for g in c.grid}
        z = [[{True: 2, None: 1, False: 0}[cell[(length, d)]] for length in result.lengths] for d in result.depths]
        text = [["found" if v == 2 else ("16-bit failed" if v == 1 else "missed") for v in row] for row in z]
        fig.add_trace(go.Heatmap(z=z, x=[str(length) for length in result.lengths],
                                 y=[f"{d:g}" for d in result.depths], zmin=0, zmax=2, colorscale=NEEDLE_COLOURS,
                                 showscale=False, text=text, texttemplate="%{text}", xgap=2, ygap=2,
                                 hovertemplate="%{x} tokens, depth %{y}: %{text}<extra></extra>"), row=1, col=i)
        fig.update_xaxes(title_text="context (tokens)", type="category", row=1, col=i)
    fig.update_yaxes(title_text="needle depth (0 = start)", type="category", row=1, col=1)
    return _layout(fig, f"Find the number: a seeded 5-digit pass code in filler, asked back greedily (seed "
                        f"{result.seed}); grey cells: the 16-bit cache already fails, not counted", height=380)


# ---------------------------------------------------------------------------- handlers

def _save(result, name: str) -> str:
    path = download_folder() / f"{name}.json"
    path.write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    return str(path)


def _numbers(text: str, kind, what: str) -> list | None:
    if not (text or "").strip():
        return None
    try:
        return [kind(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise KvplayError(f"{what} must be numbers separated by spaces, got {text[:40]!r}.") from None


def make_inside_handlers(settings):
    def scan(model=None, progress=gr.Progress()):
        result = inside.outliers(model, settings=settings, progress=progress_cb(progress))
        return scan_figure(result), result.verdict.replace("\n", "\n\n"), _save(result, "outliers")

    def errors(model=None, caches=INSIDE_SPECS, tokens=512, progress=gr.Progress()):
        maps = inside.error_maps(model, list(caches or []), tokens=tokens, settings=settings,
                                 progress=progress_cb(progress))
        return error_figure(maps), _save(maps, "head-errors")

    def attention(model=None, prompt="", cache="kvplay-int2", step=8, layer=0, head=0):
        s = inside.shift(model, prompt, cache, step=step, layer=layer, head=head, settings=settings)
        return shift_figure(s)

    def needle(model=None, caches=INSIDE_SPECS, lengths="", depths="", seed=0, progress=gr.Progress()):
        result = inside.needle(model, list(caches or []), quick=True, lengths=_numbers(lengths, int, "Lengths"),
                               depths=_numbers(depths, float, "Depths"), seed=int(seed or 0), settings=settings,
                               progress=progress_cb(progress))
        rows = result.summary_rows()
        table = [[r.get(k, "") for k in rows[0]] for r in rows]
        return needle_figure(result), gr.update(value=table, headers=list(rows[0])), _save(result, "needle")

    return dict(scan=scan, errors=errors, attention=attention, needle=needle)


def _default_attention_prompt(model) -> str:
    from .prompts import find_the_number, raw_default_prompt

    return find_the_number(sentences=40) if is_chat(model) else raw_default_prompt(1200)


# ---------------------------------------------------------------------------- layout

def inside_tab(settings, model: str | None = None) -> None:
    """The Inside tab, laid out inside the caller's gr.Blocks."""
    h = {name: gpu(user_errors(fn)) for name, fn in make_inside_handlers(settings).items()}
    quantized = preset_choices()
    with gr.Tab("Inside"):
        gr.Markdown("Why a cache breaks, and whether it still finds a fact. **Outlier channels** are key "
                    "dimensions far larger than the rest: a group that spans the head's channels (per-token "
                    "grouping) sets its step from them and rounds the ordinary channels away. Per-channel "
                    "grouping and Hadamard rotation are the known fixes.")
        with gr.Row():
            i_model = model_box(settings, model)
            i_presets = gr.CheckboxGroup(quantized, value=[s for s in INSIDE_SPECS if s in quantized],
                                         label="Caches (16-bit baseline always runs)")

        gr.Markdown("### 1. Fragility scan\n" + inside.OUTLIER_DEFINITION)
        s_run = gr.Button("Scan the keys and values", variant="primary")
        s_verdict = gr.Markdown()
        s_plot = gr.Plot(show_label=False, elem_classes="kv-hide-empty")
        s_file = gr.File(label="Download (JSON)")
        s_run.click(h["scan"], [i_model], [s_plot, s_verdict, s_file], api_name="inside_scan", **MODEL_JOB)

        gr.Markdown("### 2. Error where it happens\nEach cache stores the same keys and values (one prefill of "
                    "the held-out play); the map shows how far what it hands attention is from the exact "
                    "tensors, per layer and KV head. The 16-bit window holds no error: use more tokens than "
                    "the window to see the quantized part.")
        with gr.Row():
            e_tokens = gr.Slider(128, 2048, value=512, step=64, label="Tokens of the held-out play")
            e_run = gr.Button("Map the error", variant="primary")
        e_plot = gr.Plot(show_label=False, elem_classes="kv-hide-empty")
        e_file = gr.File(label="Download (JSON)")
        e_run.click(h["errors"], [i_model, i_presets, e_tokens], [e_plot, e_file], api_name="inside_errors",
                    show_progress_on=[e_run], **MODEL_JOB)

        gr.Markdown("### 3. Attention shift\nThe 16-bit cache generates greedily; then the query that produces "
                    "the chosen generated token attends once over the 16-bit history and once over the same "
                    "history stored by the chosen cache (eager attention, transformers' output_attentions). "
                    "Shaded: the sink tokens and the 16-bit window, which hold exact values.")
        with gr.Row():
            with gr.Column(scale=2):
                a_prompt = gr.Textbox(value=_default_attention_prompt(model or settings.default_model), lines=4,
                                      label="Prompt")
            with gr.Column():
                a_cache = gr.Dropdown(quantized, value="kvplay-int2" if "kvplay-int2" in quantized else None,
                                      allow_custom_value=True, label="Cache")
                a_step = gr.Number(value=8, precision=0, label="Generated token (1 = the second one)")
                with gr.Row():
                    a_layer = gr.Number(value=0, precision=0, label="Layer")
                    a_head = gr.Number(value=0, precision=0, label="Query head")
                a_run = gr.Button("Show the attention shift", variant="primary")
        a_plot = gr.Plot(show_label=False, elem_classes="kv-hide-empty")
        a_run.click(h["attention"], [i_model, a_prompt, a_cache, a_step, a_layer, a_head], [a_plot],
                    api_name="inside_attention", **MODEL_JOB)

        gr.Markdown("### 4. Find the number\nA 5-digit pass code hidden in varied filler at each context length and "
                    "depth, asked back through the chat template (plain continuation for models without one). "
                    "The 16-bit cache runs first; cells it fails are grey and not counted against a cache. "
                    f"Default grid: {list(inside.QUICK_LENGTHS)} tokens x depths {list(inside.QUICK_DEPTHS)}.")
        with gr.Row():
            n_lengths = gr.Textbox(value="", label="Context lengths (tokens; empty = default grid)")
            n_depths = gr.Textbox(value="", label="Depths (0 = start, 1 = end; empty = default)")
            n_seed = gr.Number(value=0, precision=0, label="Seed")
            n_run = gr.Button("Find the number", variant="primary")
        n_plot = gr.Plot(show_label=False, elem_classes="kv-hide-empty")
        n_table = gr.Dataframe(interactive=False, label="Found per cache (Y found, n missed, - 16-bit failed)")
        n_file = gr.File(label="Download (JSON)")
        n_run.click(h["needle"], [i_model, i_presets, n_lengths, n_depths, n_seed], [n_plot, n_table, n_file],
                    api_name="inside_needle", show_progress_on=[n_run], **MODEL_JOB)

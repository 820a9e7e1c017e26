"""The "Inside" tab: outlier channels, per-head error, attention shift, the find-the-number grid and what eviction
kept.

    with gr.Blocks() as app:
        inside_tab(settings, model)      # lays the tab out inside the caller's Blocks

Layout and wiring only; the commands are in kvplay/app/inside.py, the figures in kvplay/show/inside.py.
"""
from __future__ import annotations

import gradio as gr

from kvplay.app import inside
from kvplay.errors import KvplayError
from kvplay.lab.inside import OUTLIER_DEFINITION, QUICK_DEPTHS, QUICK_LENGTHS
from kvplay.results import to_json
from kvplay.show.inside import error_figure, kept_figure, needle_figure, scan_figure, shift_figure
from kvplay.ui.common import (
    MODEL_JOB,
    SHOW,
    cancel_token,
    download_folder,
    gpu,
    is_chat,
    model_box,
    not_run_status,
    preset_choices,
    progress_cb,
    spec_list,
    status_line,
    user_errors,
)

KEPT_DEFAULT = " ".join(inside.KEPT_SPECS)
# Each view's results sit in a Column that starts hidden and that its handler shows (its first output, which the
# API leaves out), as in the other tabs: no empty plot frames or download boxes before a run.


# ---------------------------------------------------------------------------- handlers

def _save(result, name: str) -> str:
    path = download_folder() / f"{name}.json"
    path.write_text(to_json(result), encoding="utf-8")
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
        result = inside.outliers(model, settings=settings, progress=progress_cb(progress),
                                 cancel=cancel_token(settings))
        return SHOW, scan_figure(result), result.verdict.replace("\n", "\n\n"), _save(result, "outliers")

    def errors(model=None, caches=inside.INSIDE_SPECS, tokens=512, progress=gr.Progress()):
        maps = inside.error_maps(model, list(caches or []), tokens=tokens, settings=settings,
                                 progress=progress_cb(progress), cancel=cancel_token(settings))
        return SHOW, not_run_status(maps), error_figure(maps), _save(maps, "head-errors")

    def attention(model=None, prompt="", cache="kvplay-int2", step=8, layer=0, head=0):
        s = inside.shift(model, prompt, cache, step=step, layer=layer, head=head, settings=settings,
                         cancel=cancel_token(settings))
        return SHOW, shift_figure(s)

    def needle(model=None, caches=inside.INSIDE_SPECS, lengths="", depths="", seed=0, progress=gr.Progress()):
        result = inside.needle(model, list(caches or []), quick=True, lengths=_numbers(lengths, int, "Lengths"),
                               depths=_numbers(depths, float, "Depths"), seed=int(seed or 0), settings=settings,
                               progress=progress_cb(progress), cancel=cancel_token(settings))
        rows = result.summary_rows()
        table = [[r.get(k, "") for k in rows[0]] for r in rows]
        return (SHOW, not_run_status(result), needle_figure(result), gr.update(value=table, headers=list(rows[0])),
                _save(result, "needle"))

    def kept(model=None, caches=KEPT_DEFAULT, tokens=1024, depth=0.5, progress=gr.Progress()):
        specs = spec_list(caches)
        if not specs:
            raise KvplayError("Type at least one evicting cache, such as baseline:evict=snapkv,keep=0.25.")
        result = inside.kept(model, specs, tokens=int(tokens or 1024), depth=float(depth), settings=settings,
                             progress=progress_cb(progress), cancel=cancel_token(settings))
        return SHOW, kept_figure(result), _save(result, "kept")

    return dict(scan=scan, errors=errors, attention=attention, needle=needle, kept=kept)


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
            with gr.Column(min_width=300):     # the box and its card stacked, not three squeezed columns on a phone
                i_model = model_box(settings, model)
            i_presets = gr.CheckboxGroup(quantized, value=[s for s in inside.INSIDE_SPECS if s in quantized],
                                         label="Caches (16-bit baseline always runs)")
        i_status = status_line()          # the caches this model refused in the last map or grid, and why

        gr.Markdown("### 1. Fragility scan\n" + OUTLIER_DEFINITION)
        s_run = gr.Button("Scan the keys and values", variant="primary")
        with gr.Column(visible=False, elem_id="kv-inside-scan") as s_results:
            s_verdict = gr.Markdown()
            s_plot = gr.Plot(show_label=False)
            s_file = gr.File(label="Download (JSON)")
        s_run.click(h["scan"], [i_model], [s_results, s_plot, s_verdict, s_file], api_name="inside_scan",
                    show_progress_on=[s_run], **MODEL_JOB)

        gr.Markdown("### 2. Error where it happens\nEach cache stores the same keys and values (one prefill of "
                    "the held-out play); the map shows how far what it hands attention is from the exact "
                    "tensors, per layer and KV head. The 16-bit window holds no error: use more tokens than "
                    "the window to see the quantized part.")
        with gr.Row():
            e_tokens = gr.Slider(128, 2048, value=512, step=64, label="Tokens of the held-out play")
            e_run = gr.Button("Map the error", variant="primary")
        with gr.Column(visible=False, elem_id="kv-inside-errors") as e_results:
            e_plot = gr.Plot(show_label=False)
            e_file = gr.File(label="Download (JSON)")
        e_run.click(h["errors"], [i_model, i_presets, e_tokens], [e_results, i_status, e_plot, e_file],
                    api_name="inside_errors",
                    show_progress_on=[e_run], **MODEL_JOB)

        gr.Markdown("### 3. Attention shift\nThe 16-bit cache generates greedily; then the query that produces "
                    "the chosen generated token attends once over the 16-bit history and once over the same "
                    "history stored by the chosen cache (eager attention, transformers' output_attentions). "
                    "Shaded: the sink tokens and the 16-bit window, which hold exact values.")
        with gr.Row():
            with gr.Column(scale=2):
                a_prompt = gr.Textbox(value=inside.attention_prompt(is_chat(model or settings.default_model)), lines=4,
                                      label="Prompt")
            with gr.Column():
                a_cache = gr.Dropdown(quantized, value="kvplay-int2" if "kvplay-int2" in quantized else None,
                                      allow_custom_value=True, label="Cache")
                a_step = gr.Number(value=8, precision=0, label="Generated token (1 = the second one)")
                with gr.Row():
                    a_layer = gr.Number(value=0, precision=0, label="Layer")
                    a_head = gr.Number(value=0, precision=0, label="Query head")
                a_run = gr.Button("Show the attention shift", variant="primary")
        with gr.Column(visible=False, elem_id="kv-inside-attention") as a_results:
            a_plot = gr.Plot(show_label=False)
        a_run.click(h["attention"], [i_model, a_prompt, a_cache, a_step, a_layer, a_head], [a_results, a_plot],
                    api_name="inside_attention", show_progress_on=[a_run], **MODEL_JOB)

        gr.Markdown("### 4. Find the number\nA 5-digit pass code hidden in varied filler at each context length and "
                    "depth, asked back through the chat template (plain continuation for models without one). "
                    "The 16-bit cache runs first; cells it fails are grey and not counted against a cache. "
                    f"Default grid: {list(QUICK_LENGTHS)} tokens x depths {list(QUICK_DEPTHS)}.")
        with gr.Row():
            n_lengths = gr.Textbox(value="", label="Context lengths (tokens; empty = default grid)")
            n_depths = gr.Textbox(value="", label="Depths (0 = start, 1 = end; empty = default)")
            n_seed = gr.Number(value=0, precision=0, label="Seed")
            n_run = gr.Button("Find the number", variant="primary")
        with gr.Column(visible=False, elem_id="kv-inside-needle") as n_results:
            n_plot = gr.Plot(show_label=False)
            n_table = gr.Dataframe(interactive=False, label="Found per cache (Y found, n missed, - 16-bit failed)")
            n_file = gr.File(label="Download (JSON)")
        n_run.click(h["needle"], [i_model, i_presets, n_lengths, n_depths, n_seed],
                    [n_results, i_status, n_plot, n_table, n_file],
                    api_name="inside_needle", show_progress_on=[n_run], **MODEL_JOB)

        gr.Markdown("### 5. What eviction kept\nA cache that evicts (`evict=snapkv|streamingllm|tova,keep=...`) keeps "
                    "only a share of the prompt's tokens. One prompt with a pass code hidden in filler: for each "
                    "layer, the share of its KV heads that kept each position, the pass code outlined, and whether "
                    "the cache's answer still names it. SnapKV scores by what the question at the end attends to; "
                    "StreamingLLM keeps the first and newest tokens whatever they say.")
        with gr.Row():
            k_caches = gr.Textbox(value=KEPT_DEFAULT, label="Evicting caches (specs)", scale=2)
            k_tokens = gr.Slider(256, 4096, value=1024, step=256, label="Prompt (tokens)")
            k_depth = gr.Slider(0, 1, value=0.5, step=0.05, label="Pass code depth (0 = start)")
            k_run = gr.Button("Show what was kept", variant="primary")
        with gr.Column(visible=False, elem_id="kv-inside-kept") as k_results:
            k_plot = gr.Plot(show_label=False)
            k_file = gr.File(label="Download (JSON)")
        k_run.click(h["kept"], [i_model, k_caches, k_tokens, k_depth], [k_results, k_plot, k_file],
                    api_name="inside_kept", show_progress_on=[k_run], **MODEL_JOB)

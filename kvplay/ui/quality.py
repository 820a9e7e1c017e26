"""The Quality tab: perplexity, KL and per-layer error on a held-out or pasted text, and the same caches across
models (does a verdict carry over?), which opens on the recorded run in docs/results. Layout and wiring only;
kvplay.app.quality measures, kvplay.show.plots and tables draw."""
from __future__ import annotations

import html
import json

import gradio as gr

from kvplay.app import catalogue
from kvplay.app.quality import beside_recorded, ppl, ppl_models
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError
from kvplay.paths import assets
from kvplay.results import ModelsResult, from_dict
from kvplay.show import plots, tables
from kvplay.ui.common import (
    DEFAULTS,
    MODEL_JOB,
    SHOW,
    cancel_token,
    downloads,
    model_box,
    not_run_status,
    presets_box,
    progress_cb,
    status_line,
)

HELD_OUT = "held-out play (The Tempest)"
# The across-models view opens on this run (`python -m kvplay ppl --models ...`, docs/results/README.md says how);
# it ships with the package, as the recorded Compare runs do.
ACROSS_RECORDED = assets("recorded", "ppl-three-models.json")
ACROSS_MODELS = [name for name, e in catalogue.MODELS.items() if e.wheel is not None]    # the real models


def recorded_across() -> ModelsResult | None:
    """The shipped across-models run, or None when the file is missing or no longer reads as a result."""
    try:
        result = from_dict(json.loads(ACROSS_RECORDED.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if isinstance(result, ModelsResult) else None


def across_recorded() -> tuple[str, object, object]:
    """The across-models view's opening: a status line saying it is recorded, its figure and table; empty ones
    when there is no recording."""
    result = recorded_across()
    if result is None:
        return "", None, None
    run = result.runs[0]
    line = (f"Recorded: {run.tokens:,} tokens of {run.text_name} on {run.env.device} "
            f"({ACROSS_RECORDED.name}, shipped with kvplay); press Run on each model to measure live, or measure "
            "your own model beside them.")
    return (f"<p class='kv-status-line kv-recorded'>{html.escape(line)}</p>", plots.models_figure(result),
            tables.frame(result))


def make_quality(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def quality(model: str | None = None, caches=DEFAULTS, text_source: str = HELD_OUT, pasted_text: str = "",
                max_tokens: int = 1024, chunk: int = 16, progress=gr.Progress()):
        text = pasted_text if text_source == "pasted text" else None    # pasted text, never a path on the server
        result = ppl(model, caches, text=text, text_name="pasted text" if text else "",
                             max_tokens=max_tokens, chunk=chunk, settings=settings, progress=progress_cb(progress),
                             cancel=cancel_token(settings))
        return (SHOW, not_run_status(result), tables.frame(result), plots.ppl_kl_figure(result),
                plots.layer_error_figure(result), downloads(result, "quality"))

    def across(models=None, caches=DEFAULTS, text_source: str = HELD_OUT, pasted_text: str = "",
               max_tokens: int = 512, chunk: int = 16, needle: bool = False, progress=gr.Progress()):
        text = pasted_text if text_source == "pasted text" else None
        result = ppl_models(models if models is not None else ACROSS_MODELS, caches, needle=bool(needle),
                                     text=text, text_name="pasted text" if text else "", max_tokens=max_tokens,
                                     chunk=chunk, settings=settings, progress=progress_cb(progress),
                                     cancel=cancel_token(settings))
        return "", plots.models_figure(result), tables.frame(result), downloads(result, "across-models")

    def beside(model: str = "", progress=gr.Progress()):
        recorded = recorded_across()
        if recorded is None:
            raise KvplayError("No recorded run ships with this copy of kvplay: run on each model instead.")
        result = beside_recorded(model, recorded, settings=settings, progress=progress_cb(progress),
                                 cancel=cancel_token(settings))
        run = recorded.runs[0]
        line = (f"{len(recorded.runs)} columns recorded ({ACROSS_RECORDED.name}, {run.env.device}); "
                f"{result.runs[-1].env.model} measured now, on this machine, on the same {run.tokens:,} tokens of "
                f"{run.text_name}.")
        return (f"<p class='kv-status-line'>{html.escape(line)}</p>", plots.models_figure(result),
                tables.frame(result), downloads(result, "across-models"))

    return dict(quality=quality, across=across, beside=beside)


def quality_tab(h: dict, heavy: dict, settings: Settings, start: str) -> None:
    """Lay out the tab and wire it to its handlers (h: error-wrapped; heavy: also holding the device)."""
    with gr.Tab("Quality"):
        with gr.Row():
            with gr.Column():
                q_model = model_box(settings, start)
                q_presets = presets_box()
            with gr.Column():
                source = gr.Radio([HELD_OUT, "pasted text"], value=HELD_OUT, label="Text")
                pasted = gr.Textbox(value="", lines=4, label="Pasted text")
                max_tokens = gr.Slider(128, 2048, value=1024, step=64, label="Tokens to evaluate")
                q_chunk = gr.Slider(1, 128, value=16, step=1, label="Tokens per forward",
                                    info="1 = exact decode semantics; larger chunks see each other in 16-bit")
                q_run = gr.Button("Evaluate", variant="primary")
                q_status = status_line()
        gr.Markdown("Perplexity, KL and top-1 here are measured on the raw text (teacher-forced, no chat "
                    "template), for chat models too.")
        with gr.Column(visible=False) as q_results:
            q_table = gr.Dataframe(interactive=False, label="Quality against 16-bit")
            with gr.Row():
                q_kl = gr.Plot(show_label=False)
                q_heat = gr.Plot(show_label=False)
            q_files = gr.File(label="Downloads", file_count="multiple")
        q_run.click(heavy["quality"], [q_model, q_presets, source, pasted, max_tokens, q_chunk],
                    [q_results, q_status, q_table, q_kl, q_heat, q_files], api_name="quality",
                    show_progress_on=[q_status], **MODEL_JOB)

        opening = across_recorded()
        gr.Markdown("### Across models: does a verdict carry over?\nThe caches ticked above, on the same text, "
                    "on each model: a cell per cache and model, coloured by the verdict's rule on KL and top-1, "
                    "with the change in perplexity and the bits per element at 8k tokens on that model's shape. A "
                    "cache a model's architecture refuses says so. A text is a harder test than Compare's one "
                    "answer: here every one of thousands of tokens counts, teacher-forced, so a cache can keep "
                    "Compare's short answer and still turn red here (quanto-int4 on Qwen2.5: answer kept, "
                    "perplexity +69% over the play).")
        with gr.Row():
            a_models = gr.CheckboxGroup(ACROSS_MODELS, value=ACROSS_MODELS, label="Models (2 to 4)", scale=2)
            with gr.Column(scale=1):
                a_needle = gr.Checkbox(False, label="Also find the number",
                                       info="the quick 3 x 3 grid through each cache, on each model")
                a_run = gr.Button("Run on each model", variant="primary")
        with gr.Row():
            b_model = gr.Textbox(label="Your model beside the recorded ones", scale=2,
                                 placeholder="a catalogue name, a GGUF file, a folder or a Hub id",
                                 info="measured now with the recording's caches, text and tokens (minutes on a CPU)")
            b_run = gr.Button("Measure it beside them", scale=1)
        a_status = gr.HTML(opening[0], min_height=30, padding=False)
        a_plot = gr.Plot(opening[1], show_label=False, elem_id="kv-across")
        a_table = gr.Dataframe(opening[2], interactive=False, label="Per cache and model", wrap=True)
        a_files = gr.File(label="Downloads", file_count="multiple")
        a_run.click(heavy["across"], [a_models, q_presets, source, pasted, max_tokens, q_chunk, a_needle],
                    [a_status, a_plot, a_table, a_files], api_name="quality_across_models",
                    show_progress_on=[a_status], **MODEL_JOB)
        b_run.click(heavy["beside"], [b_model], [a_status, a_plot, a_table, a_files],
                    api_name="quality_beside_recorded", show_progress_on=[a_status], **MODEL_JOB)

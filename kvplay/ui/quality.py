"""The Quality tab: perplexity, KL and per-layer error on a held-out or pasted text. Layout and wiring only;
kvplay.app.commands measures, kvplay.show.plots and tables draw."""
from __future__ import annotations

import gradio as gr

from kvplay.app import commands
from kvplay.app.settings import Settings
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


def make_quality(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def quality(model: str | None = None, caches=DEFAULTS, text_source: str = HELD_OUT, pasted_text: str = "",
                max_tokens: int = 1024, chunk: int = 16, progress=gr.Progress()):
        text = pasted_text if text_source == "pasted text" else None    # pasted text, never a path on the server
        result = commands.ppl(model, caches, text=text, text_name="pasted text" if text else "",
                             max_tokens=max_tokens, chunk=chunk, settings=settings, progress=progress_cb(progress),
                             cancel=cancel_token(settings))
        return (SHOW, not_run_status(result), tables.frame(result), plots.ppl_kl_figure(result),
                plots.layer_error_figure(result), downloads(result, "quality"))

    return dict(quality=quality)


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

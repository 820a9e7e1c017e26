"""The Throughput tab: decode tokens/s against batch size and context length, measured on this machine.
Layout and wiring only; kvplay.app.throughput measures, kvplay.show.plots and tables draw."""
from __future__ import annotations

import gradio as gr

from kvplay.app.settings import Settings
from kvplay.app.throughput import throughput as measure_throughput
from kvplay.errors import KvplayError
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
    weights_arg,
)


def default_batches(settings: Settings) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16) if b <= settings.max_batch][:4]


def make_throughput(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def throughput(model: str | None = None, caches=DEFAULTS, batch_sizes=None, context: int = 512,
                   new_tokens: int = 32, contexts: str = "256 1024 2048", weights: str = "none",
                   progress=gr.Progress()):
        if contexts is not None and not isinstance(contexts, str):
            raise KvplayError("Contexts must be text such as '256 1024'.")
        ctxs = [c for c in (contexts or "").replace(",", " ").split() if c]
        sizes = batch_sizes if batch_sizes is not None else default_batches(settings)
        result = measure_throughput(model, caches, sizes or [], context, new_tokens, contexts=ctxs,
                                    weights=weights_arg(weights), settings=settings,
                                    progress=progress_cb(progress), cancel=cancel_token(settings))
        return (SHOW, not_run_status(result), plots.throughput_figure(result, "batch"),
                plots.throughput_figure(result, "context"), tables.frame(result), downloads(result, "throughput"))

    return dict(throughput=throughput)


def throughput_tab(h: dict, heavy: dict, settings: Settings, start: str) -> None:
    """Lay out the tab and wire it to its handlers (h: error-wrapped; heavy: also holding the device)."""
    with gr.Tab("Throughput"):
        with gr.Row():
            with gr.Column():
                t_model = model_box(settings, start)
                t_presets = presets_box()
            with gr.Column():
                batches = [b for b in (1, 2, 4, 8, 16) if b <= settings.max_batch]
                batch_sizes = gr.CheckboxGroup(batches, value=default_batches(settings), label="Batch sizes")
                t_context = gr.Slider(16, 4096, value=512, step=16, label="Context (tokens)")
                new_tokens = gr.Slider(4, max(4, min(128, settings.max_new_tokens)), value=32, step=4,
                                       label="New tokens per run")
                contexts = gr.Textbox(value="256 1024 2048", label="Also sweep contexts at batch 1")
                t_weights = gr.Radio(["none", "int8", "int4"], value="none", label="Weight quantization")
                t_run = gr.Button("Measure throughput", variant="primary")
                t_status = status_line()
        gr.Markdown("Measured on this machine, on the model chosen above, one timed run per point (its first decode "
                    "step discarded). A shared machine is noisy: read differences under about 20% as noise and "
                    "compare caches within one run, not across runs. The chart's title names the model it ran on.")
        with gr.Column(visible=False) as t_results:
            with gr.Row():
                tb_plot = gr.Plot(show_label=False)
                tc_plot = gr.Plot(show_label=False)
            t_table = gr.Dataframe(interactive=False, label="Decode tokens / s")
            t_files = gr.File(label="Downloads", file_count="multiple")
        t_run.click(heavy["throughput"], [t_model, t_presets, batch_sizes, t_context, new_tokens, contexts,
                                          t_weights], [t_results, t_status, tb_plot, tc_plot, t_table, t_files],
                    api_name="throughput", show_progress_on=[t_status], **MODEL_JOB)

"""The Memory tab: measured cache bytes as the context grows, projected to a real architecture, and what fits
on a GPU. Layout and wiring only; kvplay.app.memory and kvplay.app.capacity measure, kvplay.show.plots and tables
draw."""
from __future__ import annotations

import gradio as gr

from kvplay.app.capacity import capacity as fit_capacity
from kvplay.app.memory import memory as measure_memory
from kvplay.app.settings import Settings
from kvplay.cache.arch import published_archs
from kvplay.results import from_dict, to_dict
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
    spec_list,
    status_line,
)

TYPED_HINT = "baseline:evict=snapkv,keep=0.25 kvplay-int4:evict=snapkv,keep=0.5"


def make_memory(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def memory(model: str | None = None, caches=DEFAULTS, max_context: int = 2048, chunk: int = 32,
               project_to: str = "Llama-2-7B", axes: str = "linear", typed: str = "", progress=gr.Progress()):
        """The ticked caches, then any typed ones (options and eviction: `baseline:evict=snapkv,keep=0.25`)."""
        caches = [*spec_list(caches), *spec_list(typed)]
        result = measure_memory(model, caches, max_context, chunk=chunk, settings=settings,
                                progress=progress_cb(progress), cancel=cancel_token(settings))
        return (SHOW, not_run_status(result), plots.memory_figure(result),
                plots.projection_figure(result, project_to, axes == "log"), tables.frame(result), to_dict(result),
                downloads(result, "memory"))

    def projection(state, arch, log):
        """Redraw the projection for new axes; before any sweep, a figure that says to run one (no error)."""
        return plots.projection_figure(from_dict(state) if state else None, arch, log == "log")

    def capacity(caches=DEFAULTS, arch: str = "Llama-2-7B", gpu_gib: float = 24, weight_dtype: str = "float16",
                 context: int = 4096):
        result = fit_capacity(caches, arch, gpu_gib, weight_dtype, context, settings=settings)
        return SHOW, tables.frame(result), plots.capacity_figure(result)

    return dict(memory=memory, projection=projection, capacity=capacity)


def memory_tab(h: dict, heavy: dict, settings: Settings, start: str) -> None:
    """Lay out the tab and wire it to its handlers (h: error-wrapped; heavy: also holding the device)."""
    archs = list(published_archs())
    with gr.Tab("Memory"):
        with gr.Row():
            with gr.Column():
                m_model = model_box(settings, start)
                m_presets = presets_box()
                m_typed = gr.Textbox("", label="More caches, typed (options and eviction too)", placeholder=TYPED_HINT,
                                     info="Separated by spaces; a comma belongs to a cache's options.")
                with gr.Row():
                    max_context = gr.Slider(256, min(16384, settings.max_context), value=2048, step=256,
                                            label="Grow the cache to (tokens)")
                    chunk = gr.Slider(1, 256, value=32, step=1, label="Tokens per step")
                m_run = gr.Button("Measure growth", variant="primary")
                m_status = status_line()
            with gr.Column():
                arch = gr.Dropdown(archs, value="Llama-2-7B", label="Project to")
                scale = gr.Radio(["linear", "log"], value="linear", label="Axes")
                gr.Markdown("The projection appears here once you press **Measure growth**: it uses the "
                            "bits per element that run measures.", elem_id="kv-proj-hint")
                proj_plot = gr.Plot(show_label=False, elem_id="kv-proj")     # hidden while empty (PAGE_CSS)
        with gr.Column(visible=False) as m_results:
            growth_plot = gr.Plot(show_label=False)
            m_table = gr.Dataframe(label="At the longest context", interactive=False)
            m_files = gr.File(label="Downloads", file_count="multiple")
        m_state = gr.State(None)
        m_run.click(heavy["memory"], [m_model, m_presets, max_context, chunk, arch, scale, m_typed],
                    [m_results, m_status, growth_plot, proj_plot, m_table, m_state, m_files], api_name="memory",
                    show_progress_on=[m_status], **MODEL_JOB)
        for trigger in (arch.input, scale.input):
            trigger(h["projection"], [m_state, arch, scale], proj_plot, api_name=False)
        gr.Markdown("### What fits on a GPU\nCache-only bound: the weights are subtracted, activations and "
                    "framework overhead are not. Llama-2-7B in 16-bit needs 0.5 MiB per token: about 5 GB at "
                    "10k tokens.")
        with gr.Row():
            c_presets = presets_box()
            with gr.Column():
                c_arch = gr.Dropdown(archs, value="Llama-2-7B", label="Architecture")
                gpu_gib = gr.Number(value=24, label="GPU memory (GiB)")
                wdtype = gr.Dropdown(["float16", "bfloat16", "float32", "int8", "int4"], value="float16",
                                     label="Weights")
                c_context = gr.Number(value=4096, precision=0, label="Context for the batch column (tokens)")
                c_run = gr.Button("Compute")
        with gr.Column(visible=False) as c_results:
            c_table = gr.Dataframe(interactive=False, label="Capacity")
            c_plot = gr.Plot(show_label=False)
        c_run.click(h["capacity"], [c_presets, c_arch, gpu_gib, wdtype, c_context], [c_results, c_table, c_plot],
                    api_name="capacity")

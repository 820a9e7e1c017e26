"""The Gradio layout and its wiring. Compute lives in kvplay.app.commands, pictures in kvplay.show.plots,
kvplay.show.cards and kvplay.show.tables; this module and kvplay.ui.compare only lay out components and
connect events (no torch here). Shared pieces are in kvplay.ui.common.
"""
from __future__ import annotations

import os
from pathlib import Path

import gradio as gr

from kvplay.app import commands, guard
from kvplay.app.prompts import generate_prompt
from kvplay.app.settings import Settings
from kvplay.cache.arch import published_archs
from kvplay.errors import KvplayError
from kvplay.results import from_dict, to_dict
from kvplay.show import cards as render
from kvplay.show import plots, tables
from kvplay.ui.common import (
    MODEL_JOB,
    downloads,
    gpu,
    model_box,
    presets_box,
    progress_cb,
    startup_model,
    user_errors,
    warm_start,
    weights_arg,
)
from kvplay.ui.compare import compare_tab, make_compare
from kvplay.ui.inside import inside_tab
from kvplay.ui.tradeoffs import tradeoffs_tab

ABOUT = (Path(__file__).parent / "about.md").read_text(encoding="utf-8")
# Results areas stay hidden until they hold a result: no placeholder tables or empty plot frames (Compare's by
# this CSS; the other tabs' by a Column each handler makes visible, which the API leaves out of its outputs).
# Every tab bar wraps (build_app sets overflow_behavior="wrap"): at phone width all labels stay whole and
# readable, on two lines, none behind a "more" menu.
PAGE_CSS = """
#kv-results:not(:has(.kv-card)) { display: none; }
/* Nothing drawn before it has data: a plot, file box or table with no value yet takes no room (Gradio draws
   an empty frame with an icon, or a table of headers "1 2 3"). */
.block:has(> .empty[aria-label="Empty value"]) { display: none !important; }
.block:has(> .table-container.no-rows) { display: none !important; }
.column:has(#kv-proj .js-plotly-plot) #kv-proj-hint { display: none; }
.kv-status-line { margin: 4px 0; color: #444; }
#kv-model-note { border-left: 4px solid #888; padding-left: 8px; }
.table-wrap th .header, .table-wrap th span { word-break: keep-all !important; overflow-wrap: normal !important; }
/* Markdown tables (About): words never split inside a cell; a table wider than its box scrolls inside it. */
.prose table { display: block; overflow-x: auto; max-width: 100%; }
.prose td, .prose th { word-break: normal !important; overflow-wrap: normal !important; hyphens: none !important; }
.prose td:first-child code { white-space: nowrap; }
@media (max-width: 640px) {
  .tab-container button { padding: 4px 8px !important; }
  /* error toasts at the foot of the screen, narrow, clear of the fields being edited */
  .toast-wrap { top: auto !important; bottom: 8px !important; right: 8px !important; left: 8px !important;
                width: auto !important; max-width: none !important; }
}
"""


SHOW = gr.Column(visible=True)   # a handler's first output: its tab's results appear
DEFAULTS = None          # a handler given no caches runs the default presets (the UI starts with them ticked)
HELD_OUT = "held-out play (The Tempest)"


def default_batches(settings: Settings) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16) if b <= settings.max_batch][:4]


def make_handlers(settings: Settings):
    # Every model handler gets a cancel token for its Gradio job: cancelling the job or closing the
    # page stops the run at its next step (Gradio itself cannot stop a running worker thread), and so
    # does passing settings.max_seconds.
    def job_token():
        return guard.gradio_cancel_token(settings.max_seconds)

    def generate(model: str | None = None, prompt: str = "", max_new_tokens: int = 48):
        return commands.generate_text(model, prompt, max_new_tokens, settings=settings, cancel=job_token())

    compare = make_compare(settings)

    def memory(model: str | None = None, caches=DEFAULTS, max_context: int = 2048, chunk: int = 32,
               project_to: str = "Llama-2-7B", axes: str = "linear", progress=gr.Progress()):
        result = commands.memory(model, caches, max_context, chunk=chunk, settings=settings,
                                progress=progress_cb(progress), cancel=job_token())
        return (SHOW, plots.memory_figure(result), plots.projection_figure(result, project_to, axes == "log"),
                tables.frame(result), to_dict(result), downloads(result, "memory"))

    def projection(state, arch, log):
        """Redraw the projection for new axes; before any sweep, a figure that says to run one (no error)."""
        return plots.projection_figure(from_dict(state) if state else None, arch, log == "log")

    def capacity(caches=DEFAULTS, arch: str = "Llama-2-7B", gpu_gib: float = 24, weight_dtype: str = "float16",
                 context: int = 4096):
        result = commands.capacity(caches, arch, gpu_gib, weight_dtype, context, settings=settings)
        return SHOW, tables.frame(result), plots.capacity_figure(result)

    def throughput(model: str | None = None, caches=DEFAULTS, batch_sizes=None, context: int = 512,
                   new_tokens: int = 32, contexts: str = "256 1024 2048", weights: str = "none",
                   progress=gr.Progress()):
        if contexts is not None and not isinstance(contexts, str):
            raise KvplayError("Contexts must be text such as '256 1024'.")
        ctxs = [c for c in (contexts or "").replace(",", " ").split() if c]
        sizes = batch_sizes if batch_sizes is not None else default_batches(settings)
        result = commands.throughput(model, caches, sizes or [], context, new_tokens, contexts=ctxs,
                                    weights=weights_arg(weights), settings=settings,
                                    progress=progress_cb(progress), cancel=job_token())
        return (SHOW, plots.throughput_figure(result, "batch"), plots.throughput_figure(result, "context"),
                tables.frame(result), downloads(result, "throughput"))

    def quality(model: str | None = None, caches=DEFAULTS, text_source: str = HELD_OUT, pasted_text: str = "",
                max_tokens: int = 1024, chunk: int = 16, progress=gr.Progress()):
        text = pasted_text if text_source == "pasted text" else None    # pasted text, never a path on the server
        result = commands.ppl(model, caches, text=text, text_name="pasted text" if text else "",
                             max_tokens=max_tokens, chunk=chunk, settings=settings, progress=progress_cb(progress),
                             cancel=job_token())
        return (SHOW, tables.frame(result), plots.ppl_kl_figure(result), plots.layer_error_figure(result),
                downloads(result, "quality"))

    return dict(generate=generate, compare=compare, memory=memory, projection=projection, capacity=capacity,
                throughput=throughput, quality=quality)


# ---------------------------------------------------------------------------- layout

def _status() -> gr.HTML:
    """Where a tab's one progress bar (and any error) shows, so results already on screen stay untouched."""
    return gr.HTML("", min_height=30, padding=False)


def build_app(settings: Settings | None = None) -> gr.Blocks:
    settings = settings or Settings.from_env()
    h = {name: user_errors(fn) for name, fn in make_handlers(settings).items()}
    heavy = {name: gpu(h[name]) for name in ("generate", "compare", "memory", "throughput", "quality")}
    archs = list(published_archs())
    start, note = startup_model(settings)
    with gr.Blocks(title="kvplay: KV-cache quantization playground") as app:
        gr.HTML(f"<style>{render.CARD_CSS}{PAGE_CSS}</style>", padding=False)
        gr.Markdown("# kvplay · what does KV-cache quantization really do?\n"
                    "One prompt through a 16-bit KV cache and through quantized caches, side by side: "
                    "a verdict per cache, where the text departs, how far the next-token distribution drifts, how "
                    "many bytes are saved and what it costs in speed. New here? Press **Compare** and read the "
                    "**About** tab.")
        compare_tab(app, settings, heavy["compare"], start, note)

        with gr.Tab("Memory"):
            with gr.Row():
                with gr.Column():
                    m_model = model_box(settings, start)
                    m_presets = presets_box()
                    with gr.Row():
                        max_context = gr.Slider(256, min(16384, settings.max_context), value=2048, step=256,
                                                label="Grow the cache to (tokens)")
                        chunk = gr.Slider(1, 256, value=32, step=1, label="Tokens per step")
                    m_run = gr.Button("Measure growth", variant="primary")
                    m_status = _status()
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
            m_run.click(heavy["memory"], [m_model, m_presets, max_context, chunk, arch, scale],
                        [m_results, growth_plot, proj_plot, m_table, m_state, m_files], api_name="memory",
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
                    t_status = _status()
            gr.Markdown("Measured on this machine, one timed run per point (its first decode step discarded). "
                        "Read differences under about 20% as noise: on the bundled 4-layer model a decode step "
                        "costs about the same at 256 and 512 tokens of context (fixed per-step work dominates), "
                        "so single runs can come out in either order. Five interleaved runs of the 16-bit cache on "
                        "a busy 2-core machine gave 44-73 tok/s at 256 tokens, 44-67 at 512 and 30-38 at 2,048.")
            with gr.Column(visible=False) as t_results:
                with gr.Row():
                    tb_plot = gr.Plot(show_label=False)
                    tc_plot = gr.Plot(show_label=False)
                t_table = gr.Dataframe(interactive=False, label="Decode tokens / s")
                t_files = gr.File(label="Downloads", file_count="multiple")
            t_run.click(heavy["throughput"], [t_model, t_presets, batch_sizes, t_context, new_tokens, contexts,
                                              t_weights], [t_results, tb_plot, tc_plot, t_table, t_files],
                        api_name="throughput", show_progress_on=[t_status], **MODEL_JOB)

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
                    q_status = _status()
            gr.Markdown("Perplexity, KL and top-1 here are measured on the raw text (teacher-forced, no chat "
                        "template), for chat models too.")
            with gr.Column(visible=False) as q_results:
                q_table = gr.Dataframe(interactive=False, label="Quality against 16-bit")
                with gr.Row():
                    q_kl = gr.Plot(show_label=False)
                    q_heat = gr.Plot(show_label=False)
                q_files = gr.File(label="Downloads", file_count="multiple")
            q_run.click(heavy["quality"], [q_model, q_presets, source, pasted, max_tokens, q_chunk],
                        [q_results, q_table, q_kl, q_heat, q_files], api_name="quality", show_progress_on=[q_status],
                        **MODEL_JOB)

        with gr.Tab("Generate"):
            g_model = model_box(settings, start)
            g_prompt = gr.Textbox(value=generate_prompt(start), lines=3, label="Prompt",
                                  info="Continued as raw text; for a chat model, a user turn in its chat template.")
            g_max = gr.Slider(1, settings.max_new_tokens, value=min(48, settings.max_new_tokens), step=1,
                              label="Max new tokens")
            g_run = gr.Button("Generate (16-bit cache)")
            g_out = gr.Textbox(label="Output", lines=8)
            g_run.click(heavy["generate"], [g_model, g_prompt, g_max], g_out, api_name="generate", **MODEL_JOB)

        # Further tabs plug in here, one line each (kvplay/ui/tradeoffs.py, kvplay/ui/inside.py).
        tradeoffs_tab(app, settings)
        inside_tab(settings, start)

        with gr.Tab("About"):
            gr.Markdown(ABOUT)
    # Every tab bar wraps, none hides tabs behind a menu at phone width. The page's own tab bar is an implicit
    # gr.Tabs that exists only once the Blocks has closed, so the config is written again after setting it.
    for block in app.blocks.values():
        if isinstance(block, gr.Tabs):
            block.overflow_behavior = "wrap"
    app.config = app.get_config_file()
    app.queue(max_size=settings.queue_size)
    warm_start(settings, start)
    return app


def launch_kwargs() -> dict:
    # System fonts: a hosted or offline page must not wait on a font CDN.
    theme = gr.themes.Soft(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return dict(theme=theme, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))


def launch() -> None:
    try:
        commands.apply_settings(Settings.from_env())
    except KvplayError as exc:
        raise SystemExit(str(exc)) from None
    build_app().launch(**launch_kwargs())

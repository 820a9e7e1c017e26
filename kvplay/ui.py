"""The Gradio layout and its wiring. Compute lives in kvplay.service, pictures in kvplay.plots
and kvplay.render; this module only lays out components and connects events (no torch here)."""
from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from . import guard, plots, render, service
from .arch import published_archs
from .cache.spec import DEFAULT_SPECS, SCHEMES, parse_spec
from .errors import KvplayError
from .models import BUNDLED_NAME
from .results import from_dict, to_csv, to_dict, to_json
from .settings import Settings

try:  # ZeroGPU Spaces: borrow a GPU for the heavy calls; a no-op anywhere else
    import spaces

    gpu = spaces.GPU
except ImportError:
    def gpu(fn):
        return fn

ABOUT = (Path(__file__).parent / "about.md").read_text(encoding="utf-8")
HUB_MODELS = ["HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
              "meta-llama/Llama-3.2-1B"]
PRESETS = [name for name in SCHEMES if name != "baseline"]
MODEL_JOB = dict(concurrency_limit=1, concurrency_id="model")   # one model run at a time per device
DOWNLOAD_TTL_S = 3600            # download folders older than this are deleted when a new one is made
_OPTION_VALUE = re.compile(r"^[\w.\-]{1,16}$")


def user_errors(fn):
    """Show KvplayError as one sentence in the browser (gr.Error), never a traceback."""
    def reraise(exc):
        raise gr.Error(str(exc), print_exception=False) from None

    if _is_generator(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except KvplayError as exc:
                reraise(exc)
        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvplayError as exc:
            reraise(exc)
    return wrapper


def _is_generator(fn) -> bool:
    import inspect

    return inspect.isgeneratorfunction(fn)


PROGRESS_INTERVAL_S = 0.25   # runners report every decode step; the browser redraws on every update it gets


def _progress_cb(progress: gr.Progress):
    last = [0.0]

    def update(fraction: float, desc: str) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_INTERVAL_S or fraction >= 1:
            last[0] = now
            progress(fraction, desc=desc)
    return update


_download_root: list[Path] = []   # the one folder this process writes downloads under (created on first use)


def _download_folder() -> Path:
    """A new folder for one run's downloads, inside a temporary folder the app created; stale ones are removed.

    No path ever comes from the user: every file offered for download is written here.
    """
    if not _download_root or not _download_root[0].is_dir():
        _download_root[:] = [Path(tempfile.mkdtemp(prefix="kvplay-downloads-"))]
    root = _download_root[0]
    now = time.time()
    for old in root.iterdir():
        try:
            if now - old.stat().st_mtime > DOWNLOAD_TTL_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def _downloads(result, name: str) -> list[str]:
    """JSON, CSV and the HTML report, written to a folder the app created."""
    from .report import write_report

    folder = _download_folder()
    to_json(result, folder / f"{name}.json")
    to_csv(result, folder / f"{name}.csv")
    write_report([result], folder / f"{name}-report.html")
    return [str(folder / f"{name}.json"), str(folder / f"{name}.csv"), str(folder / f"{name}-report.html")]


def _table(result) -> pd.DataFrame:
    return pd.DataFrame(result.summary_rows())


# ---------------------------------------------------------------------------- handlers

def _overrides(**values) -> dict:
    """The Advanced options as spec option values: whole numbers as ints, anything else one short word."""
    out = {}
    for key, v in values.items():
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if v not in (None, "", "default") and not _OPTION_VALUE.match(str(v)):
            raise KvplayError(f"Option {key}={str(v)[:20]!r} is invalid; give a number or a single word.")
        out[key] = v
    return out


def _preset_names(presets) -> list[str]:
    if presets is None:
        return []
    if not isinstance(presets, (list, tuple)):
        raise KvplayError("Caches to compare must be a list of cache names.")
    for p in presets:
        if not (isinstance(p, str) and p in SCHEMES):
            parse_spec(p)  # the registry's own sentence for an unknown name
            raise KvplayError(f"{p!r} is not a preset name; put specs with options under Extra specs.")
    return list(presets)


def make_handlers(settings: Settings):
    # Every model handler gets a cancel token for its Gradio job: cancelling the job or closing the
    # page stops the run at its next step (Gradio itself cannot stop a running worker thread), and so
    # does passing settings.max_seconds.
    def job_token():
        return guard.gradio_cancel_token(settings.max_seconds)

    def generate(model, prompt, max_new):
        return service.generate_text(model, prompt, max_new, settings=settings, cancel=job_token())

    def compare(model, prompt, max_new, presets, custom, group, residual, keys, values, rotation, sink, kbits,
                vbits, weights, batch, progress=gr.Progress()):
        overrides = _overrides(group=group, residual=residual, keys=keys, values=values, rotation=rotation,
                               sink=sink if sink else None, kbits=kbits, vbits=vbits)
        if custom is not None and not isinstance(custom, str):
            raise KvplayError("Extra specs must be text.")
        specs = [render.spec_with_overrides(p, overrides) for p in _preset_names(presets)] + (custom or "").split()
        result = outputs = None
        for result in service.compare_stream(model, specs, prompt, max_new, batch_size=batch,
                                             weights=None if weights in (None, "none") else weights,
                                             settings=settings, progress=_progress_cb(progress),
                                             cancel=job_token()):
            figs = plots.compare_figures(result)
            outputs = (render.cards_html(result), render.snippets_markdown(result), _table(result), figs["kl"],
                       figs["agreement"], figs["bytes"], figs["speed"])
            yield (*outputs, None)
        yield (*outputs, _downloads(result, "compare"))     # the last partial result is the whole one

    def memory(model, presets, max_context, chunk, arch, log, progress=gr.Progress()):
        result = service.memory(model, presets, max_context, chunk=chunk, settings=settings,
                                progress=_progress_cb(progress), cancel=job_token())
        return (plots.memory_figure(result), plots.projection_figure(result, arch, log == "log"), _table(result),
                to_dict(result), _downloads(result, "memory"))

    def projection(state, arch, log):
        if not state:
            raise KvplayError("Run the memory sweep first; the projection uses its measured bits per element.")
        return plots.projection_figure(from_dict(state), arch, log == "log")

    def capacity(presets, arch, gpu_gib, weight_dtype, context):
        result = service.capacity(presets, arch, gpu_gib, weight_dtype, context, settings=settings)
        return _table(result), plots.capacity_figure(result)

    def throughput(model, presets, batch_sizes, context, new_tokens, contexts, weights, progress=gr.Progress()):
        if contexts is not None and not isinstance(contexts, str):
            raise KvplayError("Contexts must be text such as '256 1024'.")
        ctxs = [c for c in (contexts or "").replace(",", " ").split() if c]
        result = service.throughput(model, presets, batch_sizes or [], context, new_tokens, contexts=ctxs,
                                    weights=None if weights in (None, "none") else weights, settings=settings,
                                    progress=_progress_cb(progress), cancel=job_token())
        return (plots.throughput_figure(result, "batch"), plots.throughput_figure(result, "context"), _table(result),
                _downloads(result, "throughput"))

    def quality(model, presets, source, pasted, max_tokens, chunk, progress=gr.Progress()):
        text = pasted if source == "pasted text" else None    # pasted text, never a path on the server
        result = service.ppl(model, presets, text=text, text_name="pasted text" if text else "",
                             max_tokens=max_tokens, chunk=chunk, settings=settings, progress=_progress_cb(progress),
                             cancel=job_token())
        return (_table(result), plots.ppl_kl_figure(result), plots.layer_error_figure(result),
                _downloads(result, "quality"))

    return dict(generate=generate, compare=compare, memory=memory, projection=projection, capacity=capacity,
                throughput=throughput, quality=quality)


# ---------------------------------------------------------------------------- layout

def _model_box(settings: Settings):
    choices = [BUNDLED_NAME] + (list(settings.allowed_models) or HUB_MODELS)
    return gr.Dropdown(choices=choices, value=settings.default_model, allow_custom_value=True, label="Model",
                       info="The bundled Shakespeare model works offline; or pick / type a Hub id.")


def _presets(value=DEFAULT_SPECS):
    return gr.CheckboxGroup(PRESETS, value=list(value), label="Caches to compare (16-bit baseline always runs)")


def build_app(settings: Settings | None = None) -> gr.Blocks:
    settings = settings or Settings.from_env()
    h = {name: user_errors(fn) for name, fn in make_handlers(settings).items()}
    heavy = {name: gpu(h[name]) for name in ("generate", "compare", "memory", "throughput", "quality")}
    archs = list(published_archs())
    with gr.Blocks(title="kvplay: KV-cache quantization playground") as app:
        gr.Markdown("# kvplay · what does KV-cache quantization really do?\n"
                    "One prompt through a 16-bit KV cache and through quantized caches, side by side: "
                    "where the text departs, how far the next-token distribution drifts, how many bytes are "
                    "saved and what it costs in speed. New here? Press **Compare** and read the **About** tab.")
        with gr.Tab("Compare"):
            with gr.Row():
                with gr.Column(scale=2):
                    model = _model_box(settings)
                    prompt = gr.Textbox(value=service.default_prompt(), lines=6, max_lines=12, label="Prompt")
                    gr.Examples([[service.default_prompt()], ["ROMEO:\n"], ["Ham.\nTo be, or not to be, that is the question:"]],
                                inputs=prompt, label="Prompts")
                with gr.Column(scale=1):
                    presets = _presets()
                    max_new = gr.Slider(1, settings.max_new_tokens, value=min(64, settings.max_new_tokens), step=1,
                                        label="Max new tokens")
                    with gr.Accordion("Advanced", open=False):
                        custom = gr.Textbox(label="Extra specs", placeholder="kvplay-int2:rotation=hadamard,sink=4",
                                            info="Space-separated spec strings; see About for the syntax.")
                        with gr.Row():
                            group = gr.Dropdown(["default", 16, 32, 64, 128], value="default", label="Group size",
                                                allow_custom_value=True)
                            residual = gr.Number(value=None, label="Residual window (tokens)", precision=0, minimum=0)
                        with gr.Row():
                            keys = gr.Dropdown(["default", "channel", "token"], value="default", label="Keys grouped per")
                            values = gr.Dropdown(["default", "channel", "token"], value="default", label="Values grouped per")
                        with gr.Row():
                            rotation = gr.Dropdown(["default", "none", "hadamard"], value="default", label="Rotation")
                            sink = gr.Number(value=0, label="Sink tokens", precision=0, minimum=0)
                        with gr.Row():
                            kbits = gr.Dropdown(["default", 2, 3, 4, 8], value="default", label="Key bits (kvplay)")
                            vbits = gr.Dropdown(["default", 2, 3, 4, 8], value="default", label="Value bits (kvplay)")
                        with gr.Row():
                            weights = gr.Radio(["none", "int8", "int4"], value="none", label="Weight quantization (quanto)")
                            batch = gr.Slider(1, settings.max_batch, value=1, step=1, label="Batch size")
                    run = gr.Button("Compare", variant="primary", size="lg")
            gr.HTML(f"<style>{render.CARD_CSS}</style>", padding=False)
            cards = gr.HTML(label="Generations", elem_id="kv-cards")
            with gr.Row():
                kl_plot = gr.Plot(label="KL per step", elem_id="kv-kl")
                agree_plot = gr.Plot(label="Top-1 agreement")
            with gr.Row():
                bytes_plot = gr.Plot(label="Cache bytes")
                speed_plot = gr.Plot(label="Speed")
            table = gr.Dataframe(label="Summary", interactive=False, wrap=True)
            with gr.Accordion("Reproduce in your code", open=False):
                snippets = gr.Markdown()
            files = gr.File(label="Download JSON, CSV and the HTML report", file_count="multiple")
            run.click(heavy["compare"], [model, prompt, max_new, presets, custom, group, residual, keys, values,
                                         rotation, sink, kbits, vbits, weights, batch],
                      [cards, snippets, table, kl_plot, agree_plot, bytes_plot, speed_plot, files],
                      api_name="compare", **MODEL_JOB)

        with gr.Tab("Memory"):
            with gr.Row():
                with gr.Column():
                    m_model = _model_box(settings)
                    m_presets = _presets()
                    with gr.Row():
                        max_context = gr.Slider(256, min(16384, settings.max_context), value=2048, step=256,
                                                label="Grow the cache to (tokens)")
                        chunk = gr.Slider(1, 256, value=32, step=1, label="Tokens per step")
                    m_run = gr.Button("Measure growth", variant="primary")
                with gr.Column():
                    arch = gr.Dropdown(archs, value="Llama-2-7B", label="Project to")
                    scale = gr.Radio(["linear", "log"], value="linear", label="Axes")
                    proj_plot = gr.Plot(label="Projection")
            growth_plot = gr.Plot(label="Measured growth")
            m_table = gr.Dataframe(label="At the longest context", interactive=False)
            m_files = gr.File(label="Downloads", file_count="multiple")
            m_state = gr.State(None)
            m_run.click(heavy["memory"], [m_model, m_presets, max_context, chunk, arch, scale],
                        [growth_plot, proj_plot, m_table, m_state, m_files], api_name="memory", **MODEL_JOB)
            for trigger in (arch.change, scale.change):
                trigger(h["projection"], [m_state, arch, scale], proj_plot, api_name=False)
            gr.Markdown("### What fits on a GPU\nCache-only bound: the weights are subtracted, activations and "
                        "framework overhead are not. Llama-2-7B in 16-bit needs 0.5 MiB per token: about 5 GB at 10k tokens.")
            with gr.Row():
                c_presets = _presets()
                with gr.Column():
                    c_arch = gr.Dropdown(archs, value="Llama-2-7B", label="Architecture")
                    gpu_gib = gr.Number(value=24, label="GPU memory (GiB)")
                    wdtype = gr.Dropdown(["float16", "bfloat16", "float32", "int8", "int4"], value="float16",
                                         label="Weights")
                    c_context = gr.Number(value=4096, precision=0, label="Context for the batch column")
                    c_run = gr.Button("Compute")
            c_table = gr.Dataframe(interactive=False)
            c_plot = gr.Plot()
            c_run.click(h["capacity"], [c_presets, c_arch, gpu_gib, wdtype, c_context], [c_table, c_plot],
                        api_name="capacity")

        with gr.Tab("Throughput"):
            with gr.Row():
                with gr.Column():
                    t_model = _model_box(settings)
                    t_presets = _presets()
                with gr.Column():
                    batches = [b for b in (1, 2, 4, 8, 16) if b <= settings.max_batch]
                    batch_sizes = gr.CheckboxGroup(batches, value=batches[:4], label="Batch sizes")
                    t_context = gr.Slider(16, 4096, value=512, step=16, label="Context (tokens)")
                    new_tokens = gr.Slider(4, max(4, min(128, settings.max_new_tokens)), value=32, step=4,
                                           label="New tokens per run")
                    contexts = gr.Textbox(value="256 1024 2048", label="Also sweep contexts at batch 1")
                    t_weights = gr.Radio(["none", "int8", "int4"], value="none", label="Weight quantization")
                    t_run = gr.Button("Measure throughput", variant="primary")
            with gr.Row():
                tb_plot = gr.Plot()
                tc_plot = gr.Plot()
            t_table = gr.Dataframe(interactive=False)
            t_files = gr.File(label="Downloads", file_count="multiple")
            t_run.click(heavy["throughput"], [t_model, t_presets, batch_sizes, t_context, new_tokens, contexts,
                                              t_weights], [tb_plot, tc_plot, t_table, t_files],
                        api_name="throughput", **MODEL_JOB)

        with gr.Tab("Quality"):
            with gr.Row():
                with gr.Column():
                    q_model = _model_box(settings)
                    q_presets = _presets()
                with gr.Column():
                    source = gr.Radio(["held-out play (The Tempest)", "pasted text"],
                                      value="held-out play (The Tempest)", label="Text")
                    pasted = gr.Textbox(lines=4, label="Pasted text")
                    max_tokens = gr.Slider(128, 2048, value=1024, step=64, label="Tokens to evaluate")
                    q_chunk = gr.Slider(1, 128, value=16, step=1, label="Tokens per forward",
                                        info="1 = exact decode semantics; larger chunks see each other in 16-bit")
                    q_run = gr.Button("Evaluate", variant="primary")
            q_table = gr.Dataframe(interactive=False)
            with gr.Row():
                q_kl = gr.Plot()
                q_heat = gr.Plot()
            q_files = gr.File(label="Downloads", file_count="multiple")
            q_run.click(heavy["quality"], [q_model, q_presets, source, pasted, max_tokens, q_chunk],
                        [q_table, q_kl, q_heat, q_files], api_name="quality", **MODEL_JOB)

        with gr.Tab("Generate"):
            g_model = _model_box(settings)
            g_prompt = gr.Textbox(value="ROMEO:\n", lines=3, label="Prompt")
            g_max = gr.Slider(1, settings.max_new_tokens, value=min(48, settings.max_new_tokens), step=1,
                              label="Max new tokens")
            g_run = gr.Button("Generate (16-bit cache)")
            g_out = gr.Textbox(label="Output", lines=8)
            g_run.click(heavy["generate"], [g_model, g_prompt, g_max], g_out, api_name="generate", **MODEL_JOB)

        with gr.Tab("About"):
            gr.Markdown(ABOUT)
    app.queue(max_size=settings.queue_size)
    return app


def launch_kwargs() -> dict:
    # System fonts: a hosted or offline page must not wait on a font CDN.
    theme = gr.themes.Soft(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return dict(theme=theme, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))


def launch() -> None:
    try:
        service.apply_settings(Settings.from_env())
    except KvplayError as exc:
        raise SystemExit(str(exc)) from None
    build_app().launch(**launch_kwargs())

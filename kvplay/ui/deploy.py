"""The Deploy tab: what should I deploy? The answer first (the setting, what it buys, what it risks, the line to
paste), then the inputs, then the evidence (a table of every setting and the equal-bytes chart). It opens on a
recorded answer for the start-up model. Layout and wiring only: kvplay.app.advise measures and decides,
kvplay.show.advise words and draws."""
from __future__ import annotations

import gradio as gr
import pandas as pd

from kvplay.app.advise import advise, recorded
from kvplay.app.settings import Settings
from kvplay.cache.arch import published_archs
from kvplay.lab.advise import BARS, ENGINES
from kvplay.lab.capacity import WEIGHT_BYTES
from kvplay.show import advise as words
from kvplay.ui.common import MODEL_JOB, cancel_token, downloads, gpu, model_box, progress_cb, status_line

DEFAULT_ENGINE = "ollama"
GPU_CHOICES = [("24 GB", "24"), ("48 GB", "48"), ("80 GB", "80"), ("H100 80GB", "h100"), ("H200 141GB", "h200")]
NO_RECORDING = ("<div class='kv-verdict kv-deploy'><p class='kv-overall'>No recorded answer for {model} on "
                "{engine}: press <b>Advise</b>.</p><p class='kv-foot'>The first time measures each setting on the "
                "model (about a minute for the catalogue's models on 2 CPU cores, longer for llama.cpp's K/V pairs "
                "and vLLM's nine settings); later questions on the same model read the measurements back at "
                "once.</p></div>")
CSS = """
.kv-deploy .kv-paste { background: #f4f6f8; border: 1px solid #ddd; border-radius: 6px; padding: 6px 10px;
  white-space: pre-wrap; overflow-wrap: anywhere; margin: 6px 0; font-size: 0.92em; }
.kv-deploy .kv-caveats { list-style: disc !important; padding-left: 1.2em !important; font-size: 0.85em;
  color: #444; }
"""
STYLE = f"<style>{CSS}</style>"          # inside the answer's own box: no block of its own, no gap above it


def shown(result) -> tuple:
    """What the tab shows for an answer: the words, the table, the chart."""
    if result is None:
        return "", None, None
    return STYLE + words.answer_html(result), pd.DataFrame(words.table_rows(result)), words.figure(result)


def make_deploy(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def deploy(model: str | None = None, engine: str = DEFAULT_ENGINE, budget: str = "24", context=None,
               weights: str = "", bar: str = "default", arch: str = "", progress=gr.Progress()):
        """The setting to deploy, measured on the model (what is not measured yet), as words, table and chart."""
        result = advise(model, engine, gpu=budget, context=context or None, weights=weights or None, bar=bar,
                        arch=arch or None, settings=settings, progress=progress_cb(progress),
                        cancel=cancel_token(settings))
        return (*shown(result), "", downloads(result, "deploy"))

    def deploy_recording(model: str | None = None, engine: str = DEFAULT_ENGINE):
        """The recorded answer for this model and engine, or a line saying to press Advise."""
        result = recorded(model, engine)
        if result is None:
            name = ENGINES[engine].name if engine in ENGINES else engine
            return STYLE + NO_RECORDING.format(model=model or "this model", engine=name), None, None
        return shown(result)

    return dict(deploy=deploy, deploy_recording=deploy_recording)


def deploy_tab(h: dict, settings: Settings, start: str) -> None:
    """Lay out the tab and wire it (h: the error-wrapped handlers)."""
    first, table, chart = h["deploy_recording"](start, DEFAULT_ENGINE)
    with gr.Tab("Deploy"):
        answer = gr.HTML(first, elem_id="kv-deploy-answer")
        with gr.Row():
            with gr.Column():
                model = model_box(settings, start)
                engine = gr.Radio([(e.name, e.key) for e in ENGINES.values()], value=DEFAULT_ENGINE, label="Engine",
                                  info="Ollama, llama.cpp and LM Studio share llama.cpp's cache types; Ollama takes "
                                       "one type for K and V, the others a type each.")
                with gr.Row():
                    budget = gr.Dropdown(GPU_CHOICES, value="24", allow_custom_value=True, label="Memory budget",
                                         info="a GPU, or its memory in GiB typed")
                    context = gr.Number(value=None, precision=0, label="Context to serve (tokens)",
                                        info="0: the model's limit, capped at what the budget fits")
            with gr.Column():
                weights = gr.Dropdown([("the engine's usual (int4 for GGUF, else bfloat16)", "")] +
                                      [(w, w) for w in WEIGHT_BYTES], value="", label="Weights as deployed")
                bar = gr.Radio([(f"{b.name}: {b.words}", b.name) for b in BARS.values()], value="default",
                               label="Quality bar")
                arch = gr.Dropdown([("the model itself", "")] + [(a, a) for a in published_archs()], value="",
                                   label="Count the bytes for",
                                   info="a bigger sibling's published architecture; the quality stays this "
                                        "model's (labelled 'measured on the ... sibling')")
                run = gr.Button("Advise", variant="primary")
                status = status_line()
        with gr.Column():
            plot = gr.Plot(chart, show_label=False)
            frame = gr.Dataframe(table, interactive=False, label="Every setting: bytes in the budget, quality, flag",
                                 wrap=True)
            files = gr.File(label="Downloads", file_count="multiple")
        run.click(gpu(h["deploy"]), [model, engine, budget, context, weights, bar, arch],
                  [answer, frame, plot, status, files], api_name="advise", show_progress_on=[status], **MODEL_JOB)
        for trigger in (model.change, engine.change):
            trigger(h["deploy_recording"], [model, engine], [answer, frame, plot], api_name=False, queue=False)


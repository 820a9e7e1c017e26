"""The Deploy tab: what should I deploy? The answer first (the setting, what it buys, what it risks, the line to
paste), then the inputs, then the evidence (a table of every setting and the equal-bytes chart). It opens on a
recorded answer for the start-up model. "Link to these inputs" puts them in the page's address
(#deploy.model=...&deploy.engine=...; Compare's links use bare keys, so neither tab reads the other's); opening
such a link selects this tab and shows the answer to those inputs where it costs no model run (the measurement
store, or a recording made with those inputs), else says to press Advise. Layout and wiring only:
kvplay.app.advise measures and decides, kvplay.show.advise words and draws."""
from __future__ import annotations

import json

import gradio as gr
import pandas as pd
from gradio.context import Context

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
NOT_KEPT = ("<div class='kv-verdict kv-deploy'><p class='kv-overall'>This link asks about {model} on {engine} with "
            "inputs this server has not answered yet: press <b>Advise</b>.</p><p class='kv-foot'>The inputs are "
            "filled in below; measuring them loads the model (about a minute on 2 CPU cores for a catalogue "
            "model).</p></div>")
KEYS = ("model", "engine", "budget", "context", "weights", "bar", "arch", "needle")    # the handler's inputs, in order
PREFIX = "deploy."
RECORDED_INPUTS = ("24", None, "", "default", "", None)   # budget ... needle as scripts/record_deploy.py records them


def _share_js() -> str:
    """The inputs into the page's address (#deploy.model=...), copied to the clipboard, and shown."""
    return f"""(...v) => {{
  const keys = {json.dumps(KEYS)};
  const p = new URLSearchParams();
  keys.forEach((k, i) => p.set('{PREFIX}' + k, v[i] === null || v[i] === undefined ? '' : String(v[i])));
  const url = location.origin + location.pathname + '#' + p.toString();
  history.replaceState(null, '', url);
  try {{ navigator.clipboard?.writeText(url).catch(() => {{}}); }} catch (e) {{}}
  return url;
}}"""


def _read_link_js() -> str:
    """A Deploy link's inputs back into the tab, the tab selected; a page without one keeps its inputs."""
    return f"""(...v) => {{
  const keys = {json.dumps(KEYS)};
  const raw = location.hash.length > 1 ? location.hash.slice(1) : location.search.slice(1);
  const p = new URLSearchParams(raw);
  if (!keys.some(k => p.has('{PREFIX}' + k))) return [...v, false];
  const pick = () => [...document.querySelectorAll('button[role="tab"]')]
    .find(b => b.textContent.trim() === 'Deploy')?.click();
  setTimeout(pick, 0); setTimeout(pick, 500);
  return [...keys.map((k, i) => {{
    if (!p.has('{PREFIX}' + k)) return v[i];
    const s = p.get('{PREFIX}' + k);
    if (k === 'context' || k === 'needle') return s === '' ? null : Number(s);
    return s;
  }}), true];
}}"""

def shown(result) -> tuple:
    """What the tab shows for an answer: the words, the table, the chart."""
    if result is None:
        return "", None, None
    return STYLE + words.answer_html(result), pd.DataFrame(words.table_rows(result)), words.figure(result)


def make_deploy(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def deploy(model: str | None = None, engine: str = DEFAULT_ENGINE, budget: str = "24", context=None,
               weights: str = "", bar: str = "default", arch: str = "", needle=None, progress=gr.Progress()):
        """The setting to deploy, measured on the model (what is not measured yet), as words, table and chart."""
        result = advise(model, engine, gpu=budget, context=context or None, weights=weights or None, bar=bar,
                        arch=arch or None, needle=needle, settings=settings, progress=progress_cb(progress),
                        cancel=cancel_token(settings))
        return (*shown(result), "", downloads(result, "deploy"))

    def deploy_linked(model=None, engine=DEFAULT_ENGINE, budget="24", context=None, weights="", bar="default",
                      arch="", needle=None, linked=True):
        """A share link's answer where it costs no model run: the measurement store's, a recording made with these
        inputs, or a line saying to press Advise."""
        if not linked:
            return gr.skip(), gr.skip(), gr.skip()
        result = advise(model, engine, gpu=budget, context=context or None, weights=weights or None, bar=bar,
                        arch=arch or None, needle=needle, settings=settings, measure=False)
        if result is None and (budget, context or None, weights, bar, arch, needle) == RECORDED_INPUTS:
            return deploy_recording(model, engine)
        if result is None:
            name = ENGINES[engine].name if engine in ENGINES else engine
            return STYLE + NOT_KEPT.format(model=model or "the default model", engine=name), None, None
        return shown(result)

    def deploy_recording(model: str | None = None, engine: str = DEFAULT_ENGINE):
        """The recorded answer for this model and engine, or a line saying to press Advise."""
        result = recorded(model, engine)
        if result is None:
            name = ENGINES[engine].name if engine in ENGINES else engine
            return STYLE + NO_RECORDING.format(model=model or "this model", engine=name), None, None
        return shown(result)

    return dict(deploy=deploy, deploy_recording=deploy_recording, deploy_linked=deploy_linked)


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
                needle = gr.Number(value=None, precision=0, label="Needle at (tokens)",
                                   info="empty: the longest the machine affords (the model's limit on a GPU, none "
                                        "on a CPU); 0: none")
                run = gr.Button("Advise", variant="primary")
                status = status_line()
                with gr.Row(equal_height=True):
                    share = gr.Button("Link to these inputs", size="sm", elem_id="kv-deploy-share", scale=1)
                    link = gr.Textbox(show_label=False, elem_id="kv-deploy-link", buttons=["copy"],
                                      interactive=False, lines=1, max_lines=1, scale=2, container=False,
                                      placeholder="a link that reopens these inputs")
        with gr.Column():
            plot = gr.Plot(chart, show_label=False)
            frame = gr.Dataframe(table, interactive=False, label="Every setting: bytes in the budget, quality, flag",
                                 wrap=True)
            files = gr.File(label="Downloads", file_count="multiple")
        linked = gr.Checkbox(value=False, visible=False)      # set when the page opened from a Deploy link
    inputs = [model, engine, budget, context, weights, bar, arch, needle]          # KEYS' order
    run.click(gpu(h["deploy"]), inputs, [answer, frame, plot, status, files], api_name="advise",
              show_progress_on=[status], **MODEL_JOB)
    for trigger in (model.input, engine.input):              # the user's picks, not a link's filling in
        trigger(h["deploy_recording"], [model, engine], [answer, frame, plot], api_name=False, queue=False)
    share.click(None, inputs, link, js=_share_js(), api_name=False)
    Context.root_block.load(None, inputs, inputs + [linked], js=_read_link_js(), api_name=False)
    linked.change(h["deploy_linked"], inputs + [linked], [answer, frame, plot], api_name=False)


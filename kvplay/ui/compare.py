"""The Compare tab: the verdict first, then cards, plots and tables; a Stop button; a link that reopens the inputs.

The tab opens on the default task's recorded run (kvplay.show.recorded, drawn by the same code as a live run);
picking an example or a model shows that model's recording of it, if any; Compare runs it live. Layout and wiring only:
kvplay.app.inputs declares the inputs (the components, the handler's arguments, the share link's keys and the
/compare API are made from it, an Advanced box per registered cache option), kvplay.app.compare computes,
kvplay.show.cards / plots / tables draw.
"""
from __future__ import annotations

import html
import inspect
import json
import time

import gradio as gr

from kvplay.app import prompts
from kvplay.app.compare import compare_servers as run_servers
from kvplay.app.compare import compare_stream
from kvplay.app.inputs import FIRST_OPTIONS, Input, compare_inputs, compare_specs, option_values
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError
from kvplay.show import cards as render
from kvplay.show import plots, recorded, tables
from kvplay.ui.common import (
    MODEL_JOB,
    cancel_token,
    default_prompt,
    downloads,
    is_chat,
    model_box,
    presets_box,
    progress_cb,
    weights_arg,
)

STOPPED = "<p class='kv-status-line'>Stopped. The caches that finished are shown; press Compare to run again.</p>"


NOT_RECORDED = ("<p class='kv-status-line'>No recorded run of {model} for this prompt; press Compare to run it."
                "</p>")


def recorded_outputs(prompt: str, model_name: str | None, say_missing: bool = False) -> list:
    """The status line and every result output for this prompt's recorded run on this model; empty ones when it
    has none, with a line saying so when `say_missing` (a model just picked: the last one's results must go)."""
    rec = recorded.for_task(prompts.task_for(prompt), model_name)
    if rec is None:
        line = NOT_RECORDED.format(model=html.escape(str(model_name or "this model"))) if say_missing else ""
        return [line, "", "", None, None, None, None, None, "", None]
    result = rec.result
    figs = plots.compare_figures(result)
    return [f"<p class='kv-status-line kv-recorded'>{html.escape(rec.label())}</p>", render.verdict_html(result),
            render.cards_html(result), figs["kl"], figs["agreement"], figs["bytes"], figs["speed"],
            tables.frame(result), render.snippets_markdown(result), None]


LINKED = ("<p class='kv-status-line'>The link's inputs are loaded; press Compare to run them (the recorded run "
          "belongs to other inputs, so it is not shown).</p>")


def linked_outputs(linked: bool) -> list:
    """After a link's inputs are read: cleared results and a line saying to press Compare (a page opened without
    a link never calls this: `linked` stays False)."""
    if not linked:
        return [gr.skip()] * 10
    return [LINKED, "", "", None, None, None, None, None, "", None]


def result_outputs(result) -> list:
    """Compare's outputs after the status line and before the files, for one (partial) result."""
    figs = plots.compare_figures(result)
    return [render.verdict_html(result) if len(result.caches) > 1 else "", render.cards_html(result), figs["kl"],
            figs["agreement"], figs["bytes"], figs["speed"], tables.frame(result), render.snippets_markdown(result)]


def make_servers(settings: Settings):
    """The "Running servers" handler: the same prompt through two or more OpenAI-compatible servers."""
    def compare_servers(servers: str | list = "", prompt: str = "", max_new_tokens: int = 64,
                        progress=gr.Progress()):
        t0 = time.perf_counter()
        result = run_servers(servers, prompt, max_new_tokens, settings=settings,
                                          progress=progress_cb(progress), cancel=cancel_token(settings))
        status = (f"<p class='kv-status-line'>Done: {len(result.caches)} servers in {time.perf_counter() - t0:.1f} s; "
                  "KL from their top-20 log-probabilities is an approximation (docs/servers.md).</p>")
        return (status, *result_outputs(result), downloads(result, "servers"))
    return compare_servers


def compare_signature() -> inspect.Signature:
    """The Compare handler's signature: one argument per declared input (kvplay.app.inputs), in the API's order,
    with the default a caller who leaves it out gets; then Gradio's progress."""
    params = [inspect.Parameter(i.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=i.default)
              for i in compare_inputs()]
    progress = inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress())
    return inspect.Signature([*params, progress])


def make_compare(settings: Settings):
    """The Compare handler. Its arguments are Compare's declared inputs (compare_signature), read from the method
    registry when it is made; every one but `prompt` has the default the UI starts with."""
    signature = compare_signature()

    def compare(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        v = bound.arguments
        specs = compare_specs(v["caches"], v["extra_specs"], option_values(v), settings.max_specs)  # parsed once
        t0 = time.perf_counter()
        result = outputs = None
        stream = compare_stream(v["model"], specs, v["prompt"], v["max_new_tokens"],
                                        batch_size=v["batch_size"], weights=weights_arg(v["weights"]),
                                        settings=settings, progress=progress_cb(v["progress"]),
                                        cancel=cancel_token(settings), chat=v["chat"])
        try:
            for result in stream:                  # the lab grades each answer as soon as decoding ends
                stepping = any(c.partial for c in result.caches)
                doing = ("stepping together" if stepping else "done, timing each alone") if not result.calibrating \
                    else "decoding or done; " + "; ".join(f"{s} {what}" for s, what in result.calibrating.items())
                status = (f"<p class='kv-status-line'>{len(result.caches)} caches {html.escape(doing)} "
                          f"({time.perf_counter() - t0:.1f} s)…</p>")
                outputs = result_outputs(result)
                yield (status, *outputs, None)
        except KvplayError as exc:       # a limit or a cancel mid-run: what was computed stays, with the sentence
            if outputs is None:
                raise
            yield (f"<p class='kv-status-line'>{html.escape(str(exc))} The numbers so far are shown.</p>", *outputs,
                   None)
            return
        if result is None:
            return
        status = (f"<p class='kv-status-line'>Done: {len(result.caches)} caches in {time.perf_counter() - t0:.1f} s "
                  f"on {result.env.model} ({result.env.dtype}, {result.env.device}).</p>")
        yield (status, *outputs, downloads(result, "compare"))
    compare.__signature__ = signature
    return compare


def _share_js(inputs: list[Input]) -> str:
    return f"""(...v) => {{
  const keys = {json.dumps([i.name for i in inputs])};
  const p = new URLSearchParams();
  keys.forEach((k, i) => {{
    let x = v[i];
    if (Array.isArray(x)) x = x.join(',');
    p.set(k, x === null || x === undefined ? '' : String(x));
  }});
  const url = location.origin + location.pathname + '#' + p.toString();
  history.replaceState(null, '', url);
  try {{ navigator.clipboard?.writeText(url).catch(() => {{}}); }} catch (e) {{}}
  return url;
}}"""


def _read_link_js(inputs: list[Input]) -> str:
    """Reads the link's `#key=value&...` (or `?key=value&...`) back into the inputs; a key it lacks keeps its
    input's value. How each value is read comes from its input's kind."""
    kinds = {i.name: "maybe" if i.kind == "option" else i.kind for i in inputs}
    return f"""(...v) => {{
  const keys = {json.dumps([i.name for i in inputs])}, kinds = {json.dumps(kinds)};
  const raw = location.hash.length > 1 ? location.hash.slice(1) : location.search.slice(1);
  const p = new URLSearchParams(raw);
  if (!keys.some(k => p.has(k))) return [...v, false];
  return [...keys.map((k, i) => {{
    if (!p.has(k)) return v[i];
    const s = p.get(k);
    if (kinds[k] === 'specs') return s ? s.split(',') : [];
    if (kinds[k] === 'bool') return s === 'true';
    if (kinds[k] === 'int') return Number(s);
    if (kinds[k] === 'maybe') return /^-?[0-9]+$/.test(s) ? Number(s) : s;
    return s;
  }}), true];
}}"""


_SCROLL_JS = """(...v) => {
  if (window.innerWidth < 800) {   // phone: bring the results into view, again once the first card arrives
    const go = (how) => document.getElementById('kv-status')?.scrollIntoView({behavior: how, block: 'start'});
    go('smooth');
    const box = document.getElementById('kv-results') || document.body;
    const seen = new MutationObserver(() => {
      if (box.querySelector('.kv-card')) { seen.disconnect(); setTimeout(() => go('auto'), 50); }
    });
    seen.observe(box, {childList: true, subtree: true});
    setTimeout(() => seen.disconnect(), 600000);
  }
  return v;
}"""


def option_box(i: Input) -> gr.Dropdown:
    """An Advanced option: "default" keeps each preset's own value; numbers may be typed."""
    return gr.Dropdown(list(i.choices), value=i.default, label=i.label, info=i.info, allow_custom_value=i.numeric)


def advanced_boxes(inputs: list[Input]) -> dict:
    """Every Advanced option's box, two to a row: the API's first options in view, every other one folded under
    "More options" (a method registered with a new option lands there)."""
    shown = [i for i in inputs if i.advanced and i.name in FIRST_OPTIONS]
    more = [i for i in inputs if i.advanced and i.name not in FIRST_OPTIONS]
    boxes = {}
    for k in range(0, len(shown), 2):
        with gr.Row():
            boxes.update({i.name: option_box(i) for i in shown[k:k + 2]})
    with gr.Accordion("More options (each cache method's, from the registry)", open=False,
                      elem_id="kv-more-options"):
        for k in range(0, len(more), 2):
            with gr.Row():
                boxes.update({i.name: option_box(i) for i in more[k:k + 2]})
    return boxes


def _servers_box(settings: Settings):
    """Where the page's user names running servers: the operator's KVPLAY_SERVERS names, or (on one's own
    machine) NAME=URL lines; None when neither is allowed (a Space with no servers listed)."""
    names = [s.split("=", 1)[0].split(":", 1)[0] for s in settings.servers]
    if names:
        return gr.CheckboxGroup(names, value=names[:2], label="Servers (the 16-bit reference first)")
    if settings.allow_server_urls:
        return gr.Textbox(value="", lines=3, label="Servers, one NAME=URL per line (the 16-bit reference first)",
                          placeholder="base=http://127.0.0.1:8000\nq4:q4_0=http://127.0.0.1:8001")
    return None


def compare_tab(app: gr.Blocks, settings: Settings, handler, start_model: str, note: str | None,
                servers_handler=None):
    """Lay out the Compare tab and wire it; `handler` is make_compare's function, wrapped for the UI, and
    `servers_handler` make_servers'."""
    tasks = prompts.tasks(start_model)                      # the default first; each with its recording, if any
    opening = recorded_outputs(tasks[0].prompt, start_model)  # shown the moment the page opens
    declared = compare_inputs()
    d = {i.name: i for i in declared}
    with gr.Tab("Compare"):
        # The verdict first: beside the inputs on a wide screen, above them on a phone (the row stacks in order),
        # so the first screen after the page opens shows the recorded verdict, and a run keeps its verdict in view.
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=360, elem_id="kv-first"):
                with gr.Row():             # beside the verdict they start and stop, at every width
                    run = gr.Button("Compare", variant="primary", size="lg", scale=3)
                    stop = gr.Button("Stop", variant="stop", size="lg", scale=1, elem_id="kv-stop")
                status = gr.HTML(opening[0], elem_id="kv-status", min_height=36)
                verdict = gr.HTML(opening[1], elem_id="kv-verdict", padding=False)
            with gr.Column(scale=2, min_width=340, elem_id="kv-inputs"):
                model = model_box(settings, start_model)
                if note:
                    gr.Markdown(note, elem_id="kv-model-note")
                prompt = gr.Textbox(value=tasks[0].prompt, lines=4, max_lines=10, label=d["prompt"].label)
                max_new = gr.Slider(1, settings.max_new_tokens, value=min(tasks[0].max_new_tokens,
                                                                          settings.max_new_tokens),
                                    step=1, label=d["max_new_tokens"].label, render=False)   # drawn below the picker
                examples = gr.Examples([[t.prompt, min(t.max_new_tokens, settings.max_new_tokens)] for t in tasks],
                                       inputs=[prompt, max_new],
                                       label="Example tasks (each shows its recorded run)",
                                       example_labels=[t.title for t in tasks], cache_examples=False,
                                       api_visibility="private")
                presets = presets_box(max_specs=settings.max_specs)
                with gr.Row():
                    max_new.render()
                    chat = gr.Checkbox(value=is_chat(start_model), label=d["chat"].label, info=d["chat"].info)
                with gr.Accordion("Advanced", open=False, elem_id="kv-advanced"):
                    custom = gr.Textbox(value=d["extra_specs"].default, label=d["extra_specs"].label,
                                        placeholder="kvplay-int2:rotation=hadamard,sink=4", info=d["extra_specs"].info)
                    gr.Markdown("Every box left at *default* keeps each cache's own setting.")
                    boxes = advanced_boxes(declared)
                    with gr.Row():
                        weights = gr.Radio(list(d["weights"].choices), value=d["weights"].default,
                                           label=d["weights"].label)
                        batch = gr.Slider(1, settings.max_batch, value=d["batch_size"].default, step=1,
                                          label=d["batch_size"].label)
                servers_box = servers_run = None
                if servers_handler is not None and (settings.servers or settings.allow_server_urls):
                    with gr.Accordion("Running servers (vLLM, SGLang, llama.cpp)", open=False, elem_id="kv-servers"):
                        gr.Markdown("Measure a deployment: the same prompt through two or more OpenAI-compatible "
                                    "servers of one model, each started with its own cache flags.")
                        servers_box = _servers_box(settings)
                        servers_run = gr.Button("Compare servers")
                with gr.Row(equal_height=True):
                    share = gr.Button("Link to these inputs", size="sm", elem_id="kv-share", scale=1)
                    link = gr.Textbox(show_label=False, elem_id="kv-link", buttons=["copy"], interactive=False,
                                      lines=1, max_lines=1, scale=2, container=False,
                                      placeholder="a link that reopens these inputs")
        with gr.Column(elem_id="kv-results"):
            cards = gr.HTML(opening[2], elem_id="kv-cards", padding=False)
            with gr.Row():
                kl_plot = gr.Plot(opening[3], show_label=False, elem_id="kv-kl")
                agree_plot = gr.Plot(opening[4], show_label=False, elem_id="kv-agree")
            with gr.Row():
                bytes_plot = gr.Plot(opening[5], show_label=False, elem_id="kv-bytes")
                speed_plot = gr.Plot(opening[6], show_label=False, elem_id="kv-speed")
            table = gr.Dataframe(opening[7], label="Summary", interactive=False, wrap=True, elem_id="kv-table",
                                 max_height=420)
            gr.Markdown(tables.GLOSSARY)
            with gr.Accordion("Reproduce in your code", open=False, elem_id="kv-reproduce"):
                snippets = gr.Markdown(opening[8])
            files = gr.File(label="Download JSON, CSV and the HTML report", file_count="multiple")
        # Set when the page was opened from a share link. Inside the tab: a component between two tabs would split
        # the page's tab bar in two, Compare alone above the rest (seen at 1440 and 390 px).
        linked = gr.Checkbox(value=False, visible=False)
    boxes.update(model=model, prompt=prompt, max_new_tokens=max_new, caches=presets, extra_specs=custom,
                 weights=weights, batch_size=batch, chat=chat)
    inputs = [boxes[i.name] for i in declared]          # the handler's arguments, the API's and the link's order
    outputs = [status, verdict, cards, kl_plot, agree_plot, bytes_plot, speed_plot, table, snippets, files]
    event = run.click(handler, inputs, outputs, api_name="compare", show_progress_on=[status], js=_SCROLL_JS,
                      **MODEL_JOB)
    # A picked example shows its recording on the model picked (no model runs); one without a recording clears the
    # last result.
    examples.load_input_event.then(recorded_outputs, [prompt, model], outputs, api_name=False, queue=False)
    cancels = [event]
    if servers_run is not None:
        cancels.append(servers_run.click(servers_handler, [servers_box, prompt, max_new], outputs,
                                         api_name="compare_servers", show_progress_on=[status], js=_SCROLL_JS))
    # Stop cancels at once; the second, queued write of the status comes down the session's event stream after
    # any update the cancelled run had already sent there (one arriving after the first write left the status
    # reading "5 caches stepping together (4.2 s)..." for good, 1 Stop in 7 in tests/test_browser.py)
    stop.click(lambda: STOPPED, None, status, cancels=cancels, api_name=False, queue=False) \
        .then(lambda: STOPPED, None, status, api_name=False, show_progress="hidden")
    share.click(None, inputs, link, js=_share_js(declared), api_name=False)
    # A link reopens its inputs, never the recording of other ones: the results clear and say what to press.
    app.load(None, inputs, inputs + [linked], js=_read_link_js(declared), api_name=False)
    linked.change(linked_outputs, [linked], outputs, api_name=False, queue=False)   # only a link asks the server

    seen = {default_prompt(start_model)}

    def follow_model(name, text):
        """A model picked by the user: its chat default, and its default prompt unless the user typed their own."""
        try:
            new = default_prompt(name)
        except (KvplayError, TypeError, ValueError):
            new = None
        keep = text if new is None or (text and text not in seen) else new
        if new:
            seen.add(new)
        return is_chat(name), keep
    # A picked model shows its own recording of the prompt, or clears the last model's results and says so.
    model.input(follow_model, [model, prompt], [chat, prompt], api_name=False, queue=False) \
        .then(lambda text, name: recorded_outputs(text, name, say_missing=True), [prompt, model], outputs,
              api_name=False, queue=False)
    return model

"""The Trade-offs tab: the equal-bytes chart, fewer tokens or fewer bits (tasks), window and sink sweep, drift over
long context, other engines.

Layout and wiring only: kvplay.lab.tradeoffs validates and computes, and draws the figures.

    with gr.Blocks() as app:
        ...                                   # the Compare tab first
        tradeoffs_tab(app, settings)          # finds Compare's "Extra specs" box itself, or pass it in
"""
from __future__ import annotations

import gradio as gr
import pandas as pd

from kvplay.app import tradeoffs as jobs
from kvplay.app.settings import Settings
from kvplay.cache import DEFAULT_SPECS, parse_spec
from kvplay.errors import KvplayError
from kvplay.lab import tradeoffs
from kvplay.results import METRICS, from_dict, to_dict
from kvplay.show import tables
from kvplay.show import tradeoffs as figures
from kvplay.ui.common import (
    MODEL_JOB,
    cancel_token,
    gpu,
    model_box,
    presets_box,
    progress_cb,
    spec_list,
    user_errors,
)

INTRO = ("**At the bytes you can afford, which cache loses the least?** Every registered cache and a few variants "
         "(group size, 16-bit window, key/value bits, rotation) run one teacher-forced pass over the same text; "
         "each is scored against one 16-bit pass. x: bits per cached element, metadata and 16-bit window "
         "included, at 8,192 tokens (the byte formulas) or at the text's own length (exact bytes). Points "
         "outlined in black are on the Pareto frontier: no other point has fewer bits and less loss.")
UI_TOKENS = 256          # the quick grid on the bundled model fits the app's time limit at this length
# The Window and sinks tab's defaults; scripts/time_tradeoffs.py times them. 768 tokens, not the CLI's 1,024: on
# SmolLM2 and 2 cores the sweep took 122 s at 1,024 tokens (HQQ re-quantizes its whole cache every 32-token pass
# without a residual: 21 s each at residual 0 and 32) and 85 s at 768.
WINDOW_DEFAULTS = dict(scheme="kvplay-int2", residuals=" ".join(map(str, tradeoffs.RESIDUALS)),
                       sinks=" ".join(map(str, tradeoffs.SINKS)), transformers_schemes=("quanto-int2", "hqq-int2"),
                       tokens=768)
# What the two long views took with their defaults, shown before a run (scripts/time_tradeoffs.py wrote the file;
# tests/test_tradeoffs.py keeps these figures equal to its medians, docs/results/tradeoffs-times.json).
TOOK_S = {"equal_bytes_quick": 27, "window_and_sinks": 89}
TOOK_ON = "SmolLM2-135M on an idle 2-core CPU (2026-12-05)"
TASKS_DEFAULT = " ".join(jobs.TASK_SPECS)
TASKS_INTRO = ("**Fewer bits or fewer tokens?** Two ways to shrink a KV cache: store each token in fewer bits "
               "(quantization), or keep fewer tokens (eviction: `evict=snapkv|streamingllm|tova,keep=0.25`), or both. "
               "Each cache answers the same tasks, generated here from a seed: a number hidden in filler (1 or 4 "
               "keys), a chain of variables, the most common or frequent words; the question ends the prompt. A "
               "task the 16-bit cache fails counts for no cache. x: bits per element measured after the prompt, so "
               "keeping a quarter of the tokens at 16 bits reads 4. The defaults (7 caches, 1,024 and 2,048 tokens, "
               "one task of each kind) take a few minutes on 2 CPU cores; `python -m kvplay tasks` runs more.")


def pareto_recorded(recorded) -> tuple[str, object, object]:
    """The equal-bytes view's across-models opening from the recorded runs (jobs.recorded_pareto()): a sentence
    saying it is recorded, a panel per catalogue model and their table; empty ones when none ship."""
    if not recorded:
        return "", None, None
    line = (f"Recorded: {', '.join(r.env.model for r in recorded)} ({jobs.PARETO_RECORDED.name}, shipped with "
            f"kvplay; on {recorded[0].env.device}, docs/engines.md).")
    return line, figures.pareto_models_figure(recorded), tables.pareto_models_frame(recorded)


def tasks_recorded() -> tuple[str, object, object]:
    """The tasks view's opening: a sentence saying it is recorded, the grid of the catalogue models' recorded
    task runs and their table; empty ones when none ship."""
    recorded = jobs.recorded_tasks()
    if not recorded:
        return "", None, None
    names = ", ".join(r.model for r in recorded)
    line = (f"Recorded: the same needle tasks on {names} ({jobs.TASKS_RECORDED.name}, shipped with kvplay; "
            "docs/eviction.md). Run the tasks above on one model, or measure your model beside these.")
    return line, figures.tasks_models_figure(recorded), tables.tasks_models_frame(recorded)


_OPEN_COMPARE_JS = """() => { const tabs = [...document.querySelectorAll('button[role="tab"]')];
  const b = tabs.find(t => t.offsetParent !== null && t.textContent.trim() === 'Compare');
  if (b) { b.click(); window.scrollTo(0, 0); } }"""
# gr.Plot has no select event (Gradio 6.31: only "change"), so a click on a chart point is passed to the server
# by plotly's own plotly_click event: the point's spec (its customdata) and a click count go into a hidden
# textbox, whose change event selects it as a table row click does (the count makes a second click on the same
# point a change too). Published points (not specs; their customdata has " · ") are skipped.
_WATCH_CLICKS_JS = """() => { let tries = 0; const timer = setInterval(() => {
  const plot = document.querySelector('#kv-pareto-plot .js-plotly-plot');
  if (plot && plot.on) {
    clearInterval(timer);
    if (plot.kvWatched) return;
    plot.kvWatched = true;
    plot.on('plotly_click', (e) => {
      const spec = e && e.points && e.points.length ? e.points[0].customdata : null;
      const box = document.querySelector('#kv-pareto-clicked textarea, #kv-pareto-clicked input');
      if (!spec || !box || String(spec).includes(' · ')) return;
      window.kvClicks = (window.kvClicks || 0) + 1;
      box.value = String(spec) + ' #' + window.kvClicks;
      box.dispatchEvent(new Event('input', { bubbles: true }));
    });
  } else if (++tries > 200) { clearInterval(timer); } }, 100); }"""


def took(view: str) -> str:
    """The time estimate shown before a long run: what the defaults took, measured, and where."""
    return (f"With these defaults this took {TOOK_S[view]} s for {TOOK_ON}; a longer text, more configurations or a "
            "larger model take longer.")


def _status() -> gr.HTML:
    """Where a sub-tab's one progress bar shows ("quanto-int4, 3 of 12 configurations"), not one per output."""
    return gr.HTML("", min_height=30, padding=False)


def find_component(app: gr.Blocks, cls, label: str):
    """The first component of `cls` whose label starts with `label`, laid out so far in `app`, or None."""
    return next((b for b in app.blocks.values()
                 if isinstance(b, cls) and str(getattr(b, "label", None) or "").startswith(label)), None)


def _published(show: bool) -> list[dict]:
    """The published reference points the Pareto chart overlays when the box is ticked."""
    return tradeoffs.published_points() if show else []


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def make_handlers(settings: Settings):
    def pareto(model=None, mode="quick", metric="mean_kl", log_y=True, published=False, tokens=UI_TOKENS,
               at="long", progress=gr.Progress()):
        if mode not in ("quick", "full"):
            raise KvplayError("Choose quick or full.")
        result = jobs.pareto(model, quick=mode == "quick", tokens=tokens, settings=settings,
                                  progress=progress_cb(progress), cancel=cancel_token(settings))
        state = to_dict(result)
        specs = [r["spec"] for r in result.summary_rows()]
        best = figures.first_point(result) or specs[0]
        return (figures.pareto_figure(result, metric, log_y, _published(published), at),
                tables.frame(result), state,
                gr.Dropdown(choices=specs, value=best), point_details(state, best))

    def redraw(state, metric="mean_kl", log_y=True, published=False, at="long"):
        if not state:
            return None
        return figures.pareto_figure(from_dict(state), metric, log_y, _published(published), at)

    def point_details(state, spec):
        if not state or not spec:
            return ""
        point = next((p for p in state["points"] if p["spec"] == spec), None)
        if point is None:
            raise KvplayError(f"{spec!r} is not a point of this chart.")
        b = point["cache_bytes"]
        long = (f"; {point['bits_long']:.2f} at {state['long_tokens']:,} tokens"
                if point.get("bits_long") is not None and state.get("long_tokens") else "")
        return (f"**`{point['spec']}`** ({figures.legend_name(point['backend'])}) at {state['context_tokens']} tokens: "
                f"{point['bits_per_element']:.2f} bits per element ({b.get('total', 0):,} bytes: payload "
                f"{b.get('payload', 0):,}, metadata {b.get('metadata', 0):,}, 16-bit {b.get('full_precision', 0):,})"
                f"{long}; "
                f"mean KL {point['mean_kl']:.4g} nats; top-1 agreement {100 * point['top1_agreement']:.1f}%; "
                f"perplexity {point['delta_ppl_pct']:+.2f}% against 16-bit"
                f"{'; on the frontier' if point['on_frontier'] else ''}.")

    def pick_point(state, clicked):
        """A point clicked on the chart ("spec #click-count"), selected as a table row would be."""
        spec = (clicked or "").rsplit(" #", 1)[0]
        if not state or not spec:
            return gr.Dropdown(), ""
        return gr.Dropdown(value=spec), point_details(state, spec)

    def pick_row(state, evt: gr.SelectData):
        rows = from_dict(state).summary_rows() if state else []
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        if not rows or not isinstance(row, int) or not 0 <= row < len(rows):
            return gr.Dropdown(), ""
        return gr.Dropdown(value=rows[row]["spec"]), point_details(state, rows[row]["spec"])

    def open_in_compare(spec):
        if not spec:
            raise KvplayError("Run the chart and pick a point first.")
        spec = str(parse_spec(spec))
        return ("" if spec == "baseline" else spec), []

    def window(model=None, scheme=WINDOW_DEFAULTS["scheme"], residuals=WINDOW_DEFAULTS["residuals"],
               sinks=WINDOW_DEFAULTS["sinks"], include_hf=True, tokens=WINDOW_DEFAULTS["tokens"], metric="mean_kl",
               progress=gr.Progress()):
        hf = WINDOW_DEFAULTS["transformers_schemes"] if include_hf else ()
        result = jobs.window_sweep(model, scheme, residuals=residuals, sinks=sinks, transformers_schemes=hf,
                                        tokens=tokens, settings=settings, progress=progress_cb(progress),
                                        cancel=cancel_token(settings))
        return figures.window_figure(result, metric), tables.frame(result), result.note

    def drift(model=None, caches=None, tokens=2048, window_tokens=64, progress=gr.Progress()):
        result = jobs.drift(model, list(caches) if caches else list(DEFAULT_SPECS), tokens=tokens,
                                 window=window_tokens, settings=settings, progress=progress_cb(progress),
                                 cancel=cancel_token(settings))
        along, by_ctx = figures.drift_figures(result)
        return along, by_ctx, tables.frame(result), result.note

    def tasks(model=None, caches=TASKS_DEFAULT, contexts="1024 2048", samples=1, progress=gr.Progress()):
        specs = spec_list(caches)
        if not specs:
            raise KvplayError("Type at least one cache spec, such as baseline:evict=snapkv,keep=0.25.")
        result = jobs.tasks(model, specs, contexts=contexts, samples=samples, settings=settings,
                            progress=progress_cb(progress), cancel=cancel_token(settings))
        return figures.tasks_figure(result), tables.frame(result), tables.tasks_note(result)

    def tasks_beside(model: str = "", progress=gr.Progress()):
        recorded = jobs.recorded_tasks()
        results = jobs.tasks_beside_recorded(model, recorded, settings=settings, progress=progress_cb(progress),
                                             cancel=cancel_token(settings))
        setup = jobs.shared_setup(recorded)
        line = (f"Recorded ({jobs.TASKS_RECORDED.name}): {', '.join(r.model for r in recorded)}. Measured now, on "
                f"this machine: {str(model).strip()}, with the caches every recording ran, {setup['samples']} task(s) "
                f"of each kind at {' and '.join(f'{n:,}' for n in setup['contexts'])} tokens, seed {setup['seed']}.")
        return line, figures.tasks_models_figure(results), tables.tasks_models_frame(results)

    def pareto_beside(model: str = "", progress=gr.Progress()):
        recorded = jobs.recorded_pareto()
        results = jobs.pareto_beside_recorded(model, recorded, settings=settings, progress=progress_cb(progress),
                                              cancel=cancel_token(settings))
        mine = results[-1]
        line = (f"Recorded ({jobs.PARETO_RECORDED.name}): {', '.join(r.env.model for r in recorded)}. Measured now, "
                f"on this machine: {str(model).strip()}, with the {len(mine.points) - 1} caches every recording "
                f"has, over the same {mine.context_tokens:,} tokens of the {mine.text_name}.")
        return line, figures.pareto_models_figure(results), tables.pareto_models_frame(results)

    def recipe(spec="kvplay-int4"):
        if not isinstance(spec, str):
            raise KvplayError("Type a cache spec such as kvplay-int4.")
        data = tradeoffs.recipe(spec)
        rows = [{"engine": e["engine"], "setting": e["setting"], "exact": "yes" if e["exact"] else "nearest",
                 "cannot express": "; ".join(e["cannot"]) or "-",
                 "measured (the real engine)": figures.measured_cell(e["measured"]), "note": e["note"],
                 "source": figures.source_cell(e["source"])}
                for e in data["engines"]]
        return _frame(rows)

    return dict(pareto=pareto, redraw=redraw, point_details=point_details, pick_point=pick_point, pick_row=pick_row,
                open_in_compare=open_in_compare, window=window, drift=drift, tasks=tasks,
                tasks_beside=tasks_beside, pareto_beside=pareto_beside, recipe=recipe)


def tradeoffs_tab(app: gr.Blocks, settings: Settings, extra_specs=None, presets=None) -> None:
    """Lay out the Trade-offs tab inside `app` and wire it. `extra_specs` / `presets`: the Compare tab's
    "Extra specs" box and cache checkboxes (found by label when not given) that "Open in Compare" fills."""
    h = {name: user_errors(fn) for name, fn in make_handlers(settings).items()}
    extra_specs = extra_specs or find_component(app, gr.Textbox, "Extra specs")
    presets = presets or find_component(app, gr.CheckboxGroup, "Caches to compare")
    metrics = [(label, key) for key, (label, _) in METRICS.items()]
    with gr.Tab("Trade-offs"):
        with gr.Tab("Equal bytes"):
            gr.Markdown(INTRO)
            with gr.Row():
                with gr.Column():
                    p_model = model_box(settings)
                    p_mode = gr.Radio(["quick", "full"], value="quick", label="Grid",
                                      info="quick: presets plus a few variants; full: every registered variant")
                    p_tokens = gr.Slider(128, min(4096, settings.max_context), value=UI_TOKENS, step=64,
                                         label="Context length (tokens)",
                                         info="Longer contexts shrink the 16-bit window's share of the bytes (and "
                                              "take longer; the CLI's pareto has no time limit).")
                    p_run = gr.Button("Measure every cache", variant="primary")
                    gr.Markdown(took("equal_bytes_quick"), elem_classes=["kv-status-line"])
                    p_status = _status()
                with gr.Column():
                    p_metric = gr.Radio(metrics, value="mean_kl", label="y axis")
                    p_log = gr.Checkbox(value=True, label="Log scale (mean KL)")
                    p_pub = gr.Checkbox(value=False, label="Overlay published figures (other model, other text)",
                                        visible=bool(tradeoffs.published_points()))
                    p_at = gr.Radio([("a long context: 8,192 tokens (byte formulas)", "long"),
                                     ("this text's length (measured)", "run")], value="long", label="Count bytes at",
                                    info="At a short text a 16-bit window is much of the cache; at long context each "
                                         "format's own bytes decide. Quality is the text's either way.")
            p_plot = gr.Plot(show_label=False, elem_id="kv-pareto-plot")
            p_clicked = gr.Textbox(visible="hidden", elem_id="kv-pareto-clicked", show_label=False, container=False)
            p_table = gr.Dataframe(label="Points (click a point on the chart or a row here to select it)",
                                   interactive=False, max_height=360, elem_id="kv-pareto-table")
            with gr.Row():
                p_pick = gr.Dropdown([], label="Selected point", allow_custom_value=True, scale=2)
                p_open = gr.Button("Open in Compare", scale=1)
            p_info = gr.Markdown(elem_id="kv-pareto-info")
            p_state = gr.State(None)
            p_run.click(gpu(h["pareto"]), [p_model, p_mode, p_metric, p_log, p_pub, p_tokens, p_at],
                        [p_plot, p_table, p_state, p_pick, p_info], api_name="pareto", show_progress_on=[p_status],
                        **MODEL_JOB
                        ).then(None, None, None, js=_WATCH_CLICKS_JS)
            for control in (p_metric, p_log, p_pub, p_at):
                control.input(h["redraw"], [p_state, p_metric, p_log, p_pub, p_at], p_plot, api_name=False
                              ).then(None, None, None, js=_WATCH_CLICKS_JS)
            p_clicked.change(h["pick_point"], [p_state, p_clicked], [p_pick, p_info], api_name=False)
            p_pick.input(h["point_details"], [p_state, p_pick], p_info, api_name=False)
            p_table.select(h["pick_row"], [p_state], [p_pick, p_info], api_name=False)
            if extra_specs is not None and presets is not None:
                p_open.click(h["open_in_compare"], [p_pick], [extra_specs, presets], api_name="open_in_compare"
                             ).then(None, None, None, js=_OPEN_COMPARE_JS)

            gr.Markdown("### Across models: does the frontier keep its caches?\nThe engines' caches and kvplay's "
                        "presets, measured the same way on each catalogue model (recorded), a panel each.")
            recorded = jobs.recorded_pareto()                 # read once, for the opening and the cap
            needs = len(jobs.shared_caches(recorded))
            fits = needs <= settings.max_specs            # a hosted copy's cap would refuse the run: say so instead
            with gr.Row():
                e_model = gr.Textbox(label="Your model beside the recorded ones", scale=2, interactive=fits,
                                     placeholder="a catalogue name, a GGUF file, a folder or a Hub id",
                                     info="measured now with the caches every recording has, on the same text and "
                                          "tokens (minutes on a CPU)" if fits else
                                          f"it runs {needs} caches, and this copy allows {settings.max_specs} per "
                                          "run (KVPLAY_MAX_SPECS): run kvplay locally to measure a model beside them")
                e_run = gr.Button("Measure it beside them", scale=1, interactive=fits)
            opening = pareto_recorded(recorded)
            e_note = gr.Markdown(opening[0], elem_classes=["kv-status-line"])
            e_plot = gr.Plot(opening[1], show_label=False, elem_id="kv-pareto-models")
            e_table = gr.Dataframe(opening[2], interactive=False, max_height=360)
            e_run.click(gpu(h["pareto_beside"]), [e_model], [e_note, e_plot, e_table],
                        api_name="pareto_beside_recorded", show_progress_on=[e_note], **MODEL_JOB)

        with gr.Tab("Fewer tokens or fewer bits"):
            gr.Markdown(TASKS_INTRO)
            with gr.Row():
                t_model = model_box(settings)
                with gr.Column(scale=2):
                    t_caches = gr.Textbox(TASKS_DEFAULT, label="Caches (specs, space-separated; 16-bit is added)",
                                          lines=2)
                    with gr.Row():
                        t_contexts = gr.Textbox("1024 2048", label="Context lengths (tokens)")
                        t_samples = gr.Slider(1, 5, value=1, step=1, label="Tasks of each kind per length")
                    t_run = gr.Button("Run the tasks", variant="primary")
                    t_status = _status()
            with gr.Row():
                b_model = gr.Textbox(label="Your model beside the recorded ones", scale=2,
                                     placeholder="a catalogue name, a GGUF file, a folder or a Hub id",
                                     info="measured now with the tasks and caches of the recorded runs (minutes on "
                                          "a CPU)")
                b_run = gr.Button("Measure it beside them", scale=1)
            opening = tasks_recorded()
            t_note = gr.Markdown(opening[0])
            t_plot = gr.Plot(opening[1], show_label=False, elem_id="kv-tasks-plot")
            t_table = gr.Dataframe(opening[2], interactive=False, max_height=360)
            t_run.click(gpu(h["tasks"]), [t_model, t_caches, t_contexts, t_samples], [t_plot, t_table, t_note],
                        api_name="tasks", show_progress_on=[t_status], **MODEL_JOB)
            b_run.click(gpu(h["tasks_beside"]), [b_model], [t_note, t_plot, t_table], api_name="tasks_beside_recorded",
                        show_progress_on=[t_status], **MODEL_JOB)

        with gr.Tab("Window and sinks"):
            gr.Markdown(tradeoffs.SEMANTICS)
            with gr.Row():
                w_model = model_box(settings)
                w_scheme = gr.Dropdown([n for n in tradeoffs.SCHEMES if n.startswith("kvplay-")],
                                       value=WINDOW_DEFAULTS["scheme"], allow_custom_value=True, label="Scheme")
                w_res = gr.Textbox(WINDOW_DEFAULTS["residuals"], label="Residual windows (tokens)")
                w_sinks = gr.Textbox(WINDOW_DEFAULTS["sinks"], label="Sink tokens")
            with gr.Row():
                w_hf = gr.Checkbox(value=True, label="Also quanto-int2 and HQQ-int2 along residual_length")
                w_tokens = gr.Slider(256, min(4096, settings.max_context), value=WINDOW_DEFAULTS["tokens"], step=64,
                                     label="Tokens")
                w_metric = gr.Radio(metrics[:2], value="mean_kl", label="y axis")
                w_run = gr.Button("Sweep", variant="primary")
            gr.Markdown(took("window_and_sinks"), elem_classes=["kv-status-line"])
            w_status = _status()
            w_plot = gr.Plot(show_label=False)
            w_note = gr.Markdown()
            w_table = gr.Dataframe(interactive=False, max_height=360)
            w_run.click(gpu(h["window"]), [w_model, w_scheme, w_res, w_sinks, w_hf, w_tokens, w_metric],
                        [w_plot, w_table, w_note], api_name="window_sweep", show_progress_on=[w_status], **MODEL_JOB)

        with gr.Tab("Drift"):
            gr.Markdown("KL against the 16-bit run at every position of a long text, smoothed; and the mean over "
                        "the second half of several context lengths: does it get worse as the cache grows?")
            with gr.Row():
                d_model = model_box(settings)
                d_presets = presets_box()
                with gr.Column():
                    d_tokens = gr.Slider(256, min(16384, settings.max_context), value=2048, step=256, label="Tokens")
                    d_window = gr.Slider(8, 512, value=64, step=8, label="Smoothing window (tokens)")
                    d_run = gr.Button("Measure drift", variant="primary")
                    d_status = _status()
            with gr.Row():
                d_along = gr.Plot(show_label=False)
                d_ctx = gr.Plot(show_label=False)
            d_note = gr.Markdown()
            d_table = gr.Dataframe(interactive=False)
            d_run.click(gpu(h["drift"]), [d_model, d_presets, d_tokens, d_window], [d_along, d_ctx, d_table, d_note],
                        api_name="drift", show_progress_on=[d_status], **MODEL_JOB)

        with gr.Tab("Other engines"):
            gr.Markdown("The nearest settings in other engines, and what each cannot express. Sources: "
                        "`assets/engine_recipes.json`.")
            with gr.Row():
                r_spec = gr.Textbox("kvplay-int4", label="Cache spec")
                r_run = gr.Button("Show settings")
            r_table = gr.Dataframe(interactive=False, wrap=True, datatype=["str"] * 6 + ["markdown"],
                                   column_widths=["9%", "27%", "7%", "20%", "12%", "17%", "8%"])
            r_run.click(h["recipe"], [r_spec], r_table, api_name="recipe")
            p_pick.change(lambda s: s or "kvplay-int4", [p_pick], r_spec, api_name=False)

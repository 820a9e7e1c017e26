"""A model of one's own beside the catalogue's recorded runs in the Trade-offs tab (the tasks view and the
equal-bytes view): the shipped recordings, the run set up to match them, the figures that set them side by side,
and the handlers behind the buttons."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import plotly.graph_objects as go
import pytest

from kvplay.app import tradeoffs as jobs
from kvplay.app.quality import MEASURED_NOW
from kvplay.errors import KvplayError
from kvplay.results import TaskCache, TaskCell, TasksResult, from_dict
from kvplay.show import tables
from kvplay.show import tradeoffs as figures
from kvplay.show.style import HEATMAP

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_recording(bundled):
    """A recorded run made here on the bundled model: 2 caches, 384 and 512 tokens, one task of each kind."""
    return jobs.tasks("shakespeare-llama", ["kvplay-int4", "baseline:evict=snapkv,keep=0.25"], contexts=[384, 512],
                      kinds=["niah_single", "niah_multikey"], samples=1, seed=7)


def test_the_shipped_recording_is_the_three_documented_runs():
    recorded = jobs.recorded_tasks()
    documented = [from_dict(json.loads((ROOT / "docs" / "results" / f"tasks-{name}-needles.json").read_text()))
                  for name in ("smollm2", "qwen2.5", "gemma3")]
    assert recorded == documented and all(isinstance(r, TasksResult) for r in recorded)
    setup = jobs.shared_setup(recorded)
    assert setup["specs"] == ["kvplay-int4", "baseline:evict=snapkv,keep=0.25", "baseline:evict=streamingllm,keep=0.25",
                              "kvplay-int4:evict=snapkv,keep=0.5", "kvplay-int2", "baseline:evict=snapkv,keep=0.125"]
    assert (setup["contexts"], setup["seed"], setup["samples"]) == ([2048, 4096], 100, 3)    # SmolLM2's run had 5


def test_a_model_of_ones_own_joins_the_recorded_runs_under_their_tasks(small_recording):
    """The recording's caches, lengths, kinds and seed on one more model, named as measured now after the recorded
    runs, which keep their scores; the same seed draws the same tasks, so it scores as a run made directly."""
    recorded = [dataclasses.replace(small_recording, model="a recorded model")]
    joined = jobs.tasks_beside_recorded("shakespeare-llama", recorded)
    assert joined[0] is recorded[0] and joined[-1].model == "shakespeare-llama" + MEASURED_NOW
    mine = joined[-1]
    assert (mine.contexts, mine.kinds, mine.seed, mine.samples) == ([384, 512], small_recording.kinds, 7, 1)
    assert [c.spec for c in mine.caches] == [c.spec for c in small_recording.caches]
    assert [[(cell.seed, cell.score) for cell in c.cells] for c in mine.caches] == \
        [[(cell.seed, cell.score) for cell in c.cells] for c in small_recording.caches]     # the same tasks
    with pytest.raises(KvplayError, match="Name the model"):
        jobs.tasks_beside_recorded(" ", recorded)
    with pytest.raises(KvplayError, match="No recorded task runs"):
        jobs.tasks_beside_recorded("shakespeare-llama", [])
    other = dataclasses.replace(small_recording, seed=8)
    with pytest.raises(KvplayError, match="differ in their lengths, kinds or seed"):
        jobs.shared_setup([small_recording, other])


def _run(model: str, scores: dict[str, list[float]]) -> TasksResult:
    """A hand-made run at 512 tokens: per cache, one score per task (16-bit first; a 0 there counts for none)."""
    ceiling = scores["baseline"]
    return TasksResult(model=model, seed=1, chat=False, contexts=[512], kinds=["niah_single"], samples=len(ceiling),
                       prompt_tokens=[500], caches=[
                           TaskCache(spec=spec, lever="quantized", bits=[4.0], relative=None, cells=[
                               TaskCell(512, "niah_single", n, score, ceiling[n] > 0) for n, score in enumerate(s)])
                           for spec, s in scores.items()])


def test_the_grid_sets_each_cache_against_each_models_own_16bit_cache():
    """A row per cache every run has, a column per model; each cell its score over that model's 16-bit score on the
    tasks 16-bit answered (a task 16-bit missed counts for none), shaded on the sequential scale, never a verdict
    colour. A cache one run lacks is no row."""
    one = _run("model one", {"baseline": [1, 1, 0], "kvplay-int4": [1, 0, 1], "kvplay-int2": [0, 0, 0]})
    two = _run("model two (measured now)", {"baseline": [1, 0.5, 1], "kvplay-int4": [1, 0.5, 1]})
    fig = figures.tasks_models_figure([one, two])
    heat = fig.data[0]
    assert list(heat.y) == ["kvplay-int4"] and list(heat.x) == ["model one", "model two<br>(measured now)"]
    assert list(heat.z[0]) == [50.0, 100.0]                 # one: 1 of the 2 tasks 16-bit answered; two: all of them
    assert list(heat.text[0]) == ["50%<br>of 2 tasks", "100%<br>of 3 tasks"]
    assert heat.colorscale == go.Heatmap(colorscale=HEATMAP).colorscale
    assert "512 tokens" in fig.layout.title.text and "score against each model's own 16-bit" in fig.layout.title.text
    frame = tables.tasks_models_frame([one, two])
    assert list(zip(frame["Model"], frame["Cache"], frame["Against 16-bit at 512 (%)"])) == [
        ("model one", "kvplay-int4", 50), ("model one", "kvplay-int2", 0), ("model two (measured now)", "kvplay-int4",
                                                                             100)]


def test_the_button_measures_beside_whatever_recording_ships(small_recording, monkeypatch):
    from kvplay.app.settings import Settings
    from kvplay.ui.tradeoffs import make_handlers

    monkeypatch.setattr(jobs, "recorded_tasks", lambda: [dataclasses.replace(small_recording, model="recorded")])
    line, fig, frame = make_handlers(Settings())["tasks_beside"]("shakespeare-llama")
    assert line.startswith("Recorded (tasks-three-models.json): recorded. Measured now, on this machine: "
                           "shakespeare-llama, with the caches every recording ran, 1 task(s) of each kind at 384 and "
                           "512 tokens, seed 7.")
    assert list(fig.data[0].x) == ["recorded", "shakespeare-llama<br>(measured now)"]
    assert set(frame["Model"]) == {"recorded", "shakespeare-llama (measured now)"}


@pytest.fixture(scope="module")
def small_chart(bundled):
    """A recorded equal-bytes run made here on the bundled model: 2 caches over 128 tokens in chunks of 16."""
    return jobs.pareto("shakespeare-llama", specs=["kvplay-int4", "kvplay-int2"], tokens=128, chunk=16)


def test_the_shipped_charts_are_the_three_documented_runs():
    recorded = jobs.recorded_pareto()
    documented = [from_dict(json.loads((ROOT / "docs" / "results" / f"pareto-engines-{name}.json").read_text()))
                  for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")]
    assert recorded == documented and [r.env.model for r in recorded] == [r.env.model for r in documented]


def test_a_model_of_ones_own_joins_the_recorded_charts_on_their_caches_text_and_tokens(small_chart):
    """The caches every recording has (one recording lacking one leaves it out), over the recordings' tokens and
    chunk, named as measured now after them; the same figures as a run made directly."""
    other = dataclasses.replace(small_chart, env=dataclasses.replace(small_chart.env, model="recorded"),
                                points=[p for p in small_chart.points if p.spec != "kvplay-int2"])
    joined = jobs.pareto_beside_recorded("shakespeare-llama", [small_chart, other])
    mine = joined[-1]
    assert joined[:2] == [small_chart, other] and mine.env.model == "shakespeare-llama" + MEASURED_NOW
    assert [p.spec for p in mine.points] == ["baseline", "kvplay-int4"]
    assert (mine.context_tokens, mine.chunk, mine.text_name) == (128, 16, small_chart.text_name)
    assert mine.points[1].mean_kl == pytest.approx(small_chart.points[1].mean_kl, rel=1e-6)   # measured again
    with pytest.raises(KvplayError, match="differ in their text, tokens or chunk"):
        jobs.pareto_beside_recorded("shakespeare-llama", [small_chart, dataclasses.replace(other, chunk=8)])
    with pytest.raises(KvplayError, match="Name the model"):
        jobs.pareto_beside_recorded("", [small_chart])


def test_the_chart_across_models_draws_a_panel_per_model_with_its_frontier(small_chart):
    other = dataclasses.replace(small_chart, env=dataclasses.replace(small_chart.env, model="other model"))
    fig = figures.pareto_models_figure([small_chart, other, other])
    assert [a.text for a in fig.layout.annotations] == ["shakespeare-llama", "other model", "other model"]
    points = [t for t in fig.data if t.mode == "markers"]
    assert len(points) == 3 and [t.yaxis for t in points] == ["y", "y2", "y3"]       # a panel each, stacked
    bits = small_chart.bits("long")
    assert list(points[0].x) == bits and [c[0] for c in points[0].customdata] == [p.spec for p in small_chart.points]
    on = small_chart.with_frontier("mean_kl", "long")
    assert list(points[0].marker.line.width) == [2 if f else 0 for f in on]            # the frontier outlined
    assert fig.layout.yaxis.type == "log" and "bits per element at" in fig.layout.xaxis3.title.text
    frame = tables.pareto_models_frame([small_chart, other])
    assert list(frame["Cache"]) == ["kvplay-int4", "kvplay-int2"] * 2


def test_the_equal_bytes_button_measures_beside_whatever_recording_ships(small_chart, monkeypatch):
    from kvplay.app.settings import Settings
    from kvplay.ui.tradeoffs import make_handlers

    monkeypatch.setattr(jobs, "recorded_pareto", lambda: [small_chart])
    line, fig, frame = make_handlers(Settings())["pareto_beside"]("shakespeare-llama")
    assert line == ("Recorded (pareto-three-models.json): shakespeare-llama. Measured now, on this machine: "
                    f"shakespeare-llama, with the 2 caches every recording has, over the same 128 tokens of the "
                    f"{small_chart.text_name}.")
    assert [a.text for a in fig.layout.annotations] == ["shakespeare-llama", "shakespeare-llama (measured now)"]
    assert set(frame["Model"]) == {"shakespeare-llama", "shakespeare-llama (measured now)"}


def test_a_copy_whose_cap_would_refuse_the_run_says_so_instead_of_offering_it():
    """The equal-bytes run beside the recordings needs the 10 caches they share; a copy capped at 6 caches a run (a
    hosted Space) greys out the box and the button and says why, rather than refuse every press."""
    import gradio as gr

    from kvplay.app.settings import Settings
    from kvplay.ui.tradeoffs import tradeoffs_tab

    needs = len(jobs.shared_caches(jobs.recorded_pareto()))
    assert needs == 10
    for cap, usable in ((6, False), (needs, True)):
        with gr.Blocks() as app:
            tradeoffs_tab(app, dataclasses.replace(Settings(), max_specs=cap))
        boxes = [b for b in app.blocks.values() if isinstance(b, gr.Textbox)
                 and b.label == "Your model beside the recorded ones"]
        buttons = [b for b in app.blocks.values() if isinstance(b, gr.Button) and b.value == "Measure it beside them"]
        assert len(boxes) == len(buttons) == 2                   # the equal-bytes view's, then the tasks view's
        assert boxes[0].interactive is usable and buttons[0].interactive is usable
        assert boxes[1].interactive is not False and buttons[1].interactive is not False     # 6 caches: within any cap
        assert ("this copy allows 6 per run" in boxes[0].info) is not usable

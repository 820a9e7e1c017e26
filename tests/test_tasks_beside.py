"""A model of one's own beside the catalogue's recorded task runs (the Trade-offs tab's tasks view): the shipped
recording, the run set up to match it, the grid that sets them side by side, and the handler behind the button."""
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

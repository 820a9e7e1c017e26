"""Tasks with answers (kvplay/lab/tasks/run.py, `python -m kvplay tasks`, Trade-offs > Fewer tokens or fewer bits):
scores gated by the 16-bit ceiling, measured bits, both levers on one chart, the CLI and the tab."""
from __future__ import annotations

import json

import pytest

from kvplay import results
from kvplay.cli.main import main
from kvplay.results import TaskCache, TaskCell, TasksResult
from kvplay.show import tables
from kvplay.show.tradeoffs import lever_points, tasks_figure


def _cache(spec, lever, bits, scores, counted):
    cells = [TaskCell(context=1024, kind=kind, seed=0, score=s, counted=c)
             for (kind, s), c in zip(scores.items(), counted)]
    return TaskCache(spec=spec, lever=lever, bits=[bits], cells=cells, relative=None)


def made_up_result() -> TasksResult:
    """16-bit finds the needle and fails variable tracking; one evicting cache finds the needle, one does not."""
    counted = [True, False]
    caches = [_cache("baseline", "16-bit", 16.0, {"niah_single": 1.0, "variable_tracking": 0.0}, counted),
              _cache("baseline:evict=snapkv,keep=0.25", "evicted", 4.0,
                     {"niah_single": 1.0, "variable_tracking": 0.4}, counted),
              _cache("kvplay-int2", "quantized", 3.3, {"niah_single": 0.0, "variable_tracking": 0.0}, counted)]
    return TasksResult(model="m", seed=0, chat=True, contexts=[1024], kinds=["niah_single", "variable_tracking"],
                       samples=1, prompt_tokens=[1020], caches=caches)


def test_a_task_16_bit_fails_counts_for_no_cache_and_the_table_says_so():
    result = made_up_result()
    assert result.failed_by_16bit() == ["variable_tracking"]
    rows = tables.tasks_rows(result)
    assert "Variable tracking" not in rows[0] and rows[1]["Needle (1 key)"] == "100%"
    assert "variable tracking task: this model cannot do them" in tables.tasks_note(result)
    # The evicting cache's 0.4 on a task 16-bit failed is not counted for it: 100% of 16-bit's, not more.
    points = {c.spec: (x, y, on) for c, x, y, on in lever_points(result, 1024)}
    assert points["baseline:evict=snapkv,keep=0.25"] == (4.0, 100.0, True)
    assert points["kvplay-int2"] == (3.3, 0.0, True)          # fewest bits: on the frontier, however bad
    assert points["baseline"][2] is False                     # 16 bits for what 4 bits also did


def test_the_chart_colours_points_by_lever_and_draws_one_frontier():
    fig = tasks_figure(made_up_result())
    names = [t.name for t in fig.data]
    assert names == ["16-bit", "fewer bits (quantized)", "fewer tokens (evicted)", "frontier"]
    assert "1,024 tokens" in fig.layout.title.text and fig.layout.xaxis.title.text.startswith("bits per cached")
    assert list(fig.data[-1].x) == [3.3, 4.0]


@pytest.mark.real_model
def test_snapkv_keeping_a_quarter_finds_the_needle_at_a_quarter_of_the_bytes(tmp_path, capsys):
    out = tmp_path / "tasks.json"
    code = main(["tasks", "--model", "smollm2-135m-instruct", "--caches", "baseline:evict=snapkv,keep=0.25",
                 "kvplay-int4", "--contexts", "1024", "--kinds", "niah_single", "--samples", "2",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Against 16-bit" in printed and "baseline:evict=snapkv,keep=0.25" in printed
    result = results.from_dict(json.loads(out.read_text()))
    base, snap, int4 = result.caches
    assert [c.lever for c in result.caches] == ["16-bit", "evicted", "quantized"]
    assert base.score(1024, "niah_single") == 1.0                  # measured: both tasks found
    assert snap.relative == 1.0                                    # measured: both found keeping 256 of 1,024
    assert abs(snap.bits[0] - 4.0) < 0.02 and base.bits[0] == 16.0   # measured 4.004 (256 of 1,023 tokens)
    assert 4.5 < int4.bits[0] < 8                                  # its 16-bit window is 128 of 1,023 tokens
    assert snap.kept[0].startswith("keeps 25") and "SnapKV" in snap.kept[0]


def test_the_tab_lays_out_and_refuses_an_empty_cache_list():
    import gradio as gr

    from kvplay.app.settings import Settings
    from kvplay.errors import KvplayError
    from kvplay.ui.tradeoffs import make_handlers, tradeoffs_tab

    with gr.Blocks() as app:
        tradeoffs_tab(app, Settings())
    labels = {b.label for b in app.blocks.values() if isinstance(b, gr.Tab)}
    assert "Fewer tokens or fewer bits" in labels
    assert any(d["api_name"] == "tasks" for d in app.config["dependencies"])
    with pytest.raises(KvplayError, match="at least one cache spec"):
        make_handlers(Settings())["tasks"](None, "  ")


def test_the_boxes_split_specs_on_spaces_and_keep_the_commas_of_their_options():
    from kvplay.app.tradeoffs import TASK_SPECS
    from kvplay.ui.common import spec_list
    from kvplay.ui.tradeoffs import TASKS_DEFAULT

    assert spec_list(TASKS_DEFAULT) == list(TASK_SPECS)          # "baseline:evict=snapkv,keep=0.5" stays one spec
    assert spec_list("kvplay-int4\n baseline:evict=snapkv,keep=0.25 ") == ["kvplay-int4",
                                                                         "baseline:evict=snapkv,keep=0.25"]

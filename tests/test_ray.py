"""Sweeps on Ray (`--ray`, kvplay/app/scale.py and cells.py) on a local 2-worker Ray instance: `ppl --models`,
`tasks`, `pareto` and `needle` give the very result of a run in one process (pareto's timings aside), a failed
model or task is named while the finished cells are kept and not run again, and without Ray `--ray` is one
sentence. The Ray tests skip without ray (pip install -r requirements-ray.txt)."""
import json
import shutil
import sys

import pytest
import torch
from conftest import tiny_llama

from kvplay import results
from kvplay.app import inside, quality, scale, tradeoffs
from kvplay.app.models import BUNDLED_PATH
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError

SPECS = ["kvplay-int4", "quanto-int4", "kvplay-int2:residual=16"]   # int2's window under 128 tokens: all quantized
SETTINGS = Settings()


@pytest.mark.parametrize("address, said", [
    ("127.0.0.1:1", "Nothing answers at 127.0.0.1:1 (Connection refused): start the cluster there with `ray start "
                    "--head`, or give --ray alone for a local instance."),
    ("nonsense", "A Ray address is HOST:PORT (what `ray start --head` prints), auto or nothing, not 'nonsense'.")])
def test_an_address_where_no_cluster_answers_is_one_sentence_at_once(address, said, capsys):
    """Before any test's Ray instance starts (a running instance is used as it is): ray.init would retry for
    minutes."""
    pytest.importorskip("ray", reason="Ray is optional: pip install -r requirements-ray.txt")
    from kvplay.cli.main import main

    assert main(["tasks", "--model", "shakespeare-llama", "--ray", address]) == 2
    assert capsys.readouterr().err.strip() == f"error: {said}"


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is optional: pip install -r requirements-ray.txt")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)      # 2 workers of one core each
    yield ray
    ray.shutdown()


def tiny_folder(path, positions: int):
    """A random 2-layer Llama in a folder, with the bundled model's tokenizer: a second model for the sweep."""
    tiny_llama(vocab_size=4096, max_position_embeddings=positions).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_PATH / name, path / name)
    return str(path)


@pytest.fixture
def as_a_worker():
    """The run in one process on one torch thread, as each worker of local_ray has: on CPUs with AMX, bfloat16
    products split over 2 threads differ from 1 thread's in the last bits (a layer's key error 0.0858132 against
    0.0858125 on an Intel Xeon), and these tests compare to the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cells(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLAY_CELL_DIR", str(tmp_path / "cells"))
    return tmp_path / "cells"


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_ppl_models_on_ray_is_the_run_in_one_process_and_a_second_run_reads_the_kept_cells(local_ray, as_a_worker,
                                                                                            cells, tmp_path):
    names = ["shakespeare-llama", tiny_folder(tmp_path / "tiny", 2048)]
    plain = quality.ppl_models(names, SPECS, max_tokens=128, settings=SETTINGS)
    notes = []
    spread = scale.ppl_models(names, SPECS, ray="local", max_tokens=128, settings=SETTINGS, note=notes.append)
    assert results.to_dict(spread) == results.to_dict(plain)        # every figure, to the last bit
    assert all(r.mean_kl > 0 for r in spread.rows if r.spec == SPECS[2])    # and there is something to compare
    assert any(r.refused for r in spread.rows)                      # the tiny model refuses some: rows that say why
    ran = [len(run.caches) for run in spread.runs]
    placed = [n for n in notes if " #1 on " in n]                    # one worker per model, each cell on it
    assert len(placed) == 2 and [n.count(" s)") for n in placed] in (ran, ran[::-1]), notes
    assert len(list(cells.glob("*.json"))) == sum(1 + n for n in ran)    # each model's checks and its cells

    notes.clear()
    again = scale.ppl_models(names, SPECS, ray="local", max_tokens=128, settings=SETTINGS, note=notes.append)
    assert results.to_dict(again) == results.to_dict(plain)
    assert sum("all kept from an earlier run" in n for n in notes) == 2 and not any(" #1 on " in n for n in notes)


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_a_model_that_fails_is_named_and_the_other_models_cells_are_kept_for_the_next_run(local_ray, as_a_worker,
                                                                                          cells, tmp_path):
    short = tiny_folder(tmp_path / "short", 96)                     # 96 positions: 128 tokens do not fit
    with pytest.raises(KvplayError) as failed:
        scale.ppl_models(["shakespeare-llama", short], SPECS, ray="local", max_tokens=128, settings=SETTINGS)
    message = str(failed.value)
    assert message.startswith(f"1 part of the run failed ({short}: Max tokens") and "96" in message, message
    assert message.endswith("the same command again runs only the rest.") and "the 4 cells that finished" in message

    notes = []
    names = ["shakespeare-llama", tiny_folder(tmp_path / "tiny", 2048)]
    spread = scale.ppl_models(names, SPECS, ray="local", max_tokens=128, settings=SETTINGS, note=notes.append)
    assert "  shakespeare-llama: 4 cells, all kept from an earlier run" in notes      # baseline and SPECS
    assert results.to_dict(spread) == results.to_dict(quality.ppl_models(names, SPECS, max_tokens=128,
                                                                          settings=SETTINGS))


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_tasks_on_ray_share_one_model_between_two_workers_and_give_the_same_result(local_ray, as_a_worker, cells):
    specs = ["kvplay-int4", "baseline:evict=snapkv,keep=0.25"]
    run = dict(contexts=[320], kinds=["niah_single", "variable_tracking"], samples=2, settings=SETTINGS)
    plain = tradeoffs.tasks("shakespeare-llama", specs, **run)
    notes = []
    spread = scale.tasks("shakespeare-llama", specs, ray="local", note=notes.append, **run)
    assert results.to_dict(spread) == results.to_dict(plain)
    assert len(spread.caches[0].cells) == 4
    assert any("shakespeare-llama: 4 cells, 0 kept from an earlier run, 4 to run on 2 workers" in n for n in notes)
    placed = [n for n in notes if n.startswith("  shakespeare-llama #")]     # which worker ran which task: the
    assert sum(n.count(" s)") for n in placed) == 4, notes               # first often runs all 4 of these tiny ones
                                                                         # while the second loads the model


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_a_failed_task_is_named_with_its_sentence_and_the_next_run_runs_only_it(local_ray, cells):
    """At 256 tokens the bundled tokenizer fits a needle but no variable-tracking task: one cell fails, the other is
    kept, and the same command again runs only the failed one."""
    run = dict(contexts=[256], kinds=["niah_single", "variable_tracking"], samples=1, settings=SETTINGS)
    with pytest.raises(KvplayError) as alone:
        tradeoffs.tasks("shakespeare-llama", ["kvplay-int4"], **run)
    for attempt in range(2):
        notes = []
        with pytest.raises(KvplayError) as failed:
            scale.tasks("shakespeare-llama", ["kvplay-int4"], ray="local", note=notes.append, **run)
        assert str(failed.value).startswith("1 part of the run failed (shakespeare-llama x variable_tracking at 256 "
                                            f"#1: {str(alone.value).rstrip('.')}); the 1 cell that finished is kept")
        assert f"2 cells, {attempt} kept from an earlier run, {2 - attempt} to run" in "".join(notes), notes


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_pareto_on_ray_gives_the_same_points_each_timed_on_its_worker(local_ray, as_a_worker, cells):
    run = dict(specs=SPECS, tokens=128, settings=SETTINGS)
    plain = tradeoffs.pareto("shakespeare-llama", **run)
    spread = scale.pareto("shakespeare-llama", ray="local", **run)

    def untimed(result) -> dict:               # a point's seconds is its pass's time: no two runs share it
        data = results.to_dict(result)
        for point in data["points"]:
            point.pop("seconds")
        return data
    assert untimed(spread) == untimed(plain) and len(spread.points) == 1 + len(SPECS)
    assert all(p.seconds > 0 for p in spread.points) and any(p.on_frontier for p in spread.points[1:])


@pytest.mark.slow        # a Ray instance and its workers loading models
@pytest.mark.real_model  # the bundled model finds no pass code, so nothing would count
def test_needle_on_ray_gives_the_same_grid(local_ray, as_a_worker, cells):
    specs, run = ["kvplay-int4", "kvplay-int2"], dict(lengths=[256], depths=[0.1, 0.9], settings=SETTINGS)
    plain = inside.needle("smollm2-135m-instruct", specs, **run)
    spread = scale.needle("smollm2-135m-instruct", specs, ray="local", **run)
    assert results.to_dict(spread) == results.to_dict(plain)
    assert [c.spec for c in spread.caches] == ["baseline", *specs] and spread.caches[0].found > 0


@pytest.mark.slow        # a Ray instance and its workers loading models
def test_the_cli_merges_a_ray_run_into_the_same_json(local_ray, as_a_worker, cells, tmp_path, capsys):
    from kvplay.cli.main import main

    args = ["tasks", "--model", "shakespeare-llama", "--caches", "kvplay-int2", "--contexts", "256", "--kinds",
            "niah_single", "--samples", "1"]
    assert main(args + ["--json", str(tmp_path / "plain.json")]) == 0
    assert main(args + ["--ray", "--json", str(tmp_path / "ray.json")]) == 0
    assert json.loads((tmp_path / "ray.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
    out = capsys.readouterr()
    half = len(out.out) // 2
    assert out.out[:half] == out.out[half:] and "kvplay-int2" in out.out      # the same table printed twice
    assert "shakespeare-llama #1 on" in out.err                      # where the cell ran, on stderr


@pytest.mark.parametrize("argv", [["ppl", "--models", "shakespeare-llama", "other", "--ray"],
                                  ["tasks", "--ray", "auto"]])
def test_without_ray_installed_ray_is_one_sentence_naming_the_requirements_file(argv, monkeypatch, capsys):
    from kvplay.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)                    # `import ray` raises ImportError
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == ("error: --ray needs Ray, which is not installed: "
                                               "pip install -r requirements-ray.txt.")


def test_ray_goes_with_a_sweep(capsys):
    from kvplay.cli.main import main

    assert main(["ppl", "--model", "shakespeare-llama", "--ray"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ray spreads a sweep over workers: it goes with --models."

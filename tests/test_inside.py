"""The Inside views: fragility scan, retrieval test, per-head error and attention shift (kvplay/lab/inside/)."""
import json

import pytest
import torch
from conftest import tiny_llama

from kvplay import results
from kvplay.cache import parse_spec
from kvplay.cli.main import main
from kvplay.errors import KvplayError
from kvplay.lab import inside
from kvplay.lab.quality import layer_errors
from kvplay.results.inside import SHIFT_ROWS

PLANTED = 5          # key channel scaled up in layer 1 of the tiny model; RoPE pairs it with PLANTED + head_dim/2


@pytest.fixture(scope="module")
def planted():
    """tiny_llama with one key channel of layer 1 made 30x larger (its k_proj row), and its scan."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[PLANTED] *= 30
    ids = torch.randint(0, 96, (1, 96), generator=torch.Generator().manual_seed(0))
    return model, inside.outlier_scan(model, None, ids=ids)


def test_scan_finds_planted_outlier_channels(planted):
    _, scan = planted
    clean, hot = scan.layers[0].heads[0], scan.layers[1].heads[0]
    assert clean.key_outlier_channels == 0 and clean.key_max_ratio < inside.OUTLIER_FACTOR
    assert 1 <= hot.key_outlier_channels <= 2                       # the channel and its RoPE partner
    assert set(hot.key_top_channels) <= {PLANTED, PLANTED + 16} and hot.key_top_channels
    assert hot.key_max_ratio > 15                                    # measured 20-30x
    assert hot.key_max_ratio_rotated < hot.key_max_ratio / 3         # rotation spreads it (measured ~1.5x)
    assert hot.key_kurtosis > clean.key_kurtosis and hot.key_kurtosis_rotated < hot.key_kurtosis
    assert "Layer 1 keys, head 0" in scan.verdict


def test_risk_follows_key_grouping(planted):
    _, scan = planted
    risk = {r.spec: r for r in scan.schemes}
    assert risk["quanto-int4"].at_risk and risk["hqq-int4"].at_risk          # per-token int4 groups
    assert not risk["kvplay-int4"].at_risk and not risk["baseline"].at_risk  # per-channel keys; 16-bit
    rotated = inside.scheme_risk(parse_spec("kvplay-int4:keys=token"), scan.layers)       # the preset rotates
    assert not rotated.at_risk                                                # 30x -> ~1.5x after rotation
    assert inside.scheme_risk(parse_spec("kvplay-int4:keys=token,rotation=none"), scan.layers).at_risk


def test_outliers_contract(planted):
    data = json.loads(json.dumps(results.to_dict(planted[1])))
    assert data["kind"] == "outliers" and len(data["layers"]) == 2
    head = data["layers"][1]["heads"][0]
    assert {"layer", "heads"} <= set(data["layers"][1])
    assert {"head", "key_kurtosis", "value_kurtosis", "key_max_ratio", "key_outlier_channels",
            "key_kurtosis_rotated"} <= set(head)


def test_needle_prompt_is_seeded_and_placed(bundled):
    _, tok = bundled
    a = inside.needle_prompt(tok, 400, 0.5, seed=3, chat=False)
    assert a == inside.needle_prompt(tok, 400, 0.5, seed=3, chat=False)
    assert inside.needle_prompt(tok, 400, 0.5, seed=4, chat=False).passkey != a.passkey
    assert abs(len(a.ids) - 400) <= 30                                   # about the length asked
    for depth in (0.0, 0.5, 1.0):
        p = inside.needle_prompt(tok, 400, depth, seed=3, chat=False)
        where = (p.needle_token - p.filler_start) / (p.filler_end - p.filler_start)
        assert abs(where - depth) < 0.1, (depth, where)
        assert p.passkey in tok.decode(p.ids[p.needle_token:p.needle_token + 24])


def test_needle_run_contract_and_baseline_first(bundled):
    model, tok = bundled
    result = inside.needle_run(model, tok, ["kvplay-int2"], lengths=[128], depths=[0.0, 1.0], chat=False,
                                 new_tokens=4)
    data = json.loads(json.dumps(results.to_dict(result)))
    assert data["kind"] == "needle" and [c["spec"] for c in data["caches"]] == ["baseline", "kvplay-int2"]
    base, quant = data["caches"]
    assert [g[:2] for g in base["grid"]] == [[128, 0.0], [128, 1.0]] and all(len(g) == 3 for g in quant["grid"])
    for b, q in zip(base["grid"], quant["grid"]):
        assert isinstance(b[2], bool)
        assert (q[2] is None) == (not b[2])                          # cells the baseline fails are not counted
    assert quant["counted"] == sum(g[2] for g in base["grid"])


def test_answer_check():
    assert inside.answer_correct(" 42177", "42177") and inside.answer_correct("4 2 1 7 7.", "42177")
    assert not inside.answer_correct("4217", "42177")


def test_head_errors_match_layer_errors_with_one_kv_head():
    model = tiny_llama()
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(1))
    spec = "kvplay-int2:residual=0"
    per_head = inside.head_errors(model, ids, spec)
    keys, values = layer_errors(model, ids, spec)
    assert len(per_head.key_error) == 2 and len(per_head.key_error[0]) == 1
    assert [row[0] for row in per_head.key_error] == pytest.approx(keys, rel=1e-4)
    assert [row[0] for row in per_head.value_error] == pytest.approx(values, rel=1e-4)
    assert min(keys) > 0.01                                              # int2 loses something (measured ~0.2)


def test_attention_shift_rows(bundled):
    model, tok = bundled
    ids = inside.scan_tokens(tok, 80)[0].tolist()       # 80 tokens: the int2 blocks (32 tokens) get quantized
    before = model.config._attn_implementation
    same = inside.attention_shift(model, tok, ids, "baseline", step=3, layer=1, head=0, new_tokens=6)
    assert model.config._attn_implementation == before                   # restored
    assert len(same.baseline) == same.context_tokens == len(ids) + 3
    assert sum(same.baseline) == pytest.approx(1.0, abs=1e-3)
    assert max(abs(d) for d in same.difference) == 0.0                   # 16-bit against itself
    shifted = inside.attention_shift(model, tok, ids, "kvplay-int2:residual=0", step=3, layer=1, head=0,
                                     new_tokens=6)
    assert max(abs(d) for d in shifted.difference) > 0                   # history quantized: weights move
    with pytest.raises(KvplayError, match="between 1 and"):
        inside.attention_shift(model, tok, ids, "baseline", step=0, layer=1, head=0, new_tokens=6)


@pytest.mark.parametrize("argv, words", [
    (["needle", "--model", "shakespeare-llama", "--depths", "2"], "Depths must be fractions"),
    (["outliers", "--model", "shakespeare-llama", "--tokens", "3"], "Tokens"),
    (["errors", "--model", "shakespeare-llama", "--tokens", "3"], "Tokens"),
    (["errors", "--model", "shakespeare-llama", "--caches", "baseline"], "at least one quantized cache"),
    (["errors", "--model", "shakespeare-llama", "--caches", "kvplay-int9"], "kvplay-int9"),
    (["attention", "--model", "shakespeare-llama", "--caches", "kvplay-int2", "kvplay-int4"], "Give one cache"),
    (["attention", "--model", "shakespeare-llama", "--layer", "99"], "The layer must be between 0 and"),
    (["attention", "--model", "shakespeare-llama", "--prompt", " "], "Prompt is empty"),
])
def test_cli_bad_input_one_sentence(argv, words, capsys, bundled):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0]


def test_cli_outliers_writes_contract(tmp_path, capsys, bundled):
    out = tmp_path / "o.json"
    assert main(["outliers", "--model", "shakespeare-llama", "--tokens", "64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "outliers" and data["tokens"] == 64 and data["layers"][0]["heads"]
    assert "At risk" in capsys.readouterr().out


def test_cli_errors_writes_the_map(tmp_path, capsys, bundled):
    out, csv = tmp_path / "e.json", tmp_path / "e.csv"
    argv = ["errors", "--model", "shakespeare-llama", "--tokens", "96", "--caches", "baseline",
            "kvplay-int2:residual=0", "kvplay-int4:residual=0", "--json", str(out), "--csv", str(csv)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    layers, kv_heads = bundled[0].config.num_hidden_layers, bundled[0].config.num_key_value_heads
    assert data["kind"] == "head_errors" and data["tokens"] == 96
    assert [c["spec"] for c in data["caches"]] == ["kvplay-int2:residual=0", "kvplay-int4:residual=0"]  # no baseline
    for c in data["caches"]:
        assert len(c["key_error"]) == layers and {len(row) for row in c["key_error"] + c["value_error"]} == {kv_heads}
    int2, int4 = results.from_dict(data).summary_rows()
    assert int2["key_error_median_pct"] > int4["key_error_median_pct"] > 0             # fewer bits, more error
    assert int2["key_error_worst_pct"] >= int2["key_error_median_pct"]
    printed = capsys.readouterr().out
    assert "worst_key_head" in printed and int2["worst_key_head"] in printed
    assert csv.read_text().splitlines()[0].startswith("spec,key_error_median_pct")


@pytest.fixture(scope="module")
def inside_results(bundled):
    """Small real results of the Inside views on the bundled model."""
    model, tok = bundled
    scan = inside.outlier_scan(model, tok, tokens=64, model_name="shakespeare-llama")
    grid = inside.needle_run(model, tok, ["kvplay-int2"], lengths=[128], depths=[0.1, 0.9], chat=False, new_tokens=4,
                             model_name="shakespeare-llama")
    ids = inside.scan_tokens(tok, 96)
    maps = results.ErrorMaps(model="shakespeare-llama", tokens=96,
                            caches=[inside.head_errors(model, ids, s) for s in ("kvplay-int4", "kvplay-int2")])
    shift = inside.attention_shift(model, tok, ids[0, :80].tolist(), "kvplay-int2:residual=0", step=3, layer=1,
                                   head=0, new_tokens=6)
    kept = inside.kept_run(model, tok, ["baseline:evict=snapkv,keep=0.25"], tokens=256, chat=False,
                           model_name="shakespeare-llama")
    return scan, grid, maps, shift, kept


def test_report_has_a_section_per_inside_view(inside_results, tmp_path, capsys):
    from kvplay.show.report import build_report

    scan, grid, maps, shift, kept = inside_results
    page = build_report([scan, grid, maps, shift, kept])
    for title in (kind.title for kind in results.INSIDE):
        assert f"<h2>{title}</h2>" in page
    assert page.count("class=\"plotly-graph-div\"") == 5                        # a figure per view
    assert "Outlier channels per KV head" in page and "Find the number" in page
    assert "relative reconstruction error" in page and "Attention, layer 1, query head 0" in page
    assert scan.verdict.splitlines()[0] in page and "not at risk" in page      # verdict and risks, in words
    assert "<th>worst_key_head</th>" in page and "<th>found</th>" in page
    data = json.loads(page.split('id="kvplay-data">')[1].split("</script>")[0])
    assert [d["kind"] for d in data] == ["outliers", "needle", "head_errors", "attention_shift", "kept"]
    assert "kept each position after the prompt was read, the pass code outlined" in page     # the kept view, in words

    paths = []                                                                # the CLI's report from saved JSON
    for result in (scan, grid, maps, shift, kept):
        paths.append(tmp_path / f"{result.kind}.json")
        results.to_json(result, paths[-1])
    html = tmp_path / "report.html"
    assert main(["report", "--inputs", *map(str, paths), "--out", str(html)]) == 0
    again = html.read_text()
    assert all(f"<h2>{t}</h2>" in again for t in (kind.title for kind in results.INSIDE))
    assert again.count("class=\"plotly-graph-div\"") == 5
    rebuilt = results.from_dict(json.loads(paths[1].read_text()))
    assert rebuilt.caches[1].grid == grid.caches[1].grid and rebuilt.summary_rows() == grid.summary_rows()
    assert results.from_dict(json.loads(paths[3].read_text())).difference == shift.difference


def test_attention_shift_table_and_cli(inside_results, tmp_path, capsys):
    shift = inside_results[3]
    rows = shift.summary_rows()
    moves = [abs(r["difference"]) for r in rows]
    assert len(rows) == SHIFT_ROWS and moves == sorted(moves, reverse=True) and moves[0] > 0
    assert moves[0] == pytest.approx(max(abs(d) for d in shift.difference), abs=1e-5)
    assert shift.sink == 4 and shift.window == 0                                     # kvplay-int2's sinks, no window
    assert all(r["held_in"] == ("sink (16-bit)" if r["position"] < 4 else "quantized") for r in rows)
    out = tmp_path / "a.json"
    argv = ["attention", "--model", "shakespeare-llama", "--prompt", "ROMEO:\nWhat light through yonder window "
            "breaks? It is the east, and Juliet is the sun.", "--caches", "kvplay-int2:residual=0", "--step", "3",
            "--layer", "1", "--new-tokens", "6", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "attention_shift" and data["spec"] == "kvplay-int2:residual=0" and data["layer"] == 1
    assert len(data["baseline"]) == len(data["quantized"]) == data["context_tokens"]
    assert sum(data["baseline"]) == pytest.approx(1.0, abs=1e-3)
    assert "weight_16bit" in capsys.readouterr().out


def test_figures_are_titled(planted):
    from kvplay.show import inside as inside_plots

    scan = inside_plots.scan_figure(planted[1])
    assert "Outlier channels" in scan.layout.title.text and len(scan.data) == 4
    result = results.NeedleResult(model="m", seed=0, chat=True, lengths=[256, 512], depths=[0.5],
                                 prompt_tokens=[256, 512],
                                 caches=[results.NeedleCache("baseline", [[256, 0.5, True], [512, 0.5, False]]),
                                         results.NeedleCache("kvplay-int2", [[256, 0.5, False], [512, 0.5, None]])])
    fig = inside_plots.needle_figure(result)
    assert [list(t.z[0]) for t in fig.data] == [[2, 0], [0, 1]]          # found, missed; missed, 16-bit failed
    shift = results.AttentionShift("kvplay-int2:sink=2", 3, "x", 0, 0, 6, [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
                                  [0.4, 0.2, 0.1, 0.1, 0.1, 0.1], sink=2, window=2)
    fig = inside_plots.shift_figure(shift)
    assert len(fig.layout.shapes) == 4                                  # sink and window, shaded on both rows
    assert list(fig.data[2].y) == pytest.approx([-0.1, 0.1, 0, 0, 0, 0])


def test_inside_tab_builds():
    import gradio as gr

    from kvplay.app.settings import Settings
    from kvplay.ui.inside import inside_tab

    with gr.Blocks() as app:
        inside_tab(Settings(), "shakespeare-llama")
    names = {d.get("api_name") for d in app.config["dependencies"]}
    assert {"inside_scan", "inside_errors", "inside_attention", "inside_needle", "inside_kept"} <= names
    results = [b for b in app.blocks.values() if isinstance(b, (gr.Plot, gr.File, gr.Dataframe))]
    assert len(results) == 10                     # 5 plots, 4 downloads, the needle table: none shown before a run
    assert all(isinstance(b.parent, gr.Column) and b.parent.visible is False for b in results)
    runs = [d for d in app.config["dependencies"] if (d.get("api_name") or "").startswith("inside_")]
    shown_first = {d["outputs"][0] for d in runs}
    assert shown_first == {b.parent._id for b in results}     # each run shows its own results column


def test_tab_bad_input_is_one_sentence():
    import gradio as gr

    from kvplay.app.settings import Settings
    from kvplay.ui.common import user_errors
    from kvplay.ui.inside import make_inside_handlers

    needle = user_errors(make_inside_handlers(Settings())["needle"])
    with pytest.raises(gr.Error, match="Lengths must be numbers"):
        needle("shakespeare-llama", ["kvplay-int2"], "256 lots", "", 0)

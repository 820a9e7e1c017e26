"""Trade-offs: the grid from the registry, the frontier, exact bits per element, sweeps, recipes, CLI and tab."""
import json

import pytest

from kvplay import results
from kvplay.cache import SCHEMES, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cli.main import main
from kvplay.lab import tradeoffs
from kvplay.show import tradeoffs as figures

SPECS = ["kvplay-int8", "kvplay-int4", "kvplay-int2", "kvplay-int2:residual=0"]
TOKENS = 256          # kvplay's default 128-token window keeps half of it in 16-bit


@pytest.fixture(scope="module")
def pareto(bundled):
    model, tok = bundled
    return tradeoffs.pareto_run(model, tok, specs=SPECS, tokens=TOKENS, chunk=64, model_name="shakespeare-llama")


def test_grid_covers_every_scheme_and_varies_the_registered_options():
    quick, full = tradeoffs.grid(True), tradeoffs.grid(False)
    names = {s.name for s in quick}
    assert names == {n for n, s in SCHEMES.items() if s.method.quantized and s.method.builds_cache}
    assert {s.backend for s in quick} >= {"quanto", "hqq", "kvplay"}
    varied = {k for s in quick for k, v in s.option_values().items() if v != getattr(s.scheme.defaults(), k)}
    assert {"group", "residual", "rotation", "kbits"} <= varied
    assert set(quick) < set(full) and len(quick) >= 12
    assert all(parse_spec(str(s)) == s for s in full)           # every variant is a valid, canonical spec


def test_frontier_on_hand_made_points():
    xs = [16, 4.5, 4.5, 2.5, 3.0, 2.5]
    ys = [0.0, 0.02, 0.05, 0.30, 0.40, 0.30]
    # 4.5/0.05 is beaten by 4.5/0.02; 3.0/0.40 by 2.5/0.30; equal points do not dominate each other.
    assert results.frontier(xs, ys) == [True, True, False, True, False, True]
    assert results.frontier([1, 2], [0.9, 0.5], higher_is_better=True) == [True, False]


def test_pareto_contract_and_exact_bits(pareto, bundled):
    data = json.loads(json.dumps(results.to_dict(pareto)))
    assert data["kind"] == "pareto" and data["context_tokens"] == TOKENS and data["env"]["model"]
    for p in data["points"]:
        assert {"spec", "bits_per_element", "mean_kl", "top1_agreement", "delta_ppl_pct", "on_frontier"} <= set(p)
    assert [p["spec"] for p in data["points"]] == ["baseline"] + SPECS
    arch = Arch.from_config(bundled[0].config)
    for p in pareto.points:
        exact = 8 * p.cache_bytes["total"] / (arch.elements_per_token * TOKENS)
        assert p.bits_per_element == pytest.approx(exact, rel=1e-12)
    base, int8, _, int2, int2_no_window = pareto.points
    assert base.bits_per_element == 16 and base.mean_kl == 0 and base.top1_agreement == 1 and base.on_frontier
    assert int2.mean_kl > int8.mean_kl and int2_no_window.mean_kl > int2.mean_kl   # real ordering, not a constant
    assert int2_no_window.bits_per_element < int2.bits_per_element
    assert results.from_dict(data).points[1] == pareto.points[1]


def test_pareto_figure_marks_the_frontier_with_fixed_backend_colours(pareto):
    fig = figures.pareto_figure(pareto)
    assert "bits" in fig.layout.xaxis.title.text and fig.layout.title.text
    traces = {t.name: t for t in fig.data}
    from kvplay.show.style import colour_for, verdict_like

    kvplay = traces["kvplay"]                     # each point in its scheme's colour, the palette every tab uses
    assert list(kvplay.marker.color) == [colour_for(s) for s in kvplay.customdata]
    assert not any(verdict_like(c) for t in fig.data if t.name != "Pareto frontier" for c in
                   ([t.marker.color] if isinstance(t.marker.color, str) else t.marker.color))
    front = traces["Pareto frontier"]
    assert len(front.x) == sum(p.on_frontier for p in pareto.points)



def test_bytes_at_long_context_move_windowed_caches_to_their_formats_bits(pareto, bundled):
    """The same points with bytes counted at 8,192 tokens from the byte formulas: a 128-token 16-bit window, half
    of a 256-token cache, shrinks to a sliver there, so windowed caches move left and the frontier is re-drawn."""
    from kvplay.cache.accounting import analytic_nbytes, bits_per_element
    from kvplay.errors import KvplayError

    arch = Arch.from_config(bundled[0].config)
    assert pareto.long_tokens == 8192
    for p in pareto.points:
        assert p.bits_long == pytest.approx(bits_per_element(analytic_nbytes(p.spec, arch, 8192), arch, 8192))
    base, int8, int4, int2, int2_no_window = pareto.points
    assert base.bits_long == 16
    assert int2.bits_long < int2.bits_per_element / 2           # the window was most of its bytes at 256 tokens
    assert int2.bits_long - int2_no_window.bits_long < 0.5       # ... and almost none at 8k
    fig = figures.pareto_figure(pareto, at="long")
    assert "at 8,192 tokens" in fig.layout.xaxis.title.text and "8,192" in fig.layout.title.text
    shown = {s: x for t in fig.data if t.name == "kvplay" for s, x in zip(t.customdata, t.x)}
    assert shown["kvplay-int2"] == int2.bits_long
    front = next(t for t in fig.data if t.name == "Pareto frontier")
    assert len(front.x) == sum(pareto.with_frontier("mean_kl", "long"))
    assert [r["bits_at_8192"] for r in pareto.summary_rows()] == [
        round(p.bits_long, 3) for p in sorted(pareto.points, key=lambda p: p.bits_per_element)]
    older = results.from_dict({**results.to_dict(pareto), "long_tokens": None})    # a chart from before
    with pytest.raises(KvplayError, match="predates bytes at long context"):
        figures.pareto_figure(older, at="long")
    with pytest.raises(KvplayError, match="one of run, long"):
        pareto.bits("8k")


def test_frontier_names_only_on_still_images_and_never_inside_a_cluster():
    """chart_png's labels: the app's chart has none (hover and the table name points); a still image names each
    frontier point left of it (the first above right), but not two frontier points within 0.6 bits and a factor
    of 2 in KL, whose names would collide."""
    env = results.Environment(model="m", dtype="bfloat16", device="cpu")
    pts = [results.ParetoPoint(spec=s, backend="kvplay", bits_per_element=b, mean_kl=k, top1_agreement=0.9,
                               delta_ppl_pct=0.0, on_frontier=False)
           for s, b, k in (("a", 2.5, 0.07), ("b", 3.3, 0.03), ("c", 8.4, 0.0021), ("d", 8.6, 0.0013),
                           ("dominated", 4.0, 0.5))]
    chart = results.ParetoResult(context_tokens=256, chunk=32, mode="quick", text_name="t", baseline_ppl=1.0,
                                 env=env, points=pts)
    (trace, _) = figures.pareto_figure(chart).data
    assert trace.mode == "markers"
    (trace, _) = figures.pareto_figure(chart, labels=True).data
    named = {s: pos for s, text, pos in zip(trace.customdata, trace.text, trace.textposition) if text}
    assert named == {"a": "top right", "b": "middle left"}        # c and d: 0.2 bits apart, KL within 2x


def _chart(points) -> results.ParetoResult:
    env = results.Environment(model="m", dtype="bfloat16", device="cpu")
    pts = [results.ParetoPoint(spec=s, backend=b, bits_per_element=bits, mean_kl=kl, top1_agreement=top1,
                               delta_ppl_pct=0.0, on_frontier=front) for s, b, bits, kl, top1, front in points]
    return results.ParetoResult(context_tokens=256, chunk=32, mode="quick", text_name="t", baseline_ppl=1.0,
                                env=env, points=pts)


def test_log_scale_draws_zero_kl_on_a_floor_and_the_reference_is_called_16_bit():
    """Issue 41: ticking log scale changed nothing once any cache had KL 0 (the 16-bit one always has)."""
    chart = _chart([("baseline", "dynamic", 16.0, 0.0, 1.0, True), ("kvplay-int8", "kvplay", 8.5, 0.0, 1.0, True),
                    ("kvplay-int4", "kvplay", 4.5, 0.004, 0.98, True), ("kvplay-int2", "kvplay", 2.5, 0.2, 0.8, True)])
    fig = figures.pareto_figure(chart, log_y=True)
    assert fig.layout.yaxis.type == "log" and "0 drawn at 4e-04" in fig.layout.yaxis.title.text
    points = {s: (y, text) for t in fig.data if t.customdata is not None
              for s, y, text in zip(t.customdata, t.y, t.hovertext)}
    assert points["kvplay-int8"] == (pytest.approx(4e-4), f"{results.METRICS['mean_kl'][0]} 0")   # floor; hover: 0
    assert points["kvplay-int2"][0] == 0.2
    assert "16-bit" in {t.name for t in fig.data} and "dynamic" not in {t.name for t in fig.data}
    assert figures.pareto_figure(chart, log_y=False).layout.yaxis.type != "log"


def test_the_chart_opens_on_the_fewest_bit_frontier_cache_that_is_not_red():
    """Issue 41: the preselected point was hqq-int2:residual=0, at +311% perplexity."""
    chart = _chart([("baseline", "dynamic", 16.0, 0.0, 1.0, True), ("hqq-int2:residual=0", "hqq", 2.1, 1.9, 0.3, True),
                    ("kvplay-int2", "kvplay", 2.5, 0.2, 0.8, True), ("kvplay-int4", "kvplay", 4.5, 0.004, 0.98, True),
                    ("quanto-int2", "quanto", 2.4, 2.5, 0.25, False)])
    assert figures.first_point(chart) == "kvplay-int2"
    broken = _chart([("baseline", "dynamic", 16.0, 0.0, 1.0, True), ("hqq-int2", "hqq", 2.1, 1.9, 0.3, True)])
    assert figures.first_point(broken) == "hqq-int2"          # every compressed point is red: the fewest bits


def test_the_tables_name_their_columns_in_words(pareto):
    from kvplay.show import tables

    rows = tables.rows(pareto)
    assert [r["Cache"] for r in rows] == [r["spec"] for r in pareto.summary_rows()]   # row i is the same point
    assert {"Bits per element", "Mean KL (nats)", "Top-1 agreement (%)", "On the frontier"} <= set(rows[0])
    assert not any("_" in key for row in rows for key in row)


@pytest.mark.parametrize("metric", ["mean_kl", "delta_ppl_pct"])
def test_published_points_are_an_overlay_flagged_as_other_model_other_text(pareto, metric):
    refs = [r for r in tradeoffs.published_points() if r["metric"] == metric]
    assert refs and all(r["source"] and r["model"] and 0 < r["bits_per_element"] <= 16 for r in refs)
    plain = figures.pareto_figure(pareto, metric)
    fig = figures.pareto_figure(pareto, metric, published=tradeoffs.published_points())
    (overlay,) = [t for t in fig.data if t.name not in {u.name for u in plain.data}]
    assert "other model, other text" in overlay.name
    assert list(overlay.y) == [r["value"] for r in refs]
    assert all(r["source"] in text for r, text in zip(refs, overlay.customdata))
    own = sum(len(t.x) for t in plain.data if t.name != "Pareto frontier")
    assert own == len(pareto.points)           # kvplay's own points are the same with or without the overlay


def test_window_sweep_and_drift(bundled):
    model, tok = bundled
    w = tradeoffs.window_sweep_run(model, tok, "kvplay-int2", residuals=(0, 64), sinks=(0, 4),
                                   transformers_schemes=(), tokens=128, chunk=32)
    data = results.to_dict(w)
    assert data["kind"] == "window_sweep" and "flush" in data["note"]
    (cache,) = data["caches"]
    assert [p[:2] for p in cache["points"]] == [[0, 0], [0, 4], [64, 0], [64, 4]]
    kl = {tuple(p[:2]): p[2] for p in cache["points"]}
    assert kl[(64, 0)] < kl[(0, 0)]                                 # a 16-bit window helps
    d = tradeoffs.drift_run(model, tok, ["kvplay-int2"], tokens=256, chunk=64, window=32)
    (c,) = results.to_dict(d)["caches"]
    assert [p[0] for p in c["by_context"]] == [128, 256] and len(c["kl_smoothed"]) == 256 // 32
    assert d.window == 32 and "32 tokens" in d.note


def test_recipes_map_specs_to_engines_with_sources():
    by = {e["engine"]: e for e in tradeoffs.recipe("quanto-int2")["engines"]}
    assert by["transformers"]["exact"] and '"backend": "quanto"' in by["transformers"]["setting"]
    assert all(e["source"].startswith("https://") for e in by.values())
    by = {e["engine"]: e for e in tradeoffs.recipe("kvplay-int4:kbits=8")["engines"]}
    assert "q8_0" in by["llama.cpp"]["setting"] and any("window" in c for c in by["llama.cpp"]["cannot"])
    assert "k_bits=8, v_bits=4" in by["exllamav3"]["setting"] and not by["llama.cpp"]["exact"]
    by = {e["engine"]: e for e in tradeoffs.recipe("kvplay-fp8:residual=0")["engines"]}
    assert "fp8" in by["vLLM"]["setting"] and not any("window" in c for c in by["vLLM"]["cannot"])


def test_llama_cpp_rotates_by_default_so_only_calibrated_rotations_are_beyond_it():
    """Issue 41: the llama.cpp row said it could not express a Hadamard rotation; it rotates by default (attn_rot)."""
    def cannot(spec, engine):
        return " ".join(next(e for e in tradeoffs.recipe(spec)["engines"] if e["engine"] == engine)["cannot"])
    assert "rotat" not in cannot("kvplay-int4:rotation=hadamard", "llama.cpp")
    assert "fitted per layer" in cannot("kvplay-int4:rotation=calibrated", "llama.cpp")
    assert "Hadamard" in cannot("kvplay-int4:rotation=hadamard", "vLLM")
    assert "rotat" not in cannot("kvplay-int4:rotation=none", "vLLM")


@pytest.mark.parametrize("argv, words", [(["recipe", "kvplay-int9"], "Unknown cache"),
                                         (["pareto", "--model", "shakespeare-llama", "--tokens", "5"], "Tokens"),
                                         (["window-sweep", "--model", "shakespeare-llama", "--residuals", "-1"],
                                          "Residual windows")])
def test_cli_bad_input_exits_2_with_one_sentence(argv, words, capsys):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0]


def test_cli_recipe_writes_json(tmp_path, capsys):
    assert main(["recipe", "hqq-int4", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["spec"] == "hqq-int4"
    assert "llama.cpp" in capsys.readouterr().out


def test_tab_lays_out_and_opens_a_point_in_compare():
    import gradio as gr

    from kvplay.app.settings import Settings
    from kvplay.ui.tradeoffs import make_handlers, tradeoffs_tab

    with gr.Blocks() as app:
        with gr.Tab("Compare"):
            box = gr.Textbox(label="Extra specs")
            gr.CheckboxGroup(["kvplay-int4"], label="Caches to compare (16-bit baseline always runs)")
        tradeoffs_tab(app, Settings())
    labels = {b.label for b in app.blocks.values() if isinstance(b, gr.Tab)}
    assert {"Trade-offs", "Equal bytes", "Window and sinks", "Drift", "Other engines"} <= labels
    fills_box = [d for d in app.config["dependencies"] if box._id in d["outputs"]]
    assert fills_box and fills_box[0]["api_name"] == "open_in_compare"
    h = make_handlers(Settings())
    assert h["open_in_compare"]("kvplay-int4:sink=16") == ("kvplay-int4:sink=16", [])   # Compare runs just this
    with pytest.raises(Exception, match="Unknown cache"):
        h["open_in_compare"]("kvplay-int9")
    point = dict(spec="kvplay-int2", backend="kvplay", bits_per_element=6.25, cache_bytes={"total": 40960},
                 mean_kl=0.0011, top1_agreement=0.97, delta_ppl_pct=0.37, on_frontier=True)
    pick, info = h["pick_point"]({"context_tokens": 128, "points": [point]}, "kvplay-int2 #3")   # a chart click
    assert pick.value == "kvplay-int2" and info.startswith("**`kvplay-int2`** (kvplay) at 128 tokens")
    with pytest.raises(Exception, match="not a point of this chart"):
        h["pick_point"]({"context_tokens": 128, "points": [point]}, "kvplay-int4 #4")


def test_the_time_shown_before_a_long_run_is_the_one_measured_with_the_tabs_defaults():
    """Issue 41: Equal bytes (quick) and Window and sinks say before a run how long their defaults took. The figures
    are scripts/time_tradeoffs.py's medians, measured with the defaults the tab has now, and within the targets."""
    from pathlib import Path

    from kvplay.ui import tradeoffs as tab

    measured = json.loads((Path(__file__).parents[1] / "docs/results/tradeoffs-times.json").read_text())
    assert measured["defaults"] == {"equal_bytes_quick_tokens": tab.UI_TOKENS,
                                    **{k: list(v) if isinstance(v, tuple) else v
                                       for k, v in tab.WINDOW_DEFAULTS.items()}}
    for view, target in measured["targets"].items():
        assert tab.TOOK_S[view] == round(target["median_s"]) and target["met"]
        assert f"this took {tab.TOOK_S[view]} s for SmolLM2-135M" in tab.took(view)
    assert measured["measured"].startswith(tab.TOOK_ON[-11:-1])           # the date shown is the run's


def test_report_has_a_tradeoffs_section(pareto, tmp_path, capsys):
    from kvplay.show.report import build_report

    page = build_report([pareto])
    assert results.ParetoResult.title in page and "kvplay-int2:residual=0" in page
    saved = tmp_path / "p.json"
    saved.write_text(json.dumps(results.to_dict(pareto)))
    assert main(["report", "--inputs", str(saved), "--out", str(tmp_path / "r.html")]) == 0
    assert results.ParetoResult.title in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("name", [n for n in SCHEMES if n != "baseline"])
def test_a_recipe_quotes_an_engines_own_cache_exactly_and_nothing_else_as_exact(name):
    """Each method says which engine's own cache it is (CacheMethod.own_recipe): that engine's row quotes the
    setting as exact; kvplay's own schemes, which no engine can express whole, get no exact row."""
    spec = parse_spec(name)
    own = spec.method.own_recipe(spec)
    rows = {e["engine"]: e for e in tradeoffs.recipe(name)["engines"]}
    exact = sorted(engine for engine, row in rows.items() if row["exact"])
    if own is None:
        assert exact == [], (name, exact)
    else:
        assert exact == [own[0]] and rows[own[0]]["setting"] == own[1] and rows[own[0]]["cannot"] == []


def test_the_engines_own_settings_read_as_their_docs_write_them():
    assert parse_spec("llamacpp-q4_0").method.own_recipe(parse_spec("llamacpp-q4_0:ctv=q8_0")) == (
        "llama.cpp", "llama-server -ctk q4_0 -ctv q8_0 -fa on")
    assert parse_spec("vllm-fp8").method.own_recipe(parse_spec("vllm-fp8:scales=prompt"))[1].endswith(
        "--calculate-kv-scales")
    assert "'backend': 'quanto'" not in tradeoffs.recipe("quanto-int4")["engines"][0]["setting"]   # JSON, not repr


def test_a_recipe_shows_what_the_real_llama_cpp_measured_for_its_setting():
    """The llama.cpp row carries the real engine's figures on SmolLM2 for the type it names (assets/
    engines_parity.json, written by scripts/engines_parity.py); a setting nobody measured says so."""
    from kvplay.lab.tradeoffs.recipes import PARITY
    from kvplay.show.tradeoffs import measured_cell

    real = {r["type"]: r for r in json.loads(PARITY.read_text())["texts"][0]["real"]}
    rows = {e["engine"]: e for e in tradeoffs.recipe("kvplay-int4")["engines"]}
    assert rows["llama.cpp"]["measured"]["kl"] == real["q4_0"]["mean_kl"]              # int4's nearest: q4_0
    assert all(rows[e]["measured"] is None for e in rows if e != "llama.cpp")
    assert tradeoffs.recipe("llamacpp-q4_1")["engines"][1]["measured"]["kl"] == real["q4_1"]["mean_kl"]
    assert tradeoffs.recipe("llamacpp-q4_0:ctv=q8_0")["engines"][1]["measured"] is None   # mixed types: not run
    assert measured_cell(rows["llama.cpp"]["measured"]).startswith(f"KL {real['q4_0']['mean_kl']:.3g}, perplexity +")
    assert measured_cell(None) == "-"


def test_drift_draws_zero_kl_on_a_floor_and_ticks_the_lengths_measured():
    """Issue 41: zero KL on a log axis drew vertical lines, and the context ticks read "2 3 4 ... 1000 2"."""
    env = results.Environment(model="m", dtype="bfloat16", device="cpu")
    lengths = [256, 512, 1024, 2048]
    caches = [results.DriftCache(spec="kvplay-int8", kl_smoothed=[[64, 0.0], [128, 0.0]],
                                 by_context=[[n, 0.0] for n in lengths], mean_kl=0.0),
              results.DriftCache(spec="kvplay-int2", kl_smoothed=[[64, 0.001], [128, 0.3]],
                                 by_context=[[n, 0.001 * (n / 256) ** 2] for n in lengths], mean_kl=0.1)]
    drift = results.DriftResult(context_tokens=2048, chunk=16, window=64, note="", env=env, caches=caches)
    along, by_ctx = figures.drift_figures(drift)
    for fig in (along, by_ctx):
        assert fig.layout.yaxis.type == "log" and "log scale" in fig.layout.yaxis.title.text
        zero = next(t for t in fig.data if t.name == "kvplay-int8")
        assert min(zero.y) > 0 and list(zero.customdata) == [0.0] * len(zero.y)     # on the floor; hover says 0
    assert list(by_ctx.layout.xaxis.ticktext) == ["256", "512", "1,024", "2,048"]

"""What should I deploy? (issue 51): the rule on synthetic measurements, the bytes against Capacity, the measurement
store, bad input, and one real run on the bundled model."""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from kvplay.app import advise as app
from kvplay.app.catalogue import GEMMA, QWEN, REAL_MODEL
from kvplay.cache import ggml, parse_spec
from kvplay.cache.arch import published_archs
from kvplay.cli import answers
from kvplay.cli.main import main
from kvplay.errors import KvplayError
from kvplay.lab import advise as lab
from kvplay.lab.capacity import capacity
from kvplay.results import AdviseResult, DeploySetting, Measured, from_dict, to_dict
from kvplay.show import advise as show
from kvplay.show.report import build_report

# A Qwen2.5-like model: keys at q4_0 collapse it, every other type costs a little (KL adds up over K and V).
KEY_KL = {"f16": 0.0, "q8_0": 0.002, "q5_1": 0.03, "q5_0": 0.04, "q4_1": 0.05, "iq4_nl": 0.08, "q4_0": 6.7}
VALUE_KL = {"f16": 0.0, "q8_0": 0.001, "q5_1": 0.003, "q5_0": 0.004, "q4_1": 0.005, "iq4_nl": 0.006, "q4_0": 0.008}
INFO = {"arch": {"name": "qwen-like", "layers": 24, "kv_heads": 2, "head_dim": 64, "params": 494_032_768,
                 "context": 32768}, "env": {"model": "qwen-like", "dtype": "bfloat16", "device": "cpu"},
        "measured": "a test, 2026-12-05", "text_name": "tempest.txt", "task": "pass code"}


def _types(spec: str) -> tuple[str, str]:
    return next(p for p in ((k, v) for k in lab.LLAMA_TYPES for v in lab.LLAMA_TYPES) if lab.pair_spec(*p) == spec)


OWN_KL = {"kvplay-int4": 0.004, "kvplay-3bit": 0.012}       # kvplay's presets: within the bar, fewer bits than any


def qwen_like(spec: str) -> Measured:
    if spec in OWN_KL:
        return Measured(spec, OWN_KL[spec], 0.97, 0.5, "27611", True, 0.1)
    k, v = _types(spec)
    kl = KEY_KL[k] + VALUE_KL[v]
    return Measured(spec, kl, 1 - min(kl, 0.95), 100 * kl, "27611" if kl < 1 else "The ship", kl < 1, 0.1)


def answer(engine="llama.cpp", lookup=qwen_like, bar="default", **inputs) -> tuple[AdviseResult, list[str]]:
    """The advice from synthetic measurements, and the specs looked up (in order)."""
    asked = []

    def counted(spec):
        asked.append(spec)
        return lookup(spec)
    checked = app.check_inputs(engine, bar=bar, **inputs)
    return app.compose("qwen-like", checked, INFO, *lab.collect(checked.engine, counted, checked.bar)), asked


def test_keys_at_q4_0_break_the_model_and_are_never_recommended():
    result, asked = answer()
    assert result.recommended == lab.pair_spec("q8_0", "iq4_nl")       # 6.5 bits, KL 0.008 under the bar's 0.02
    assert not any(_types(s)[0] == "q4_0" and row.meets_bar for s in asked[:-2] for row in [result.setting(s)])
    own = result.own                         # fewer bits than any pair and within the bar, yet never the answer
    assert [r.spec for r in own] == list(lab.OWN) and all(r.meets_bar and r.bits < 5 for r in own)
    assert all(r.context_fits > result.choice.context_fits and "not deployable in llama.cpp" in r.verdict for r in own)
    assert result.settings[-2:] == own and all(r.flag.startswith("not deployable in llama.cpp") for r in own)
    assert show.own_line(result).startswith("Not deployable in llama.cpp, for comparison: kvplay's own presets "
                                            "would buy kvplay-int4 ")
    assert asked[-2:] == list(lab.OWN)                                  # kvplay's presets, after the engine's
    assert len(asked) - 2 == len(set(asked)) - 2 < 49 / 2               # pruned: 13 of 49 pairs measured
    assert sum(r.status == "pruned" for r in result.settings) == 49 - (len(asked) - 2)
    assert all(r.verdict.startswith("not measured: ") for r in result.settings if r.status == "pruned")
    words = show.risks(result)
    assert any(w.startswith("Keys at q4_0 break this model") for w in words), words
    assert show.sentence(result).startswith("Use K q8_0 / V iq4_nl: ")


def test_the_chart_is_the_engines_settings_with_the_choice_marked():
    """Equal bytes restricted to the engine: its measured settings, the recommendation outlined, kvplay's presets
    faded and named as not deployable; no verdict colour on any point (kvplay.show.style.VERDICT is the verdict's)."""
    from kvplay.show.style import VERDICT

    result, _ = answer()
    fig = show.figure(result)
    points = [t for t in fig.data if t.x[0] is not None and t.mode == "markers+text"]
    measured = [r for r in result.deployable if r.mean_kl is not None]
    assert [t.name for t in points] == [r.label for r in measured] + [f"{s} (kvplay's own)" for s in lab.OWN]
    outlined = [t.name for t in points if t.marker.line.width == 3]
    assert outlined == [result.choice.label] == ["K q8_0 / V iq4_nl"]
    assert all(t.opacity == 0.45 for t in points[-2:]) and all(t.opacity == 1.0 for t in points[:-2])
    assert "kvplay's own (faded): not deployable in llama.cpp" in [t.name for t in fig.data]
    assert not {t.marker.color for t in points} & set(VERDICT.values())
    assert "llama.cpp's settings" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "bits per cached element (K and V)"
    assert fig.layout.yaxis.title.text.startswith("mean KL to 16-bit (nats)")
    vllm, _ = answer("vllm", lambda s: qwen_like(s) if s in OWN_KL else Measured(s, 0.01, 0.99, 1, "27611", True, 1))
    assert {t.name for t in show.figure(vllm).data if t.mode == "markers+text"} == \
        {r.label for r in vllm.deployable if r.mean_kl is not None} | {f"{s} (kvplay's own)" for s in lab.OWN}


def test_ties_go_to_the_lowest_kl_and_the_bar_moves_the_choice():
    result, _ = answer()
    tied = [r for r in result.settings if r.bits == 6.5 and r.meets_bar]
    assert len(tied) == 2 and min(tied, key=lambda r: r.mean_kl).spec == result.recommended   # V iq4_nl over q4_0
    strict, _ = answer(bar="strict")                                    # KL at most 0.005, top-1 at least 98%
    assert strict.recommended == lab.pair_spec("q8_0", "q5_1")          # 7.25 bits, KL 0.005
    rows = [DeploySetting("a", "a", "", "measured", bits=8, context_fits=100, mean_kl=0.01, meets_bar=True),
            DeploySetting("b", "b", "", "measured", bits=8, context_fits=100, mean_kl=0.001, meets_bar=True),
            DeploySetting("c", "c", "", "measured", bits=4, context_fits=200, mean_kl=0.3, meets_bar=False)]
    assert lab.recommend(rows).spec == "b"


def test_an_answer_lost_misses_the_bar_only_where_16_bit_answers():
    lost = Measured("x", 0.001, 0.99, 0.1, "2761", False, 0.1)
    assert lab.judge(lost, lab.BARS["default"], needs_answer=True) == (False, "answer lost")
    assert lab.judge(lost, lab.BARS["default"], needs_answer=False)[0]

    def wrong_everywhere(spec):              # 16-bit answers wrong: the bar is KL alone
        return Measured(spec, 0.0 if spec == "baseline" else 0.01, 0.99, 1.0, "1", False, 0.1)
    result, _ = answer("ollama", wrong_everywhere)
    assert not result.needs_answer and result.recommended == "llamacpp-q4_0"
    broken, _ = answer("ollama", lambda s: wrong_everywhere(s) if s == "baseline" else qwen_like(s))
    assert broken.recommended == "llamacpp-q8_0"          # q4_0's keys: KL 6.7


def test_context_that_fits_is_capacitys_arithmetic():
    arch = published_archs()["Qwen2.5-7B"]
    result, _ = answer("ollama", gpu="24", arch="Qwen2.5-7B", weights="int4", context=32768)
    free = 24 * 2**30 - arch.params * 0.5
    per_token = {s: b / 8 * arch.elements_per_token for s, b in (("baseline", 16), ("llamacpp-q8_0", 8.5),
                                                                 ("llamacpp-q4_0", 4.5))}
    expected = capacity({s: b * 8 / arch.elements_per_token for s, b in per_token.items()}, arch, 24, "int4", 32768)
    for row, cap in zip(result.settings, expected.caches):
        assert row.context_fits == math.floor(free / per_token[row.spec]) == (cap.cache_fits or cap.max_context)
        assert row.max_batch == cap.max_batch == math.floor(free / (per_token[row.spec] * 32768))
    assert result.settings[0].context_fits == 382_986           # Qwen2.5-7B: 56 KiB a token in 16-bit
    assert result.recommended == "llamacpp-q8_0" and result.projected
    assert show.sentence(result) == ("Use q8_0: 2.0x the sequences at 32k tokens in a 24 GB GPU (22 instead of 11); "
                                     "one sequence reaches the model's 128k-token limit either way, answer kept, KL "
                                     "0.003.")
    fp16, _ = answer("ollama", gpu="16", arch="Qwen2.5-7B", weights="float16", context=32768)   # 15.2 GB of weights
    assert [r.context_fits for r in fp16.deployable] == [33_981, 63_965, 120_823]
    assert show.sentence(fp16) == ("Use q8_0: 1.9x the context in 16 GiB (64k instead of 34k tokens), answer kept, "
                                   "KL 0.003.")
    assert "measured on the 0.5B sibling (qwen-like)" in show.scope(result)


def test_bad_input_is_one_sentence_naming_the_choices(capsys):
    with pytest.raises(KvplayError, match=r"^Unknown engine 'vlm'; choose one of ollama, llama.cpp, lmstudio, vllm, "
                                          r"sglang, transformers\.$"):
        app.check_inputs("vlm")
    for kwargs, words in ((dict(gpu="banana"), "Unknown GPU"), (dict(bar="lax"), "Unknown quality bar"),
                          (dict(weights="q4_k"), "Unknown weight dtype"), (dict(arch="GPT-5"), "Unknown architecture")):
        with pytest.raises(KvplayError, match=words):
            app.check_inputs("ollama", **kwargs)
    assert main(["advise", "--engine", "nope", "--model", "shakespeare-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: Unknown engine 'nope'; choose one of ollama, llama.cpp, lmstudio, vllm, sglang, "
                   "transformers."]


def test_the_light_cli_knows_the_engines_gpus_and_bars():
    assert answers.ENGINE_KEYS == tuple(lab.ENGINES) and answers.GPU_KEYS == tuple(lab.GPUS)
    assert answers.BAR_KEYS == tuple(lab.BARS)
    assert app.check_inputs("LM Studio").engine.key == "lmstudio" and app.check_inputs("llamacpp").engine.pairs
    for engine in lab.ENGINES.values():          # every flag names the engine's own setting for it
        for d in engine.settings:
            k, v = _types(d.spec) if engine.pairs else (None, None)
            assert engine.key != "llama.cpp" or d.spec == "baseline" or f"-ctk {k} -ctv {v}" in d.flag
    assert lab.ENGINES["llama.cpp"].settings[0].spec == "baseline" and len(lab.ENGINES["llama.cpp"].settings) == 49
    assert [ggml.bits_per_element(t) for t in lab.LLAMA_TYPES] == sorted(
        (ggml.bits_per_element(t) for t in lab.LLAMA_TYPES), reverse=True)   # PRECISER's order follows the bytes


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("advise")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPLAY_ADVISE_DIR", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(scope="module")
def live(store, bundled):
    """Ollama's three settings measured on the bundled model (64 tokens, chunk 16: about 2 s on 2 cores)."""
    return app.advise("shakespeare-llama", "ollama", tokens=64, chunk=16, device="cpu")


def test_a_real_answer_on_the_bundled_model(live, tmp_path):
    assert [r.spec for r in live.settings] == ["baseline", "llamacpp-q8_0", "llamacpp-q4_0", *lab.OWN]
    assert [r.status for r in live.settings] == ["measured"] * 5 and live.cached == 0
    assert [r.deployable for r in live.settings] == [True] * 3 + [False] * 2
    base, q8, q4 = live.deployable
    assert base.mean_kl == 0 and base.top1 == 1 and not live.needs_answer     # the toy model has no task to answer
    assert 0 < q8.mean_kl < q4.mean_kl < 0.02       # measured 0.0003 and 0.002 at 64 tokens
    assert live.setting(live.recommended).meets_bar and live.recommended == "llamacpp-q4_0"
    assert live.paste == "OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE=q4_0 ollama serve"
    assert [c.key for c in live.caveats] == ["ollama-fa"]
    assert from_dict(to_dict(live)) == live
    assert show.figure(live).data and "<pre class='kv-paste'>" in show.answer_html(live)
    assert "What should I deploy?" in build_report([live])
    int4, three = live.own            # kvplay's presets: measured the same way, within the bar, never the answer
    assert three.meets_bar and three.context_fits > q4.context_fits and three.mean_kl is not None
    assert "not deployable in Ollama" in three.verdict and "kvplay&#x27;s own presets" in show.answer_html(live)
    assert live.needle_tokens == 0 and "Needle not measured: on a CPU" in show.answer_html(live)   # device="cpu"
    assert set(show.table_rows(live)[0]) >= {"Answer", "Needle"} and {r["Needle"] for r in show.table_rows(live)} \
        == {"not measured"}


def test_asking_again_reads_the_store_and_loads_no_model(live, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(app, "run_plan", refuse)
    monkeypatch.setattr(lab, "measure", refuse)
    again = app.advise("shakespeare-llama", "ollama", gpu="h100", tokens=64, chunk=16, device="cpu")
    assert again.cached == 5 and [r.mean_kl for r in again.settings] == [r.mean_kl for r in live.settings]
    assert again.budget == "an H100 80GB" and again.settings[0].max_batch > live.settings[0].max_batch
    assert again.seconds < 1.0                      # measured 0.03 s
    with pytest.raises(AssertionError, match="measured again"):    # another text length is another measurement
        app.advise("shakespeare-llama", "ollama", tokens=96, chunk=16, device="cpu")


def test_the_tab_answers_and_opens_on_recordings(live):
    from kvplay.app.settings import Settings
    from kvplay.ui.deploy import make_deploy

    h = make_deploy(Settings())
    words, table, figure, status, files = h["deploy"]("shakespeare-llama", "ollama", "h200", 0, "", "default", "")
    assert "Use q4_0: " in words and list(table["Setting"])[:3] == ["f16 (the default)", "q8_0", "➜ q4_0"]
    assert figure.data and status == "" and [f.rsplit(".", 1)[1] for f in files] == ["json", "csv", "html"]
    words, table, figure = h["deploy_recording"]("qwen2.5-coder-0.5b-instruct", "llama.cpp")
    assert "Use K f16 / V q4_0: " in words and "Recorded on " in words and "Keys at q4_0 break this model" in words
    words, table, figure = h["deploy_recording"]("shakespeare-llama", "vllm")
    assert "No recorded answer for shakespeare-llama on vLLM" in words and table is None and figure is None
    # A share link's inputs: answered from the store where they were measured, else a recording made with them,
    # else a line saying to press Advise; never a model run (run_plan is not called by deploy_linked).
    words, table, figure = h["deploy_linked"]("shakespeare-llama", "ollama", "h200", None, "", "default", "", None)
    assert "Use q4_0: " in words and "settings read from earlier measurements" in words and figure.data
    words, _, _ = h["deploy_linked"]("qwen2.5-coder-0.5b-instruct", "llama.cpp", "24", None, "", "default", "", None)
    assert "Use K f16 / V q4_0: " in words and "Recorded on " in words
    words, table, _ = h["deploy_linked"]("qwen2.5-coder-0.5b-instruct", "llama.cpp", "48", None, "", "default", "",
                                         None)
    assert "inputs this server has not answered yet: press <b>Advise</b>" in words and table is None


def test_the_share_link_carries_every_input_of_the_tab():
    """The link's keys are the handler's parameters (prefixed, so Compare's link reader never takes them)."""
    import inspect

    from kvplay.app.settings import Settings
    from kvplay.ui import deploy

    params = list(inspect.signature(deploy.make_deploy(Settings())["deploy"]).parameters)
    assert list(deploy.KEYS) == params[:-1] and params[-1] == "progress"
    assert list(inspect.signature(deploy.make_deploy(Settings())["deploy_linked"]).parameters)[:-1] == params[:-1]
    write, read = deploy._share_js(), deploy._read_link_js()
    assert "'deploy.' + k" in write and "'deploy.' + k" in read and "'Deploy'" in read


def test_the_needle_is_measured_when_asked_and_kept_apart(store, live, monkeypatch):
    """--needle 256 on the bundled model: each setting's needle is measured (the text's measurements read back),
    then kept in its own file; without it the same store answers again."""
    needled = app.advise("shakespeare-llama", "ollama", tokens=64, chunk=16, device="cpu", needle=256)
    assert needled.needle_tokens == 256 and not needled.needle_note
    assert all(r.needle_found is not None for r in needled.settings)      # every row, kvplay's own too
    assert needled.needs_needle == bool(needled.reference.needle_found)
    assert [r.mean_kl for r in needled.settings] == [r.mean_kl for r in live.settings]
    assert list(show.table_rows(needled)[0])[7] == "Needle at 256"
    monkeypatch.setattr(app, "run_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured again")))
    again = app.advise("shakespeare-llama", "ollama", tokens=64, chunk=16, device="cpu", needle=256)
    assert [r.needle for r in again.settings] == [r.needle for r in needled.settings] and again.cached == 5
    assert app.advise("shakespeare-llama", "ollama", tokens=64, chunk=16, device="cpu", needle=512,
                      measure=False) is None                              # another length: not measured yet
    with pytest.raises(KvplayError, match="Needle must be 0 .not measured. or at least 256 tokens"):
        app.check_inputs("ollama", needle=100)


def test_a_needle_lost_misses_the_bar_only_where_16_bit_finds_it():
    lost = Measured("x", 0.001, 0.99, 0.1, "27611", True, 0.1, needle_tokens=32768, needle="1", needle_found=False)
    assert lab.judge(lost, lab.BARS["default"], True, needs_needle=True) == (False, "needle lost at 32,768 tokens")
    assert lab.judge(lost, lab.BARS["default"], True, needs_needle=False)[0]
    assert app.needle_tokens(None, "cpu", 32744) == 0 and app.needle_tokens(None, "cuda", 32744) == 32744
    with pytest.raises(KvplayError, match="at most 32,744 tokens"):
        app.needle_tokens(40000, "cuda", 32744)


def test_the_real_llama_cpp_backs_the_llama_cpp_rows_when_installed(live, bundled, tmp_path, monkeypatch):
    """With llama-cpp-python and a GGUF, the llama.cpp family's rows come from llama.cpp's own runs, against its f16
    cache, and the table says so. The double below stands in for llama.cpp (not installed here): it runs the bundled
    model through kvplay's emulation of the same types, so the real path must give the emulated run's figures."""
    from contextlib import contextmanager

    import torch

    from kvplay.lab import llamacpp

    model, tok = bundled
    opened = []

    @contextmanager
    def context(path, spec, n_ctx, n_batch=512, n_ubatch=512):
        opened.append((str(spec), n_batch, Path(path).name))
        yield spec

    def eval_logits(spec, ids):
        emulated = parse_spec(lab.pair_spec(spec.ctk, spec.ctv))
        probe = lab.Probe(torch.tensor([ids]), 16, torch.tensor([[1]]), None, "", 1, None)
        return lab.text_logits(model, tok, emulated, probe)[0].numpy()
    monkeypatch.setattr(llamacpp, "context", context)
    monkeypatch.setattr(llamacpp, "eval_logits", eval_logits)
    monkeypatch.setattr(app, "real_gguf", lambda name, engine: tmp_path / "model.gguf" if engine.pairs or
                        engine.key == "ollama" else None)
    monkeypatch.setenv("KVPLAY_ADVISE_DIR", str(tmp_path / "store"))
    real = app.advise("shakespeare-llama", "ollama", tokens=64, chunk=16, device="cpu")
    assert opened == [("llama.cpp:f16", 16, "model.gguf"), ("llama.cpp:q8_0", 16, "model.gguf"),
                      ("llama.cpp:q4_0", 16, "model.gguf")]
    assert [r.source for r in real.settings] == ["llama.cpp"] * 3 + ["kvplay"] * 2
    assert [r.mean_kl for r in real.settings] == pytest.approx([r.mean_kl for r in live.settings], rel=1e-5)
    assert [r["Setting"] for r in show.table_rows(real)][:3] == [
        "f16 (the default) [the real llama.cpp]", "q8_0 [the real llama.cpp]", "➜ q4_0 [the real llama.cpp]"]
    assert any("measured by llama.cpp itself" in n for n in real.notes)
    opened.clear()
    assert app.advise("shakespeare-llama", "ollama", gpu="48", tokens=64, chunk=16, device="cpu").cached == 5
    assert opened == []                                    # kept under the real engine's specs: read back
    assert lab.real_spec("vllm-fp8") is None and str(lab.real_spec(lab.pair_spec("q8_0", "q4_0"))) == \
        "llama.cpp:ctk=q8_0,ctv=q4_0"


def test_the_cli_keeps_its_printed_answer(store, live, capsys):
    argv = ["advise", "--model", "smollm2-135m-instruct", "--engine", "ollama"]
    args = answers.argparse.ArgumentParser()
    answers.add_arguments(args)
    answers.keep(args.parse_args(argv[1:]), "Use q8_0: kept.\n")
    assert answers.print_kept(argv[1:])
    assert capsys.readouterr().out.startswith("Use q8_0: kept.\n\n(asked before: the kept answer, read in ")
    assert not answers.print_kept(argv[1:] + ["--gpu", "48"])          # another question
    assert not answers.print_kept(["--model", "shakespeare-llama"])   # not a pinned file: always asked


@pytest.mark.slow
def test_the_advise_endpoint_answers_through_gradio_client(client, store):
    """The /advise endpoint: the Deploy tab's inputs by name, the answer, the table and the JSON contract."""
    import json

    from kvplay.ui.deploy import KEYS

    api = client.view_api(return_format="dict")["named_endpoints"]["/advise"]
    assert [p["parameter_name"] for p in api["parameters"]] == list(KEYS)
    words, table, chart, status, files = client.predict(model="shakespeare-llama", engine="ollama", budget="h200",
                                                        api_name="/advise")
    assert "Use q4_0: " in words and "an H200 141GB" in words
    paths = [f if isinstance(f, str) else f.get("path") or f.get("value") for f in files]
    data = json.loads(Path(next(f for f in paths if f.endswith(".json"))).read_text(encoding="utf-8"))
    assert data["kind"] == "advise" and data["recommended"] == "llamacpp-q4_0"
    assert [r["deployable"] for r in data["settings"]] == [True] * 3 + [False] * 2


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
START = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def deploy_url():
    """The app opening on SmolLM2 (its recorded answers), with no model loaded: the tab needs none to open."""
    from kvplay.app.settings import Settings
    from kvplay.ui import app as ui

    mp = pytest.MonkeyPatch()
    mp.setattr(ui, "warm_start", lambda settings, name: None)
    mp.setattr(ui, "startup_model", lambda settings: (START, None))       # the page's start, as ui.app calls it
    app_ = ui.build_app(Settings(default_model=START))
    app_.launch(**{**ui.launch_kwargs(), "server_port": None}, prevent_thread_lock=True, quiet=True)
    yield app_.local_url
    app_.close()
    mp.undo()


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists() or os.environ.get("KVPLAY_BROWSER_TEST") == "0",
                    reason="needs Debian's chromium")
@pytest.mark.parametrize("width, height", [(1440, 900), (390, 844)])
def test_the_deploy_tab_opens_on_a_recorded_answer_in_the_first_screen(deploy_url, width, height):
    """Issue 51's done-when: the Deploy tab opens on a recorded answer, the recommendation inside the first screen."""
    from playwright.sync_api import sync_playwright

    assert app.recorded(START, "ollama") is not None, "record it: python scripts/record_deploy.py"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(deploy_url, wait_until="load")
        page.get_by_role("tab", name="Deploy", exact=True).click()
        answer = page.locator("#kv-deploy-answer .kv-overall")
        answer.wait_for()
        box = answer.bounding_box()
        words = answer.inner_text()
        recorded = page.locator("#kv-deploy-answer .kv-foot").last.inner_text()
        wide = page.evaluate("document.documentElement.scrollWidth")
        browser.close()
    assert words.startswith(("Use ", "Keep ")) and "Recorded on " in recorded
    assert 0 <= box["y"] and box["y"] + box["height"] <= height, f"the answer ends at {box['y'] + box['height']} px"
    assert wide <= width + 1


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists() or os.environ.get("KVPLAY_BROWSER_TEST") == "0",
                    reason="needs Debian's chromium")
def test_a_deploy_link_reopens_its_inputs_and_answer(deploy_url):
    """Link to these inputs, then open the link: the Deploy tab is selected, its inputs filled in, the answer to them
    shown (here Qwen2.5's llama.cpp recording, made with these inputs)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(deploy_url, wait_until="load")
        page.get_by_role("tab", name="Deploy", exact=True).click()
        page.locator("#kv-deploy-answer .kv-overall").wait_for()
        page.get_by_label("llama.cpp", exact=True).check()
        page.locator("#kv-deploy-share").click()
        link = page.locator("#kv-deploy-link textarea, #kv-deploy-link input").first
        page.wait_for_function("() => location.hash.includes('deploy.engine=llama.cpp')")
        shared = link.input_value()
        assert shared.startswith(deploy_url.rstrip("/")) and "deploy.model=smollm2-135m-instruct" in shared
        url = shared.replace("deploy.model=smollm2-135m-instruct", "deploy.model=qwen2.5-coder-0.5b-instruct")
        fresh = browser.new_page(viewport={"width": 1440, "height": 900})
        fresh.goto(url, wait_until="load")
        # The page first opens on the default model's recording, so wait for the linked model's answer itself.
        fresh.wait_for_function("() => [...document.querySelectorAll('#kv-deploy-answer .kv-overall')]"
                                ".some(e => e.innerText.startsWith('Use K f16 / V q4_0'))", timeout=30_000)
        words = fresh.locator("#kv-deploy-answer .kv-overall").inner_text()
        selected = fresh.locator("button[role='tab'][aria-selected='true']").first.inner_text()
        browser.close()
    assert words.startswith("Use K f16 / V q4_0: ") and selected.strip() == "Deploy"


def test_the_recordings_open_and_docs_deploy_md_shows_them():
    """Every recorded answer opens with today's classes, recommends a setting that meets its bar, and is the evidence
    docs/deploy.md shows (python scripts/record_deploy.py --docs-only rewrites it)."""
    kept = {(p.parent.name, p.stem) for p in app.RECORDED.glob("*/*.json")}
    assert {(m, "ollama") for m in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")} <= kept
    found = {}
    for model, engine in sorted(kept):
        result = app.recorded(model, engine)
        assert result.recorded.startswith("on ") and result.choice.meets_bar and result.engine == engine
        found.setdefault(model, {})[engine] = result
    qwen = found["qwen2.5-coder-0.5b-instruct"]
    for engine in {"ollama", "llama.cpp", "lmstudio"} & set(qwen):      # keys at q4_0 break Qwen2.5
        assert getattr(parse_spec(qwen[engine].recommended).options, "ctk", None) != "q4_0"
        assert any(row.startswith("Keys at q4_0 break") or row.startswith("q4_0 breaks")
                   for row in show.risks(qwen[engine]))
    doc = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text(encoding="utf-8")
    order = {m: [found[m][e] for e in lab.ENGINES if e in found[m]] for m in (REAL_MODEL, QWEN, GEMMA) if m in found}
    assert show.docs_section(order) in doc, "python scripts/record_deploy.py --docs-only"

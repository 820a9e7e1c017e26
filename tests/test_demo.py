"""Issue 25's demo: tasks with answers to check, the recorded runs the page opens on, and docs/demo.md's figures.

The recordings are read and drawn here with the current code and no model; a recording whose format has drifted
from the result classes fails until it is re-recorded (python scripts/record_demo.py). The real-model tests
(marked like tests/test_real_model.py's) pin the 16-bit greedy answer to every task's expected one.
"""
from dataclasses import fields
from pathlib import Path

import pytest

from kvplay.app import prompts
from kvplay.app.catalogue import GEMMA, QWEN, REAL_MODEL
from kvplay.results import CacheRun, CompareResult, Environment
from kvplay.show import cards as render
from kvplay.show import recorded

ROOT = Path(__file__).resolve().parents[1]
TASKS = prompts.tasks(REAL_MODEL)
CHECKED = [t for t in TASKS if t.expected is not None]
RECORDED_MODELS = [REAL_MODEL, QWEN, GEMMA]          # every real catalogue model: the page opens on each one's run
RECORDED = [(m, t) for m in RECORDED_MODELS for t in prompts.tasks(m)]


# ---------------------------------------------------------------------------- the tasks (no model)

def test_every_task_declares_an_answer_or_none_and_the_default_has_one():
    assert TASKS[0].prompt == prompts.default_prompt(REAL_MODEL) and TASKS[0].expected == prompts.PASS_CODE
    assert len({t.slug for t in TASKS}) == len(TASKS) and len(TASKS) >= 3
    assert any(t.expected is None for t in TASKS)                       # a story says it has no answer
    for t in TASKS:
        assert t.check in prompts.CHECKS and 1 <= t.max_new_tokens <= 128
        if t.expected is not None:
            assert t.expected in t.prompt                               # the answer is there to retrieve
    assert prompts.PASS_NOTE.format(code=prompts.PASS_CODE) in TASKS[0].prompt
    assert prompts.example_prompts(REAL_MODEL) == [t.prompt for t in TASKS[1:]]
    assert all(t.expected is None for t in prompts.tasks("shakespeare-llama"))   # the bundled model continues text
    assert prompts.task_for(" " + TASKS[2].prompt + "\n") == TASKS[2] and prompts.task_for("my own prompt") is None


def test_the_pass_code_sits_far_outside_every_16_bit_window():
    """~350 tokens into ~1,270: every quantized cache holds it quantized when the question comes."""
    prompt = TASKS[0].prompt
    before = prompt.index(prompts.PASS_CODE)
    assert 0.2 < before / len(prompt) < 0.4                              # 0.29 of the characters
    assert len(prompt) - before > 2000                                   # ~600 tokens after it, windows hold 128


@pytest.mark.parametrize("text, expected, check, graded", [
    ("The pass code for the ship's strongroom is 27611.", "27611", "number", ("27611", True)),
    ("The pass code is 2761.", "27611", "number", ("2761", False)),           # a digit lost
    ("The pass code is 276110.", "27611", "number", ("276110", False)),       # not the same number
    ("The old, the code.\n\n[The next sentence is a sentence", "27611", "number",
     ("The old, the code. [The next…", False)),                              # quanto-int2's answer, measured
    ("", "27611", "number", ("nothing", False)),
    ("It raises an AssertionError.", "AssertionError", "word", ("AssertionError", True)),
    ("It raises a ValueError.", "AssertionError", "word", ("It raises a ValueError.", False)),
    ("Once upon a time", None, "number", None),
])
def test_grade_finds_the_expected_answer_only_as_a_whole(text, expected, check, graded):
    assert prompts.grade(text, expected, check) == graded


def _run(spec: str, text: str, partial: bool = False, expected: str = "27611") -> CacheRun:
    """A CacheRun as the lab writes it: graded once its decoding is over (partial: still decoding)."""
    graded = None if partial else prompts.grade(text, expected)
    pieces = text.split(" ")
    tokens = [p if i == 0 else " " + p for i, p in enumerate(pieces)]
    n = len(tokens)
    return CacheRun(spec=spec, text=text, token_ids=list(range(n)), tokens=tokens, first_divergence=None,
                    match_fraction=1.0, diff_spans=[], kl=[0.001] * n, top1=[True] * n, baseline_logprob=[0.0] * n,
                    mean_kl=0.001, max_kl=0.001, top1_agreement=1.0, context_tokens=[100 + n],
                    cache_bytes_per_step=[1000], cache_bytes=1000, baseline_bytes=4000, compression=4.0,
                    bits_per_element=4.0, prefill_s=0.1, prefill_tokens_per_s=1000.0, decode_tokens_per_s=0.0,
                    wall_s=1.0, partial=partial, answer=graded and graded[0], answer_right=graded and graded[1])


def _result(expected, caches, prompt="...the scene above? Answer in one sentence.") -> CompareResult:
    res = CompareResult(prompt=prompt, prompt_tokens=100, max_new_tokens=32, batch_size=1, sampling={},
                        env=Environment(model=REAL_MODEL, dtype="bfloat16", device="cpu"), caches=caches, chat=True)
    res.expected = expected
    return res


def test_cards_and_verdict_carry_the_task_line_with_the_prompt_and_answer_apart():
    res = _result("27611", [_run("baseline", "The pass code is 27611."), _run("quanto-int2", "The code is 2761."),
                            _run("kvplay-int4", "The pass code is 27611.", partial=True)])
    base, wrong, running = (render.card(r, res) for r in res.caches)
    assert "answer: 27611 ✓" in base and "kv-task right" in base
    assert "answer: 2761 ✗ (expected 27611)" in wrong and "kv-task wrong" in wrong
    assert "answer: checked when decoding ends" in running and "✓" not in running   # never graded half-way
    prompt_at, answer_at = base.index("class='kv-prompt'"), base.index("class='kv-answer'")
    assert prompt_at < base.index("Answer in one sentence.") < answer_at < base.index("27611.</span>")
    verdict = render.verdict_html(res)
    assert "quanto-int2: " in verdict and "answer: 2761 ✗ (expected 27611)" in verdict
    assert "16-bit baseline" in verdict and "answer: 27611 ✓" in verdict
    res.expected = None                                                  # a story: no task line at all
    assert "kv-task" not in render.cards_html(res) and "answer:" not in render.verdict_html(res)


def _graded(spec: str, answer: str, kl: float, top1: float, n: int = 32, partial: bool = False) -> CacheRun:
    run = _run(spec, " ".join(["x"] * (n - 1) + [answer]), partial=partial)
    run.kl, run.mean_kl, run.top1_agreement = [kl] * n, kl, top1
    return run


def test_the_headline_never_calls_a_cache_that_answered_wrong_closest():
    """Issue 41: with hqq-int2, quanto-int2 and kvplay-int4 ticked, the finished headline ranked hqq-int2 (wrong,
    KL 2.7) "closest" among the 2-bit caches. Issue 50: it then left out kvplay-int4, the only cache that kept the
    answer, and printed "6.4-6.4x". It now leads with a cache that kept the answer, and each size says whose it is."""
    base = _graded("baseline", "27611", 0.0, 1.0)
    hqq, quanto = _graded("hqq-int2", "2761", 2.7, 0.3), _graded("quanto-int2", "5", 3.6, 0.27)
    kv2, kv4 = _graded("kvplay-int2", "27611", 0.03, 0.9), _graded("kvplay-int4", "27611", 3.0, 0.3)
    for run, size in ((hqq, 6.4), (quanto, 6.4), (kv2, 6.3), (kv4, 3.4)):
        run.compression = run.long_context_compression = size
        run.long_context_tokens = 8192
    sentence = render.overall_sentence(_result("27611", [base, hqq, quanto, kv2]))
    assert sentence == ("kvplay-int2 (6.3x smaller at 8k) kept the answer and drifts from 16-bit (KL 0.03); hqq-int2 "
                        "and quanto-int2 (6.4x smaller at 8k each) lost it."), sentence
    triple = render.overall_sentence(_result("27611", [base, hqq, quanto, kv4]))     # the triple
    assert triple.startswith("kvplay-int4 (3.4x smaller at 8k) kept the answer"), triple
    assert "6.4-6.4x" not in triple and "closest" not in triple
    lost = render.overall_sentence(_result("27611", [base, hqq, quanto]))
    assert lost == "No cache kept the answer; hqq-int2 (6.4x smaller at 8k) drifts least (KL 2.7).", lost


def test_a_finished_short_answer_is_judged():
    """Issue 49/50: the 16-bit model answered the pass code in 6 tokens and stopped; quanto-int4 answered wrong, and
    the headline read "Too few tokens to judge" with every card "pending". A finished answer is judged on the tokens
    it has: the answer first, then KL and top-1 over those tokens, with their number."""
    base = _graded("baseline", "27611", 0.0, 1.0, n=6)
    wrong = _graded("quanto-int4", "2", 3.9, 0.33, n=6)
    right = _graded("kvplay-int4", "27611", 0.0006, 1.0, n=6)
    res = _result("27611", [base, wrong, right])
    assert render.overall_sentence(res).startswith("kvplay-int4 (4.0x smaller now) kept the answer and stays close to "
                                                   "16-bit (KL <0.001 over 6 tokens); quanto-int4")
    assert "lost it" in render.overall_sentence(res)
    verdict = render.verdict_html(res)
    assert "pending" not in verdict and "Too few" not in verdict
    assert "quanto-int4: far from 16-bit" in verdict and "answer: 2 ✗ (expected 27611)" in verdict
    assert "KL 3.9 over 6 tokens" in verdict
    assert "kv-badge red" in render.card(wrong, res) and "kv-badge green" in render.card(right, res)
    still = _result("27611", [_graded("baseline", "x", 0.0, 1.0, n=6, partial=True),
                              _graded("quanto-int4", "x", 3.9, 0.33, n=6, partial=True)])
    assert render.overall_sentence(still).startswith("Decoding: 6 of 32 tokens so far")     # mid-run: still pending


def test_no_cache_is_judged_before_eight_decoded_tokens():
    """Issue 41: after one token, quanto-int2 read "close to 16-bit ... same text for all 1 tokens · KL 0"."""
    base = _graded("baseline", "27611", 0.0, 1.0, n=1, partial=True)
    early = _graded("quanto-int2", "The", 0.0, 1.0, n=1, partial=True)
    res = _result("27611", [base, early])
    verdict = render.verdict_html(res)
    assert "close to 16-bit" not in verdict and "far from" not in verdict
    assert "quanto-int2: pending · 1 tokens so far (a verdict needs 8)" in verdict
    assert render.overall_sentence(res) == "Decoding: 1 of 32 tokens so far; the verdict comes at 8."
    assert "kv-badge pending" in render.card(early, res) and "close to 16-bit" not in render.card(early, res)
    later = _result("27611", [_graded("baseline", "x", 0.0, 1.0, n=8, partial=True),
                              _graded("quanto-int2", "x", 0.001, 1.0, n=8, partial=True)])
    assert render.overall_sentence(later).startswith("So far, 8 of 32 tokens (answers are checked when decoding "
                                                     "ends): quanto-int2 (4.0x smaller now) stays")


# ---------------------------------------------------------------------------- the recordings (no model)

@pytest.fixture
def no_model(monkeypatch):
    """Loading any model fails the test: the recordings must draw from their JSON alone."""
    from kvplay.app import jobs, models

    def refuse(*args, **kwargs):
        raise AssertionError("a recording ran a model")
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(jobs, "load_model", refuse)      # every command loads through the job envelope


def _files() -> dict:
    import json

    missing = [(m, t.slug) for m, t in RECORDED if not recorded.path(t.slug, m).is_file()]
    assert not missing, f"no recording for {missing}: python scripts/record_demo.py --model MODEL --only SLUG"
    return {(m, t.slug): json.loads(recorded.path(t.slug, m).read_text(encoding="utf-8")) for m, t in RECORDED}


def test_every_task_has_a_recording_in_the_current_format():
    """A field added to, renamed in or dropped from the results fails here: re-record with scripts/record_demo.py."""
    run_fields = {f.name for f in fields(CacheRun)}
    result_fields = {f.name for f in fields(CompareResult)} | {"kind"}
    for (model, slug), data in _files().items():
        assert data["kind"] == "recording" and data["slug"] == slug and data["result"]["env"]["model"] == model
        body = data["result"]
        assert set(body) == result_fields, f"{slug}: {set(body) ^ result_fields} (re-record)"
        for run in body["caches"]:
            assert set(run) == run_fields, f"{slug} {run['spec']}: {set(run) ^ run_fields} (re-record)"


@pytest.mark.parametrize("model, task", RECORDED, ids=lambda v: getattr(v, "slug", v))
def test_recordings_follow_their_task_and_render_without_a_model(model, task, no_model):
    from kvplay.app.catalogue import MODELS
    from kvplay.show import plots, tables

    rec = recorded.for_task(task, model)
    assert rec is not None, f"{task.slug}: no recording for this prompt (python scripts/record_demo.py)"
    res = rec.result
    assert res.prompt == task.prompt and res.expected == task.expected and res.check == task.check
    assert res.max_new_tokens == task.max_new_tokens and res.chat == MODELS[model].chat
    assert res.caches[0].spec == "baseline"
    assert rec.label() == f"Recorded on a {rec.machine}, {rec.date}, with {model}; press Compare to run it live."
    assert not any(c.partial for c in res.caches)                       # a finished run
    cards = render.cards_html(res)
    assert cards.count("class='kv-card'") == len(res.caches)
    said = len(render.refusals(res.refused))                              # refused caches: a line per reason
    assert render.verdict_html(res).count("kv-verdict-line") == len(res.caches) + said == len(res.caches) + (
        model == GEMMA)
    assert cards.count("kv-refused") == len(res.refused) == (2 if model == GEMMA else 0)   # transformers' caches
    figs = plots.compare_figures(res)
    assert all(figs[k] is not None for k in ("kl", "agreement", "bytes"))
    assert (figs["speed"] is None) == (not any(render.timed(c) for c in res.caches))   # a busy machine: untimed
    frame = tables.frame(res)
    assert frame.iloc[:, 0].tolist() == [c.spec for c in res.caches]
    verdict = ["Answer"] if task.expected is not None else []            # first, so a phone shows them unscrolled
    assert list(frame.columns[:3 + len(verdict)]) == ["Cache", *verdict, "Mean KL (nats)", "Top-1 agreement (%)"]
    if verdict:
        assert frame["Answer"].iloc[0] == f"{task.expected} ✓"
    base = render.task_line(res.caches[0], res)
    assert (base is None) == (task.expected is None)
    if base is not None:
        assert base == (f"answer: {task.expected} ✓", True)             # the 16-bit model gets it right
    others = [m for m in RECORDED_MODELS + ["shakespeare-llama"] if m != model]
    shown = {m: recorded.for_task(task, m) for m in others}              # never shown for another model: the other
    assert all(r is None or r.model == m for m, r in shown.items())     # gets its own recording of a shared prompt


def test_the_default_recording_shows_what_the_demo_claims(no_model):
    """The 16-bit cache and kvplay-int4 find the code; transformers' 2-bit cache does not (measured, greedy)."""
    res = recorded.for_task(TASKS[0], REAL_MODEL).result
    right = {c.spec: render.task_line(c, res)[1] for c in res.caches}
    assert right["baseline"] and right["kvplay-int4"] and not right["quanto-int2"]
    assert all(c.text.rstrip().endswith(".") for c in res.caches if right[c.spec])   # whole sentences, not cut
    assert all(len(c.token_ids) < res.max_new_tokens for c in res.caches if right[c.spec])  # ended by the model


def test_docs_demo_quotes_every_models_recordings():
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_demo", ROOT / "scripts" / "record_demo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    models = script.docs_models()
    assert list(models) == RECORDED_MODELS
    section = recorded.section(models)
    doc = (ROOT / "docs" / "demo.md").read_text(encoding="utf-8")
    assert section in doc, "docs/demo.md's recorded section is stale: python scripts/record_demo.py --docs-only"
    for name in RECORDED_MODELS:                                         # each model's 16-bit answer, right
        part = section.split(f"#### {name}\n", 1)[1]
        assert part.split("| baseline | ", 1)[1].startswith(f"{prompts.PASS_CODE} ✓ |")


def test_picking_a_model_shows_its_own_recording_or_says_it_has_none(no_model):
    """The Compare tab's model picker: each real catalogue model's recording of its default task (Qwen shares
    SmolLM2's chat prompt, so the prompt alone cannot tell them apart), and for a model with none, cleared results
    and a line saying so, never the last model's run."""
    from kvplay.ui.compare import recorded_outputs

    for model in RECORDED_MODELS:
        out = recorded_outputs(prompts.default_prompt(model), model, say_missing=True)
        assert f"with {model}; press Compare" in out[0] and f"answer: {prompts.PASS_CODE} ✓" in out[2]
    out = recorded_outputs(prompts.default_prompt(REAL_MODEL), "shakespeare-llama", say_missing=True)
    assert "No recorded run of shakespeare-llama" in out[0] and out[1:3] == ["", ""]
    assert recorded_outputs("my own prompt", REAL_MODEL)[0] == ""     # an edited prompt: nothing to show or say


def test_the_compare_tab_opens_on_the_recording_and_generate_on_a_chat_task(monkeypatch, no_model):
    from kvplay.app import startup
    from kvplay.app.settings import Settings
    from kvplay.ui import app as ui

    monkeypatch.setattr(ui, "warm_start", lambda settings, name: None)
    monkeypatch.setattr(startup, "startup_model", lambda settings, progress=None: (REAL_MODEL, None))
    every = [c.get("props", {}) for c in ui.build_app(Settings()).config["components"]]
    props = {p.get("elem_id"): p for p in every}
    status = props["kv-status"]["value"]
    assert "Recorded on a " in status and "press Compare to run it live" in status
    assert f"answer: {prompts.PASS_CODE} ✓" in props["kv-cards"]["value"]
    assert "kv-overall" in props["kv-verdict"]["value"]
    generate = next(p for p in every if p.get("label") == "Prompt" and "<|im_start|>user" in str(p.get("value")))
    assert generate["value"] == prompts.generate_prompt(REAL_MODEL)
    examples = next(p for p in every if p.get("label", "") and str(p.get("label")).startswith("Example tasks"))
    assert [s for s in examples["sample_labels"]] == [t.title for t in TASKS]


# ---------------------------------------------------------------------------- the real model

real_model = pytest.mark.real_model


@real_model
@pytest.mark.parametrize("task", CHECKED, ids=lambda t: t.slug)
def test_the_16_bit_model_answers_every_checked_task(real, task):
    """Greedy, chat template, 16-bit cache: right, and ended by the model's end token within the task's budget."""
    import torch

    from kvplay.cache import build_cache, parse_spec
    from kvplay.lab.generate import generate

    model, tok = real
    ids = torch.tensor([prompts.encode(tok, task.prompt, chat=True)])             # (1, T)
    trace = generate(model, ids, build_cache(parse_spec("baseline"), model), task.max_new_tokens, keep_logits=False,
                     stop_token=tok.eos_token_id)
    text = tok.decode(trace.tokens[0], skip_special_tokens=True)
    assert prompts.grade(text, task.expected, task.check) == (task.expected, True), text
    assert int(trace.tokens[0, -1]) == tok.eos_token_id, text                     # a whole answer, not cut


@real_model
def test_the_generate_prompt_is_the_chat_template_itself(real):
    _, tok = real
    turn = [{"role": "user", "content": prompts.GENERATE_QUESTION}]
    assert prompts.generate_prompt(REAL_MODEL) == tok.apply_chat_template(turn, tokenize=False,
                                                                          add_generation_prompt=True)


@real_model
def test_the_pass_code_is_quantized_history_when_the_question_comes(real):
    """Past the 4 sink tokens and far before the newest 128 that kvplay and quanto/HQQ keep in 16-bit."""
    _, tok = real
    prompt = TASKS[0].prompt
    total = len(prompts.encode(tok, prompt, chat=True))
    before = len(prompts.encode(tok, prompt[:prompt.index(prompts.PASS_CODE)], chat=True))
    print(f"pass code at token ~{before} of {total}")
    assert 250 <= before <= 450 and total - before >= 800


@real_model
def test_the_generate_tab_answers_its_opening_task(real):
    from kvplay.app import generate
    from kvplay.app.settings import Settings

    text = generate.generate_text(REAL_MODEL, prompts.generate_prompt(REAL_MODEL), 24,
                                 settings=Settings(default_model=REAL_MODEL))
    assert "Paris" in text.split("assistant\n")[-1], text


def test_a_character_split_across_tokens_is_shown_whole():
    """Issue 41: an emoji and right-to-left prompt showed every answer as "�����". Byte-level tokens that end
    inside a character add nothing; the token that completes it shows the whole character."""
    from kvplay.lab.compare import token_pieces

    class Bytes:                                   # a byte-level tokenizer: one token per UTF-8 byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "ok 😀 مرحبا"
    ids = list(text.encode("utf-8"))
    pieces = token_pieces(Bytes(), ids)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert "😀" in pieces and pieces.count("") == len(ids) - len(text)     # 3 of the emoji's 4 bytes wait
    assert token_pieces(Bytes(), ids[:12], pieces[:5]) == pieces[:12]      # a known prefix is kept as it was

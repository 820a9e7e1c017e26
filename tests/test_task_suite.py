"""The RULER-style task suite (kvplay/lab/tasks/suite.py): lengths, determinism, the answers really in the prompt,
the question at the end, the needle where the task says, scoring and the refusals."""
import re
from collections import Counter

import pytest

from kvplay.errors import KvplayError
from kvplay.lab.tasks.suite import KINDS, LABELS, Task, make_task, suite
from kvplay.lab.texts import encode

CONTEXTS = (1024, 2048)


@pytest.fixture(scope="module")
def tok(real):
    return real[1]


def _user_message(tok, task: Task) -> tuple[str, str]:
    """The user's message and the answer's first words, read back from a chat prompt."""
    text = tok.decode(task.ids)
    user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return user, text.rsplit("<|im_start|>assistant\n", 1)[1]


def _context(tok, task: Task) -> str:
    """The context: the user's message between its first line (the instructions) and the question."""
    user, _ = _user_message(tok, task)
    return user.split("\n", 1)[1].rsplit("\n" + task.question, 1)[0]


def test_kinds_and_labels():
    assert KINDS == ("niah_single", "niah_multikey", "variable_tracking", "common_words", "frequent_words")
    assert set(LABELS) == set(KINDS) and len(set(LABELS.values())) == len(KINDS)


@pytest.mark.real_model
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", KINDS)
def test_task_fits_and_asks_at_the_end(tok, kind, context):
    task = make_task(kind, tok, context, seed=3)
    assert (task.kind, task.context, task.seed) == (kind, context, 3)
    assert 0.97 * context <= len(task.ids) <= context
    assert task.answers and all(task.answers)
    assert task.question and task.question in tok.decode(task.ids[-80:])
    text = tok.decode(task.ids)
    # The chat prompt is one user turn through the template, the question last, then the answer's first words in
    # the assistant turn (nothing else follows the question).
    user, prefix = _user_message(tok, task)
    assert user.endswith("\n" + task.question) and text.endswith(task.question + "<|im_end|>\n<|im_start|>assistant\n"
                                                                 + prefix)
    assert prefix and not prefix.startswith(" ") and len(tok(prefix).input_ids) < 30
    assert list(task.ids) == encode(tok, user, True) + tok(prefix, add_special_tokens=False).input_ids
    for answer in task.answers:
        assert answer in text
    assert task.max_new_tokens >= len(tok(" " + ", ".join(task.answers), add_special_tokens=False).input_ids)


@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_task_is_seeded(tok, kind):
    one = make_task(kind, tok, 1024, seed=5)
    assert make_task(kind, tok, 1024, seed=5) == one
    other = make_task(kind, tok, 1024, seed=6)
    assert other.ids != one.ids and other.answers != one.answers


@pytest.mark.real_model
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", ["niah_single", "niah_multikey"])
def test_needle_is_where_the_task_says(tok, kind, context):
    for seed in range(4):
        task = make_task(kind, tok, context, seed=seed)
        (value,) = task.answers
        assert re.fullmatch(r"\d{7}", value) and task.max_new_tokens == 12
        start, end = task.needle_tokens
        needle = tok.decode(task.ids[start:end]).strip()
        key = re.search(r"for (\S+) mentioned", task.question).group(1)
        assert needle == f"One of the special magic numbers for {key} is: {value}."
        assert tok.decode(task.ids).count(value) == 1                 # the number is only in the needle
        # depth: the needle's first token's place in the context, counted in tokens
        context_text = _context(tok, task)
        before = context_text[:context_text.index(needle)]
        assert task.depth == pytest.approx(len(tok(before).input_ids) / len(tok(context_text).input_ids), abs=0.02)
        assert 0 <= task.depth <= 1


@pytest.mark.real_model
def test_needle_depth_is_seeded_across_the_context(tok):
    depths = [make_task("niah_single", tok, 1024, seed=s).depth for s in range(12)]
    assert min(depths) < 0.3 and max(depths) > 0.7


@pytest.mark.real_model
def test_multikey_has_four_needles_and_asks_one(tok):
    task = make_task("niah_multikey", tok, 2048, seed=2)
    needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", tok.decode(task.ids))
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4 and len({v for _, v in needles}) == 4
    asked = re.search(r"for (\S+) mentioned", task.question).group(1)
    assert dict(needles)[asked] == task.answers[0]
    asked_keys = {re.search(r"for (\S+) mentioned", make_task("niah_multikey", tok, 1024, seed=s).question).group(1)
                  for s in range(6)}
    assert len(asked_keys) > 1


@pytest.mark.real_model
@pytest.mark.parametrize("context", CONTEXTS)
def test_variable_tracking_chain(tok, context):
    task = make_task("variable_tracking", tok, context, seed=4)
    assert task.depth is None and task.needle_tokens is None
    names = task.answers
    assert len(names) == 5 and len(set(names)) == 5
    value = re.search(r"the value (\d+) in the text above", task.question).group(1)
    text = _context(tok, task)
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    places = [text.index(line) for line in lines]
    assert places == sorted(places)                                   # each assignment after the one it copies
    assert len(re.findall(r"\bVAR [A-Z]{5}\b", text)) == 5 + 4        # no other variables


def _numbered(text: str) -> list[str]:
    entries = re.findall(r"(\d+)\. ([a-z]+)", text)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    return [w for _, w in entries]


@pytest.mark.real_model
@pytest.mark.parametrize("context", CONTEXTS)
def test_common_words_are_the_most_common(tok, context):
    task = make_task("common_words", tok, context, seed=1)
    assert task.depth is None and task.needle_tokens is None
    counts = Counter(_numbered(_context(tok, task))).most_common()
    assert len(task.answers) == 10 and {w for w, _ in counts[:10]} == set(task.answers)
    assert counts[9][1] > counts[10][1] >= 1                          # the ten stand apart from the rest
    assert len(counts) > 20


@pytest.mark.real_model
@pytest.mark.parametrize("context", CONTEXTS)
def test_frequent_words_are_the_most_frequent(tok, context):
    task = make_task("frequent_words", tok, context, seed=1)
    words = _context(tok, task).split()
    assert all(re.fullmatch(r"[a-z]{5}", w) for w in words)
    counts = Counter(words).most_common()
    assert [w for w, _ in counts[:3]] == list(task.answers)
    assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]  # a Zipf tail: ranks are unambiguous


@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_plain_prompt_without_chat(tok, kind):
    task = make_task(kind, tok, 1024, seed=0, chat=False)
    text = tok.decode(task.ids)
    assert "<|im_start|>" not in text and "\nAnswer: " in text[-400:]
    assert 0.97 * 1024 <= len(task.ids) <= 1024
    assert task.question in tok.decode(task.ids[-80:])
    assert task.answers == make_task(kind, tok, 1024, seed=0, chat=True).answers
    if task.needle_tokens:
        start, end = task.needle_tokens
        assert task.answers[0] in tok.decode(task.ids[start:end])


@pytest.mark.real_model
def test_model_without_chat_template_gets_plain_text(tok):
    template = tok.chat_template
    try:
        tok.chat_template = None
        task = make_task("niah_single", tok, 1024, seed=0, chat=True)
    finally:
        tok.chat_template = template
    assert task.ids == make_task("niah_single", tok, 1024, seed=0, chat=False).ids


@pytest.mark.real_model
def test_suite_covers_every_kind_at_every_context(tok):
    tasks = suite(tok, [1024, 2048], kinds=("niah_single", "common_words"), seed=7)
    assert [(t.kind, t.context) for t in tasks] == [("niah_single", 1024), ("common_words", 1024),
                                                    ("niah_single", 2048), ("common_words", 2048)]
    assert tasks == suite(tok, [1024, 2048], kinds=("niah_single", "common_words"), seed=7)
    assert len({t.seed for t in tasks}) == 4
    assert [t.seed for t in suite(tok, [1024], kinds=("niah_single",), seed=8)] != [tasks[0].seed]
    first = tasks[0]
    assert make_task(first.kind, tok, first.context, seed=first.seed) == first   # each task can be made again
    assert [t.kind for t in suite(tok, [512])] == list(KINDS)


def _task(answers) -> Task:
    return Task(kind="common_words", context=0, seed=0, ids=(), answers=tuple(answers), depth=None,
                needle_tokens=None, max_new_tokens=1)


def test_score_is_the_fraction_of_answers_found():
    task = _task(["Apple", "pear"])
    assert task.score("apple and PEAR") == 1.0
    assert task.score("Only an APPLE here") == 0.5
    assert task.score("a banana") == 0.0
    assert task.score("") == 0.0
    assert _task(["8661386"]).score(" 8661386.") == 1.0
    assert _task(["8661386"]).score("866 1386") == 0.0


def test_unknown_kind_is_refused():
    with pytest.raises(KvplayError, match="Unknown task kind 'qa_hotpot'.*niah_single.*frequent_words"):
        make_task("qa_hotpot", None, 1024)
    with pytest.raises(KvplayError, match="Unknown task kind 'nope'"):
        suite(None, [1024], kinds=("niah_single", "nope"))


@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_too_short_context_is_refused_with_the_minimum(tok, kind):
    with pytest.raises(KvplayError, match=f"too short for a {kind} task") as err:
        make_task(kind, tok, 64)
    least = int(re.search(r"at least (\d+) tokens", str(err.value)).group(1))
    assert 64 < least < 600
    assert len(make_task(kind, tok, least).ids) == least        # the stated minimum is a context that works
    with pytest.raises(KvplayError, match=f"at least {least} tokens"):
        make_task(kind, tok, least - 1)

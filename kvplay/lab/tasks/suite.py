"""Long-context tasks in the style of NVIDIA RULER, generated from code and a seed (nothing is downloaded).

RULER: Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(github.com/NVIDIA/RULER, Apache-2.0). Five of its synthetic tasks, in small-model-friendly sizes:

    niah_single         one needle "One of the special magic numbers for {key} is: {number}." in filler
    niah_multikey       four needles with different keys; the question asks for one of them
    variable_tracking   a chain "VAR A = 12345." ... "VAR E = VAR D." in filler; name every variable holding the value
    common_words        a numbered list of words; name the 10 that appear most often
    frequent_words      coded words drawn from a Zipf distribution; name the 3 most frequent

Each task's question comes at the end of the prompt, followed by the start of the answer (inside the assistant turn
when chat), so an eviction policy that scores tokens by the last prompt tokens' attention sees the question and can
be judged fairly. A prompt is at most `context` tokens and within 3% of it (from a few hundred tokens up); a task is
scored as RULER's string_match_all: the fraction of its answers found in the model's text, case-insensitive.
"""
from __future__ import annotations

import functools
import random
import re
import string
from dataclasses import dataclass

from kvplay.errors import KvplayError
from kvplay.lab.texts import FILLER, HELD_OUT_TEXT
from kvplay.results import TASK_LABELS

KINDS: tuple[str, ...] = ("niah_single", "niah_multikey", "variable_tracking", "common_words", "frequent_words")

LABELS = TASK_LABELS            # short names for tables and progress (results.tasks, one definition)

# Needle keys are "adjective-noun" pairs, as RULER's are; no noun occurs in the filler sentences.
ADJECTIVES = ("amber", "brave", "calm", "clever", "crimson", "gentle", "golden", "hidden", "jolly", "lucky", "mellow",
              "nimble", "quiet", "rapid", "silver", "silent", "sturdy", "swift", "tidy", "velvet", "witty", "zesty")
NOUNS = ("badger", "beacon", "canyon", "comet", "falcon", "harbor", "lantern", "meadow", "otter", "pebble", "pelican",
         "quartz", "raven", "saddle", "sparrow", "thimble", "tiger", "trumpet", "violin", "walrus", "willow", "zebra")

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.")
VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text."
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.")
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequently appeared coded words.")

VT_HOPS = 4              # one chain: a value and four variables copied from the one before (five names)
CWE_COMMON = 10          # the words to name
FWE_TOP = 3
FWE_ALPHA = 2.0          # RULER's Zipf exponent
MIN_UNITS = {"niah_single": 2, "niah_multikey": 4, "variable_tracking": 4, "common_words": 20,
             "frequent_words": 60}   # filler sentences (niah, vt), rare-word entries (common), coded words (frequent)


@dataclass(frozen=True)
class Task:
    kind: str
    context: int                 # the target length in tokens of the prompt ids
    seed: int
    ids: tuple[int, ...]         # the prompt: context, question and the answer's first words (chat template when chat)
    answers: tuple[str, ...]     # strings that must all appear in the model's answer
    depth: float | None          # where the queried needle starts, 0..1 of the context's tokens; None without one
    needle_tokens: tuple[int, int] | None   # [start, end) token indices in ids of the queried needle, None without one
    max_new_tokens: int          # enough new tokens to write every answer
    question: str = ""           # the question as asked, just before the answer's first words

    def score(self, text: str) -> float:
        """RULER's string_match_all: the fraction of the answers found in `text`, case-insensitive."""
        low = text.lower()
        return sum(a.lower() in low for a in self.answers) / len(self.answers)


@dataclass(frozen=True)
class _Draft:
    user: str                            # the user's message: instructions, context, question
    prefix: str                          # the answer's first words
    answers: tuple[str, ...]
    question: str
    haystack: tuple[int, int]            # character span of the context in `user`
    needle: tuple[int, int] | None       # character span of the queried needle in `user`


def _filler(rng: random.Random, n: int) -> list[str]:
    """n seeded filler sentences, never one sentence twice in a row."""
    out: list[str] = []
    for _ in range(n):
        out.append(rng.choice([s for s in FILLER if not out or s != out[-1]]))
    return out


def _join(pieces: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The pieces joined by spaces, and each piece's character span."""
    spans, at = [], 0
    for p in pieces:
        spans.append((at, at + len(p)))
        at += len(p) + 1
    return " ".join(pieces), spans


def _haystack(sentences: list[str], inserts: list[tuple[float, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The filler sentences with each (depth, sentence) insert placed between them at its depth (0: before the
    first, 1: after the last), and each insert's character span."""
    pieces, where, prev = [], [], 0
    for depth, sentence in sorted(inserts, key=lambda x: x[0]):
        at = round(depth * len(sentences))
        pieces.extend(sentences[prev:at])
        where.append(len(pieces))
        pieces.append(sentence)
        prev = at
    pieces.extend(sentences[prev:])
    text, spans = _join(pieces)
    order = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    out: list[tuple[int, int]] = [(0, 0)] * len(inserts)
    for i, w in zip(order, where):
        out[i] = spans[w]
    return text, out


def _draft(intro: str, body: str, question: str, prefix: str, answers, needle: tuple[int, int] | None = None
           ) -> _Draft:
    """The user's message intro, body, question (one per line), with the body's and the needle's spans in it."""
    start = len(intro) + 1
    shift = (needle[0] + start, needle[1] + start) if needle else None
    return _Draft(user=f"{intro}\n{body}\n{question}", prefix=prefix, answers=tuple(answers), question=question,
                  haystack=(start, start + len(body)), needle=shift)


def _keys(rng: random.Random, k: int) -> list[str]:
    """k different "adjective-noun" keys."""
    return [f"{a}-{b}" for a, b in zip(rng.sample(ADJECTIVES, k), rng.sample(NOUNS, k))]


def _niah(rng: random.Random, filler: random.Random, context: int, needles: int):
    keys = _keys(rng, needles)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), needles)]
    depths = sorted(rng.random() for _ in range(needles))
    asked = rng.randrange(needles)
    inserts = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)]
    question = f"What is the special magic number for {keys[asked]} mentioned in the provided text?"
    prefix = f"The special magic number for {keys[asked]} mentioned in the provided text is"
    sentences = _filler(filler, context)

    def build(n: int) -> _Draft:     # n: filler sentences
        body, spans = _haystack(sentences[:n], inserts)
        return _draft(NIAH_INTRO, body, question, prefix, [values[asked]], spans[asked])
    return build


def _variable_tracking(rng: random.Random, filler: random.Random, context: int):
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    inserts = list(zip(sorted(rng.random() for _ in lines), lines))
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"According to the chain of variable assignments in the text above, {len(names)} variables are "
              f"assigned the value {value}, they are:")
    sentences = _filler(filler, context)

    def build(n: int) -> _Draft:     # n: filler sentences
        body, _ = _haystack(sentences[:n], inserts)
        return _draft(VT_INTRO, body, question, prefix, names)
    return build


CWE_QUESTION = f"Question: What are the {CWE_COMMON} most common words in the above list?"
CWE_PREFIX = f"The top {CWE_COMMON} words that appear most often in the list are:"


@functools.cache
def _plain_words() -> tuple[str, ...]:
    """Lower-case words of 4 to 9 letters from the held-out play (names and the prompt's own words left out)."""
    prompt = set(re.findall(r"[a-z]+", (CWE_INTRO + CWE_QUESTION + CWE_PREFIX).lower()))
    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    return tuple(sorted({w for w in re.findall(r"[A-Za-z']+", text)
                         if w.isalpha() and w.islower() and 4 <= len(w) <= 9 and w not in prompt}))


def _cwe_counts(context: int) -> tuple[int, int]:
    """How often each common word and each rare word appears: the common ones more often in longer lists."""
    return min(30, max(4, context // 128)), 2 if context < 4096 else 3


def _common_words(rng: random.Random, context: int, seed_text: str):
    pool = list(_plain_words())
    rng.shuffle(pool)
    common, rare = pool[:CWE_COMMON], pool[CWE_COMMON:]
    often, seldom = _cwe_counts(context)

    def build(n: int) -> _Draft:     # n: the rare words' entries
        kinds = min(-(-n // seldom), len(rare))     # past ~2,400 rare words (~50k tokens) they repeat more often
        entries = common * often + [rare[i % kinds] for i in range(n)]
        random.Random(f"{seed_text}:order:{n}").shuffle(entries)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
        return _draft(CWE_INTRO, body, CWE_QUESTION, CWE_PREFIX, common)
    return build


def _frequent_words(rng: random.Random, seed_text: str):
    vocab: list[str] = []
    while len(vocab) < 400:
        word = "".join(rng.choices(string.ascii_lowercase, k=5))
        if word not in vocab:
            vocab.append(word)
    weights = [k ** -FWE_ALPHA for k in range(1, len(vocab) + 1)]
    total = sum(weights)
    question = ("Question: What are the three most frequently appeared words in the above coded text? "
                "Do not provide any explanation.")
    prefix = "According to the coded text above, the three most frequently appeared words are:"

    def build(n: int) -> _Draft:     # n: about how many coded words
        text = [w for w, p in zip(vocab, weights) for _ in range(int(n * p / total))]
        random.Random(f"{seed_text}:order:{n}").shuffle(text)
        return _draft(FWE_INTRO, " ".join(text), question, prefix, vocab[:FWE_TOP])
    return build


def _builder(kind: str, context: int, seed: int):
    """The task's draft for a size n (filler sentences, rare-word entries or coded words), its content fixed by the
    seed: a larger n only lengthens the context."""
    rng, filler, seed_text = random.Random(f"{kind}:{seed}"), random.Random(f"{kind}:{seed}:filler"), f"{kind}:{seed}"
    if kind == "niah_single":
        return _niah(rng, filler, context, 1)
    if kind == "niah_multikey":
        return _niah(rng, filler, context, 4)
    if kind == "variable_tracking":
        return _variable_tracking(rng, filler, context)
    if kind == "common_words":
        return _common_words(rng, context, seed_text)
    return _frequent_words(rng, seed_text)


PLACEHOLDER = "KVPLAY-USER-MESSAGE"


def _frame(tokenizer, chat: bool) -> tuple[str, str, bool]:
    """The text around the user's message (before it, and between it and the answer's first words), and whether
    the tokenizer adds its special tokens: one user turn through the chat template when chat and the model has one."""
    if not chat or getattr(tokenizer, "chat_template", None) is None:
        return "", "\nAnswer: ", True
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(PLACEHOLDER) != 1:
        raise KvplayError("This model's chat template does not keep the prompt as written; use chat=False.")
    head, tail = text.split(PLACEHOLDER)
    return head, tail, False


def _token_spans(tokenizer, text: str, special: bool, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) of the tokens covering each character span [first, end) of `text`: from the fast tokenizer's
    offsets, else from the token counts of the text before each span's ends."""
    if not getattr(tokenizer, "is_fast", False):
        def count(c: int) -> int:
            return len(tokenizer(text[:c], add_special_tokens=special, verbose=False).input_ids)
        return [(count(first), count(end)) for first, end in spans]
    offsets = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    out = []
    for first, end in spans:
        hit = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > first]
        out.append((hit[0], hit[-1] + 1))
    return out


def _bracket(length, lo: int, short: int, context: int) -> tuple[int, int, int, int]:
    """Sizes lo (fits the context) and hi (does not) with their lengths, hi first guessed from lo's tokens per unit
    and doubled until it overflows."""
    hi = max(lo + 1, round(lo * context / max(short, 1) * 1.1))
    while (long := length(hi)) <= context:
        lo, short, hi = hi, long, hi * 2
    return lo, hi, short, long


def check_kinds(kinds) -> list[str]:
    """The task kinds asked for (None or empty: all), each one of KINDS; an unknown one is refused, naming the valid."""
    kinds = list(kinds) if kinds else list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise KvplayError(f"Unknown task kind {unknown[0]!r}; the kinds are {', '.join(KINDS)}.")
    return kinds


def make_task(kind: str, tokenizer, context: int, *, seed: int = 0, chat: bool = True) -> Task:
    """One seeded task of `kind` whose prompt is at most `context` tokens and within 3% of it."""
    check_kinds([kind])
    build = _builder(kind, context, seed)
    head, tail, special = _frame(tokenizer, chat)

    def text(d: _Draft) -> str:
        return head + d.user + tail + d.prefix

    def length(n: int) -> int:
        return len(tokenizer(text(build(n)), add_special_tokens=special, verbose=False).input_ids)

    lo = MIN_UNITS[kind]
    least = length(lo)
    if least > context:
        raise KvplayError(f"The context is too short for a {kind} task: it needs at least {least} tokens with this "
                          f"tokenizer, got {context}.")
    lo, hi, short, long = _bracket(length, lo, least, context)
    step = 0
    while hi - lo > 1:                 # lo fits, hi does not: interpolate (lengths grow about linearly), then halve
        guess = lo + round((context - short) * (hi - lo) / max(long - short, 1)) if step % 2 == 0 else (lo + hi) // 2
        mid = min(max(guess, lo + 1), hi - 1)
        got = length(mid)
        lo, short, hi, long = (mid, got, hi, long) if got <= context else (lo, short, mid, got)
        step += 1
    draft = build(lo)
    full = text(draft)
    ids = tokenizer(full, add_special_tokens=special, verbose=False).input_ids
    depth = needle = None
    if draft.needle is not None:
        at = len(head)
        needle, hay = _token_spans(tokenizer, full, special, [(draft.needle[0] + at, draft.needle[1] + at),
                                                             (draft.haystack[0] + at, draft.haystack[1] + at)])
        depth = round((needle[0] - hay[0]) / max(hay[1] - hay[0], 1), 3)
    answer = len(tokenizer(" " + ", ".join(draft.answers), add_special_tokens=False, verbose=False).input_ids)
    return Task(kind=kind, context=context, seed=seed, ids=tuple(ids), answers=draft.answers, depth=depth,
                needle_tokens=needle, max_new_tokens=answer + 4 + 3 * (len(draft.answers) - 1),
                question=draft.question)


def task_seed(seed: int, kind: str, context: int) -> int:
    """The seed of one task in a suite: fixed by the suite's seed, the kind and the context length."""
    return random.Random(f"suite:{seed}:{kind}:{context}").randrange(2 ** 31)


def suite(tokenizer, contexts, *, kinds=KINDS, seed: int = 0, chat: bool = True) -> list[Task]:
    """Every kind at every context length (by length, then kind), each task's seed from task_seed."""
    return [make_task(kind, tokenizer, n, seed=task_seed(seed, kind, n), chat=chat) for n in contexts
            for kind in check_kinds(kinds)]

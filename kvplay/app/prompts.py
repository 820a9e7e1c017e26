"""Prompts: Compare's tasks per model (data: a title, the prompt, the answer to check), and prompt -> token ids.

Every model that can answer gets the same tasks, worded for how it is prompted (the catalogue's `prompting`):
a chat model is asked a question (in its chat template); a base model, such as Gemma 3 270M, gets the same
document with the question and the start of the answer as text to complete ("Answer: The pass code ... is");
a model outside the catalogue gets the completion wording, which a chat model answers inside its template too
(or the chat wording once its tokenizer shows a chat template: tasks(name, tokenizer)). Only the bundled toy
model gets openings to continue, with no answer.

For a chat model the default task has an answer to check, on a long input: a 5-digit pass code written into the
first scene of the held-out play (~1,270 tokens with the question), then asked back. SmolLM2-135M-Instruct's
16-bit cache answers it (greedy, chat template); transformers' 2-bit caches do not (measured: see
docs/demo.md), and with the code ~350 tokens in, far outside any 16-bit window, every quantized cache has
quantized it by the time the question comes. The examples: a pass code in everyday sentences, and a story; each
declares its expected answer, or None when it has none (the story). tests/test_demo.py pins the 16-bit greedy
answer to every expected one.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvplay.app.catalogue import HELD_OUT_TEXT, entry
from kvplay.lab.grading import CHECKS, grade  # noqa: F401  (the lab grades each cache with the run)
from kvplay.lab.texts import FILLER, encode  # noqa: F401  (encode: the commands' too)


@dataclass(frozen=True)
class Task:
    """One Compare task: what the example list shows, the prompt, and how to check the answer."""

    slug: str                      # its recording's file name: assets/recorded/<slug>.json
    title: str                     # the example list's label
    prompt: str
    expected: str | None           # the answer; None: the task has none to check (a story)
    check: str = "number"          # number: the expected digits appear as a whole number; word: the word appears
    max_new_tokens: int = 64       # enough for a complete answer, which ends at the model's end token


def _scene(number: int, chars: int | None = None) -> str:
    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    start = text.find(f"SCENE {number}\n", text.find("ACT 1\n"))
    end = text.find(f"SCENE {number + 1}\n", start)
    scene = text[start:end].strip()
    return scene if chars is None else scene[:chars].rsplit("\n\n", 1)[0]


def raw_default_prompt(chars: int = 1500) -> str:
    """The opening of the held-out play: long enough that quantized history matters (non-chat models)."""
    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    start = max(text.find("ACT 1\nSCENE 1"), 0)  # skip the cast list: start at the first scene
    return text[start:start + chars]


# The question comes after the document: a 135M-parameter chat model answers a question it has just read, and
# with the instruction first SmolLM2 ended its turn at once on the scene below (measured, greedy, 16-bit).

PASS_CODE = "27611"      # random.Random(1).randrange(10_000, 100_000), the first seed tried (docs/demo.md)
PASS_NOTE = "[A note is nailed to the mast: the pass code for the ship's strongroom is {code}.]"
PASS_QUESTION = "What is the pass code for the ship's strongroom in the scene above? Answer in one sentence."
# The same question for a base model: the question, then the start of the answer, for it to complete.
PASS_COMPLETION = ("Question: What is the pass code for the ship's strongroom in the scene above?\n"
                   "Answer: The pass code for the ship's strongroom is")
FILLER_QUESTION = "What is the pass code for the archive room? Answer with the number only."
FILLER_COMPLETION = ("Question: What is the pass code for the archive room?\n"
                     "Answer: The pass code for the archive room is")
PROMPTING = ("chat", "completion", "continue")    # catalogue.CatalogueEntry.prompting


def pass_code_in_scene(code: str = PASS_CODE, depth: float = 0.3, question: str = PASS_QUESTION) -> str:
    """Scene 1 of The Tempest with a note carrying `code` after `depth` of its paragraphs, then the question."""
    paras = _scene(1).split("\n\n")
    k = int(len(paras) * depth)
    return "\n\n".join(paras[:k] + [PASS_NOTE.format(code=code)] + paras[k:]) + "\n\n" + question


def summarise_scene() -> str:
    return (_scene(1) + "\n\nSummarise the scene above from Shakespeare's The Tempest in three sentences: who is "
            "on the ship, what happens to it, and how the scene ends.")


def find_the_number(seed: int = 7, sentences: int = 60) -> str:
    """A pass code hidden two thirds of the way into seeded filler text, then asked back."""
    return _number_in_filler(seed, sentences)[0]


def _number_in_filler(seed: int, sentences: int, question: str = FILLER_QUESTION) -> tuple[str, str]:
    rng = random.Random(seed)
    code = rng.randrange(10_000, 100_000)
    lines = [rng.choice(FILLER) for _ in range(sentences)]
    lines.insert(2 * sentences // 3, f"The pass code for the archive room is {code}.")
    prompt = " ".join(lines) + "\n\n" + question
    return prompt, str(code)


def write_story() -> str:
    return "Write a short story, about 150 words, about a lighthouse keeper who finds a message in a bottle."


def chat_tasks() -> list[Task]:
    """A chat model's tasks, the default first."""
    filler, filler_code = _number_in_filler(7, 60)
    return [
        Task("pass-code-in-the-tempest", "Find the pass code in a scene of The Tempest", pass_code_in_scene(),
             PASS_CODE, "number", 32),
        Task("pass-code-in-filler", "Find the pass code in 60 everyday sentences", filler, filler_code, "number",
             32),
        Task("lighthouse-story", "A short story (no answer to check)", write_story(), None, max_new_tokens=64),
    ]


def completion_tasks() -> list[Task]:
    """A base model's tasks, the default first: the chat tasks' documents and answers, each question followed by
    the start of its answer to complete (a base model reads no chat template), then an opening to continue."""
    filler, filler_code = _number_in_filler(7, 60, FILLER_COMPLETION)
    return [
        Task("pass-code-in-the-tempest-completion", "Complete the pass code in a scene of The Tempest",
             pass_code_in_scene(question=PASS_COMPLETION), PASS_CODE, "number", 32),
        Task("pass-code-in-filler-completion", "Complete the pass code after 60 everyday sentences", filler,
             filler_code, "number", 32),
        raw_tasks()[0],
    ]


def raw_tasks() -> list[Task]:
    """A plain language model's tasks: openings to continue, none with an answer to check."""
    return [Task("tempest-opening", "The Tempest's opening", raw_default_prompt(), None),
            Task("romeo", "ROMEO:", "ROMEO:\n", None),
            Task("to-be", "To be, or not to be", "Ham.\nTo be, or not to be, that is the question:", None)]


def prompting(model_name: str | None, tokenizer=None) -> str:
    """How Compare words tasks for this model: the catalogue's `prompting`; for any other model "chat" when its
    tokenizer (if known) has a chat template, else "completion" (which a chat model answers inside its template
    too, so a model not loaded yet gets it)."""
    e = entry(model_name)
    if e is not None:
        return e.prompting
    return "chat" if tokenizer is not None and getattr(tokenizer, "chat_template", None) else "completion"


_TASKS = {"chat": chat_tasks, "completion": completion_tasks, "continue": raw_tasks}


def tasks(model_name: str | None = None, tokenizer=None) -> list[Task]:
    """The tasks Compare offers for this model, its default first (a task with an answer to check, except on the
    bundled toy model)."""
    return _TASKS[prompting(model_name, tokenizer)]()


def task_for(prompt: str | None, model_name: str | None = None) -> Task | None:
    """The task whose prompt this is (surrounding spaces ignored), among every model's tasks; None if typed."""
    text = (prompt or "").strip()
    every = [t for make in _TASKS.values() for t in make()]
    return next((t for t in every if t.prompt.strip() == text), None) if text else None


def default_prompt(model_name: str | None = None, tokenizer=None) -> str:
    """The Compare prompt a model opens with: the pass-code task, worded for the model (the play's opening only
    for the bundled toy model)."""
    return tasks(model_name, tokenizer)[0].prompt


def example_prompts(model_name: str | None = None, tokenizer=None) -> list[str]:
    """Other real tasks for a model that answers (none for the bundled toy model)."""
    style = prompting(model_name, tokenizer)
    return [t.prompt for t in _TASKS[style]()[1:]] if style != "continue" else []


# The Generate tab continues raw text with the 16-bit cache (kvplay.app.generate.generate_text), so a chat model's
# task is written in its chat template as text: ChatML, the template of the catalogue's chat models, with each
# model's own default system turn (catalogue `system`; tests check it against each tokenizer's own template).
GENERATE_QUESTION = "What is the capital of France? Answer in one sentence."
CHATML_TURN = ("<|im_start|>system\n{system}<|im_end|>\n"
               "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")     # with its default system turn
GENERATE_COMPLETION = "Question: What is the capital of France?\nAnswer: The capital of France is"


def generate_prompt(model_name: str | None = None) -> str:
    """The Generate tab's opening prompt: one user turn for a chat model, the question to complete for a base
    model, the start of a speech for the bundled toy model."""
    e = entry(model_name)
    style = prompting(model_name)
    if e is not None and e.chat and e.system:
        return CHATML_TURN.format(system=e.system, question=GENERATE_QUESTION)
    return GENERATE_COMPLETION if style == "completion" else "ROMEO:\n"


def is_chat(model_name: str | None, tokenizer) -> bool:
    """Whether Compare applies the chat template by default: catalogue chat models, or any model with a template."""
    e = entry(model_name)
    return e.chat if e is not None else bool(getattr(tokenizer, "chat_template", None))

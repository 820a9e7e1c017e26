"""Prompts: Compare's tasks per model (data: a title, the prompt, the answer to check), and prompt -> token ids.

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


def pass_code_in_scene(code: str = PASS_CODE, depth: float = 0.3) -> str:
    """Scene 1 of The Tempest with a note carrying `code` after `depth` of its paragraphs, then the question."""
    paras = _scene(1).split("\n\n")
    k = int(len(paras) * depth)
    return "\n\n".join(paras[:k] + [PASS_NOTE.format(code=code)] + paras[k:]) + "\n\n" + PASS_QUESTION


def summarise_scene() -> str:
    return (_scene(1) + "\n\nSummarise the scene above from Shakespeare's The Tempest in three sentences: who is "
            "on the ship, what happens to it, and how the scene ends.")


def find_the_number(seed: int = 7, sentences: int = 60) -> str:
    """A pass code hidden two thirds of the way into seeded filler text, then asked back."""
    return _number_in_filler(seed, sentences)[0]


def _number_in_filler(seed: int, sentences: int) -> tuple[str, str]:
    rng = random.Random(seed)
    code = rng.randrange(10_000, 100_000)
    lines = [rng.choice(FILLER) for _ in range(sentences)]
    lines.insert(2 * sentences // 3, f"The pass code for the archive room is {code}.")
    prompt = " ".join(lines) + "\n\nWhat is the pass code for the archive room? Answer with the number only."
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


def raw_tasks() -> list[Task]:
    """A plain language model's tasks: openings to continue, none with an answer to check."""
    return [Task("tempest-opening", "The Tempest's opening", raw_default_prompt(), None),
            Task("romeo", "ROMEO:", "ROMEO:\n", None),
            Task("to-be", "To be, or not to be", "Ham.\nTo be, or not to be, that is the question:", None)]


def tasks(model_name: str | None = None) -> list[Task]:
    """The tasks Compare offers for this model, its default first."""
    e = entry(model_name)
    return chat_tasks() if e is not None and e.chat else raw_tasks()


def task_for(prompt: str | None, model_name: str | None = None) -> Task | None:
    """The task whose prompt this is (surrounding spaces ignored), among every model's tasks; None if typed."""
    text = (prompt or "").strip()
    return next((t for t in chat_tasks() + raw_tasks() if t.prompt.strip() == text), None) if text else None


def default_prompt(model_name: str | None = None) -> str:
    """The Compare prompt a model opens with: a task with a checkable answer for chat models, the play otherwise."""
    return tasks(model_name)[0].prompt


def example_prompts(model_name: str | None = None) -> list[str]:
    """Other real tasks for a chat model (none for a plain language model)."""
    e = entry(model_name)
    return [t.prompt for t in chat_tasks()[1:]] if e is not None and e.chat else []


# The Generate tab continues raw text with the 16-bit cache (kvplay.app.commands.generate_text), so a chat model's
# task is written in its chat template as text: ChatML, the template of the catalogue's one chat model,
# SmolLM2-135M-Instruct (tests/test_demo.py checks it against the tokenizer's own template).
GENERATE_QUESTION = "What is the capital of France? Answer in one sentence."
CHATML_TURN = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")     # with its default system turn


def generate_prompt(model_name: str | None = None) -> str:
    """The Generate tab's opening prompt: one user turn for a chat model, the start of a speech otherwise."""
    e = entry(model_name)
    return CHATML_TURN.format(question=GENERATE_QUESTION) if e is not None and e.chat else "ROMEO:\n"


def is_chat(model_name: str | None, tokenizer) -> bool:
    """Whether Compare applies the chat template by default: catalogue chat models, or any model with a template."""
    e = entry(model_name)
    return e.chat if e is not None else bool(getattr(tokenizer, "chat_template", None))

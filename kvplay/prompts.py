"""Prompts: the default Compare prompt and examples per model, and prompt -> token ids.

For a chat model the default is a real task on a long input (summarise the first scene
of the held-out play, ~1,200 tokens), so every quantized cache has quantized most of its
history by the time it answers. The examples are other everyday tasks on long inputs.
"""
from __future__ import annotations

import random
from pathlib import Path

from .catalogue import HELD_OUT_TEXT, entry

FILLER = [   # varied sentences: a long run of one repeated sentence is easier to ignore than real text
    "The morning train was late again, so the platform filled with people reading the news.",
    "A bakery on the corner sells rye bread that is gone by nine o'clock.",
    "The river rose after three days of rain and covered the lower footpath.",
    "Most of the committee agreed to move the meeting to Thursday afternoon.",
    "The library extended its opening hours during the exam season.",
    "Old maps of the town show a market square where the car park is now.",
    "The garden club planted tulips along the fence in late October.",
    "A new cycle lane opened on the bridge, and traffic slowed for a week.",
    "The museum's winter exhibition is about clocks and the people who made them.",
    "Fresh snow closed the mountain pass, and the buses took the long road instead.",
]


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


# The task comes after the document: a 135M-parameter chat model answers a question it has just read, and
# with the instruction first SmolLM2 ended its turn at once on the scene below (measured, greedy, 16-bit).

def summarise_scene() -> str:
    return (_scene(1) + "\n\nSummarise the scene above from Shakespeare's The Tempest in three sentences: who is "
            "on the ship, what happens to it, and how the scene ends.")


def document_question() -> str:
    return (_scene(2, chars=9000) + "\n\nIn the passage above from The Tempest, why did Prospero and Miranda "
            "leave Milan, and who helped them survive?")


def find_the_number(seed: int = 7, sentences: int = 60) -> str:
    """A pass code hidden two thirds of the way into seeded filler text, then asked back."""
    rng = random.Random(seed)
    code = rng.randrange(10_000, 100_000)
    lines = [rng.choice(FILLER) for _ in range(sentences)]
    lines.insert(2 * sentences // 3, f"The pass code for the archive room is {code}.")
    return " ".join(lines) + "\n\nWhat is the pass code for the archive room? Answer with the number only."


def explain_code() -> str:
    source = (Path(__file__).parent / "metrics.py").read_text(encoding="utf-8")
    return ("```python\n" + source + "```\n\nExplain what each function in the Python module above does, one "
            "sentence each.")


def write_story() -> str:
    return "Write a short story, about 150 words, about a lighthouse keeper who finds a message in a bottle."


def default_prompt(model_name: str | None = None) -> str:
    """The Compare prompt a model opens with: a long-input chat task for chat models, the play's opening otherwise."""
    e = entry(model_name)
    return summarise_scene() if e is not None and e.chat else raw_default_prompt()


def example_prompts(model_name: str | None = None) -> list[str]:
    """Other real tasks for a chat model (none for a plain language model)."""
    e = entry(model_name)
    if e is None or not e.chat:
        return []
    return [document_question(), find_the_number(), explain_code(), write_story()]


def is_chat(model_name: str | None, tokenizer) -> bool:
    """Whether Compare applies the chat template by default: catalogue chat models, or any model with a template."""
    e = entry(model_name)
    return e.chat if e is not None else bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids: raw text, or one user turn through the model's chat template."""
    if not chat:
        return tokenizer(prompt, verbose=False).input_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

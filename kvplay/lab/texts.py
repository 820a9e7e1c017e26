"""Where the lab's data lives (kvplay.paths.assets: assets/ of a checkout, or a wheel's copy), and its held-out text.

The Tempest (assets/texts/tempest.txt) was never trained on by the bundled model; perplexity, the
sweeps' long contexts and the Inside scans read it from its start.
"""
from __future__ import annotations

from kvplay.errors import KvplayError
from kvplay.paths import assets

ASSETS = assets()
HELD_OUT_TEXT = ASSETS / "texts" / "tempest.txt"      # never trained on: the bundled model's held-out play

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


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids: raw text, or one user turn through the model's chat template."""
    if not chat:
        return tokenizer(prompt, verbose=False).input_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def long_text_ids(tokenizer, n_tokens: int) :
    """The held-out play's first `n_tokens` tokens (1, n), the play repeated as often as needed."""
    if n_tokens < 1:
        raise KvplayError(f"The text length must be at least 1 token, got {n_tokens}.")
    ids = tokenizer(HELD_OUT_TEXT.read_text(encoding="utf-8"), return_tensors="pt", verbose=False).input_ids[0]
    reps = -(-n_tokens // ids.shape[0])
    return ids.repeat(reps)[:n_tokens].unsqueeze(0)                        # (1, n)

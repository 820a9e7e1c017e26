"""What the UI and the CLI call: input validation, then the compute layer.

Every function here takes plain Python values and returns plain values or result
dataclasses, so the UI module never touches torch. Bad input raises KvplayError
with one sentence.
"""
from __future__ import annotations

import unicodedata

import torch

from .errors import KvplayError
from .models import BUNDLED_NAME, check_allowed, load_model
from .settings import Settings


def clean_text(text, what: str = "Prompt") -> str:
    """Reject empty text and control characters (tabs and newlines are fine)."""
    if not isinstance(text, str) or not text.strip():
        raise KvplayError(f"{what} is empty; type some text.")
    bad = [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\r\t"]
    if bad:
        raise KvplayError(f"{what} contains control characters (such as {bad[0]!r}); remove them.")
    return text


def check_int(value, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a whole number between {lo} and {hi}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise KvplayError(f"{what} must be a whole number, not {value}.")
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise KvplayError(f"{what} must be a whole number, not {value!r}.") from None
    if not lo <= value <= hi:
        raise KvplayError(f"{what} must be between {lo} and {hi}, got {value}.")
    return value


def get_model(name: str | None, settings: Settings):
    name = (name or "").strip() or settings.default_model
    check_allowed(name, settings)
    return load_model(None if name == BUNDLED_NAME else name, settings=settings)


def generate_text(model_name: str | None, prompt: str, max_new_tokens, settings: Settings | None = None) -> str:
    """Greedy continuation of `prompt` with the 16-bit cache: the minimal playground."""
    settings = settings or Settings.from_env()
    prompt = clean_text(prompt)
    n = check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens)
    model, tok = get_model(model_name, settings)
    ids = tok(prompt, return_tensors="pt").to(model.device)
    if ids.input_ids.shape[1] + n > settings.max_context:
        raise KvplayError(f"Prompt plus new tokens exceed the context limit of {settings.max_context} tokens.")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return prompt + tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)

"""Input validation at the edge: each helper returns the value as the lab takes it, or raises KvplayError with
one sentence naming what is wrong and what is allowed. The commands call these once, before any model loads;
the code below them trusts its typed inputs.
"""
from __future__ import annotations

import operator
import unicodedata
from pathlib import Path

from kvplay.app.settings import Settings
from kvplay.cache import baseline_first
from kvplay.errors import KvplayError

MAX_CHARS_PER_TOKEN = 64       # a prompt this many times the token limit cannot fit: refused before tokenizing


def _short(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def clean_text(text, what: str = "Prompt") -> str:
    """Reject empty text, control characters (tabs and newlines are fine) and lone surrogates."""
    if text is not None and not isinstance(text, str):
        raise KvplayError(f"{what} must be text, not {type(text).__name__}.")
    if not text or not text.strip():
        raise KvplayError(f"{what} is empty; type some text.")
    bad = [c for c in text if unicodedata.category(c) in ("Cc", "Cs") and c not in "\n\r\t"]
    if bad:
        kind = "invalid characters" if unicodedata.category(bad[0]) == "Cs" else "control characters"
        raise KvplayError(f"{what} contains {kind} (such as {bad[0]!r}); remove them.")
    return text


def check_int(value, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a whole number between {lo} and {hi}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise KvplayError(f"{what} must be a whole number, not {value}.")
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise KvplayError(f"{what} must be a whole number, not {_short(value)}.") from None
    else:
        try:
            value = operator.index(value)  # int, numpy integers
        except TypeError:
            raise KvplayError(f"{what} must be a whole number, not {type(value).__name__}.") from None
    if not lo <= value <= hi:
        raise KvplayError(f"{what} must be between {lo} and {hi}, got {_short(value)}.")
    return value


def check_float(value, what: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi], or one sentence saying why not."""
    if isinstance(value, bool) or value is None:
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.")
    try:
        value = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.") from None
    if not lo <= value <= hi:  # also refuses nan
        raise KvplayError(f"{what} must be a number between {lo:g} and {hi:g}.")
    return value


def fit_prompt(tokenizer, prompt: str, new_tokens: int, limit: int) -> int:
    """The prompt's length in tokens, refused when it plus `new_tokens` exceeds `limit` tokens."""
    if len(prompt) > MAX_CHARS_PER_TOKEN * limit:
        raise KvplayError(f"The prompt ({len(prompt)} characters) is far longer than the limit of {limit} tokens.")
    prompt_tokens = len(tokenizer(prompt, verbose=False).input_ids)
    if prompt_tokens + new_tokens > limit:
        raise KvplayError(f"The prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceeds the limit of "
                          f"{limit} tokens.")
    return prompt_tokens


def parse_specs(specs, settings: Settings) -> list:
    """The run's CacheSpecs, each parsed once, de-duplicated, the 16-bit baseline first (kvplay.cache.baseline_first).

    Model checks come later, once per spec, where the model is known (kvplay.cache.check_specs in the runners).
    """
    if specs is None:
        specs = []
    if isinstance(specs, str):
        specs = specs.split()
    if not isinstance(specs, (list, tuple)):
        raise KvplayError(f"Cache specs must be a list of spec strings, not {type(specs).__name__}.")
    if len(specs) > 4 * settings.max_specs:  # refuse before parsing thousands
        raise KvplayError(f"At most {settings.max_specs} cache specs per run, got {len(specs)}.")
    parsed = baseline_first(specs)
    count = len(parsed) - 1
    if count > settings.max_specs:
        raise KvplayError(f"At most {settings.max_specs} cache specs per run, got {count}.")
    return parsed


def read_text_file(path) -> str:
    """A UTF-8 text file's contents (the CLI's --text and --inputs; the UI takes pasted text, never a path)."""
    path = Path(path)
    try:
        if not path.is_file():
            raise KvplayError(f"No text file at {str(path)!r}.")
        data = path.read_bytes()
    except OSError as exc:
        raise KvplayError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None
    return decode_text(data, path.name)


def decode_text(data: bytes, name: str = "The file") -> str:
    """Uploaded or read bytes as clean UTF-8 text, or one sentence."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvplayError(f"{name} is not valid UTF-8 text.") from None
    return clean_text(text.removeprefix("\ufeff"), what="The text file")

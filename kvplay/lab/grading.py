"""Grading a task's answer in a cache's text: Compare grades every cache with the run (kvplay.lab.compare).

    grade("The pass code is 27611.", "27611")          # ("27611", True)
    grade("It was 2761.", "27611")                     # ("2761", False)
    grade("Prospero rules.", "Prospero", "word")       # ("Prospero", True)
"""
from __future__ import annotations

import re

CHECKS = ("number", "word")   # how an expected answer is found in a cache's text (kvplay.app.prompts.Task.check)


def grade(text: str, expected: str | None, check: str = "number") -> tuple[str, bool] | None:
    """(what the answer gave, right?) for one cache's text; None when there is nothing to check.

    number: right when `expected` is one of the text's whole numbers ("27611", never "2761" or "276110");
    the answer shown is the expected number, else the first number, else the answer's first words.
    word: right when `expected` appears as a whole word, case ignored.
    """
    if expected is None:
        return None
    words = " ".join(text.split()[:6]) + ("…" if len(text.split()) > 6 else "")
    if check == "number":
        numbers = re.findall(r"\d+", text)
        if expected in numbers:
            return expected, True
        return (numbers[0] if numbers else words or "nothing"), False
    if check == "word":
        found = re.search(rf"\b{re.escape(expected)}\b", text, flags=re.IGNORECASE)
        return (found.group(0), True) if found else (words or "nothing", False)
    raise ValueError(f"unknown check {check!r}; use one of {CHECKS}")

"""The progress callback every measurement takes: progress(fraction done, what it is doing), and the time left
it implies (time_left).

The app's envelope (kvplay.app.jobs) hands in one that also raises KvplayError at the next call once the run
is cancelled, so a measurement that reports progress at every step can be stopped at every step.
"""
from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[float, str], None]


def no_progress(fraction: float, description: str) -> None:
    """The callback when nobody watches."""


def last(stream):
    """The last item of a stream of partial results (None if it yields none): the one way to drain one."""
    item = None
    for item in stream:  # noqa: B007  (the loop keeps the last)
        pass
    return item


def time_left(start: float, fraction: float) -> str:
    """'about 40 s left' from the time since start (a time.perf_counter()) and the fraction done; '' until there
    is a rate to go by."""
    spent = time.perf_counter() - start
    if fraction <= 0.02 or spent < 1.0:
        return ""
    return f"about {max(1, round(spent * (1 - fraction) / fraction)):,} s left"

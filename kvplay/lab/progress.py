"""The progress callback every measurement takes: progress(fraction done, what it is doing).

The app's envelope (kvplay.app.jobs) hands in one that also raises KvplayError at the next call once the run
is cancelled, so a measurement that reports progress at every step can be stopped at every step.
"""
from __future__ import annotations

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

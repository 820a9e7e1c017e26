"""The progress callback every measurement takes: progress(fraction done, what it is doing).

The app's envelope (kvplay.app.jobs) hands in one that also raises KvplayError at the next call once the run
is cancelled, so a measurement that reports progress at every step can be stopped at every step.
"""
from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[float, str], None]


def no_progress(fraction: float, description: str) -> None:
    """The callback when nobody watches."""

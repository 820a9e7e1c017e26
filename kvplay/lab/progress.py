"""The progress callback every measurement takes: progress(fraction done, what it is doing), and work run in the
background with its progress relayed to a stream (in_background).

The app's envelope (kvplay.app.jobs) hands in one that also raises KvplayError at the next call once the run
is cancelled, so a measurement that reports progress at every step can be stopped at every step.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from kvplay.errors import KvplayError

Progress = Callable[[float, str], None]


def no_progress(fraction: float, description: str) -> None:
    """The callback when nobody watches."""


def last(stream):
    """The last item of a stream of partial results (None if it yields none): the one way to drain one."""
    item = None
    for item in stream:  # noqa: B007  (the loop keeps the last)
        pass
    return item


EVERY_S = 2.0        # seconds between in_background's updates


def in_background(work_fn, on_update):
    """Run work_fn(progress) in a worker thread and relay its progress: a generator calling on_update(fraction,
    what) here, in the caller's thread, for each report (and once more at the end), and yielding at most every
    EVERY_S seconds, so a stream can go on showing results meanwhile (a Compare's caches that decoded while another
    calibrates). An error or cancel raised by on_update stops the worker at its next report; the worker's own error
    is raised here."""
    news: queue.Queue = queue.Queue()
    stop = threading.Event()
    failed: list[BaseException] = []

    def report(fraction, what):
        if stop.is_set():
            raise KvplayError("Cancelled.")
        news.put((fraction, what))

    def work():
        try:
            work_fn(report)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread as it is
            failed.append(e)
        news.put(None)

    worker = threading.Thread(target=work, name="kvplay-background", daemon=True)
    worker.start()
    latest, shown = (0.0, ""), 0.0
    try:
        while (item := news.get()) is not None:
            latest = item
            on_update(*latest)                     # every report: a cancel checked here is noticed at once
            if time.perf_counter() - shown >= EVERY_S:
                shown = time.perf_counter()
                yield
    finally:
        stop.set()
        worker.join()
    if failed:
        raise failed[0]
    on_update(1.0, latest[1])
    yield


def time_left(start: float, fraction: float) -> str:
    """'about 40 s left' from the time since start (a time.perf_counter()) and the fraction done; '' until there
    is a rate to go by."""
    spent = time.perf_counter() - start
    if fraction <= 0.02 or spent < 1.0:
        return ""
    return f"about {max(1, round(spent * (1 - fraction) / fraction)):,} s left"

"""What a Compare stopped by the per-run CPU limit leaves on screen."""
from __future__ import annotations

import itertools

from kvplay.app import guard
from kvplay.app.settings import Settings
from kvplay.ui import common
from kvplay.ui.compare import make_compare


def test_a_run_stopped_by_the_limit_keeps_its_numbers_and_says_why(bundled, monkeypatch):
    ticks = itertools.count()                  # a clock that advances one "CPU second" per check (one per step)
    monkeypatch.setattr(common, "gradio_cancel_token",
                        lambda max_seconds: guard.CancelToken(max_seconds=max_seconds, clock=lambda: next(ticks)))
    handler = make_compare(Settings(max_seconds=30))          # stops about 30 steps into a 64-step run
    frames = list(handler(prompt="To be, or not to be", max_new_tokens=64))
    status, verdict, cards = frames[-1][:3]
    assert "limit of 30 CPU seconds" in status and "The numbers so far are shown." in status
    assert cards.count("kv-card'") == 5 and verdict              # every cache's card so far stays on screen

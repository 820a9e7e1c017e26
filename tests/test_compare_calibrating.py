"""A Compare never waits on calibration: caches with nothing to measure decode first, a cache that calibrates
on this model joins when ready, and its figures are those of a run that calibrated before it started."""
from __future__ import annotations

import re

import pytest

from kvplay.cache import fragile, parse_spec
from kvplay.cli.common import said_as_they_come
from kvplay.errors import KvplayError
from kvplay.lab import compare
from kvplay.show.cards import cards_html, fmt_kl, overall_sentence

CALIBRATING = str(parse_spec("kvplay-int2:fragile=0.5,group=16,residual=16"))   # not among the seeds
SPECS = ["baseline", "kvplay-int4:residual=16", CALIBRATING]
PROMPT = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
          "JULIET:\n")
NEW = 24


def _fresh(monkeypatch, folder) -> None:
    """Nothing ranked in this process, nor kept in `folder`."""
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(folder))


def _stream(model, tok, progress=None):
    return list(compare.iter_compare(model, tok, [parse_spec(s) for s in SPECS], PROMPT, NEW, progress=progress,
                                     task=compare.Task("a number", "27611", "number")))


def test_the_others_decode_first_and_the_calibrating_cache_joins_with_the_same_figures(bundled, monkeypatch,
                                                                                        tmp_path):
    model, tok = bundled
    _fresh(monkeypatch, tmp_path)
    spec = parse_spec(CALIBRATING)
    assert not spec.method.calibrated(spec, model)
    seen = []
    results = _stream(model, tok, lambda fraction, what: seen.append((fraction, what)))
    waited = [r for r in results if r.calibrating]
    assert waited and all(list(r.calibrating) == [CALIBRATING] for r in waited)
    ready = waited[-1]                              # the last one before it joins: 16-bit and kvplay-int4 done
    assert [r.spec for r in ready.caches] == SPECS[:2]
    assert all(len(r.token_ids) == NEW and len(r.kl) == NEW for r in ready.caches)
    assert "calibrating" in cards_html(ready) and CALIBRATING in cards_html(ready)
    assert overall_sentence(ready).startswith(f"{CALIBRATING} joins once calibrated for this model. ")
    ranking = [w for _, w in seen if "measuring which layers' keys" in w]
    assert ranking and all(w.startswith("kvplay-int2:") for w in ranking)       # the bar says what it waits on
    said = [w for _, w in seen if "calibrating once" in w or "measuring which layers' keys" in w]
    assert re.fullmatch(rf"{re.escape(CALIBRATING)}: calibrating once for this model, about \d+ s on this machine "
                        r"\(estimated\)", said[0]), said[0]                      # said before it starts
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0               # one bar, never going back

    lines = []                                     # the CLI says the same as it comes, on stderr
    assert said_as_they_come(iter(results), lines.append) is results[-1]
    assert re.fullmatch(rf"{re.escape(CALIBRATING)}: calibrating once for this model \(about \d+ s on this machine, "
                        r"estimated\), then decoding; the other caches go first\.", lines[0]), lines[0]
    for line, run in zip(lines[1:], results[-1].caches[1:], strict=True):          # int4's first, then int2's
        assert f" {run.label.name}: answer ✗ " in line and line.endswith(f"KL {fmt_kl(run.mean_kl)} over 24 tokens")

    joined = results[-1]
    assert not joined.calibrating and [r.spec for r in joined.caches] == SPECS
    assert spec.method.calibrated(spec, model)                                   # ranked and kept

    # The same Compare again: nothing to calibrate now, so one lockstep; the figures match the joined run's.
    again = _stream(model, tok)
    assert not any(r.calibrating for r in again)
    for late, once in zip(joined.caches, again[-1].caches, strict=True):
        assert late.token_ids == once.token_ids
        # Measured: the same to the last bit on the bundled model (int2's mean KL 8.9e-4), though the joining
        # cache decoded beside a second 16-bit run, in a smaller batch.
        assert late.mean_kl == pytest.approx(once.mean_kl, rel=1e-5)
        assert late.top1_agreement == once.top1_agreement


def test_a_cancel_while_a_cache_calibrates_stops_the_compare_and_its_calibration(bundled, monkeypatch, tmp_path):
    model, tok = bundled
    _fresh(monkeypatch, tmp_path)

    def cancel_in_calibration(fraction, what):
        if "measuring which layers" in what:
            raise KvplayError("Cancelled.")

    with pytest.raises(KvplayError, match="Cancelled"):
        _stream(model, tok, cancel_in_calibration)
    spec = parse_spec(CALIBRATING)
    assert not spec.method.calibrated(spec, model)                               # nothing half-measured kept
    assert not list(tmp_path.iterdir())


def test_the_page_says_which_cache_calibrates_while_the_others_show(bundled, monkeypatch, tmp_path):
    """Compare's handler on the bundled model: while kvplay-int2's ranking is measured, the frames show the other
    caches' cards, a 'calibrating' card and a status line naming it; the last frame has all five cards."""
    from kvplay.app.settings import Settings
    from kvplay.ui.compare import make_compare

    _fresh(monkeypatch, tmp_path)
    handler = make_compare(Settings())
    frames = list(handler(prompt=PROMPT, max_new_tokens=NEW, extra_specs=CALIBRATING, caches=["kvplay-int4"]))
    waiting = [f for f in frames if "calibrating once for this model" in f[0]]
    assert waiting, [f[0] for f in frames]
    status, _, cards = waiting[-1][:3]
    assert re.search(rf"{re.escape(CALIBRATING)} calibrating once for this model \(about \d+ s on this machine, "
                     r"estimated\)", status), status
    assert cards.count("class='kv-card'") == 2 and cards.count("kv-card kv-refused") == 1 and "calibrating" in cards
    status, _, cards = frames[-1][:3]
    assert status.startswith("<p class='kv-status-line'>Done: 3 caches") and "calibrating" not in cards

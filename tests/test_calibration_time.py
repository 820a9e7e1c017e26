"""The estimate kvplay says before a calibration starts (kvplay/cache/calibration_time.py): which parts it counts,
that parts several specs share count once, and that it is said first. How close it comes to the measured time is a
benchmark's question (docs/benchmarks.md, "Calibration time, estimated"), not a unit test's."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvplay.cache import calibrate, calibration_seconds, calibration_time, fragile, parse_spec, rotations
from kvplay.cache.methods.kvplay import _full_attention


@pytest.fixture
def unseen(bundled, monkeypatch, tmp_path):
    """The bundled model as a model nothing is kept for: no seeds, nothing in memory or on disk."""
    for module in (fragile, rotations):
        monkeypatch.setattr(module, "SEEDS", Path(tmp_path) / "none")
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setattr(rotations, "_FITTED", type(rotations._FITTED)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path / "rankings"))
    monkeypatch.setenv("KVPLAY_ROTATION_DIR", str(tmp_path / "rotations"))
    return bundled


def test_a_model_with_shipped_calibrations_has_nothing_to_estimate(bundled):
    model, _ = bundled
    specs = [parse_spec(s) for s in ("kvplay-int2", "kvplay-3bit", "kvplay-2.5bit", "kvplay-int4", "quanto-int4")]
    assert all(s.method.calibrated(s, model) and not s.method.calibration_parts(s, model) for s in specs)
    assert calibration_seconds(specs, model) == 0


def test_each_part_is_counted_once_however_many_specs_need_it(unseen):
    """kvplay-3bit and kvplay-2.5bit each need the Fisher pass, their rankings and the fast fit for 64-token key
    blocks; the pass, the Fisher weights of every preset's window and the fit are measured once for both."""
    model, _ = unseen
    three, two = parse_spec("kvplay-3bit"), parse_spec("kvplay-2.5bit")
    layers = _full_attention(model.config.get_text_config(decoder=True))
    parts = {str(s): s.method.calibration_parts(s, model) for s in (three, two)}
    fast = rotations.FITTERS["fast"]
    ranking = " + ".join(fragile.storage_key(three, layers, part, "fisher") for part in ("keys", "values"))
    long = fragile.FISHER_TOKENS
    assert set(parts["kvplay-3bit"]) == {f"Fisher pass over {long} tokens", f"Fisher weights over {long} tokens",
                                         ranking, rotations.storage_key(three, layers, fast)}
    fit = rotations.storage_key(two, layers, fast)
    assert fit == rotations.storage_key(three, layers, fast) and fit in parts["kvplay-2.5bit"]
    assert all(seconds > 0 for each in parts.values() for seconds in each.values())
    shared = sum(parts["kvplay-3bit"][name] for name in (f"Fisher pass over {long} tokens",
                                                         f"Fisher weights over {long} tokens", fit))
    alone = sum(calibration_seconds([s], model) for s in (three, two))
    assert calibration_seconds([three, two], model) == pytest.approx(alone - shared)


def test_kvplay_int2s_short_pass_is_counted_apart_and_costs_less(unseen):
    """kvplay-int2's blocks of 32 tokens are ranked from a pass over 1,024 tokens, kvplay-3bit's from the long one:
    calibrating both counts both passes, and the short one costs less than the long one."""
    model, _ = unseen
    two, three = parse_spec("kvplay-int2:fragile=0.5"), parse_spec("kvplay-3bit")    # the bundled model's 4 layers
    short, long = (s.method.calibration_parts(s, model) for s in (two, three))
    assert fragile.fisher_tokens(two) == 1024 and "Fisher pass over 1024 tokens" in short
    assert short["Fisher pass over 1024 tokens"] < long[f"Fisher pass over {fragile.FISHER_TOKENS} tokens"]
    assert calibration_seconds([two, three], model) == pytest.approx(
        calibration_seconds([two], model) + calibration_seconds([three], model))


def test_the_estimate_is_said_first_and_nothing_is_left_once_calibrated(unseen):
    model, tok = unseen
    spec = parse_spec("kvplay-2.5bit")
    expected = calibration_time.words(calibration_seconds([spec], model))
    said = []
    calibrate([spec], model, tok, lambda fraction, what: said.append((fraction, what)))
    assert said[0] == (0.0, f"kvplay-2.5bit: calibrating once for this model, {expected} on this machine (estimated)")
    assert any("key rotations" in what for _, what in said[1:]) and not any("(estimated)" in w for _, w in said[1:])
    assert spec.method.calibrated(spec, model) and calibration_seconds([spec], model) == 0


def test_the_words_round_to_seconds_then_minutes():
    assert [calibration_time.words(s) for s in (0.2, 41.4, 119.4, 150, 3600)] == \
        ["about 1 s", "about 41 s", "about 119 s", "about 2 min", "about 60 min"]

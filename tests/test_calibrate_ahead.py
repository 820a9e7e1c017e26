"""`python -m kvplay calibrate`: a model's calibrations measured ahead, so its first runs wait for nothing; the
estimate is said first, the result where it is kept, and a second run finds nothing to do."""
from __future__ import annotations

import re

from kvplay.cache import fragile, parse_spec
from kvplay.cli.main import main

SPEC = "kvplay-int2:fragile=0.5,group=16"          # not among the bundled model's seeds


def test_calibrate_says_how_long_first_then_keeps_it_and_a_second_run_has_nothing_to_do(bundled, capsys,
                                                                                         monkeypatch, tmp_path):
    model, _ = bundled
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path))
    spec = parse_spec(SPEC)
    assert not spec.method.calibrated(spec, model)
    assert main(["calibrate", "--model", "shakespeare-llama", "--caches", SPEC, "kvplay-int4"]) == 0
    out, err = capsys.readouterr()
    assert re.search(rf"shakespeare-llama: calibrating {re.escape(str(spec))} once, about \d+ s on this machine "
                     r"\(estimated\)\.", err), err
    assert re.match(rf"shakespeare-llama: calibrated {re.escape(str(spec))} in [\d.]+ s \(estimated [\d.]+ s\), kept "
                    rf"by the hash of its weights in {re.escape(str(tmp_path))}", out), out
    assert list(tmp_path.iterdir())                                    # the ranking, on disk
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())           # a fresh process, in effect
    assert spec.method.calibrated(spec, model)
    assert main(["calibrate", "--model", "shakespeare-llama", "--caches", SPEC, "kvplay-int4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == ("shakespeare-llama: nothing to calibrate; each of the 2 caches it can run has what it "
                           "needs already.") and "calibrating" not in err


def test_calibrate_refuses_bad_input_in_one_sentence(capsys):
    assert main(["calibrate", "--model", "shakespeare-llama", "--caches", "kvplay-int9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "kvplay-int9" in err[0]

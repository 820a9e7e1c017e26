"""A run's look (kvplay.show.style: colour, dash, marker) comes from the label resolved where it ran
(CacheRun.label: its scheme and whether it is a variant), never from splitting its spec's text; stored results
whose labels predate those fields get them on read."""
import json

from kvplay.cache import parse_spec
from kvplay.paths import assets
from kvplay.results import CacheRun, CompareResult, Environment, from_dict, to_dict
from kvplay.results.compare import label_for
from kvplay.show.style import colour_for, resolved, style_for


def _run(spec: str, label=None) -> CacheRun:
    return CacheRun(spec=spec, text="x", token_ids=[1], tokens=["x"], first_divergence=None, match_fraction=1.0,
                    diff_spans=[], kl=[0.0], top1=[True], baseline_logprob=[-1.0], mean_kl=0.0, max_kl=0.0,
                    top1_agreement=1.0, context_tokens=[4], cache_bytes_per_step=[28], cache_bytes=28,
                    baseline_bytes=100, compression=100 / 28, bits_per_element=4.5, prefill_s=0.1,
                    prefill_tokens_per_s=40.0, decode_tokens_per_s=0.0, wall_s=1.0, top5_ids=[[1]],
                    top5_probs=[[0.5]], top5_tokens=[["x"]], label=label)


def test_the_label_carries_the_scheme_and_whether_the_options_differ():
    assert (label_for(parse_spec("kvplay-int2")).scheme, label_for(parse_spec("kvplay-int2")).variant) == \
        ("kvplay-int2", False)
    variant = label_for(parse_spec("kvplay-int2:group=16"))
    assert (variant.scheme, variant.variant) == ("kvplay-int2", True)
    evicting = label_for(parse_spec("baseline:evict=snapkv,keep=0.25"))
    assert (evicting.scheme, evicting.variant) == ("baseline", True)


def test_a_runs_look_is_read_from_its_label_not_its_text():
    """A run labelled kvplay-int2's variant draws as one whatever its text says: style reads the label."""
    label = label_for(parse_spec("kvplay-int2:group=16"))
    run = _run("a name no parser knows", label=label)
    assert resolved(run) == ("kvplay-int2", True)
    assert colour_for(run) == colour_for("kvplay-int2") != colour_for("kvplay-int4")
    assert style_for(run)["line"]["dash"] == "longdash"
    plain = _run("kvplay-int2")
    assert style_for(plain)["line"]["dash"] != "longdash" and colour_for(plain) == colour_for(run)


def test_a_label_stored_before_it_carried_its_scheme_gets_it_on_read():
    run = _run("quanto-int4:residual=16", label=label_for(parse_spec("quanto-int4:residual=16")))
    data = to_dict(CompareResult(prompt="p", prompt_tokens=4, max_new_tokens=1, batch_size=1, sampling={},
                                 env=Environment(model="m", dtype="bfloat16", device="cpu"), caches=[run]))
    for key in ("scheme", "variant"):
        del data["caches"][0]["label"][key]
    back = from_dict(json.loads(json.dumps(data))).caches[0]
    assert (back.label.scheme, back.label.variant) == ("quanto-int4", True)


def test_the_recorded_runs_resolve_their_labels():
    """Every recorded Compare (assets/recorded) reads back with each run's scheme as its spec parses to."""
    files = sorted((assets() / "recorded").glob("*/*.json"))
    runs = [run for f in files if (d := json.loads(f.read_text(encoding="utf-8"))).get("kind") == "recording"
            for run in from_dict(d["result"]).caches]
    assert len(runs) >= 10
    for run in runs:
        spec = parse_spec(run.spec)
        assert (run.label.scheme, run.label.variant) == (spec.name, str(spec) != spec.name), run.spec

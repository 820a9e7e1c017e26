"""Spec parsing: the canonical form, defaults, and one-sentence errors naming what is valid."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplay.cache import SCHEMES, defaults, parse_spec
from kvplay.errors import KvplayError


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_round_trips_through_its_canonical_string(name):
    spec = parse_spec(name)
    assert str(spec).split(":")[0] == name            # llama.cpp's canonical form names its types: llama.cpp:f16
    assert parse_spec(str(spec)) == spec and str(parse_spec(str(spec))) == str(spec)


@pytest.mark.parametrize("text, canonical", [
    ("kvplay-int2:group=32,residual=128,keys=channel,values=token,rotation=hadamard,sink=4",
     "kvplay-int2:residual=128"),                                # rotation and sink=4 are int2's defaults
    ("kvplay-int4:vbits=4,kbits=8", "kvplay-int4:kbits=8"),
    (" KVPLAY-INT4 : sink = 4 , group=32 ", "kvplay-int4:group=32"),       # sink=4 is int4's default
    ("hqq-int4:axis_value=0,axis_key=0", "hqq-int4:axis_key=0,axis_value=0"),
    ("quanto-int2:residual=64", "quanto-int2:residual=64"),
])
def test_options_are_normalised(text, canonical):
    assert str(parse_spec(text)) == canonical


def test_documented_defaults():
    assert (defaults("quanto-int4").axis_key, defaults("hqq-int4").axis_key) == (0, 1)  # per token in each backend
    for name in ("quanto-int4", "hqq-int8"):
        assert (defaults(name).group, defaults(name).residual) == (64, 128)
    assert defaults("kvplay-int4").group == 64 and defaults("kvplay-int8").group == 64
    assert defaults("kvplay-int3").group == 32 and defaults("kvplay-int2").group == 32
    k = defaults("kvplay-int2")
    assert (k.keys, k.values, k.rotation, k.sink, k.residual) == ("channel", "token", "hadamard", 4, 124)  # issue 14


@pytest.mark.parametrize("text, sentence", [
    ("quanto-int8", "quanto offers int4 and int2; try hqq-int8 or kvplay-int8"),
    ("hqq-int3", "hqq offers int8, int4 and int2; try kvplay-int3"),
    ("int4", "valid names are baseline, quanto-int4"),
    ("kvplay-int4:foo=1", "Unknown option 'foo' for kvplay-int4; valid options: group, residual, keys"),
    ("quanto-int4:sink=4", "Unknown option 'sink' for quanto-int4"),
    ("baseline:group=4", "valid options: store, attention"),
    ("kvplay-int4:rotation=random", "rotation=random in 'kvplay-int4:rotation=random' is invalid; choose none, "
                                    "hadamard or calibrated"),
    ("kvplay-int4:keys=head", "keys=head in 'kvplay-int4:keys=head' is invalid; choose channel or token"),
    ("kvplay-int4:kbits=5", "kbits=5 in 'kvplay-int4:kbits=5' is invalid; choose 2, 3, 4 or 8"),
    ("kvplay-int4:residual=-1", "between 0 and 65536"),
    ("kvplay-int4:group=abc", "must be an integer"),
    ("kvplay-int4:group", "must look like key=value"),
    ("kvplay-int4:group=8,group=16", "given twice"),
    ("quanto-int4:axis_key=1", "axis_key=1 in 'quanto-int4:axis_key=1' is invalid; choose 0 or -1"),
    ("hqq-int4:axis_value=-1", "axis_value=-1 in 'hqq-int4:axis_value=-1' is invalid; choose 0 or 1"),
    ("kvplay-fp8:kbits=4", "valid options: residual, rotation, sink"),
    ("", "non-empty string"),
])
def test_bad_specs_say_what_is_valid(text, sentence):
    with pytest.raises(KvplayError) as err:
        parse_spec(text)
    assert sentence in str(err.value)
    assert "\n" not in str(err.value)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_parser_never_crashes_on_arbitrary_text(text):
    try:
        spec = parse_spec(text)
    except KvplayError as exc:
        assert str(exc).endswith((".", "?"))
    else:
        assert parse_spec(str(spec)) == spec


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from([n for n in SCHEMES if n.startswith("kvplay-int")]),
       group=st.sampled_from([8, 16, 32, 64, 128]), residual=st.integers(0, 512), sink=st.integers(0, 16),
       rotation=st.sampled_from(["none", "hadamard"]), keys=st.sampled_from(["channel", "token"]),
       kbits=st.sampled_from([2, 3, 4, 8]))
def test_generated_kvplay_specs_round_trip(name, group, residual, sink, rotation, keys, kbits):
    text = f"{name}:group={group},residual={residual},sink={sink},rotation={rotation},keys={keys},kbits={kbits}"
    spec = parse_spec(text)
    assert (spec.group, spec.residual, spec.sink, spec.rotation, spec.keys, spec.kbits) == (
        group, residual, sink, rotation, keys, kbits)
    assert parse_spec(str(spec)) == spec

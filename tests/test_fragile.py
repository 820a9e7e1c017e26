"""kvplay's fragile layers (kvplay/cache/fragile.py): more key bits in the layers whose keys cost the logits most.

Figures measured on the bundled model (4 layers), teacher-forced over held-out tokens 300..500, mean KL from
the 16-bit cache: kvplay-int2 1.56e-3; 4-bit keys in layer 0 alone 1.04e-3, layer 1 1.50e-3, layer 2 1.48e-3,
layer 3 1.54e-3; kvplay-int2:fragile=0.5 (layers 0 and 1) 0.90e-3. The ranking (measured on other tokens, the
end of the play) is [0, 1, 2, 3].
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from kvplay.app.catalogue import HELD_OUT_TEXT
from kvplay.cache import build_cache, calibrate, fragile, parse_spec
from kvplay.cache.engine import KVPlayCache, KVPlayLayer
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate


@pytest.fixture(scope="module")
def held_out(bundled):
    _, tok = bundled
    return tok(HELD_OUT_TEXT.read_text()[:20000], return_tensors="pt").input_ids[:, :500]      # (1, 500)


def _kl(model, ids, cache) -> float:
    """Mean KL of a cache's teacher-forced logits over tokens 300..500 from the 16-bit cache's."""
    runs = [generate(model, ids[:, :300], c, 0, forced=ids[:, 300:]) for c in (build_cache("baseline", model), cache)]
    p, q = (torch.stack(r.logits).log_softmax(-1) for r in runs)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.mark.parametrize("share, layers, count", [(0.1, 30, 3), (0.14, 30, 4), (0.2, 30, 6), (0.1, 4, 0),
                                                  (0.25, 4, 1), (0.5, 4, 2), (1.0, 4, 4), (0.0, 30, 0)])
def test_a_share_rounds_to_whole_layers(share, layers, count):
    assert fragile.fragile_count(parse_spec(f"kvplay-int2:fragile={share}"), layers) == count


def test_the_top_ranked_layer_gains_more_than_the_bottom_one_on_other_text(bundled, held_out):
    """The ranking, measured at the play's end, holds on its start: 4-bit keys in the top layer alone cut the
    KL by 33% (1.04e-3), in the bottom one by 1% (1.54e-3). Bound: top below 0.85x bottom."""
    model, tok = bundled
    spec = parse_spec("kvplay-int2:fragile=0.5")
    ranking = fragile.rank_layers(model, tok, spec, [0, 1, 2, 3])
    assert sorted(ranking) == [0, 1, 2, 3]
    top, bottom = (_kl(model, held_out, KVPlayCache(spec, model.config, {i: 4})) for i in (ranking[0], ranking[-1]))
    assert top < 0.85 * bottom, (ranking, top, bottom)


def test_values_are_ranked_on_their_own(bundled, held_out):
    """Values have their own ranking (stored_attention's values part): 4-bit values in layer 0 alone cut the KL of
    kvplay-int2 by 43% (1.56e-3 to 0.90e-3), in any other layer by at most 1.4% (1.54e-3 to 1.57e-3). Bound: top
    below 0.85x bottom. A spec with both shares gets both kinds of layers, each from its own ranking."""
    model, tok = bundled
    spec = parse_spec("kvplay-int2:vfragile=0.5")
    ranking = fragile.rank_layers(model, tok, spec, [0, 1, 2, 3], "values")
    assert sorted(ranking) == [0, 1, 2, 3] and ranking[0] == 0
    top, bottom = (_kl(model, held_out, KVPlayCache(spec, model.config, value_bits={i: 4}))
                   for i in (ranking[0], ranking[-1]))
    assert top < 0.85 * bottom, (ranking, top, bottom)
    cache = build_cache("kvplay-int2:fragile=0.5,vfragile=0.25", model, tok)
    keys = fragile.ranking(model, tok, spec, [0, 1, 2, 3])[:2]
    assert [layer.key_fmt.bits for layer in cache.layers] == [4 if i in keys else 2 for i in range(4)]
    assert [layer.value_fmt.bits for layer in cache.layers] == [4 if i == ranking[0] else 2 for i in range(4)]
    assert f"; 4-bit values in layer {ranking[0]};" in cache.description
    assert fragile.storage_key(spec, [0, 1], "values") != fragile.storage_key(spec, [0, 1], "keys")


def test_the_shipped_seed_is_what_the_code_measures(bundled):
    """assets/fragile_rankings.json (scripts/rank_fragile.py) holds the bundled model's ranking as measured now."""
    model, tok = bundled
    layers = [0, 1, 2, 3]
    spec = parse_spec("kvplay-int2:fragile=0.5")
    seeds = json.loads(fragile.SEEDS.read_text())
    assert seeds[fragile.fingerprint(model)][fragile.storage_key(spec, layers)] == \
        fragile.rank_layers(model, tok, spec, layers)


def _no_ranking(monkeypatch, why: str = "measured again") -> None:
    """Fail the test if either ranking is measured from here on."""
    for name in ("rank_layers", "rank_layers_fisher"):
        monkeypatch.setattr(fragile, name, lambda *a: pytest.fail(why))


def test_a_measured_ranking_is_kept_on_disk(bundled, tmp_path, monkeypatch):
    model, tok = bundled
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path))
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())          # a fresh process, in effect
    spec = parse_spec("kvplay-int2:fragile=0.5,group=16")                         # not among the seeds
    first = build_cache(spec, model, tok)                                         # the Fisher ranking: the default
    kept = json.loads((tmp_path / f"{fragile.fingerprint(model)}.json").read_text())
    assert sorted(kept[fragile.storage_key(spec, [0, 1, 2, 3], method="fisher")]) == [0, 1, 2, 3]
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    _no_ranking(monkeypatch)
    again = build_cache(spec, model)                                  # read back from disk: no tokenizer needed
    assert [layer.key_fmt.bits for layer in again.layers] == [layer.key_fmt.bits for layer in first.layers]


def test_fragile_layers_cut_int2_error(bundled, held_out):
    """kvplay-int2:fragile=0.5: KL 0.90e-3 against 1.56e-3 (0.58x); bound 0.8x."""
    model, _ = bundled
    plain, boosted = (_kl(model, held_out, build_cache(s, model)) for s in ("kvplay-int2", "kvplay-int2:fragile=0.5"))
    assert boosted < 0.8 * plain, (boosted, plain)


def test_fragile_layers_hold_their_bits_and_their_keys_twice_the_bytes(bundled, held_out):
    model, tok = bundled
    spec = parse_spec("kvplay-int2:fragile=0.5,residual=32")
    cache = build_cache(spec, model, tok)
    bits = [layer.key_fmt.bits for layer in cache.layers]
    assert sorted(bits) == [2, 2, 4, 4]
    chosen = [i for i, b in enumerate(bits) if b == 4]
    assert f"4-bit keys in layers {chosen[0]}, {chosen[1]}" in cache.description
    assert "fused from packed codes" in cache.description                     # the kernel reads 4-bit keys too
    generate(model, held_out[:, :300], cache, 5)
    # The 4-bit layers' key codes take twice the 2-bit layers' bytes; everything else is the same per layer.
    codes = [layer.store_k.nbytes()[0] for layer in cache.layers]
    assert {codes[i] for i in chosen} == {2 * codes[bits.index(2)]}


def test_the_ranking_is_measured_once_per_model_and_storage(bundled, monkeypatch):
    model, tok = bundled
    build_cache("kvplay-int2:fragile=0.25", model, tok)                          # measured (or already cached)
    _no_ranking(monkeypatch, "ranked again")
    build_cache("kvplay-int2:fragile=0.5", model)                                # same storage: the cached ranking
    with pytest.raises(pytest.fail.Exception):
        build_cache("kvplay-int2:fragile=0.5,fragile_kbits=3", model, tok)      # other bits: a new ranking


def test_another_window_is_ranked_under_the_presets_window_so_a_window_sweep_ranks_once(bundled, tmp_path,
                                                                                       monkeypatch):
    """Trade-offs' window sweep builds 12 variants of kvplay-int2: one ranking serves them all (each ranked again
    took 43 s, 12 of them most of the sweep's 558 s in issue 41)."""
    model, tok = bundled
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path))
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())          # a fresh process, in effect
    build_cache("kvplay-int2:fragile=0.5", model, tok)                 # the preset's ranking (2 of its 4 layers)
    _no_ranking(monkeypatch, "ranked again")
    for residual, sink in ((0, 0), (512, 16), (32, 4)):
        cache = build_cache(f"kvplay-int2:fragile=0.5,residual={residual},sink={sink}", model, tok)
        assert [(layer.residual, layer.sink_len) for layer in cache.layers] == [(residual, sink)] * 4  # its own
    with pytest.raises(pytest.fail.Exception):
        build_cache("kvplay-int2:fragile=0.5,group=16", model, tok)               # another format: ranked


def test_the_probe_replaces_one_layers_attention(bundled, held_out):
    model, _ = bundled
    ids = held_out[:, :64]
    seen = []

    def zero_layer_2(i, q, k, v, scaling):
        seen.append(i)
        return torch.zeros_like(q).transpose(1, 2) if i == 2 else None           # (B, T, Hq, D)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        same = model(ids, use_cache=False, kvplay_probe=lambda *a: None).logits
        changed = model(ids, use_cache=False, kvplay_probe=zero_layer_2).logits
    assert torch.equal(plain, same)
    assert seen == [0, 1, 2, 3] and not torch.allclose(plain, changed)


@pytest.mark.parametrize("part", ["keys", "values"])
@pytest.mark.parametrize("spec", ["kvplay-int2:residual=20", "kvplay-int2:residual=0,sink=0,rotation=none"])
def test_stored_attention_is_the_engine_token_by_token(spec, part):
    """What each query sees when the prompt goes through a KVPlayLayer one token at a time, for one part (the
    other is taken exact on both sides)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, 150, 64, generator=gen) for h in (2, 1, 1))
    layer = KVPlayLayer(parse_spec(spec).with_options(attention="sdpa"))
    rows = []
    for i in range(150):
        keys, values = layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])           # (1, 1, i + 1, 64) each
        keys, values = (keys, v[:, :, :i + 1]) if part == "keys" else (k[:, :, :i + 1], values)
        p = (q[:, :, i:i + 1] @ keys.transpose(-1, -2) * 0.125).softmax(-1)        # (1, 2, 1, i + 1)
        rows.append(p @ values)
    expected = torch.cat(rows, dim=2).transpose(1, 2)                              # (1, 150, 2, 64)
    assert layer.store_k.n_blocks >= 3
    got = fragile.stored_attention(KVPlayLayer(parse_spec(spec)), q, k, v, 0.125, part)
    exact = fragile.stored_attention(KVPlayLayer(parse_spec(spec).with_options(residual=150)), q, k, v, 0.125, part)
    assert (got - expected).abs().max() < 3e-6          # measured 6.0e-7 to 6.6e-7 (float32 sums)
    assert (exact - expected).abs().max() > 0.05        # the stored part matters: 0.53-0.57 keys, 0.26-0.29 values


@pytest.mark.parametrize("part", ["keys", "values"])
def test_stored_states_are_the_engines(bundled, held_out, part):
    """stored_states() reproduces what a KVPlayLayer hands attention after its blocks are quantized."""
    layer = KVPlayLayer(parse_spec("kvplay-int2:residual=0"))
    keys = torch.randn(1, 2, 4 + 3 * 32 + 7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer.update(keys, keys)
    stored = layer.update(keys[:, :, :0], keys[:, :, :0])[part == "values"]      # what attention gets next step
    assert torch.equal(fragile.stored_states(layer, keys, part), stored)


def test_refusals_and_no_ops(bundled):
    model, tok = bundled
    for spec in ("kvplay-int4:fragile=0.5", "kvplay-int2:kbits=4"):     # fragile_kbits=4 adds no bits: none
        cache = build_cache(spec, model)
        assert {layer.key_fmt.bits for layer in cache.layers} == {4} and "bit keys in layers" not in cache.description
        assert fragile.fragile_count(parse_spec(spec), 30) == 0
    tiny = tiny_llama(head_dim=64, num_hidden_layers=4)
    tiny.set_attn_implementation("kvplay")
    with pytest.raises(KvplayError, match="needs the tokenizer"):
        build_cache("kvplay-int2:fragile=0.5", tiny)
    tiny.set_attn_implementation("sdpa")
    with pytest.raises(KvplayError, match="attn_implementation='kvplay'"):
        build_cache("kvplay-int2:fragile=0.5", tiny, tokenizer=tok)
    assert "4-bit keys" not in build_cache("kvplay-int2:fragile=0.1", tiny).description    # 0.4 layers: none


def _fresh(monkeypatch, folder) -> None:
    """Nothing measured in this process, nor kept in `folder`."""
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(folder))


def test_a_first_exhaustive_ranking_shows_its_progress_and_a_cancel_stops_it(bundled, monkeypatch, tmp_path):
    """calibrate() measures a ranking the model lacks before the run, reporting each layer (the UI's progress
    bar); the app's cancel (its progress raises) stops it between forwards, and nothing is kept."""
    model, tok = bundled
    _fresh(monkeypatch, tmp_path / "first")
    monkeypatch.setenv("KVPLAY_RANKING", "exhaustive")
    spec = parse_spec("kvplay-int2:fragile=0.5,vfragile=0.5,group=16")           # not among the seeds
    seen = []
    calibrate([parse_spec("baseline"), spec], model, tok, lambda fraction, what: seen.append((fraction, what)))
    for part, bits in (("keys", 4), ("values", 4)):
        mine = [(f, w) for f, w in seen if f"layers' {part} need {bits} bits" in w]
        assert [f for f, _ in mine] == [0.0, 0.0, 0.25, 0.5, 0.75]
        assert mine[-1][1].startswith(str(spec)) and mine[-1][1].endswith("layer 4 of 4")
    _no_ranking(monkeypatch, "ranked again")
    build_cache(spec, model)                                                      # what calibrate measured

    monkeypatch.undo()
    _fresh(monkeypatch, tmp_path / "other")
    monkeypatch.setenv("KVPLAY_RANKING", "exhaustive")
    other = parse_spec("kvplay-int2:fragile=0.5,group=16")

    def cancelled(fraction, what):
        if fraction >= 0.5:
            raise KvplayError("Cancelled.")

    with pytest.raises(KvplayError, match="Cancelled"):
        calibrate([other], model, tok, cancelled)
    assert fragile.storage_key(other, [0, 1, 2, 3]) not in fragile._RANKINGS[model][1]


def test_a_first_fisher_ranking_shows_its_pass_and_a_cancel_stops_it(bundled, monkeypatch, tmp_path):
    """The default ranking reports its one pass layer by layer, forward then backward, for keys and values at
    once; a cancel stops it inside the forward or inside the backward, and nothing is kept."""
    model, tok = bundled
    _fresh(monkeypatch, tmp_path / "first")
    spec = parse_spec("kvplay-int2:fragile=0.5,vfragile=0.5,group=16")           # not among the seeds
    seen = []
    calibrate([parse_spec("baseline"), spec], model, tok, lambda fraction, what: seen.append((fraction, what)))
    estimate, passing, weighing = seen[0], seen[1:10], seen[10:]
    assert estimate[1].startswith(f"{spec}: calibrating once for this model, about ")   # before it starts
    assert [f for f, _ in passing] == [0.0] + [n / 8 for n in range(1, 9)]        # one pass for both parts
    assert all(w.startswith(f"{spec}: measuring which layers' keys and values need more bits") for _, w in passing)
    assert [w.split(": ")[-1] for _, w in passing[1:]] == ([f"forward, layer {n} of 4" for n in range(1, 5)]
                                                           + [f"backward, layer {n} of 4" for n in range(1, 5)])
    assert weighing == [(1.0, f"{spec}: weighing each layer's stored {part} by the pass's Fisher information")
                        for part in ("keys", "values")]
    _no_ranking(monkeypatch, "ranked again")
    build_cache(spec, model)                                                      # what calibrate measured

    for stop in (0.25, 0.75):                                                     # in the forward, in the backward
        monkeypatch.undo()
        _fresh(monkeypatch, tmp_path / f"other-{stop}")
        other = parse_spec("kvplay-int2:fragile=0.5,group=16")
        reached = []

        def cancelled(fraction, what, stop=stop, reached=reached):
            reached.append(what)
            if fraction >= stop:
                raise KvplayError("Cancelled.")

        with pytest.raises(KvplayError, match="Cancelled"):
            calibrate([other], model, tok, cancelled)
        assert reached[-1].endswith("forward, layer 2 of 4" if stop == 0.25 else "backward, layer 2 of 4")
        assert fragile.storage_key(other, [0, 1, 2, 3], method="fisher") not in fragile._RANKINGS[model][1]
        assert model not in fragile._FISHERS or not fragile._FISHERS[model]       # no half pass kept either


def test_kvplay_int2_ranks_from_its_own_short_pass_whatever_ran_before(bundled, monkeypatch, tmp_path):
    """kvplay-int2's blocks of 32 are ranked from a pass over the last 1,024 calibration tokens (fisher_tokens),
    half the long pass kvplay-3bit's blocks of 128 need: the model reads 1,024 tokens for it, and its ranking is
    the same whether or not the long pass ran first, so what a Compare calibrated is what a later run reads."""
    model, tok = bundled
    layers = list(range(model.config.num_hidden_layers))
    two, three = parse_spec("kvplay-int2:group=32"), parse_spec("kvplay-3bit")
    read = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: read.append(args[0].shape[1]))
    try:
        _fresh(monkeypatch, tmp_path / "alone")
        alone = fragile.rank_layers_fisher(model, tok, two, layers)
        assert read == [1024]
        _fresh(monkeypatch, tmp_path / "after")
        fragile.rank_layers_fisher(model, tok, three, layers)
        after = fragile.rank_layers_fisher(model, tok, two, layers)
    finally:
        hook.remove()
    assert read == [1024, fragile.FISHER_TOKENS, 1024] and after == alone

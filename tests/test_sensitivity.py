"""kvplay's fast layer ranking (kvplay/cache/sensitivity.py, fragile.rank_layers_fisher): one forward and one backward
pass, the Fisher information of every layer's keys and values, against the exhaustive ranking's 2 x layers + 1
forwards (fragile.rank_layers).

Figures measured on the bundled model (4 layers, 2 KV heads, head_dim 64) are written beside each bound.
"""
from __future__ import annotations

import copy

import pytest
import torch

from kvplay.cache import build_cache, calibrate, fragile, parse_spec, rotations, sensitivity
from kvplay.cache.engine import KVPlayLayer
from kvplay.errors import KvplayError

LAYERS = [0, 1, 2, 3]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Nothing ranked in this process, nor kept on disk."""
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path))


def test_fisher_is_the_squared_gradient_through_the_queries_past_the_window():
    """sensitivity.fisher() against autograd on the rule itself (fragile.stored_attention's): queries past a
    key's window read it as stored, the others exact. Relative error 4e-7 to 8e-7 measured; bound 1e-5."""
    gen = torch.Generator().manual_seed(0)
    q, g = (torch.randn(1, 4, 300, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 300, 16, generator=gen) for _ in range(2))
    windows = [sensitivity.Window(4, 20, 8), sensitivity.Window(0, 0, 1), sensitivity.Window(2, 50, 32)]
    layer = sensitivity.Layer(q, k, v, 0.3, g)
    sensitivity.fisher(layer, windows)
    for window in windows:
        dk, dv = (torch.zeros_like(x, requires_grad=True) for x in (k, v))
        i, j = torch.arange(300)[:, None], torch.arange(300)[None]
        use = window.stored(torch.arange(300), 300)
        rep = lambda x: x.repeat_interleave(2, 1)                                      # noqa: E731
        scores = torch.where(use, q @ rep(k + dk).mT, q @ rep(k).mT) * 0.3
        p = scores.masked_fill(j > i, -torch.inf).softmax(-1)
        out = (p * use) @ rep(v + dv) + (p * ~use) @ rep(v)
        expected = [x ** 2 for x in torch.autograd.grad((out * g).sum(), [dk, dv])]
        for got, want in zip(layer.diagonal[window], expected):
            assert (got - want).abs().max() < 1e-5 * want.abs().max(), window
        assert not layer.diagonal[window][0][..., :window.sink, :].any()                   # the sink: read exact


def test_shift_is_the_attention_each_query_past_the_window_moves():
    """sensitivity.shift(), read in chunks of SHIFT_CHUNK queries each against the keys up to its last position,
    against the rule one query at a time: the total variation between the query's attention over the exact keys
    and over the stored ones (where the window stores them), averaged over heads and the queries that read some
    key stored. 150 positions over 600 tokens span 3 chunks. Relative error 5e-9 to 5e-8 measured; bound 1e-6."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 600, 16, generator=gen)
    k = torch.randn(1, 2, 600, 16, generator=gen)
    stored = [k + 0.3 * torch.randn(k.shape, generator=gen), k.round()]
    layer = sensitivity.Layer(q, k, k, 0.3)
    positions = sensitivity.rows(600, 150)
    for window in (sensitivity.Window(4, 20, 8), sensitivity.Window(2, 200, 32)):
        expected = [[], []]
        for i in positions.tolist():
            use = window.stored(torch.tensor([i]), i + 1)[0]                          # (i + 1,) keys
            if not use.any():
                continue                                                               # reads every key exact
            exact = (q[0, :, i:i + 1] @ k[0, :, :i + 1].repeat_interleave(2, 0).mT * 0.3).softmax(-1)  # (Hq, 1, i+1)
            for n, x in enumerate(stored):
                keys = torch.where(use[:, None], x[0, :, :i + 1], k[0, :, :i + 1]).repeat_interleave(2, 0)
                moved = (q[0, :, i:i + 1] @ keys.mT * 0.3).softmax(-1)
                expected[n].append(0.5 * (moved - exact).abs().sum(-1))
        got = sensitivity.shift(layer, stored, window, positions)
        for n in range(2):
            want = torch.cat(expected[n]).mean().item()
            assert abs(got[n] - want) < 1e-6 * want, (window, n, got[n], want)


def _planted(model, layer: int, scale: float):
    """A copy of the model computing the same function, whose layer `layer` keeps RoPE pair (0, D/2) of every key
    `scale` times larger and of every query `scale` times smaller: an outlier channel pair that the stored keys'
    blocks (Hadamard-rotated, one range per channel) pay for."""
    planted = copy.deepcopy(model)
    attention = planted.model.layers[layer].self_attn
    d, config = attention.head_dim, planted.config
    with torch.no_grad():
        for proj, heads, factor in ((attention.k_proj, config.num_key_value_heads, scale),
                                    (attention.q_proj, config.num_attention_heads, 1 / scale)):
            for h in range(heads):
                proj.weight[[h * d, h * d + d // 2]] *= factor
    return planted


def test_both_rankings_put_a_planted_fragile_layer_first(bundled):
    """Layer 3 ranks last or third unplanted; with its key pair 32 times larger (the model's logits unchanged:
    KL 0.0 measured) both rankings put it first for kvplay-int2's and kvplay-3bit's keys. Its Fisher gain is
    3.7x (int2, from its 1,024-token pass) and 2.9x (3bit) the next layer's; bound 1.5x. Unplanted, the two
    rankings agree on the top layer of every preset's ranking (layer 0)."""
    model, tok = bundled
    planted = _planted(model, 3, 32.0)
    ids = fragile.calibration_ids(tok, 256)
    with torch.no_grad():
        assert fragile.mean_kl(model(ids, use_cache=False).logits, planted(ids, use_cache=False).logits) < 1e-4
    for preset in ("kvplay-int2", "kvplay-3bit"):
        spec = parse_spec(preset)
        assert fragile.rank_layers(planted, tok, spec, LAYERS)[0] == 3
        assert fragile.rank_layers_fisher(planted, tok, spec, LAYERS)[0] == 3
        gains = fragile.gains(fragile._FISHERS[planted][fragile.fisher_tokens(spec), tuple(LAYERS)], spec, LAYERS)
        assert gains[3] > 1.5 * max(gains[i] for i in (0, 1, 2)), gains
    for preset, part in (("kvplay-int2", "keys"), ("kvplay-3bit", "keys"), ("kvplay-3bit", "values"),
                         ("kvplay-2.5bit", "keys")):
        spec = parse_spec(preset)
        assert fragile.rank_layers_fisher(model, tok, spec, LAYERS, part)[0] == \
            fragile.rank_layers(model, tok, spec, LAYERS, part)[0] == 0


def test_layers_whose_keys_move_half_their_attention_come_first(bundled):
    """Past second order (Qwen2.5-Coder-0.5B's layer 0 at 2 bits: 80% of its attention moved, Fisher gain 0.005,
    the exhaustive forwards 0.52), broken() names the layer and ranks it first. The planted layer 3 at 32x moves
    0.84 of its attention at 2 bits, 0.14 at 4 (measured: broken() gives 0.68 from the 1,024-token pass);
    unplanted, no layer more than 0.11 at 2 bits. Bound: 0.5 (sensitivity.BROKEN)."""
    model, tok = bundled
    spec = parse_spec("kvplay-int2")
    assert fragile.broken(fragile.fisher_pass(model, tok, spec, LAYERS), spec, LAYERS) == {}
    planted = _planted(model, 3, 32.0)
    found = fragile.broken(fragile.fisher_pass(planted, tok, spec, LAYERS), spec, LAYERS)
    assert list(found) == [3] and found[3] > 0.5
    layer = fragile._FISHERS[planted][fragile.fisher_tokens(spec), tuple(LAYERS)][3]
    stored = fragile.stored_states(KVPlayLayer(fragile.ranked_as(spec)), layer.k)
    positions = sensitivity.rows(layer.k.shape[2])
    assert sensitivity.shift(layer, [layer.k, stored], fragile.window(spec), positions)[0] == 0   # exact: none


def test_one_forward_and_one_backward_rank_keys_values_and_every_storage(bundled, fresh, monkeypatch, tmp_path):
    """Four storages the seeds lack (a window no preset has among them), keys and values, and a key rotation's
    fit: one forward of the model and one backward per pass length (the short pass for blocks of 16, the long one
    for the others; the fit reads the long pass's queries and keys); the exhaustive ranking takes 2 x 4 + 1
    forwards per ranking."""
    model, tok = bundled
    monkeypatch.setattr(rotations, "_FITTED", type(rotations._FITTED)())
    monkeypatch.setenv("KVPLAY_ROTATION_DIR", str(tmp_path / "rotations"))
    forwards, passes = [], []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    measure = sensitivity.measure
    monkeypatch.setattr(sensitivity, "measure", lambda *a, **k: passes.append(a[1].shape[1]) or measure(*a, **k))
    try:
        calibrate([parse_spec(s) for s in ("kvplay-int2:fragile=0.5,group=16", "kvplay-3bit:group=64,rotation=hadamard",
                                           "kvplay-2.5bit:fragile=0.5,fragile_kbits=4,rotation=hadamard",
                                           "kvplay-3bit:sink=2")], model, tok)            # calibrated rotations
        assert len(forwards) == 2 and passes == list(fragile.FISHER_PASSES)
        assert (tmp_path / "rotations" / f"{fragile.fingerprint(model)}.pt").exists()
        forwards.clear()
        fragile.rank_layers(model, tok, parse_spec("kvplay-int2"), LAYERS)
        assert len(forwards) == 2 * 4 + 1
    finally:
        hook.remove()


def test_the_cache_key_separates_the_rankings(bundled, fresh, monkeypatch):
    """A Fisher ranking is kept under its own key: a kept exhaustive ranking (the shipped seeds) is read first;
    KVPLAY_RANKING=fisher reads or measures the Fisher one, KVPLAY_RANKING=exhaustive the exhaustive one."""
    model, tok = bundled
    spec = parse_spec("kvplay-int2:fragile=0.5")                                 # the seeds have its ranking
    fisher, exhaustive = (fragile.storage_key(spec, LAYERS, "keys", m) for m in ("fisher", "exhaustive"))
    assert fisher != exhaustive and fisher.endswith(exhaustive) and fisher.startswith("fisher,tokens=1024")
    calls = []
    for name in ("rank_layers", "rank_layers_fisher"):
        real = getattr(fragile, name)
        monkeypatch.setattr(fragile, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    build_cache(spec, model, tok)
    assert calls == []                                                           # the seed
    monkeypatch.setenv("KVPLAY_RANKING", "fisher")
    build_cache(spec, model, tok)
    build_cache(spec, model, tok)
    assert calls == ["rank_layers_fisher"]                                       # measured once, then kept
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())         # a new process: the disk's
    new = parse_spec("kvplay-int2:fragile=0.5,group=16")                         # not among the seeds
    build_cache(new, model, tok)
    monkeypatch.setenv("KVPLAY_RANKING", "exhaustive")
    build_cache(new, model, tok)                                                 # a kept Fisher one is not read
    monkeypatch.delenv("KVPLAY_RANKING")
    build_cache(new, model, tok)                                                 # both kept: the exhaustive one
    assert calls == ["rank_layers_fisher", "rank_layers_fisher", "rank_layers"]
    assert set(fragile._stored(fragile.fingerprint(model))) >= {
        fragile.storage_key(new, LAYERS, "keys", m) for m in fragile.RANKERS}
    monkeypatch.setenv("KVPLAY_RANKING", "neither")
    with pytest.raises(KvplayError, match="KVPLAY_RANKING='neither': choose fisher or exhaustive"):
        build_cache(parse_spec("kvplay-int2:fragile=0.5,group=8"), model, tok)


def test_labels_are_drawn_from_the_models_own_distribution():
    """sensitivity.draw, the inverse distribution function: over 40,000 rows of p = (0.1, 0.2, 0.3, 0.4, 0) each
    label's share is within 0.01 of its probability (the standard error is at most 0.0025), a label of
    probability 0 is never drawn, and a certain one always is. label_gradient is softmax - onehot(label) per row."""
    from kvplay.cache.sensitivity import draw, label_gradient

    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0]).expand(40_000, 5).contiguous()
    labels = draw(p, torch.Generator().manual_seed(0))[:, 0]
    shares = torch.bincount(labels, minlength=5).float() / len(labels)
    assert (shares - p[0]).abs().max() < 0.01 and shares[4] == 0, shares
    certain = torch.zeros(3, 7)
    certain[:, 6] = 1
    assert draw(certain, torch.Generator().manual_seed(1)).flatten().tolist() == [6, 6, 6]
    logits = torch.randn(1, 300, 11)
    grad = label_gradient(logits, torch.Generator().manual_seed(2), rows=64)[0]
    drawn = grad.argmin(-1)                                                   # the one entry with -1 added
    expected = logits[0].softmax(-1) - torch.nn.functional.one_hot(drawn, 11)
    assert torch.allclose(grad, expected, atol=1e-6) and grad.sum(-1).abs().max() < 1e-5

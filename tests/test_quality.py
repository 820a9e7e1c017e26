"""Quality over a long text on the bundled model: perplexity, KL, top-1 agreement and per-layer K/V error."""
import math

import pytest
import torch

from kvplay.app.models import HELD_OUT_TEXT
from kvplay.cache import build_cache
from kvplay.errors import KvplayError
from kvplay.lab.generate import prefill
from kvplay.lab.quality import dequantized_kv, layer_errors, perplexity_run
from kvplay.lab.texts import long_text_ids

EXACT = "kvplay-int8:residual=4096"      # a window longer than the text: nothing is quantized
TOKENS = 256


@pytest.fixture(scope="module")
def ppl(bundled):
    model, tok = bundled
    return perplexity_run(model, tok, ["kvplay-int8", "kvplay-int2", "quanto-int4", EXACT], max_tokens=TOKENS,
                          model_name="bundled")


def run(result, spec):
    return next(c for c in result.caches if c.spec == spec)


def test_baseline_comes_first_and_matches_one_full_forward(bundled, ppl):
    model, tok = bundled
    assert [c.spec for c in ppl.caches] == ["baseline", "kvplay-int8", "kvplay-int2", "quanto-int4", EXACT]
    assert ppl.text_name == "tempest.txt" and ppl.tokens == TOKENS and ppl.chunk == 16
    ids = tok(HELD_OUT_TEXT.read_text(), return_tensors="pt", verbose=False).input_ids[:, :TOKENS]
    with torch.inference_mode():
        logits = model(ids).logits[0].float()                                   # (T, V), no cache
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])))
    base = ppl.caches[0]
    assert base.ppl == pytest.approx(expected, rel=1e-3)          # measured 2.1e-4 (chunked bfloat16 forwards)
    assert (base.delta_ppl_pct, base.mean_kl, base.top1_agreement) == (0.0, 0.0, 1.0)


def test_a_cache_that_quantizes_nothing_is_the_baseline(ppl):
    same = run(ppl, EXACT)
    assert same.ppl == ppl.caches[0].ppl
    assert (same.delta_ppl_pct, same.mean_kl, same.top1_agreement) == (0.0, 0.0, 1.0)
    assert same.kl_along_text == [0.0] * 4
    assert same.layer_key_error == same.layer_value_error == [0.0] * 4


def test_quantized_caches_diverge_and_fewer_bits_hurt_more(ppl):
    for c in ppl.caches[1:]:
        assert len(c.kl_along_text) == TOKENS // 64
        # float rounding only: measured 5.8e-8 relative (1.8e-11 absolute) for quanto-int4, 0 for the others
        assert sum(c.kl_along_text) / len(c.kl_along_text) == pytest.approx(c.mean_kl, rel=1e-6, abs=1e-10)
    int8, int2 = run(ppl, "kvplay-int8"), run(ppl, "kvplay-int2")
    # KL is exactly 0 while every token it attends to is still in kvplay's 16-bit window (128 tokens: int8's
    # residual, int2's 4 sinks + 124), and not once a block has left it (int2's first 32-token block at 160
    # tokens, int8's first 64-token block at 192): measured int2 [0, 0, 5.0e-4, 1.1e-3], int8 [0, 0, 0, 2.8e-5].
    assert int8.kl_along_text[:3] == [0.0] * 3 and int8.kl_along_text[3] > 0
    assert int2.kl_along_text[:2] == [0.0] * 2 and min(int2.kl_along_text[2:]) > 0
    # On the bundled model perplexity moves either way by chance (int2 -0.25%, int8 +0.019% measured),
    # so "hurts more" is the size of the move, the KL and the agreement.
    assert abs(int2.delta_ppl_pct) > abs(int8.delta_ppl_pct)
    assert int2.mean_kl > int8.mean_kl > 0
    assert int2.top1_agreement <= int8.top1_agreement


def test_layer_errors_are_zero_for_the_baseline_and_grow_as_bits_shrink(ppl):
    base = ppl.caches[0]
    assert base.layer_key_error == base.layer_value_error == [0.0] * 4
    int8, int2, quanto = run(ppl, "kvplay-int8"), run(ppl, "kvplay-int2"), run(ppl, "quanto-int4")
    for errors in (int8.layer_key_error, int8.layer_value_error, quanto.layer_key_error, quanto.layer_value_error):
        assert len(errors) == 4 and all(e > 0 for e in errors)
    assert all(a < b for a, b in zip(int8.layer_key_error, int2.layer_key_error))
    assert all(a < b for a, b in zip(int8.layer_value_error, int2.layer_value_error))


def test_layer_errors_of_the_baseline_computed_are_exactly_zero(bundled):
    model, tok = bundled
    keys, values = layer_errors(model, long_text_ids(tok, 96), "baseline")
    assert keys == values == [0.0] * 4


# attention=sdpa: the dequantize path returns the 16-bit history itself (the fused path hands attention the packed
# codes instead; tests/test_attention.py pins that path against this one)
@pytest.mark.parametrize("spec", ["baseline", "kvplay-int4:sink=4,rotation=hadamard,attention=sdpa", "quanto-int4",
                                  "hqq-int4"])
def test_dequantized_kv_is_what_attention_gets_next(bundled, spec):
    model, tok = bundled
    ids, cache = long_text_ids(tok, 240), build_cache(spec, model)
    prefill(model, ids[:, :200], torch.ones(1, 200, dtype=torch.long), cache)
    prefill(model, ids[:, 200:], torch.ones(1, 240, dtype=torch.long), cache)   # leaves a 16-bit residual
    layer = cache.layers[0]
    keys, values = dequantized_kv(layer)
    assert keys.shape == values.shape == (1, 2, 240, 64)
    new = torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    out_k, out_v = layer.update(new, new)
    assert torch.equal(out_k[:, :, :-1], keys.to(out_k.dtype)) and torch.equal(out_v[:, :, :-1], values.to(out_v.dtype))


def test_too_short_text_is_refused_in_one_sentence(bundled):
    model, tok = bundled
    text = "Full fathom five thy father lies; of his bones are coral made."
    n = tok(text, return_tensors="pt").input_ids.shape[1]
    with pytest.raises(KvplayError, match=rf"^The text is too short to evaluate: {n} tokens, need at least 64\.$"):
        perplexity_run(model, tok, [], text=text)
    with pytest.raises(KvplayError, match=r"need at least 128\.$"):
        perplexity_run(model, tok, [], max_tokens=100, chunk=64)


def test_distribution_stats_are_llama_cpps_kl_divergence_figures():
    """Median, 99th percentile and max of the per-token KL, the same-top-1 share, and dp of the reference's top
    token, checked against numpy on random logits; identical logits give zeros everywhere."""
    import numpy as np

    from kvplay.lab.metrics import distribution_stats, kl_per_step

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(64, 50, generator=g), torch.randn(64, 50, generator=g)
    stats = distribution_stats(p, q, chunk=16)
    kl = kl_per_step(p, q).numpy()
    assert stats["kl_median"] == pytest.approx(np.median(kl), rel=1e-5)
    assert stats["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-5)
    assert stats["kl_max"] == pytest.approx(kl.max(), rel=1e-6)
    chunk_means = kl.reshape(4, 16).mean(1)
    assert stats["kl_sem"] == pytest.approx(chunk_means.std(ddof=1) / 2, rel=1e-4)       # 4 chunks: / sqrt(4)
    top = p.argmax(-1)
    dp = 100 * (torch.softmax(q, -1)[range(64), top] - torch.softmax(p, -1)[range(64), top]).numpy()
    assert stats["delta_p_mean"] == pytest.approx(dp.mean(), rel=1e-4) and stats["delta_p_mean"] < 0
    assert stats["delta_p_rms"] == pytest.approx(np.sqrt((dp ** 2).mean()), rel=1e-4)
    same = distribution_stats(p, p.clone(), chunk=16)
    assert same["kl_max"] == 0 and same["delta_p_rms"] == 0 and same["top1_sem"] == 0


INT2 = "kvplay-int2:residual=16"        # a window shorter than the 128 tokens, so something is quantized


@pytest.mark.real_model
def test_ppl_models_puts_the_same_caches_on_two_models_side_by_side(tmp_path, capsys):
    """`ppl --models`: each model's own 16-bit reference, its own figures, and bits at 8k on its own shape
    (SmolLM2's 3 KV heads of 64 against the bundled model's 2 of 64 change nothing in bits, but a cache's
    16-bit window is counted per model)."""
    from kvplay import results
    from kvplay.app.models import load_config
    from kvplay.cache import analytic_nbytes, bits_per_element
    from kvplay.cache.arch import Arch
    from kvplay.cli.main import main

    out = tmp_path / "models.json"
    assert main(["ppl", "--models", "shakespeare-llama", "smollm2-135m-instruct", "--caches", INT2,
                 "--max-tokens", "128", "--json", str(out)]) == 0
    result = results.from_dict(__import__("json").loads(out.read_text()))
    assert [r.env.model for r in result.runs] == ["shakespeare-llama", "smollm2-135m-instruct"]
    rows = {(r.model, r.spec): r for r in result.rows}
    assert set(rows) == {(m, s) for m in ("shakespeare-llama", "smollm2-135m-instruct")
                         for s in ("baseline", INT2)}
    for run in result.runs:      # each row is its model's own run
        for c in run.caches:
            assert rows[(run.env.model, c.spec)].mean_kl == c.mean_kl
    assert rows[("smollm2-135m-instruct", INT2)].mean_kl > 0 and rows[("shakespeare-llama", INT2)].mean_kl > 0
    assert rows[("smollm2-135m-instruct", INT2)].mean_kl != rows[("shakespeare-llama", INT2)].mean_kl
    arch = Arch.from_config(load_config("smollm2-135m-instruct"))
    assert rows[("smollm2-135m-instruct", INT2)].bits_long == pytest.approx(
        bits_per_element(analytic_nbytes(INT2, arch, 8192), arch, 8192))
    assert rows[("smollm2-135m-instruct", "baseline")].bits_long == 16
    printed = capsys.readouterr().out
    assert "smollm2-135m-instruct" in printed and "bits_at_8192" in printed


def test_ppl_models_refuses_one_model_or_both_flags(capsys):
    from kvplay.cli.main import main

    assert main(["ppl", "--models", "shakespeare-llama", "--caches", "kvplay-int4"]) == 2
    assert capsys.readouterr().err.strip() == "error: Compare 2 to 4 different models, got 1."
    assert main(["ppl", "--model", "shakespeare-llama", "--models", "a", "b"]) == 2
    assert capsys.readouterr().err.strip() == "error: Give --model or --models, not both."


def test_ppl_models_reports_a_cache_a_model_refuses_as_a_row_that_says_why():
    """On Gemma 3 (15 of 18 layers sliding) transformers' QuantizedCache refuses to run; the other model still runs
    it, and the refusal is the row's, in the registry's own sentence."""
    from kvplay.app.fetch import cached_path
    from kvplay.app.quality import ppl_models

    if cached_path("gemma-3-270m") is None:
        pytest.skip("gemma-3-270m is not cached: python -m kvplay fetch gemma-3-270m")
    result = ppl_models(["shakespeare-llama", "gemma-3-270m"], ["quanto-int4"], max_tokens=64, needle=True)
    rows = {(r.model, r.spec): r for r in result.rows}
    for (model, spec), row in rows.items():      # the needle's quick grid, through every cache that ran
        assert (row.needle_counted is None) == bool(row.refused), (model, spec)
    assert rows[("gemma-3-270m", "baseline")].needle_found == rows[("gemma-3-270m", "baseline")].needle_counted == 9
    assert rows[("shakespeare-llama", "quanto-int4")].mean_kl > 0
    gemma = rows[("gemma-3-270m", "quanto-int4")]
    assert gemma.mean_kl is None and "sliding-window layers (this one has 15 of 18)" in gemma.refused
    assert rows[("gemma-3-270m", "baseline")].mean_kl == 0 and not rows[("gemma-3-270m", "baseline")].refused
    assert [c.spec for c in result.runs[1].caches] == ["baseline"]


def test_the_across_models_view_colours_each_cell_by_the_verdicts_rule_and_opens_on_the_recorded_run():
    """assets/recorded/ppl-three-models.json drawn as the Quality tab opens: Qwen's quanto-int4 red (KL 0.68, top-1
    52%), Gemma's refused and grey, SmolLM2's kvplay-int4 green (KL 0.0029, top-1 97%)."""
    from kvplay.show.cards import tone_of
    from kvplay.ui.quality import ACROSS_MODELS, across_recorded

    status, fig, table = across_recorded()
    assert "Recorded: 2,048 tokens of tempest.txt" in status and "press Run on each model" in status
    heat = fig.data[0]
    models = [m.replace("<br>", "") for m in heat.x]
    assert models == ACROSS_MODELS and list(heat.y) == ["quanto-int4", "kvplay-int4", "kvplay-3bit", "kvplay-2.5bit",
                                                        "kvplay-int2"]
    cell = {(spec, m): (z, t) for spec, zs, ts in zip(heat.y, heat.z, heat.text) for m, z, t in zip(models, zs, ts)}
    assert cell[("quanto-int4", "qwen2.5-coder-0.5b-instruct")][0] == 2 == {"red": 2}[tone_of(0.68, 0.52)]
    assert cell[("quanto-int4", "gemma-3-270m")] == (None, "not run:<br>the model<br>refuses it")
    assert cell[("kvplay-int4", "smollm2-135m-instruct")][0] == 0
    assert "ΔPPL +68.7%" in cell[("quanto-int4", "qwen2.5-coder-0.5b-instruct")][1]
    assert len(table) == 18 and set(table["Model"]) == set(ACROSS_MODELS)
    assert table.loc[(table["Cache"] == "quanto-int4") & (table["Model"] == "gemma-3-270m"),
                     "Change vs 16-bit (%)"].item() == "not run"


def test_metrics_read_a_long_texts_logits_a_block_of_rows_at_a_time_with_the_same_figures(monkeypatch):
    """kl_per_step, token_logprob and distribution_stats work metrics.ROWS rows at a time (a long text's logits of
    a 262,144-token vocabulary are 2.1 GB a copy): over 600 rows, blocks of 256, 256 and 88 give what one block
    gives, row for row."""
    from kvplay.lab import metrics
    gen = torch.Generator().manual_seed(0)
    p, q = (torch.randn(600, 50, generator=gen) * 3 for _ in range(2))
    tokens = torch.randint(0, 50, (600,), generator=gen)
    blocked = (metrics.kl_per_step(p, q), metrics.token_logprob(q, tokens), metrics.distribution_stats(p, q, 16))
    monkeypatch.setattr(metrics, "ROWS", 10_000)
    whole = (metrics.kl_per_step(p, q), metrics.token_logprob(q, tokens), metrics.distribution_stats(p, q, 16))
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    assert blocked[2] == whole[2]
    assert blocked[0].min() > 0 and blocked[2]["kl_max"] > 1         # distributions far enough apart to matter


def test_a_model_of_ones_own_joins_a_recorded_grid_measured_under_its_conditions(bundled, monkeypatch):
    """beside_recorded: the recording's caches on one more model, on the recording's text, tokens and chunk, in a
    column labelled as measured now after the recorded ones, which keep their figures; a recording on a text
    kvplay does not ship, or no model named, is refused in one sentence."""
    import dataclasses

    from kvplay.app.quality import MEASURED_NOW, beside_recorded, ppl
    from kvplay.results import ModelRow, ModelsResult

    run = ppl("shakespeare-llama", ["kvplay-int4", "kvplay-int2"], max_tokens=96, chunk=16)
    recorded = ModelsResult(long_tokens=8192, runs=[run], rows=[
        ModelRow(model="a recorded model", spec=c.spec, delta_ppl_pct=1.0, mean_kl=0.5, top1_agreement=0.5,
                 bits_long=4.0) for c in run.caches])
    joined = beside_recorded("shakespeare-llama", recorded)
    assert [r.model for r in joined.rows][:3] == ["a recorded model"] * 3 and joined.rows[:3] == recorded.rows
    mine = {r.spec: r for r in joined.rows if r.model == "shakespeare-llama" + MEASURED_NOW}
    assert list(mine) == ["baseline", "kvplay-int4", "kvplay-int2"]
    assert joined.runs[-1].tokens == 96 and joined.runs[-1].chunk == 16         # the recording's conditions
    for cache in run.caches:                                                    # the same figures, measured again
        assert mine[cache.spec].mean_kl == pytest.approx(cache.mean_kl, rel=1e-6)
    pasted = dataclasses.replace(run, text_name="pasted text")
    with pytest.raises(KvplayError, match="not shipped"):
        beside_recorded("shakespeare-llama", dataclasses.replace(recorded, runs=[pasted]))
    with pytest.raises(KvplayError, match="Name the model"):
        beside_recorded(" ", recorded)

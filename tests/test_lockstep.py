"""Compare's lockstep (kvplay.lab.generate.lockstep, kvplay.cache.rows.RowGroups) pinned to the path before it.

For every registered scheme, on a tiny random Llama (2 layers, head_dim 64) with sdpa attention (the row
groups' keys and values concatenated) and with kvplay's attention (attention per row group, the fused
kernel where a cache takes it): a prefill shared in lockstep stores exactly the bytes and the tensors a
prefill of its own stores and gives the same next-token logits; a whole Compare in lockstep gives the
tokens, KL, top-1 and bytes of iter_compare_serial, one cache at a time. The bundled model runs
a mix of methods at once. Measured on this machine: every figure compared here was bit-identical (largest
KL difference 0.0), so the checks are exact.
"""
import time

import pytest
import torch
from conftest import tiny_llama

from kvplay.cache import build_cache, cache_nbytes, cache_schemes, dequantized_kv, parse_spec
from kvplay.errors import KvplayError
from kvplay.lab import compare as runner
from kvplay.lab.generate import Row, Sampler, generate, lockstep, prefill, speed_stats
from kvplay.results import CacheRun, from_dict, to_dict
from kvplay.results.compare import MIN_TIMED_STEPS

PROMPT, NEW, VOCAB = 150, 6, 96
ATTENTION = ("sdpa", "kvplay")


def _spec(name):
    spec = parse_spec(name).with_options(residual=4)     # tokens leave the 16-bit window in prefill and decode
    # a random 2-layer model has no tokenizer to rank fragile layers on (kvplay-3bit's 30% rounds to one layer) or to
    # fit key rotations on (the presets' rotation=calibrated: tests/test_rotations.py)
    spec = spec.with_options(fragile=0) if getattr(spec.options, "fragile", 0) else spec
    return spec.with_options(rotation="hadamard") if getattr(spec.options, "rotation", None) == "calibrated" else spec


@pytest.fixture(scope="module", params=ATTENTION)
def model(request):
    m = tiny_llama(head_dim=64)
    m.config._attn_implementation = request.param        # "kvplay": kvplay_attention, the fused kernel
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tok(bundled):
    return bundled[1]                                     # decodes the tiny model's ids (< 96) too


def _same_store(a, b) -> None:
    assert cache_nbytes(a).to_dict() == cache_nbytes(b).to_dict()
    for la, lb in zip(a.layers, b.layers):
        for x, y in zip(dequantized_kv(la), dequantized_kv(lb)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", cache_schemes())
def test_a_prefill_in_lockstep_stores_and_predicts_what_a_prefill_of_its_own_does(model, ids, name):
    spec = _spec(name)
    alone = build_cache(spec, model)
    logits = prefill(model, ids, torch.ones_like(ids), alone)                       # (1, V)
    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(build_cache(spec, model), Sampler(), shares_prefill=spec.method.shares_prefill, prefill_key=name),
            Row(build_cache(spec, model), follow=0, shares_prefill=spec.method.shares_prefill, prefill_key=name)]
    assert list(lockstep(model, ids, rows, 1)) == [1]                               # prefill only
    for row in rows[1:]:
        _same_store(row.cache, alone)
        assert torch.equal(row.logits[0], logits)           # measured: bit-identical (shared or its own prefill)


def _pair(new, old) -> None:
    assert [c.spec for c in new.caches] == [c.spec for c in old.caches]
    for a, b in zip(new.caches, old.caches):
        assert a.token_ids == b.token_ids, a.spec
        assert a.kl == b.kl and a.top1 == b.top1 and a.baseline_logprob == b.baseline_logprob, a.spec
        assert a.cache_bytes_per_step == b.cache_bytes_per_step and a.allocated_bytes == b.allocated_bytes, a.spec
        assert a.top5_ids == b.top5_ids and a.first_divergence == b.first_divergence, a.spec


@pytest.mark.parametrize("name", [n for n in cache_schemes() if n != "baseline"])
def test_every_scheme_in_lockstep_gives_the_serial_paths_tokens_kl_top1_and_bytes(model, ids, tok, name):
    kwargs = dict(prompt_ids=ids[0].tolist())
    new = list(runner.iter_compare(model, tok, [_spec(name)], "", NEW, **kwargs))
    old = list(iter_compare_serial(model, tok, [_spec(name)], "", NEW, **kwargs))
    _pair(new[-1], old[-1])
    assert not any(c.partial for c in new[-1].caches) and all(c.partial for c in new[0].caches)


def test_seeded_sampling_in_lockstep_draws_what_the_serial_path_draws(model, ids, tok):
    specs = [_spec("kvplay-int4"), _spec("quanto-int2")]
    kwargs = dict(prompt_ids=ids[0].tolist(), sampler=Sampler(temperature=1.5, top_p=0.9, seed=3))
    new = runner.run_compare(model, tok, specs, "", NEW, **kwargs)
    old = list(iter_compare_serial(model, tok, specs, "", NEW, **kwargs))[-1]
    _pair(new, old)
    greedy = runner.run_compare(model, tok, specs[:1], "", NEW, prompt_ids=ids[0].tolist())
    assert new.caches[0].token_ids != greedy.caches[0].token_ids                 # it really sampled


def test_many_methods_at_once_on_the_bundled_model_match_the_serial_path(bundled):
    m, tok = bundled
    names = ["baseline:attention=fused", "kvplay-int4", "kvplay-fp8", "quanto-int4", "llamacpp-q4_0"]
    specs = [_spec(n) for n in names]
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    new = runner.run_compare(m, tok, specs, prompt, NEW)
    old = list(iter_compare_serial(m, tok, specs, prompt, NEW))[-1]
    _pair(new, old)
    described = {c.spec.partition(":")[0]: c.description for c in new.caches}
    assert "fused from packed codes" in described["kvplay-int4"]      # it read its codes in lockstep too
    assert "fused kernel" in described["baseline"]


def test_a_row_that_ends_stops_counting_and_the_others_go_on(model, ids):
    """A greedy row stops at its stop token; the row it teaches stops with it; a sampling row goes on to the end."""
    greedy = generate(model, ids, build_cache("baseline", model), NEW, keep_logits=False).tokens[0].tolist()
    stop = greedy[2]
    ends = greedy.index(stop) + 1
    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(build_cache(_spec("kvplay-int4"), model), follow=0),
            Row(build_cache(_spec("kvplay-int4"), model), Sampler(temperature=3.0, seed=5), keep_logits=False)]
    list(lockstep(model, ids, rows, 12, stop_token=stop))
    sampled = generate(model, ids, build_cache(_spec("kvplay-int4"), model), 12,
                       sampler=Sampler(temperature=3.0, seed=5), stop_token=stop)
    assert [len(r.tokens) for r in rows[:2]] == [ends, ends] and len(rows[0].cache_bytes) == ends
    assert torch.cat(rows[0].tokens, 1)[0].tolist() == greedy[:ends]
    assert torch.cat(rows[2].tokens, 1)[0].tolist() == sampled.tokens[0].tolist()
    assert rows[2].cache_bytes == sampled.cache_bytes
    assert rows[0].cache.get_seq_length() == PROMPT + ends - 1          # no step after it ended


@pytest.mark.parametrize("name", ["quanto-int4", "hqq-int4"])
def test_transformers_caches_dequantize_once_per_flush_in_lockstep_and_every_step_when_timed(model, ids, name,
                                                                                            monkeypatch):
    """QuantizedLayer.update dequantizes its whole history each step; in lockstep (never timed) each quantized
    tensor is dequantized once (methods/hf.MemoizedDequantize), with the tokens and logits pinned above; timing
    afterwards (time_alone) runs the layer as shipped."""
    calls = []
    layer_class = type(build_cache(name, model).layers[0])
    base = next(c for c in layer_class.__mro__[1:] if "_dequantize" in vars(c) and c.__name__ != "MemoizedDequantize")
    original = base._dequantize
    monkeypatch.setattr(base, "_dequantize", lambda self, q: calls.append(q) or original(self, q))   # held: ids stay
    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(build_cache(_spec(name), model), Sampler(), name=name)]
    list(lockstep(model, ids, rows, 9))                   # 8 decode steps; residual 4: two flushes
    layers = model.config.num_hidden_layers
    # K and V of the 2 quantized states read, each once: the prefill's and the first flush's (the second flush
    # comes at the last step, read by none); unmemoized it would be every decode step's: 2 * layers * 8
    assert len({id(q) for q in calls}) == len(calls) == 2 * layers * 2
    assert not any(layer.memoize or "_dequantized" in vars(layer) for layer in rows[1].cache.layers)
    calls.clear()
    runner.time_alone(model, [rows[1].cache], [rows[1].tokens[-1]], rounds=1, steps=2)
    assert len(calls) == 2 * layers * 2                                # every step dequantizes, as shipped


def test_a_method_that_wrongly_declares_a_shared_prefill_is_refused(model, ids):
    from transformers.cache_utils import Cache, DynamicLayer

    class Rounding(DynamicLayer):                 # hands attention its stored keys rounded: prefill differs
        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states.round(), value_states, *args, **kwargs)
            return keys, values

    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(Cache(layers=[Rounding() for _ in range(2)]), Sampler(), name="rounding", measure_bytes=False)]
    with pytest.raises(KvplayError, match="rounding: its prefill hands attention other keys"):
        list(lockstep(model, ids, rows, 2))
    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(Cache(layers=[Rounding() for _ in range(2)]), Sampler(), shares_prefill=False, name="rounding",
                measure_bytes=False)]
    assert list(lockstep(model, ids, rows, 2)) == [1, 2]                 # with a prefill of its own it runs


def test_results_come_after_prefill_and_every_few_steps_and_progress_counts_steps(model, ids, tok):
    seen = []
    results = list(runner.iter_compare(model, tok, [_spec("kvplay-int4")], "", 17, prompt_ids=ids[0].tolist(),
                                       progress=lambda frac, desc: seen.append((frac, desc))))
    assert [len(r.caches[0].token_ids) for r in results] == [1, 8, 16, 17, 17]
    assert [r.caches[1].partial for r in results] == [True] * 4 + [False]
    assert "step 12 of 17" in [d for _, d in seen] and "timing each cache alone" in [d for _, d in seen]
    assert f"prefill ({PROMPT} tokens): 1 of 1 done" in [d for _, d in seen]   # kvplay-int4 shares the prefill
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1         # the timing steps count too
    per_round = runner.TIME_STEPS - 1                                   # each turn's first step is discarded
    rounds = range(runner.TIME_ROUNDS, runner.TIME_ROUNDS + runner.MORE_ROUNDS + 1)
    for run in results[-1].caches:             # timed alone after the run, at the context it reached
        assert run.decode_context_tokens == PROMPT + 16
        assert (run.decode_tokens_per_s > 0 and run.decode_timed_steps in [r * per_round for r in rounds]
                and not run.speed_note) or \
            (run.decode_tokens_per_s == 0 and run.speed_note.startswith("the machine is busy"))
    short = runner.run_compare(model, tok, [_spec("kvplay-int4")], "", NEW, prompt_ids=ids[0].tolist())
    assert all(c.decode_tokens_per_s == 0 and c.decode_timed_steps == 0 for c in short.caches)


def test_more_steps_settle_a_noisy_median_and_a_steady_one_is_settled_at_once():
    steady = [0.050, 0.051, 0.049, 0.050, 0.052, 0.050, 0.049, 0.051]            # 8 timed steps, spread 4%
    noisy = [0.05, 0.08, 0.05, 0.09, 0.05, 0.08, 0.05, 0.09]                     # spread 70%, as a busy machine's
    assert runner.uncertainty(steady) < runner.SETTLED < runner.uncertainty(noisy)
    assert runner.uncertainty(noisy * 4) < runner.SETTLED                       # 32 steps: ±8% (±17% with 8)
    assert runner.uncertainty([]) == float("inf")


def test_timing_goes_on_while_a_median_is_unsettled_and_quotes_every_cache_once_it_settles(model, ids, tok,
                                                                                          monkeypatch):
    calls = []                                                                  # rounds asked of each call

    def noisy_then_steady(model, caches, tokens, *, rounds: int, steps: int, on_step=None):
        turn = len(calls)
        calls.append(rounds)
        for _ in range(rounds * steps * len(caches)):
            on_step()
        step = [0.05, 0.08, 0.05, 0.09] if turn == 0 else [0.05, 0.05, 0.05, 0.05]   # busy, then quiet
        per_cache = [(step * rounds)[:rounds * (steps - 1)] for _ in caches]
        return per_cache, [None] * len(caches)

    monkeypatch.setattr(runner, "time_alone", noisy_then_steady)
    seen = []
    result = runner.run_compare(model, tok, [_spec("kvplay-int4")], "", 17, prompt_ids=ids[0].tolist(),
                                progress=lambda frac, desc: seen.append(desc))
    assert calls[0] == runner.TIME_ROUNDS and len(calls) > 1 and set(calls[1:]) == {1}   # then a round at a time
    assert len(calls) < 1 + runner.MORE_ROUNDS                                   # and no more once it settled
    assert all(c.decode_tokens_per_s > 0 and not c.speed_note for c in result.caches)
    assert f"timing each cache alone (round {runner.TIME_ROUNDS + 1} of at most " \
           f"{runner.TIME_ROUNDS + runner.MORE_ROUNDS})" in seen


def test_a_median_that_never_settles_is_not_timed_with_the_rounds_and_the_uncertainty(model, ids, tok,
                                                                                     monkeypatch):
    def always_busy(model, caches, tokens, *, rounds: int, steps: int, on_step=None):
        return [[0.05, 0.15] * rounds for _ in caches], [None] * len(caches)

    monkeypatch.setattr(runner, "time_alone", always_busy)
    result = runner.run_compare(model, tok, [_spec("kvplay-int4")], "", 17, prompt_ids=ids[0].tolist())
    total = runner.TIME_ROUNDS + runner.MORE_ROUNDS
    for c in result.caches:
        assert c.decode_tokens_per_s == 0 and c.speed_note.startswith(
            f"the machine is busy (after {total} rounds its median step time was still uncertain by ±")


def _run(spec, **speed) -> CacheRun:
    return CacheRun(spec=spec, text="", token_ids=[1], tokens=["a"], first_divergence=None, match_fraction=1.0,
                    diff_spans=[], kl=[0.0], top1=[True], baseline_logprob=[0.0], mean_kl=0.0, max_kl=0.0,
                    top1_agreement=1.0, context_tokens=[10], cache_bytes_per_step=[100], cache_bytes=100,
                    baseline_bytes=100, compression=1.0, bits_per_element=16, prefill_s=0.1,
                    prefill_tokens_per_s=100.0, wall_s=1.0, **{"decode_tokens_per_s": 0.0, **speed})


def test_the_speed_clause_names_its_context_or_says_not_timed_never_a_number():
    from kvplay.show.cards import speed_clause, speed_text

    timed = dict(decode_timed_steps=8, decode_context_tokens=1320, decode_spread=[40.0, 50.0])
    base, fast = _run("baseline", decode_tokens_per_s=50.0, **timed), _run("kvplay-int4", decode_tokens_per_s=45.0,
                                                                           **timed)
    assert speed_clause(fast, base) == "at 1,320 tokens: 0.9x the 16-bit speed; at 8k: see the Throughput tab"
    assert speed_text(fast).startswith("45 tok/s at 1,320 tokens")
    busy = _run("kvplay-int4", decode_context_tokens=1320, speed_note="the machine is busy (the middle half ...)")
    assert speed_clause(busy, base) == "speed not timed: the machine is busy (the middle half ...)"
    assert speed_text(busy) == "speed not timed: the machine is busy (the middle half ...)"
    assert speed_clause(_run("kvplay-int4", partial=True), base) == "speed not timed: timed after decoding ends"
    assert speed_clause(_run("kvplay-int4"), base) == ("speed not timed: too short to time (fewer than "
                                                        f"{MIN_TIMED_STEPS} decode steps)")


def test_the_speed_chart_gives_the_cards_reason_in_lines_a_phone_holds():
    """The full suite's phone check once found the chart's one-line reason (190 characters, two caches busy) running
    off a 390-px screen; the chart now wraps it, and keeps the cards' words."""
    from kvplay.results import CompareResult, Environment
    from kvplay.show.cards import speed_text
    from kvplay.show.plots import speed_figure

    timed = dict(decode_timed_steps=8, decode_context_tokens=1320, decode_spread=[40.0, 50.0])
    busy = [_run(spec, speed_note=f"the machine is busy (after 12 rounds its median step time was still uncertain "
                                  f"by ±{pct}%)") for spec, pct in (("quanto-int2", 13), ("kvplay-int4", 10))]
    result = CompareResult(prompt="", prompt_tokens=1, max_new_tokens=1, batch_size=1, sampling={},
                           env=Environment("m", "bfloat16", "cpu"),
                           caches=[_run("baseline", decode_tokens_per_s=50.0, **timed), *busy])
    (note,) = speed_figure(result).layout.annotations
    lines = note.text.split("<br>")
    assert max(len(line) for line in lines) <= 44 and len(lines) >= 4
    for run in busy:                               # the card's reason, word for word, once the lines are joined
        assert speed_text(run).removeprefix("speed not timed: ") in " ".join(lines)


def test_results_saved_before_these_fields_still_load():
    from kvplay.results import CompareResult, Environment

    result = CompareResult(prompt="", prompt_tokens=1, max_new_tokens=1, batch_size=1, sampling={},
                           env=Environment("m", "bfloat16", "cpu"), caches=[_run("baseline")])
    data = to_dict(result)
    for key in ("decode_context_tokens", "speed_note", "partial"):
        del data["caches"][0][key]
    run = from_dict(data).caches[0]
    assert run.decode_context_tokens is None and run.speed_note == "" and run.partial is False


def iter_compare_serial(model, tokenizer, specs, prompt: str, max_new_tokens: int, *, model_name: str = "",
                        batch_size: int = 1, sampler: Sampler | None = None, weights: str | None = None,
                        prompt_ids: list[int] | None = None, chat: bool = False, progress=None):
    """Compare as it ran before the lockstep: one cache at a time, free-running then teacher-forced, each pass with
    its own prefill, timed as it runs; yields the partial result after each spec (what the lockstep is pinned to)."""
    run = runner._prepare(model, tokenizer, specs, prompt, max_new_tokens, model_name=model_name, batch_size=batch_size,
                   sampler=sampler, weights=weights, prompt_ids=prompt_ids, chat=chat, progress=progress)
    specs, ids, sampler = run.specs, run.ids, run.sampler
    device = model.device
    progress = progress or (lambda frac, desc: None)
    progress(0.0, "warming up")
    runner.warm_up(model, ids, specs)
    base_trace, runs = None, []
    for i, spec in enumerate(specs):
        def step(j, n, i=i, spec=spec, phase="generating"):
            progress((i + 0.5 * j / max(n, 1)) / len(specs), f"{spec}: {phase}")
        t0 = time.perf_counter()
        runner._peak_reset(device)
        cache = build_cache(spec, model)
        free = generate(model, ids, cache, max_new_tokens, sampler=Sampler(sampler.temperature, sampler.top_p,
                                                                           sampler.seed),
                        stop_token=tokenizer.eos_token_id if chat else None, on_step=step)  # a chat answer ends
        peak, wall = runner._peak(device), time.perf_counter() - t0
        if base_trace is None:
            base_trace = forced = free
        else:
            forced = generate(model, ids, build_cache(spec, model), 0, forced=base_trace.tokens,
                              on_step=lambda j, n, i=i, spec=spec: step(n + j, 2 * n, phase="teacher forcing"))
        runs.append(run.cache_run(spec, free, forced, base_trace, wall=wall, peak=peak,
                                  description=getattr(cache, "description", ""),
                                  speed=(*speed_stats(free.decode_s, ids.shape[0]), None, "")))
        progress((i + 1) / len(specs), f"{spec}: done")
        yield run.result(runs)



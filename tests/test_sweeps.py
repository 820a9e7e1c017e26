"""Memory, Capacity and Throughput on the bundled model: measured memory against context, projections, GPU
capacity, throughput (kvplay/lab/memory.py, capacity.py, throughput.py)."""
import pytest
import torch

from kvplay.app.models import HELD_OUT_TEXT, quantize_weights
from kvplay.cache import analytic_nbytes
from kvplay.cache.arch import Arch, published_archs
from kvplay.errors import KvplayError
from kvplay.lab.capacity import capacity, capacity_for, default_bits
from kvplay.lab.memory import PROJECTION_TOKENS, memory_sweep, project
from kvplay.lab.texts import long_text_ids
from kvplay.lab.throughput import throughput_sweep

SAWTOOTH = "kvplay-int4:residual=32,sink=0"   # blocks of 64 tokens leave a 32-token window: visible in 256 tokens
CONTEXT, CHUNK = 256, 32


@pytest.fixture(scope="module")
def memory(bundled):
    model, tok = bundled
    return memory_sweep(model, tok, [SAWTOOTH, "kvplay-int2", "quanto-int4"], CONTEXT, CHUNK, model_name="bundled")


def series(result, spec):
    return next(c for c in result.caches if c.spec == spec)


def test_long_text_repeats_the_play_to_reach_any_length(bundled):
    _, tok = bundled
    once = tok(HELD_OUT_TEXT.read_text(), return_tensors="pt", verbose=False).input_ids
    n = once.shape[1]
    ids = long_text_ids(tok, n + 100)
    assert ids.shape == (1, n + 100)
    assert torch.equal(ids[:, :n], once) and torch.equal(ids[:, n:], once[:, :100])
    with pytest.raises(KvplayError):
        long_text_ids(tok, 0)


def test_memory_points_cover_the_sweep_and_grow(memory):
    assert [c.spec for c in memory.caches] == ["baseline", SAWTOOTH, "kvplay-int2", "quanto-int4"]
    for c in memory.caches:
        assert [int(p[0]) for p in c.points] == list(range(CHUNK, CONTEXT + 1, CHUNK))
        nbytes = [p[1] for p in c.points]
        # Over any 4 chunks (128 tokens: a kvplay block and a quanto residual) every cache grows.
        assert all(nbytes[k] > nbytes[k - 4] for k in range(4, len(nbytes))), c.spec
    base = [p[1] for p in series(memory, "baseline").points]
    assert all(b > a for a, b in zip(base, base[1:]))
    assert memory.env.model == "bundled" and memory.env.weights == "16-bit"


def test_the_formula_is_quoted_only_where_it_holds_for_chunked_arrival(memory):
    """The sweep feeds chunks: it quotes a formula (which tests/test_bytes.py pins to the live bytes) only for
    methods whose formula holds however tokens arrive, and it agrees with the last measured point there."""
    for c in memory.caches:
        if c.spec.startswith(("baseline", "kvplay")):
            assert c.extra["analytic_bytes"] == c.points[-1][1]
        else:
            assert c.extra["analytic_bytes"] is None    # transformers' formula assumes prefill + decode
    assert series(memory, "baseline").extra["bits_per_element"] == 16.0
    assert all(c.extra["bits_per_element"] < 16 for c in memory.caches[1:])


def test_kvplay_memory_drops_each_time_a_block_leaves_the_window(memory):
    points = series(memory, SAWTOOTH).points
    drops = {int(b[0]) for a, b in zip(points, points[1:]) if b[1] < a[1]}
    # A 64-token block is quantized once the window holds residual + 64 = 96 tokens, then every 64 tokens.
    assert drops == {96, 160, 224}
    # With int2's 32-token blocks (= the chunk) one block leaves per chunk once the window is full: no drop,
    # and every later increment is the same, smaller than a 16-bit chunk's.
    int2 = [p[1] for p in series(memory, "kvplay-int2").points]
    steps = [b - a for a, b in zip(int2, int2[1:])]
    assert len(set(steps[4:])) == 1 and steps[-1] < steps[0]
    # transformers' QuantizedCache re-quantizes its residual at once: its bytes drop too.
    quanto = [p[1] for p in series(memory, "quanto-int4").points]
    assert any(b < a for a, b in zip(quanto, quanto[1:]))


def test_projection_of_the_16_bit_cache_to_llama_2_7b(memory):
    llama2 = published_archs()["Llama-2-7B"]
    assert project(16, llama2, 1) == 524_288
    assert project(16, llama2, 10_000) == 5_242_880_000          # about 4.88 GiB: the "5 GB" of the blog posts
    assert set(memory.projections) == set(published_archs())
    base = memory.projections["Llama-2-7B"]["baseline"]
    assert base == [[t, t * 524_288] for t in PROJECTION_TOKENS]
    for arch, by_spec in memory.projections.items():
        for spec, points in by_spec.items():
            if spec != "baseline":
                assert all(p[1] < b[1] for p, b in zip(points, by_spec["baseline"])), (arch, spec)


def test_projection_uses_the_bits_measured_at_the_largest_context_below(memory):
    target = published_archs()["Llama-3-8B"]
    bpe = series(memory, SAWTOOTH).extra["bits_per_element"]                 # measured at the sweep's end
    assert memory.projections["Llama-3-8B"][SAWTOOTH][-1] == [131072, project(bpe, target, 131072)]


def test_capacity_of_llama_2_7b_on_24_gib_by_hand():
    llama2 = published_archs()["Llama-2-7B"]
    result = capacity({"baseline": 16.0, "int4": 4.0}, llama2, 24)
    free = 24 * 2**30 - 2 * 6_738_415_616                                     # 12,292,972,544 bytes
    base, int4 = result.caches
    assert result.weight_bytes == 13_476_831_232
    assert base.bytes_per_token == 524_288
    assert base.cache_fits == free // 524_288 == 23_446
    assert base.max_batch == free // (524_288 * 4096) == 5
    assert int4.cache_fits == free // 131_072 == 93_787
    # Llama 2 was trained on 4,096 positions: no cache gets a longer context (issue 41 saw 150,060 for quanto-int2)
    assert result.context_limit == 4096 and base.max_context == int4.max_context == 4096
    assert "Cache-only bound" in result.note
    from kvplay.show.plots import capacity_figure
    from kvplay.show.tables import capacity_rows

    assert "the cache alone fits 93,787" in capacity_rows(result)[1]["Longest context, batch 1 (tokens)"]
    fig = capacity_figure(result)
    assert max(fig.data[0].y) == 4096 and "4,096" in fig.layout.annotations[0].text
    mistral = capacity({"baseline": 16.0}, published_archs()["Mistral-7B"], 16)     # 32,768 positions
    assert mistral.caches[0].cache_fits is None and mistral.caches[0].max_context < 32_768


def test_capacity_from_the_formulas_alone():
    assert default_bits("baseline") == 16.0
    result = capacity_for(["kvplay-int4", "kvplay-int2"], "Llama-2-7B", 24)
    base, int4, int2 = result.caches
    assert [r.spec for r in result.caches] == ["baseline", "kvplay-int4", "kvplay-int2"]
    assert base.cache_fits == 23_446
    assert base.cache_fits < int4.cache_fits < int2.cache_fits
    assert 4 < int4.bits_per_element < 5
    weights_do_not_fit = capacity_for([], "Llama-3-70B", 24)
    assert weights_do_not_fit.caches[0].max_context == 0 and weights_do_not_fit.caches[0].max_batch == 0
    int4_weights = capacity_for([], "Llama-2-7B", 24, weight_dtype="int4")
    assert int4_weights.weight_bytes == 6_738_415_616 // 2 and int4_weights.caches[0].cache_fits > 23_446


@pytest.mark.parametrize("gib", [0, -8])
def test_capacity_needs_positive_gpu_memory(gib):
    with pytest.raises(KvplayError, match=r"^GPU memory must be a positive number of GiB\.$"):
        capacity({"baseline": 16.0}, published_archs()["Llama-2-7B"], gib)


def test_capacity_names_the_valid_choices():
    with pytest.raises(KvplayError, match="float16.*int4"):
        capacity({"baseline": 16.0}, published_archs()["Llama-2-7B"], 24, weight_dtype="fp4")
    with pytest.raises(KvplayError, match="Llama-2-7B"):
        capacity_for([], "GPT-5", 24)


def test_throughput_is_positive_for_every_spec_and_batch(bundled):
    model, tok = bundled
    result = throughput_sweep(model, tok, ["kvplay-int4", "quanto-int4"], batch_sizes=(1, 2), context=64,
                              new_tokens=5, contexts=(32, 96))
    assert [c.spec for c in result.caches] == ["baseline", "kvplay-int4", "quanto-int4"]
    for c in result.caches:
        assert [p[0] for p in c.points] == [1, 2] and all(p[1] > 0 for p in c.points)
        assert [p[0] for p in c.context_points] == [32, 96] and all(p[1] > 0 for p in c.context_points)
    assert result.batch_sizes == [1, 2] and result.context == 64 and result.new_tokens == 5


def test_quantized_weights_are_a_labelled_copy(bundled):
    model, tok = bundled
    quantized = quantize_weights(model, "int8")
    assert type(quantized.model.layers[0].mlp.up_proj).__name__ == "QLinear"
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "PackedLinear"    # the original is untouched
    assert type(quantized.lm_head).__name__ == "PackedLinear"                     # lm_head stays 16-bit
    result = memory_sweep(quantized, tok, [], 64, 32, weights="int8")    # the LoadedModel's format, handed in
    assert result.env.weights == "quanto int8"
    assert result.caches[0].points[-1][1] == analytic_nbytes("baseline", Arch.from_config(model.config), 64).total
    with pytest.raises(KvplayError, match="int8 or int4"):
        quantize_weights(model, "int3")


def test_an_evicting_cache_is_measured_as_when_serving_one_prompt(bundled):
    """Issue 50: fed chunk by chunk, only the first chunk was a prompt, and SnapKV keeping a quarter read 15.8 bits
    per element at 2,048 tokens where the tasks view read 4.0. Each point is now a prompt of that length, evicted
    once: the 16-bit cache keeping a quarter reads 4.0 bits, as the byte formula says, at every length."""
    model, tok = bundled
    quarter, both = "baseline:evict=snapkv,keep=0.25", "kvplay-int4:evict=streamingllm,keep=0.5"
    res = memory_sweep(model, tok, [quarter, both], CONTEXT, CHUNK, model_name="bundled")
    arch = Arch.from_config(model.config)
    for spec in (quarter, both):
        c = series(res, spec)
        assert [p[0] for p in c.points] == [32, 64, 128, 256]                   # prompts doubling from the chunk
        assert [p[1] for p in c.points] == [analytic_nbytes(spec, arch, n).total for n, _ in c.points]
    assert series(res, quarter).extra["bits_per_element"] == pytest.approx(4.0, abs=0.05)
    # keeping half, at most half of 16-bit's bits: 8.0 at 256 tokens, where the 128 kept fit the 16-bit window
    assert series(res, both).extra["bits_per_element"] <= 8.0 + 0.05

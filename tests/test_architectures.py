"""The cache layer across architectures: tiny random models built from transformers config classes.

No download: every model is a randomly initialised 2-layer, hidden-64 model in bfloat16, so each
generate() call costs a few tens of milliseconds on CPU. The prompt (150 tokens) is longer than
the kvplay windows used here, so quantization really happens during both prefill and decode.
The architectures are tests/conftest.py's (ARCHS); measured bytes against the formula on each of them are
tests/test_bytes.py's.
"""
from functools import cache

import pytest
import torch
from conftest import ARCHS, FULL_ATTENTION, MIXED, ODD, SLIDING_ONLY
from conftest import TINY_VOCAB as VOCAB
from conftest import tiny_arch as tiny
from gemma3_tiny import tiny_gemma3
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvplay.cache import METHODS, CacheSpec, KVPlayCache, KVPlayLayer, attention, build_cache, cache_nbytes, parse_spec
from kvplay.cache.accounting import analytic_nbytes, bits_per_element, layer_nbytes, layer_split
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate

needs_kernel = pytest.mark.skipif(not attention.available(), reason="no C compiler for kvplay's kernels")
PROMPT, NEW = 150, 20
WITH_SLIDING = {**MIXED, **SLIDING_ONLY}

KVPLAY_INT4 = "kvplay-int4:group=32,residual=16"             # group 32 divides head_dim 32
QUANTO_INT4 = "quanto-int4:group=32"                           # quanto groups must divide head_dim


def registry_specs() -> list[str]:
    """One spec per registered method that builds a transformers cache: its fewest-bit scheme, group 32
    (head_dim 32), a 16-token window, kvplay's Hadamard rotation and no 16-bit boundary layers (vLLM TurboQuant's
    first and last 2 would be both layers of these models; options a method does not take are ignored)."""
    return [str(CacheSpec(min(m.schemes, key=lambda s: s.bits).name).with_options(group=32, residual=16,
                                                                                  rotation="hadamard", boundary=0))
            for m in METHODS.values() if m.builds_cache]


SPECS = registry_specs()           # baseline, quanto-int2, hqq-int2, kvplay-int2 (rotated), and any new method
REFUSE_SLIDING = [s for s in SPECS if parse_spec(s).method.full_attention_only]


@cache
def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def run(model, cache) -> torch.Tensor:
    ids = prompt()
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)


@cache
def baseline(arch: str):
    """(greedy output, measured cache bytes) of the 16-bit reference on this architecture."""
    cache = build_cache("baseline", tiny(arch))
    return run(tiny(arch), cache), cache_nbytes(cache)


def check_output(out: torch.Tensor) -> None:
    assert out.shape == (1, PROMPT + NEW)
    assert torch.equal(out[:, :PROMPT], prompt())


# ------------------------------------------------------------------------------------------- the matrix

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("arch", list(FULL_ATTENTION))
def test_every_spec_generates_on_every_full_attention_architecture(arch, spec):
    cache = build_cache(spec, tiny(arch))
    out = run(tiny(arch), cache)
    check_output(out)
    measured = cache_nbytes(cache)
    assert measured.total > 0
    assert cache.get_seq_length() == PROMPT + NEW - 1          # the last token is never fed back
    if parse_spec(spec).is_quantized:
        assert measured.payload > 0
        assert measured.total < baseline(arch)[1].total
    else:
        assert torch.equal(out, baseline(arch)[0])
    if isinstance(cache, KVPlayCache):
        assert all(isinstance(layer, KVPlayLayer) for layer in cache.layers)
        # these tiny models attend with sdpa, so decode dequantizes and the description says why
        assert cache.description == (f"{cache.spec}: 2 layers quantized; decode attention: dequantize then attend "
                                     "(the model's attention implementation is 'sdpa', not 'kvplay')")


@pytest.mark.parametrize("spec", [s for s in SPECS if s not in REFUSE_SLIDING])
@pytest.mark.parametrize("arch", list(MIXED))
def test_kvplay_and_baseline_generate_on_models_mixing_sliding_and_full_layers(arch, spec):
    model = tiny(arch)
    cache = build_cache(spec, model)
    out = run(model, cache)
    check_output(out)
    measured = cache_nbytes(cache)
    assert measured.total > 0
    kinds = [type(layer) for layer in cache.layers]
    assert DynamicSlidingWindowLayer in kinds
    # The sliding layer holds a bounded window, not the whole sequence.
    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert all(layer.keys.shape[-2] < PROMPT for layer in sliding)
    if parse_spec(spec).is_quantized:
        assert KVPlayLayer in kinds if parse_spec(spec).backend == "kvplay" else \
            set(kinds) & set(parse_spec(spec).method.layer_types)        # the full layers are the method's own
        assert measured.payload > 0
        assert measured.total < baseline(arch)[1].total
    else:
        assert torch.equal(out, baseline(arch)[0])


@pytest.mark.parametrize("spec", REFUSE_SLIDING)
@pytest.mark.parametrize("arch", list(WITH_SLIDING))
def test_transformers_caches_refuse_sliding_window_models_with_a_kvplay_error(arch, spec):
    with pytest.raises(KvplayError, match="sliding-window"):
        build_cache(spec, tiny(arch))


@pytest.mark.parametrize("arch", list(WITH_SLIDING))
def test_kvplay_keeps_sliding_window_layers_in_16_bit_and_says_so(arch):
    model = tiny(arch)
    cache = build_cache(KVPLAY_INT4, model)
    check_output(run(model, cache))
    kept = sum(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    quantized = sum(isinstance(layer, KVPlayLayer) for layer in cache.layers)
    assert kept >= 1 and kept + quantized == len(cache.layers) == 2
    window = Arch.from_config(model.config).sliding_window
    words = f"{quantized} global layer{'s' * (quantized != 1)} quantized, {kept} sliding layer{'s' * (kept != 1)} " \
            f"kept in 16-bit ({window} tokens each)"
    assert words in cache.description and words in repr(cache)
    assert layer_split(cache) == {"quantized": quantized, "sliding": kept, "window": window,
                                  "text": words if quantized else ""}      # all sliding: nothing is quantized


@pytest.mark.parametrize("arch", list(ARCHS))
def test_arch_counts_exactly_the_layers_the_kvplay_cache_quantizes(arch):
    """Arch.from_config feeds analytic_nbytes and capacity estimates: its full-attention layer count
    must be the number of layers kvplay's cache really quantizes."""
    model = tiny(arch)
    cache = KVPlayCache(parse_spec("kvplay-int4:keys=channel,values=channel"), model.config)
    quantized = sum(isinstance(layer, KVPlayLayer) for layer in cache.layers)
    assert Arch.from_config(model.config).layers == quantized, cache.description


@pytest.mark.parametrize("arch", list(ARCHS))
def test_int8_with_a_window_longer_than_the_sequence_reproduces_the_baseline_exactly(arch):
    model = tiny(arch)
    # head_dim 15 divides no group size: group values per channel there (a block of 16 tokens).
    spec = "kvplay-int8:group=16,residual=4096,values=channel" if arch in ODD else "kvplay-int8:group=32,residual=4096"
    cache = build_cache(spec, model)
    out = run(model, cache)
    assert torch.equal(out, baseline(arch)[0])
    assert cache_nbytes(cache).payload == 0                    # nothing left the window
    assert cache_nbytes(cache).total == baseline(arch)[1].total


# ------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("arch", list(FULL_ATTENTION))
def test_quanto_default_group_is_refused_up_front_when_it_does_not_divide_head_dim(arch):
    """quanto groups the flattened tensor, so a group of 64 over head_dim 32 would crash on odd lengths."""
    with pytest.raises(KvplayError, match="group size 64 must divide head_dim 32 for quanto"):
        build_cache("quanto-int4", tiny(arch))


@pytest.mark.parametrize("arch", list(FULL_ATTENTION))
def test_quanto_runs_on_an_odd_prompt_length_when_its_group_divides_head_dim(arch):
    model = tiny(arch)
    cache = build_cache(QUANTO_INT4, model)
    ids = torch.randint(3, VOCAB, (1, PROMPT + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
                             min_new_tokens=4, do_sample=False)
    assert out.shape == (1, PROMPT + 5)


@pytest.mark.parametrize("arch", list(FULL_ATTENTION) + list(MIXED))
def test_a_group_that_does_not_divide_head_dim_is_refused_by_build_cache(arch):
    # kvplay-int4's default group is 64; head_dim is 32 and values are grouped per token.
    with pytest.raises(KvplayError, match="group size 64 must divide head_dim 32"):
        build_cache("kvplay-int4:residual=16", tiny(arch))


@pytest.mark.parametrize("spec, message", [
    ("quanto-int4", "group size 64 must divide head_dim 15 for quanto"),
    ("kvplay-int4:group=32", "group size 32 must divide head_dim 15 when values are grouped per token"),
    ("kvplay-int4:keys=token,values=channel,group=16", "group size 16 must divide head_dim 15 when keys"),
    ("kvplay-int2:rotation=hadamard,values=channel", "Hadamard rotation needs an even head_dim"),
])
def test_an_odd_head_dim_is_refused_up_front_where_a_spec_cannot_handle_it(spec, message):
    model = tiny("gpt2-odd-head-dim")
    assert Arch.from_config(model.config).head_dim == 15
    with pytest.raises(KvplayError, match=message):
        build_cache(spec, model)


def test_an_odd_head_dim_works_when_keys_and_values_are_grouped_per_channel():
    arch = "gpt2-odd-head-dim"
    # an odd head_dim has no Hadamard rotation, so the rotated preset is turned back to rotation=none
    model, spec = tiny(arch), "kvplay-int4:keys=channel,values=channel,group=16,residual=16,rotation=none"
    cache = build_cache(spec, model)
    check_output(run(model, cache))
    measured = cache_nbytes(cache)
    assert measured.payload > 0
    assert measured.total < baseline(arch)[1].total


# ---------------------------------------------------------------------------- Gemma 3 in miniature

PRESETS = ["kvplay-int4", "kvplay-int2", "kvplay-3bit", "kvplay-2.5bit"]


def _preset(name: str) -> str:
    """The preset as shipped, but with Hadamard keys for rotation=calibrated and no fragile layers (both calibrate
    on text, and a tiny random model has no tokenizer; the bytes and the kernel's formats are the same)."""
    spec = parse_spec(name)
    rotation = "hadamard" if spec.rotation == "calibrated" else spec.rotation
    return str(spec.with_options(rotation=rotation, fragile=0, vfragile=0))


def test_gemma3_keeps_five_sliding_layers_in_16_bit_and_quantizes_the_global_one():
    """Gemma 3's shape (tests/gemma3_tiny.py): the global layer quantized, the sliding ones 16-bit and bounded to
    their window, the split said in words and given as data, bits per element exact (16 for the reference)."""
    model = tiny_gemma3()
    arch = Arch.from_config(model.config)
    assert (arch.layers, arch.sliding_layers, arch.sliding_window, arch.kv_heads, arch.head_dim) == (1, 5, 32, 1, 256)
    base, cache = build_cache("baseline", model), build_cache("kvplay-int4:residual=16", model)
    run(model, base), run(model, cache)
    words = "1 global layer quantized, 5 sliding layers kept in 16-bit (32 tokens each)"
    assert cache.description.startswith(f"{cache.spec}: {words};")
    assert layer_split(cache)["text"] == words and layer_split(base)["text"] == ""
    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert len(sliding) == 5 and all(layer.keys.shape[-2] == 31 for layer in sliding)   # stopped at the window
    # Counted by hand: 5 layers x 31 tokens x (K and V) x 1 head x 256 x 2 bytes, the same in both caches.
    sixteen = cache_nbytes(cache).full_precision - layer_nbytes(cache.layers[5]).full_precision
    assert sixteen == 5 * 31 * 2 * 256 * 2
    tokens = PROMPT + NEW - 1
    assert bits_per_element(cache_nbytes(base), arch, tokens) == 16.0
    assert cache_nbytes(cache) == analytic_nbytes(cache.spec, arch, tokens, prefill=PROMPT)
    assert bits_per_element(cache_nbytes(cache), arch, tokens) < 16.0


def test_gemma3_270m_bits_per_element_count_its_sliding_layers_at_16_bits():
    """On the real Gemma 3 270M's shape at 32k tokens, 15 sliding layers hold 511 tokens each in 16-bit besides 3
    global layers of 32,768 quantized tokens: bits per element are the global layers' bits and 16 weighted by
    those counts (worked here from a full-attention model of 3 layers)."""
    from transformers import Gemma3TextConfig

    gemma = Arch.from_config(Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=256, sliding_window=512))
    assert gemma.layer_split() == "3 global layers quantized, 15 sliding layers kept in 16-bit (512 tokens each)"
    full_only = Arch("three-global", layers=3, kv_heads=1, head_dim=256)
    n, held = 32768, 15 * 511
    for spec in ("kvplay-int4", "kvplay-int2", "llamacpp-q4_0", "vllm-fp8"):
        bits = bits_per_element(analytic_nbytes(spec, full_only, n), full_only, n)
        expected = (bits * 3 * n + 16 * held) / (3 * n + held)
        assert bits_per_element(analytic_nbytes(spec, gemma, n), gemma, n) == pytest.approx(expected, rel=1e-12)
    assert bits_per_element(analytic_nbytes("kvplay-int4", gemma, 32768), gemma, 32768) > 5.3   # 4.6 without them


@pytest.mark.parametrize("arch_name", ["gemma3", "gemma3-270m-config"])
def test_transformers_quantized_cache_refuses_gemma3_in_one_sentence_naming_what_to_pick(arch_name):
    from transformers import Gemma3TextConfig

    config = tiny_gemma3().config if arch_name == "gemma3" else Gemma3TextConfig(
        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    layers, sliding = (6, 5) if arch_name == "gemma3" else (18, 15)
    for spec in REFUSE_SLIDING_PRESETS:
        with pytest.raises(KvplayError) as err:
            parse_spec(spec).method.check_model(parse_spec(spec), config)
        text = str(err.value)
        assert f"cannot run a model with sliding-window layers (this one has {sliding} of {layers})" in text
        assert "pick kvplay-int4 or kvplay-int2" in text and text.count(". ") == 0 and "\n" not in text


REFUSE_SLIDING_PRESETS = [s.name for m in METHODS.values() if m.full_attention_only for s in m.schemes]


@needs_kernel
@pytest.mark.parametrize("name", PRESETS)
def test_presets_run_fused_on_head_dim_256_and_one_kv_head(name):
    """kvplay's presets on Gemma 3's heads (D 256, 4 query heads on one KV head): decode attention reads the packed
    codes (the kernel takes D up to 256), and its logits match dequantize-then-sdpa's, teacher-forced."""
    model = tiny_gemma3("kvplay")
    spec = _preset(name)
    cache = build_cache(spec, model)
    assert "decode attention: fused from packed codes" in cache.description, cache.description
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 400), generator=gen)   # kvplay-3bit's 128-token key blocks fill
    mask = torch.ones_like(ids)
    mask[1, :37] = 0                                                      # left padding
    forced = torch.randint(3, VOCAB, (2, 40), generator=gen)
    fused = torch.stack(generate(model, ids, cache, 0, forced=forced, mask=mask).logits)
    slow_spec = parse_spec(spec).with_options(attention="sdpa")
    slow = torch.stack(generate(model, ids, build_cache(slow_spec, model), 0, forced=forced, mask=mask).logits)
    assert cache.layers[5].store_k.n_blocks > 0                          # the global layer really quantized
    # Worst logit difference measured over the four presets: 3.9e-3, one bfloat16 step (logits up to 0.55); bound 4x.
    assert (fused - slow).abs().max() <= 0.016
    assert slow.abs().max() > 0.3


def test_compare_on_gemma3_runs_what_it_can_and_says_why_the_model_refused_the_rest(bundled):
    """Compare's defaults include transformers' quantized caches, which refuse Gemma 3: the run goes on with the
    others, and each refused cache is a card and a verdict line carrying the refusal's sentence (issue 40)."""
    from kvplay.lab.compare import run_compare
    from kvplay.results import from_dict, to_dict
    from kvplay.show.cards import cards_html, headline, refusals

    _, tok = bundled
    model, ids = tiny_gemma3("kvplay"), list(range(3, 40))           # the tiny vocabulary's ids, decoded by any
    result = run_compare(model, tok, ["quanto-int4", "kvplay-int4"], "", 4, prompt_ids=ids)
    assert [c.spec for c in result.caches] == ["baseline", "kvplay-int4"] and list(result.refused) == ["quanto-int4"]
    why = result.refused["quanto-int4"]
    assert "cannot run a model with sliding-window layers (this one has 5 of 6)" in why
    cards = cards_html(result)
    assert cards.count("class='kv-card'") == 2 and cards.count("kv-refused") == 1 and "not run on this model" in cards
    lines = headline(result)[1]
    assert len(lines) == 2 and lines[-1] == ("refused", f"Not run: {why}")
    both = {"quanto-int4": why, "quanto-int2": why.replace("quanto-int4", "quanto-int2", 1)}
    assert refusals(both) == [f"quanto-int4 and quanto-int2{why[len('quanto-int4'):]}"]     # one line per reason
    assert from_dict(to_dict(result)).refused == result.refused
    with pytest.raises(KvplayError, match="^quanto-int2: transformers' quantized cache cannot run"):
        run_compare(model, tok, ["quanto-int2"], "", 2, prompt_ids=ids)     # nothing left to compare: the error


@pytest.mark.parametrize("view", ["memory", "throughput", "quality", "needle"])
def test_memory_throughput_quality_and_the_needle_run_what_gemma3_can_and_name_what_it_refused(bundled, view):
    """The tabs' defaults include transformers' quantized caches: on Gemma 3 each view runs the rest and the result
    names the refused ones with their sentence, for the tab's status line and the CLI (issue 40)."""
    from transformers import Gemma3ForCausalLM

    from kvplay.lab.inside.needle import needle_run
    from kvplay.lab.memory import memory_sweep
    from kvplay.lab.quality import perplexity_run
    from kvplay.lab.throughput import throughput_sweep
    from kvplay.results import from_dict, to_dict
    from kvplay.show.tables import not_run_note

    _, tok = bundled
    config = tiny_gemma3("kvplay").config
    config.vocab_size = len(tok)                                   # the bundled tokenizer's ids, for the play
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
    specs = ["quanto-int4", "kvplay-int4"]
    run = {"memory": lambda: memory_sweep(model, tok, specs, 64, 32),
           "throughput": lambda: throughput_sweep(model, tok, specs, [1], 16, 4),
           "quality": lambda: perplexity_run(model, tok, specs, max_tokens=64, chunk=16),
           "needle": lambda: needle_run(model, tok, specs, lengths=[64], depths=[0.5], chat=False)}[view]
    result = run()
    assert [c.spec for c in result.caches] == ["baseline", "kvplay-int4"] and list(result.refused) == ["quanto-int4"]
    assert not_run_note(result) == f"Not run on this model: {result.refused['quanto-int4']}"
    assert "sliding-window layers (this one has 5 of 6)" in result.refused["quanto-int4"]
    assert from_dict(to_dict(result)).refused == result.refused

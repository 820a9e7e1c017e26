"""kvplay's bit-budget presets (issue 27): kvplay-2.5bit and kvplay-3bit.

Their all-in bits per element at 8,192 tokens on SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64),
from the byte formula the exact-bytes tests pin to live caches (tests/test_methods.py runs every scheme,
these two included): a real check of each preset's configuration against the issue's targets. Then the
decode path: both store 8-bit scales and zeros (kmeta/vmeta=8bit), which the fused kernel reads (attend_t.kmeta8,
vmeta8); the presets, their 8-bit keys or values alone, and the same specs with float16 scales are pinned against
dequantize-then-sdpa as tests/test_attention.py pins the older presets (which also runs them on every code path).
Last, the bits the verdict lines, cards, tables and scheme table now quote.
"""
import pytest
import torch
from conftest import engine_layer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvplay.cache import analytic_nbytes, attention, bits_per_element, build_cache, parse_spec, scheme_table
from kvplay.cache.arch import Arch
from kvplay.cache.engine import KVPlayLayer
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate

SMOLLM2 = Arch("smollm2-135m-instruct", layers=30, kv_heads=3, head_dim=64)
TARGETS = {"kvplay-2.5bit": 2.5, "kvplay-3bit": 3.5}         # issue 27: at most this many bits at 8,192 tokens
needs_kernel = pytest.mark.skipif(not attention.available(), reason="no C compiler for kvplay's kernels")


def bits(spec, tokens=8192, arch=SMOLLM2):
    return bits_per_element(analytic_nbytes(spec, arch, tokens), arch, tokens)


@pytest.mark.parametrize("name, target", TARGETS.items())
def test_bits_per_element_at_8k_meet_the_targets(name, target):
    assert bits(name) <= target
    assert bits(name) < bits("kvplay-int4") == pytest.approx(4.68, abs=1e-3)  # the check can fail: int4 is over both


def test_the_2_5_bit_preset_costs_no_more_than_quanto_int2_from_8k_tokens():
    for tokens in (8192, 16384):                                # at quanto's flush points its window is empty
        assert analytic_nbytes("kvplay-2.5bit", SMOLLM2, tokens).total <= \
            analytic_nbytes("quanto-int2", SMOLLM2, tokens).total
    # ... but not at 4k, where kvplay's 16-bit tokens (sink 4, window 32, up to 63 waiting for a block) weigh double
    assert bits("kvplay-2.5bit", 4096) == pytest.approx(2.596, abs=1e-3)
    assert bits("kvplay-2.5bit", 4096) > bits("quanto-int2", 4096)
    # 2.490 bits: keys at 3 bits in 8 of 30 layers and 2 in 22 (2.267), 2-bit values, so 2.133 bits of codes; 0.25
    # for 8-bit scales and zeros (16 bits per 64 tokens of a key channel, per 64 values of a token); 64 16-bit
    # tokens of 8,192 (sink 4, window 32, 28 waiting for a block; 0.106)
    assert bits("kvplay-2.5bit") == pytest.approx(2.490, abs=1e-3)
    # 3.388 bits: keys at 4 bits in 18 of 30 layers and 3 in 12 (3.6), values at 4 bits in 6 and 2 in 24 (2.4), so
    # 3 bits of codes; 0.1875 for 8-bit scales and zeros (16 bits per 128 tokens of a key channel, 0.125; per 64
    # values of a token, 0.25); 128 16-bit tokens (sink 4, window 124; 0.200)
    assert bits("kvplay-3bit") == pytest.approx(3.388, abs=1e-3)


@pytest.mark.parametrize("name, target", TARGETS.items())
def test_the_16_bit_window_share_is_bounded_between_block_boundaries(name, target):
    """Between two flushes up to a block less one token waits in 16-bit beyond the window: kvplay-2.5bit's
    64-token blocks add at most 0.12 bits at 8k, kvplay-3bit's 128-token blocks 0.25 (measured over tokens
    8,192-8,319: 2.443 to 2.547 and 3.388 to 3.580; 2.494 and 3.482 on average over 8,192-8,447). On average over
    every phase each stays within its target."""
    block = KVPlayLayer(parse_spec(name)).block
    at = [bits(name, t) for t in range(8192, 8320)]
    assert max(at) <= min(at) + 16 * (block - 1) / 8192 + 1e-9
    assert max(at) <= target + 0.1 and sum(bits(name, t) for t in range(8192, 8448)) / 256 <= target


def test_vgroup_is_refused_where_it_cannot_apply():
    arch = Arch("odd", layers=2, kv_heads=1, head_dim=48)
    with pytest.raises(KvplayError, match="group size 32 must divide head_dim 48"):
        parse_spec("kvplay-int2:vgroup=32").method.check(parse_spec("kvplay-int2:vgroup=32"), arch)
    spec = parse_spec("kvplay-int2:values=channel,vgroup=16")
    with pytest.raises(KvplayError, match="vgroup applies when keys are grouped per channel and values per token"):
        spec.method.check(spec, SMOLLM2)
    with pytest.raises(KvplayError):
        parse_spec("kvplay-fp8:vgroup=32")                      # fp8 has no groups


def test_value_groups_follow_vgroup_and_key_blocks_follow_group():
    layer = KVPlayLayer(parse_spec("kvplay-2.5bit"))
    assert (layer.block, layer.key_fmt.group, layer.value_fmt.group) == (64, 64, 64)
    assert (layer.key_fmt.meta, layer.value_fmt.meta) == ("8bit", "8bit")
    assert KVPlayLayer(parse_spec("kvplay-int2")).value_fmt.group == 32          # vgroup=0: the group size
    for name in TARGETS:           # the kernel reads 8-bit scales and zeros, and the same codes with float16 ones
        layer, fp16 = (KVPlayLayer(parse_spec(name).with_options(**meta)) for meta in
                       ({}, dict(kmeta="fp16", vmeta="fp16")))
        assert attention.covers(layer.key_fmt, layer.value_fmt, 64)
        assert attention.covers(fp16.key_fmt, fp16.value_fmt, 64)
    for uncovered in ("kvplay-int4:keys=token", "kvplay-int3:group=4"):   # the check can fail (3 bits: 8-code chunks)
        layer = KVPlayLayer(parse_spec(uncovered))
        assert not attention.covers(layer.key_fmt, layer.value_fmt, 64), uncovered


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


# Worst |fused - dequantize-then-sdpa| over the cases below as a share of the largest output: measured 6.9e-3
# (kvplay-2.5bit:kbits=4 with float16 scales, 383 tokens; 6.5e-3 with 8-bit ones, kvplay-2.5bit, 383 tokens);
# test_attention.py's bound for the older presets, 0.028, is 4x that.
FP16 = ":kmeta=fp16,vmeta=fp16"       # the presets' codes with float16 scales and zeros: what the kernel reads
MAX_DIFF = 0.028


@needs_kernel
@pytest.mark.parametrize("cached", [60, 300, 383])              # window only; blocks + window; a flush now
@pytest.mark.parametrize("spec", ["kvplay-2.5bit" + FP16, "kvplay-2.5bit:kbits=4,kmeta=fp16,vmeta=fp16",
                                  "kvplay-3bit" + FP16, "kvplay-2.5bit", "kvplay-3bit", "kvplay-2.5bit:vmeta=fp16",
                                  "kvplay-3bit:kmeta=fp16", "kvplay-3bit:kbits=4,vbits=4"])   # the last: fragile
def test_fused_decode_matches_dequantize_then_sdpa(spec, cached):
    gen = torch.Generator().manual_seed(1)
    layer = engine_layer(parse_spec(spec), 3)
    layer.fused = True

    def kv(n):
        return torch.randn(1, 3, n, 64, generator=gen).bfloat16()
    layer.update(kv(cached), kv(cached))
    keys, _ = layer.update(kv(1), kv(1))
    view = keys.kvplay_view
    s = parse_spec(spec)
    assert view.n_blocks == max(0, cached - s.sink - s.residual) // layer.block    # a block filled now is 16-bit here
    query = torch.randn(1, 9, 1, 64, generator=gen).bfloat16()
    fused = view.attend(query, None, 64 ** -0.5)
    assert fused is not None                                    # the kernel took it
    k, v = view.materialize()
    reference, _ = sdpa_attention_forward(_Module(3), query, k, v, None, scaling=64 ** -0.5)
    scale = reference.float().abs().max()
    assert (fused.float() - reference.float()).abs().max() <= MAX_DIFF * scale and scale > 0.1


@needs_kernel
@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("meta", ["", FP16])
def test_the_bundled_model_decodes_the_presets_fused(bundled, name, meta):
    """The bundled model (4 layers): the presets (8-bit scales and zeros) and the same codes with float16 scales
    decode fused, as dequantized."""
    model, tok = bundled
    cache = build_cache(name + meta, model, tok)
    assert cache.description.endswith("decode attention: fused from packed codes (on CPU)")
    gen = torch.Generator().manual_seed(5)
    ids, forced = torch.randint(3, 1000, (1, 420), generator=gen), torch.randint(3, 1000, (1, 40), generator=gen)
    fused = torch.stack(generate(model, ids, cache, 0, forced=forced).logits)
    slow = torch.stack(generate(model, ids, build_cache(parse_spec(name + meta).with_options(attention="sdpa"),
                                                        model, tok), 0, forced=forced).logits)
    # Worst logit difference measured: 0.0625 for the earlier presets, one bfloat16 step at logits up to 13.8; bound 4x.
    assert (fused - slow).abs().max() <= 0.25 and slow.abs().max() > 1
    assert cache.layers[0].store_k.n_blocks >= 2      # the history really was quantized (kvplay-3bit: blocks of 128)


# ---------------------------------------------------------------------------- where the bits are quoted

def _run(spec, compression, long):
    from kvplay.results import CacheRun

    n = 16
    return CacheRun(spec=spec, text="", token_ids=list(range(n)), tokens=["a"] * n, first_divergence=None,
                    match_fraction=1.0, diff_spans=[], kl=[0.01] * n, top1=[True] * n, baseline_logprob=[0.0] * n,
                    mean_kl=0.01, max_kl=0.01, top1_agreement=1.0, context_tokens=[10], cache_bytes_per_step=[100],
                    cache_bytes=int(2**20 / compression), baseline_bytes=2**20, compression=compression,
                    bits_per_element=16 / compression, prefill_s=0.1, prefill_tokens_per_s=1.0,
                    decode_tokens_per_s=1.0, wall_s=1.0, long_context_tokens=8192, long_context_compression=long)


def test_verdict_cards_and_tables_quote_bits_per_element_now_and_at_8k():
    from kvplay.results import CompareResult, Environment
    from kvplay.show import cards as render
    from kvplay.show import tables

    run = _run("kvplay-2.5bit", 4.0, 16 / 2.475)                 # 4 bits now, 2.475 at 8k
    result = CompareResult(prompt="p", prompt_tokens=10, max_new_tokens=16, batch_size=1, sampling={},
                           env=Environment(model="m", dtype="bfloat16", device="cpu"),
                           caches=[_run("baseline", 1.0, 1.0), run])
    _, line = render.verdict_line(run, result.caches[0])
    assert "4.0x smaller now, 6.5x at 8k tokens (4 and 2.48 bits per element)" in line
    card = render.card(run, result)
    assert "bits per element" in card and "4 now, 2.48 at 8k" in card
    assert "bits per element" in render.card(result.caches[0], result) and " now, " not in render.bits_text(
        result.caches[0], badge=True)
    row = tables.compare_rows(result)[1]
    assert row["Bits per element, now"] == 4.0 and row["Bits per element at 8,192 tokens"] == 2.48


def test_the_scheme_table_quotes_each_presets_bits_at_8k():
    table = scheme_table()
    assert "bits per element at 8,192 tokens, all-in (SmolLM2-135M)" in table.splitlines()[0]
    rows = {line.split(" | ")[0].strip("| `"): line.rsplit(" | ", 1)[1].strip(" |") for line in table.splitlines()
            if line.startswith("| `")}
    assert rows["kvplay-2.5bit"] == "2.49" and rows["kvplay-3bit"] == "3.39"
    assert rows["kvplay-int2"] == "3.30" and rows["quanto-int2"] == "2.50" and rows["baseline"] == "16.00"

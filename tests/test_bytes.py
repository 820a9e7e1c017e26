"""Measured bytes equal the formula: every registered cache method, on the tiny architectures, at every length.

The one place that pins kvplay.cache.cache_nbytes (what a live cache holds, counted by the method that made
its layers) to kvplay.cache.analytic_nbytes (the method's formula), category by category (payload, metadata,
16-bit), at every cache length of a batch-2 prefill with a left-padded row followed by one-token decode steps,
and, for the methods whose formula holds however tokens arrive (formula_any_arrival), after each of a run of
uneven prefill chunks.

Cells (the ids name them: architecture-spec):
  * every registered scheme, as registered (window capped so tokens leave it), on a tiny Llama with
    head_dim 64, where every default group divides the head;
  * option variants (sinks, windows, bit splits, groupings, fits, ggml type mixes, fp8 scales) on that Llama;
  * one spec per registered method on each tiny architecture of tests/conftest.py (head_dim 32) that the method
    takes: the full-attention ones, those mixing sliding-window and full layers (transformers' QuantizedCache
    refuses them, tests/test_architectures.py checks the refusal), and head_dim 15 (not the sliding-only ones:
    every layer there is a 16-bit sliding-window layer, which every method leaves alone);
  * the presets and one spec per other method on a Gemma 3 in miniature (tests/gemma3_tiny.py: five 16-bit
    sliding layers per quantized global one, head_dim 256, one KV head), the sliding layers counted too;
  * the specs that calibrate on text (a tokenizer) on the bundled model.
Independent counts written by hand live beside the code they check (tests/test_cache.py, tests/test_formats.py,
tests/test_engines_formats.py).
"""
import pytest
import torch
from conftest import FULL_ATTENTION, MIXED, ODD, TINY_VOCAB, tiny_arch, tiny_llama
from gemma3_tiny import tiny_gemma3

from kvplay.cache import METHODS, CacheBytes, analytic_nbytes, build_cache, cache_schemes, parse_spec
from kvplay.cache.accounting import cache_nbytes
from kvplay.cache.arch import Arch
from kvplay.lab.generate import decode_one_token, prefill

PROMPT, NEW, BATCH, PAD = 150, 12, 2, 5          # row 1 of the batch is left-padded by PAD tokens
CHUNKS = (70, 1, 29, 64, 3, 33)                  # uneven prefill chunks: 200 tokens that never line up with a block
ODD_REFUSED = {"quanto", "hqq", "llamacpp", "vllm-nvfp4", "sglang", "vllm-pth", "vllm-turboquant"}  # head_dim 15
WINDOW = 32                                      # the 16-bit window each spec is capped to (< PROMPT)


def capped(name: str, fragile=0, vfragile=0, **options) -> str:
    """The spec with its 16-bit window capped to WINDOW, kvplay's key blocks to 64 tokens (kvplay-3bit's 128 would
    leave none of the prompt; a VARIANT keeps 128) and, unless told, no fragile layers (ranking them needs a
    tokenizer), Hadamard keys for rotation=calibrated (fitting them needs one too; CALIBRATED runs both on the
    bundled model, and the bytes are the same) and no 16-bit boundary layers (vllm-turboquant's first and last 2)."""
    spec = parse_spec(name)
    residual, group = getattr(spec.options, "residual", None), getattr(spec.options, "group", None)
    if spec.backend == "kvplay" and group and group > 64 and "group" not in options:
        options["group"] = 64
    if getattr(spec.options, "rotation", None) == "calibrated" and "rotation" not in options:
        options["rotation"] = "hadamard"
    options.setdefault("boundary", 0)      # vLLM TurboQuant's 16-bit first and last layers would be all 2 of them
    return str(spec.with_options(residual=None if residual is None else min(WINDOW, residual), fragile=fragile,
                                 vfragile=vfragile, **options))


def per_method(arch: str) -> list[str]:
    """One spec per registered method that takes this tiny architecture (head_dim 32, or 15): its fewest-bit
    scheme, with groups that fit the head (options a scheme does not take are ignored). Left out, as refused
    (tests/test_architectures.py checks the refusals): transformers' QuantizedCache methods on models with
    sliding-window layers, and on head_dim 15 every method whose groups or blocks cannot fit it."""
    specs = []
    for method in (m for m in METHODS.values() if m.builds_cache):
        name = min(method.schemes, key=lambda s: s.bits).name
        if (arch in MIXED and method.full_attention_only) or (arch in ODD and method.name in ODD_REFUSED):
            continue
        if arch in ODD:    # only per-channel groups (of 16 tokens) and no rotation fit head_dim 15
            specs.append(capped(name, keys="channel", values="channel", group=16, rotation="none"))
        else:
            specs.append(capped(name, group=32))
    return specs


VARIANTS = [
    # kvplay's engine: sinks, windows, split bits, groupings, fitted scales, rotation
    "kvplay-int2:rotation=hadamard,sink=4", "kvplay-int4:kbits=8,vbits=4,residual=32",
    "kvplay-int4:keys=token,values=channel,residual=32",
    "kvplay-fp8:sink=7,residual=33", "kvplay-int2:vfit=mse,kfit=mse", "kvplay-int2:sink=4,residual=124,vfit=mse",
    "kvplay-int4:sink=4,residual=60,vfit=mse", "kvplay-int4:residual=0,sink=0", "kvplay-int3:residual=1",
    "kvplay-int2:vgroup=32", "baseline:attention=fused",
    # 8-bit scales and zeros (2 bytes a group), keys and values apart, per token and per channel
    "kvplay-int2:kmeta=8bit,vgroup=64", "kvplay-int4:vmeta=8bit,values=channel,residual=32",
    # kvplay-3bit's 128-token key blocks, with no sink and window so that one leaves the 150-token prompt (its
    # 3-bit keys and 2-bit values: no fragile layers or fitted rotations without a tokenizer)
    "kvplay-3bit:sink=0,residual=0,fragile=0,vfragile=0,rotation=hadamard",
    # the 16-bit reference in preallocated buffers (tests/test_prealloc.py counts what they allocate)
    "baseline:store=prealloc", "baseline:store=prealloc,attention=fused",
    # transformers' QuantizedCache: windows and axes
    "quanto-int4:residual=50", "hqq-int2:group=32,axis_key=0", "hqq-int4:residual=1",
    # llama.cpp's mixed types, 16-bit parts, no rotation; vLLM's prompt scales
    "llamacpp-q4_0:ctk=q8_0,ctv=iq4_nl", "llamacpp-q5_1:ctk=f16", "llamacpp-q4_1:ctv=q8_0,attn_rot=off",
    "vllm-fp8:scales=prompt",
]
HEAD_DIM_64 = "llama-hd64"
GEMMA3 = "gemma3-hd256"
GEMMA3_SPECS = ["baseline", "kvplay-int4", "kvplay-int2", "kvplay-3bit", "kvplay-2.5bit", "kvplay-fp8",
                "llamacpp-q4_0", "llamacpp-q8_0:ctv=q4_0", "vllm-fp8"]
BUNDLED = "bundled"
# Specs that calibrate on text (they need the tokenizer): vLLM's per-head scales, and kvplay's fragile layers
# (4-bit keys in the 2 of the bundled model's 4 layers its ranking finds most fragile, and with vfragile 4-bit values
# in the one its values' ranking puts first; the presets' shares round to none of a tiny model's 2 layers) and
# fitted key rotations (the presets: rotation=calibrated).
CALIBRATED = ["vllm-fp8:scales=head", "kvplay-int2:fragile=0.5,residual=32",
              "kvplay-int2:fragile=0.5,vfragile=0.25,residual=32", "kvplay-3bit:group=32,residual=32",
              "kvplay-2.5bit:residual=32"]

CELLS = ([(HEAD_DIM_64, capped(name)) for name in cache_schemes()]
         + [(HEAD_DIM_64, v) for v in VARIANTS]
         + [(arch, spec) for arch in {**FULL_ATTENTION, **MIXED, **ODD} for spec in per_method(arch)]
         + [(BUNDLED, spec) for spec in CALIBRATED]
         + [(GEMMA3, capped(spec)) for spec in GEMMA3_SPECS])


@pytest.fixture(scope="module")
def gemma3():
    return tiny_gemma3()


@pytest.fixture(scope="module")
def llama_hd64():
    return tiny_llama(head_dim=64)


def counted(cache) -> CacheBytes:
    """Bytes of every layer, transformers' 16-bit sliding-window layers included (the formula counts them too)."""
    return cache_nbytes(cache)


def check_bytes(model, tok, spec) -> None:
    """The matrix's check of one cell (also run by tests/test_methods.py on the CONTRIBUTING.md example method,
    which is registered only inside its test)."""
    spec, shape = parse_spec(spec), Arch.from_config(model.config)
    vocab = min(model.config.get_text_config(decoder=True).vocab_size, TINY_VOCAB)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0

    cache = build_cache(spec, model, tok)
    prefill(model, ids, mask, cache)
    for step in range(NEW):                       # after prefill, then after each decode step
        if step:
            mask = torch.cat([mask, mask.new_ones(BATCH, 1)], dim=-1)
            decode_one_token(model, ids[:, step:step + 1], mask, cache)
        measured = counted(cache)
        assert measured == analytic_nbytes(spec, shape, PROMPT + step, batch=BATCH, prefill=PROMPT), \
            f"at {PROMPT + step} tokens"
    assert (measured.payload > 0) == spec.is_quantized       # tokens really left the 16-bit window

    if spec.method.formula_any_arrival:
        cache, seen = build_cache(spec, model, tok), 0
        chunked = torch.randint(3, vocab, (1, sum(CHUNKS)), generator=gen)
        for chunk in CHUNKS:
            prefill(model, chunked[:, seen:seen + chunk], torch.ones(1, seen + chunk, dtype=torch.long), cache)
            seen += chunk
            assert counted(cache) == analytic_nbytes(spec, shape, seen), f"after a chunk, at {seen}"


@pytest.mark.parametrize("arch, spec", CELLS, ids=[f"{a}-{s}" for a, s in CELLS])
def test_measured_bytes_equal_the_formula(request, arch, spec):
    if arch == BUNDLED:
        model, tok = request.getfixturevalue("bundled")
    else:
        model, tok = (request.getfixturevalue("llama_hd64") if arch == HEAD_DIM_64 else
                      request.getfixturevalue("gemma3") if arch == GEMMA3 else tiny_arch(arch)), None
    check_bytes(model, tok, spec)

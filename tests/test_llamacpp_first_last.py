"""ik_llama.cpp's mixed KV cache on kvplay's llama.cpp emulation (methods/llamacpp.py, first_last=TYPE,
first_last_n=N): which layers take the other type, that they store it, and that the bytes are the formula's.

ik_llama.cpp (#1599, llama_kv_cache_init in src/llama.cpp @ 8337e4cd3861) gives layer i the first type when
i < N and the last type when i >= n_layer - N; a layer in both ranges takes the last type, the same one here.
"""
import pytest
import torch
from conftest import tiny_llama
from fused_helpers import needs_kernel, teacher_forced
from gemma3_tiny import tiny_gemma3
from test_bytes import check_bytes

from kvplay.cache import METHODS, analytic_nbytes, build_cache, cache_nbytes, dequantized_kv, ggml, parse_spec
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.generate import prefill
from kvplay.lab.metrics import relative_error

SPEC = "llamacpp-q4_0:first_last=q8_0"
PROMPT = 60


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(head_dim=64, num_hidden_layers=6)


def filled(spec, model, tokens=PROMPT):
    ids = torch.randint(3, 90, (1, tokens), generator=torch.Generator().manual_seed(2))
    cache = build_cache(spec, model)
    prefill(model, ids, torch.ones_like(ids), cache)
    return cache


def test_the_first_and_last_two_layers_store_the_other_type_and_their_bytes_are_its(llama):
    cache = filled(SPEC, llama)
    kinds = [(layer.store_k.fmt.kind, layer.store_v.fmt.kind) for layer in cache.layers]
    assert kinds == [("q8_0", "q8_0")] * 2 + [("q4_0", "q4_0")] * 2 + [("q8_0", "q8_0")] * 2
    assert "layers 0, 1, 4, 5: K and V q8_0" in cache.description
    # one head (tiny_llama: 1 KV head) of 64 elements: q8_0 two blocks of 2 + 32 bytes, q4_0 two of 2 + 16
    rows = PROMPT * 2                                                      # K and V rows of each layer
    per_layer = [METHODS["llamacpp"].layer_nbytes(layer) for layer in cache.layers]
    assert [(b.payload, b.metadata) for b in per_layer] == [(rows * 64, rows * 4)] * 2 + [(rows * 32, rows * 4)] * 2 \
        + [(rows * 64, rows * 4)] * 2
    assert ggml.row_nbytes("q8_0", 64) == (64, 4) and ggml.row_nbytes("q4_0", 64) == (32, 4)
    assert cache_nbytes(cache) == analytic_nbytes(SPEC, Arch.from_config(llama.config), PROMPT)


def test_the_edges_store_what_q8_0_stores_and_read_back_closer_than_the_middle(llama):
    mixed, q8 = filled(SPEC, llama), filled("llamacpp-q8_0", llama)
    for i in (0, 1):                  # no q4_0 layer before them: the same inputs, so the same q8_0 codes
        for part in ("store_k", "store_v"):
            assert all(torch.equal(a, b) for a, b in zip(getattr(mixed.layers[i], part).used(),
                                                         getattr(q8.layers[i], part).used()))
    base = filled("baseline", llama)
    err = [relative_error(dequantized_kv(layer)[0], b.keys) for layer, b in zip(mixed.layers, base.layers)]
    # measured: layers 0, 1 (q8_0) 0.0056, 0.0076; 2, 3 (q4_0) 0.087, 0.092 (layers 4, 5 are compared with 16-bit
    # states that the middle's rounding has already moved, so their figures mix both)
    assert max(err[0], err[1]) * 5 < min(err[2], err[3]), err


@pytest.mark.parametrize("spec", [SPEC, "llamacpp-q4_0:first_last=q8_0,first_last_n=1",
                                  "llamacpp-q4_0:first_last=f16", "llamacpp-q8_0:ctv=q4_0,first_last=q5_1"])
def test_live_bytes_equal_the_formula_at_every_length(llama, spec):
    check_bytes(llama, None, spec)


def test_edges_that_cover_every_layer_are_the_edge_type_everywhere(llama):
    spec = "llamacpp-q4_0:first_last=q8_0,first_last_n=4"                  # 4 + 4 > 6 layers
    arch = Arch.from_config(llama.config)
    assert analytic_nbytes(spec, arch, 100) == analytic_nbytes("llamacpp-q8_0", arch, 100)
    assert all(layer.ctk == layer.ctv == "q8_0" for layer in build_cache(spec, llama).layers)


def test_first_last_is_refused_where_sliding_layers_hide_which_layers_are_the_edges():
    with pytest.raises(KvplayError, match="sliding ones included.*this model's 5 sliding-window layers 16-bit"):
        build_cache(SPEC, tiny_gemma3())
    assert build_cache("llamacpp-q4_0", tiny_gemma3()) is not None          # without first_last it runs


def test_it_names_ik_llama_cpps_flags_and_claims_no_exact_recipe():
    spec = parse_spec("llamacpp-q4_0:first_last=q8_0,first_last_n=3")
    method = spec.method
    assert str(spec) == "llamacpp-q4_0:first_last=q8_0,first_last_n=3"
    assert method.own_recipe(spec) is None and method.own_recipe(parse_spec("llamacpp-q4_0")) is not None
    assert ("llama-server -m model.gguf -fa on -ctk q4_0 -ctv q4_0 -ctk-first q8_0,3 -ctk-last q8_0,3 "
            "-ctv-first q8_0,3 -ctv-last q8_0,3") in method.snippet(spec)
    assert method.engine_name(spec) == "llama.cpp q4_0, first and last 3 layers q8_0, emulated"
    with pytest.raises(KvplayError, match="first_last=q3_k"):
        parse_spec("llamacpp-q4_0:first_last=q3_k")


@needs_kernel
def test_fused_decode_reads_both_types_and_matches_dequantize_then_attend():
    fused, plain = (tiny_llama(head_dim=64, num_hidden_layers=6) for _ in range(2))
    fused.set_attn_implementation("kvplay")
    cache, logits = teacher_forced(fused, SPEC)
    assert "fused from the ggml codes" in cache.description, cache.description
    _, expected = teacher_forced(plain, SPEC)
    # measured 0.005 (bfloat16 rounding of the kernel's float32 sums against sdpa's), bound 4x
    assert relative_error(logits, expected) < 0.02
    f16_edges = build_cache("llamacpp-q4_0:first_last=f16", fused)
    assert "dequantize then attend (the fused kernel reads quantized ggml types only" in f16_edges.description

"""The caches engines deploy, emulated: llama.cpp's ggml types (kvplay/cache/ggml.py, methods/llamacpp.py),
transformers' fp8 backend (methods/hf_fp8.py) and vLLM's fp8 cache (methods/vllm_fp8.py).

The ggml quantizers are pinned bit for bit against a straightforward transcription of ggml-quants.c's
quantize_row_*_ref and dequantize_row_* (scalar float32 loops below, numpy float32 arithmetic in the C
source's order), on random blocks (ties included) and on blocks checked by hand.
"""
import math

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from kvplay.cache import (
    METHODS,
    CacheBytes,
    analytic_nbytes,
    build_cache,
    cache_nbytes,
    dequantized_kv,
    ggml,
    parse_spec,
    quant,
)
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate, prefill

F = np.float32
KV = [F(v) for v in ggml.KVALUES_IQ4NL]


# ---------------------------------------------------------------------------- ggml's reference, transcribed

def c_roundf(v):
    return math.copysign(math.floor(abs(float(v)) + 0.5), float(v))


def signed_max(xb):
    amax, mx = F(0), F(0)
    for v in xb:
        if amax < abs(v):
            amax, mx = abs(v), v
    return mx


def nibbles(codes):
    return np.array([(codes[j] & 0xF) | ((codes[j + 16] & 0xF) << 4) for j in range(16)], np.uint8)


def high_bits(codes):
    qh = 0
    for j in range(16):
        qh |= ((codes[j] & 0x10) >> 4) << j
        qh |= ((codes[j + 16] & 0x10) >> 4) << (j + 16)
    return np.frombuffer(np.uint32(qh).tobytes(), np.uint8)


def ref_quantize(xb, kind):
    """One 32-element block (np.float32) -> {part: np array}, as quantize_row_<kind>_ref writes it."""
    inv = lambda d: F(F(1) / d) if d else F(0)        # noqa: E731
    if kind == "q8_0":
        amax = F(0)
        for v in xb:
            amax = max(amax, abs(v))
        d = F(amax / F(127))
        return {"d": np.float16(d), "qs": np.array([c_roundf(F(v * inv(d))) for v in xb], np.int8)}
    if kind in ("q4_0", "q5_0"):
        half = F(8 if kind == "q4_0" else 16)
        d = F(signed_max(xb) / -half)
        codes = [min(int(2 * half - 1), int(F(F(v * inv(d)) + F(half + F(0.5))))) for v in xb]
        out = {"d": np.float16(d), "qs": nibbles(codes)}
        return out | ({"qh": high_bits(codes)} if kind == "q5_0" else {})
    if kind in ("q4_1", "q5_1"):
        lo, hi = F(np.finfo(F).max), F(-np.finfo(F).max)
        for v in xb:
            lo, hi = min(lo, v), max(hi, v)
        d = F(F(hi - lo) / F(15 if kind == "q4_1" else 31))
        codes = [int(F(F(F(v - lo) * inv(d)) + F(0.5))) for v in xb]
        if kind == "q4_1":
            codes = [min(15, c) for c in codes]
        out = {"d": np.float16(d), "m": np.float16(lo), "qs": nibbles(codes)}
        return out | ({"qh": high_bits(codes)} if kind == "q5_1" else {})
    assert kind == "iq4_nl"                           # quantize_row_iq4_nl_impl(32, 32, ..., ntry = -1)
    amax, mx = F(0), F(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return {"d": np.float16(0), "qs": np.zeros(16, np.uint8)}
    d = F(mx / F(-127))
    idv = F(F(1) / d)
    sumqx = sumq2 = F(0)
    codes = []
    for v in xb:
        al = F(idv * v)
        if al <= KV[0]:
            idx = 0
        elif al >= KV[15]:
            idx = 15
        else:
            ml, mu = 0, 15
            while mu - ml > 1:
                mav = (ml + mu) // 2
                if al < KV[mav]:
                    mu = mav
                else:
                    ml = mav
            idx = mu - 1 if F(al - KV[mu - 1]) < F(KV[mu] - al) else mu
        codes.append(idx)
        w, q = F(v * v), KV[idx]
        sumqx = F(sumqx + F(F(w * q) * v))
        sumq2 = F(sumq2 + F(F(w * q) * q))
    d = F(sumqx / sumq2) if sumq2 > 0 else F(0)
    return {"d": np.float16(d), "qs": nibbles(codes)}


def ref_dequantize(p, kind):
    """dequantize_row_<kind> of one block -> 32 np.float32."""
    d = F(p["d"])
    if kind == "q8_0":
        return np.array([F(F(q) * d) for q in p["qs"]], F)
    lo = [int(b) & 0xF for b in p["qs"]] + [int(b) >> 4 for b in p["qs"]]
    if kind == "iq4_nl":
        return np.array([F(d * KV[c]) for c in lo], F)
    if "qh" in p:
        qh = int(np.frombuffer(p["qh"].tobytes(), np.uint32)[0])
        lo = [c | (((qh >> j) & 1) << 4) for j, c in enumerate(lo)]
    if "m" in p:
        return np.array([F(F(F(c) * d) + F(p["m"])) for c in lo], F)
    return np.array([F(F(c - (16 if "qh" in p else 8)) * d) for c in lo], F)


def random_blocks(n=48, seed=0):
    """(n, 32) float32: normal blocks, heavy-tailed ones, quarter-step grids (rounding ties) and a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    x[n // 4:n // 2] *= torch.randn(n // 4, 1, generator=g).exp() * 3            # varied scales
    x[n // 2:3 * n // 4] = torch.randint(-16, 17, (n // 4, 32), generator=g) * 0.25   # exact ties
    x[-1] = 0
    x[-2, 5] = 40.0                                                               # one outlier
    return x


QUANTIZED = [k for k in ggml.TYPES if ggml.quantized(k)]


@pytest.mark.parametrize("kind", QUANTIZED)
def test_each_type_quantizes_and_dequantizes_bit_for_bit_as_ggml_reference(kind):
    x = random_blocks()
    parts = dict(zip(ggml.PARTS[kind], ggml.quantize(x.flatten(), kind)))         # one row of 48 blocks
    got = ggml.dequantize(tuple(parts.values()), kind).numpy()
    for b, xb in enumerate(x.numpy()):
        ref = ref_quantize(xb, kind)
        for name, want in ref.items():
            mine = parts[name][b].numpy().reshape(-1)
            assert mine.tobytes() == np.asarray(want).reshape(-1).tobytes(), (kind, b, name)
        assert got[32 * b:32 * (b + 1)].tobytes() == ref_dequantize(ref, kind).tobytes(), (kind, b)


def test_blocks_checked_by_hand():
    ramp = torch.arange(32, dtype=torch.float32) - 16                              # -16 .. 15
    # q4_0: the signed max is -16, d = -16 / -8 = 2, codes = trunc(x / 2 + 8.5) capped at 15
    qs, d = ggml.quantize(ramp, "q4_0")
    # byte 0: x0 = -16 -> 0, x16 = 0 -> 8; byte 1: x1 = -15 -> 1, x17 = 1 -> 9
    assert d.item() == 2.0 and qs[0, 0].item() == 0x80 and qs[0, 1].item() == 0x91
    assert ggml.dequantize((qs, d), "q4_0")[17].item() == 2.0                          # x = 1: 9 - 8 = 1 step of 2
    # q5_0: d = 1, codes = x + 16 = 0..31: the upper half sets bits 16..31 of qh, qs[j] = j | j << 4
    qs, qh, d = ggml.quantize(ramp, "q5_0")
    assert d.item() == 1.0 and qh[0].tolist() == [0, 0, 0xFF, 0xFF] and qs[0, 3].item() == 0x33
    assert torch.equal(ggml.dequantize((qs, qh, d), "q5_0"), ramp)
    # q8_0: d = 127 / 127 = 1; roundf rounds ties away from zero (torch.round would give 2, -2, 0)
    x = torch.zeros(32)
    x[:5] = torch.tensor([127.0, 2.5, -2.5, 0.5, 1.49])
    qs, d = ggml.quantize(x, "q8_0")
    assert d.item() == 1.0 and qs[0, :5].tolist() == [127, 3, -3, 1, 1]
    # q4_1: min 0, max 15 -> d = 1, m = 0, codes = trunc(x + 0.5)
    x = torch.linspace(0, 15, 32)
    qs, d, m = ggml.quantize(x, "q4_1")
    assert (d.item(), m.item()) == (1.0, 0.0) and ggml.dequantize((qs, d, m), "q4_1").tolist() == \
        [math.floor(v + 0.5) for v in x.tolist()]
    # iq4_nl: the table itself times 0.01: max -1.27 -> d0 = 0.01, every code its own index, d refit to ~0.01
    x = torch.tensor([ggml.KVALUES_IQ4NL[j % 16] * 0.01 for j in range(32)])
    qs, d = ggml.quantize(x, "iq4_nl")
    assert qs[0].tolist() == [j | j << 4 for j in range(16)]
    assert d.item() == pytest.approx(0.01, rel=1e-3)               # float16(0.01) = 0.010002


def test_bits_per_element_are_ggml_type_sizes_exactly():
    arch = Arch("a", layers=3, kv_heads=2, head_dim=64)
    want = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5, "f16": 16.0}
    for kind, bits in want.items():
        spec = parse_spec(f"llamacpp-q4_0:ctk={kind},ctv={kind}")
        nbytes = analytic_nbytes(spec, arch, 100)
        assert nbytes.total * 8 == bits * arch.elements_per_token * 100, kind
        assert ggml.bits_per_element(kind) == bits
    mixed = analytic_nbytes("llamacpp-q4_0:ctk=q8_0,ctv=q4_0", arch, 10)        # keys 8.5 bits, values 4.5
    assert mixed.total * 8 == (8.5 + 4.5) / 2 * arch.elements_per_token * 10
    assert mixed.metadata == 2 * 3 * 2 * 10 * (64 // 32) * 2                      # one fp16 d per block, K and V


# ---------------------------------------------------------------------------- rotation

def test_walsh_hadamard_is_ggmls_matrix_and_the_sizes_follow_llama_cpp():
    for n in (64, 128):
        h = ggml.walsh_hadamard(n)
        assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(n), atol=3e-7, rtol=0)   # measured 6.0e-8
        assert torch.equal(h, quant.hadamard(n))                    # Sylvester's order: the same matrix
    assert [ggml.rotation_size(d, "k") for d in (64, 128, 192, 256, 96)] == [64, 128, 64, 256, None]
    assert [ggml.rotation_size(d, "v") for d in (64, 128, 256)] == [64, 64, 64]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))


def test_rotation_default_and_off(model, ids):
    def layer(spec):
        cache = build_cache(spec, model)
        prefill(model, ids, torch.ones_like(ids), cache)
        return cache.layers[0]

    on = layer("llamacpp-q4_0")
    assert torch.equal(on.rot_k, ggml.rotation(64, 64)) and torch.equal(on.rot_v, ggml.rotation(64, 64))
    assert layer("llamacpp-q4_0:attn_rot=off").rot_k is None
    f16_keys = layer("llamacpp-q4_0:ctk=f16")
    assert f16_keys.rot_k is None and f16_keys.rot_v is not None                 # only a quantized part rotates


def test_rotation_spreads_an_outlier_channel():
    """Keys with one channel 20x the rest: rotated q4_0 loses far less than unrotated (measured 0.059 vs 0.160)."""
    from kvplay.cache.methods.llamacpp import LlamaCppLayer

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 64, 64, generator=g)
    keys[..., 7] *= 20
    errors = {}
    for rot in ("auto", "off"):
        layer = LlamaCppLayer(parse_spec(f"llamacpp-q4_0:attn_rot={rot}"))
        k, _ = layer.update(keys, keys)
        errors[rot] = ((k - keys).norm() / keys.norm()).item()
    assert errors["auto"] < errors["off"] / 2, errors


# ---------------------------------------------------------------------------- the cache

def test_every_token_is_stored_on_arrival_with_no_16_bit_window(model, ids):
    from kvplay.cache.methods.llamacpp import LlamaCppLayer

    exact = build_cache("baseline", model)
    prefill(model, ids, torch.ones_like(ids), exact)
    cache = build_cache("llamacpp-q4_1:ctv=q8_0,attn_rot=off", model)
    prefill(model, ids, torch.ones_like(ids), cache)
    assert cache_nbytes(cache).full_precision == 0
    assert all(isinstance(layer, LlamaCppLayer) for layer in cache.layers)
    for layer, ref in zip(cache.layers[:1], exact.layers):          # layer 0: the same input as the 16-bit run
        k, v = dequantized_kv(layer)
        want_k = ggml.dequantize(ggml.quantize(ref.keys.float(), "q4_1"), "q4_1").to(k.dtype)
        want_v = ggml.dequantize(ggml.quantize(ref.values.float(), "q8_0"), "q8_0").to(v.dtype)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)                  # the newest token too


def test_head_dim_not_a_multiple_of_32_is_refused_in_one_sentence():
    cfg = tiny_llama(head_dim=48).config
    with pytest.raises(KvplayError, match="multiple of 32"):
        parse_spec("llamacpp-q4_0").method.check_model(parse_spec("llamacpp-q4_0"), cfg)
    parse_spec("llamacpp-q4_0:ctk=f16,ctv=f16").method.check_model(parse_spec("llamacpp-q4_0:ctk=f16,ctv=f16"), cfg)


# ---------------------------------------------------------------------------- fp8: transformers and vLLM

def test_hf_fp8_scale_is_the_prompts_absmax_and_stays(model, ids):
    cache = build_cache("hf-fp8", model)
    generate(model, ids, cache, 3, keep_logits=False)
    exact = build_cache("baseline", model)
    prefill(model, ids, torch.ones_like(ids), exact)
    for layer, ref in zip(cache.layers, exact.layers):
        assert layer._quantized_keys[1].item() == (ref.keys.abs().amax().float() / 448).item()
        assert layer._quantized_keys[0].shape[-2] == 40 + 2                        # prompt plus two decode tokens
    assert cache_nbytes(cache).metadata == 2 * 2 * 4                               # float32 K and V scale, 2 layers


def test_vllm_unit_and_prompt_scales(model, ids):
    exact = build_cache("baseline", model)
    prefill(model, ids, torch.ones_like(ids), exact)
    unit = build_cache("vllm-fp8", model)
    prompt = build_cache("vllm-fp8:scales=prompt", model)
    for cache in (unit, prompt):
        prefill(model, ids, torch.ones_like(ids), cache)
    for u, p, ref in zip(unit.layers[:1], prompt.layers, exact.layers):   # layer 0 sees the 16-bit run's input
        k, _ = dequantized_kv(u)
        assert torch.equal(k, ref.keys.float().to(torch.float8_e4m3fn).float().to(k.dtype))   # scale 1.0
        assert p.scales[0].item() == (ref.keys.float().abs().amax() / 200).item()
        assert p.scales[1].item() == (ref.values.float().abs().amax() / 100).item()


def test_vllm_per_head_scales_are_calibrated_on_the_text(bundled):
    from kvplay.cache.fragile import calibration_ids

    model, tok = bundled
    arch = Arch.from_config(model.config)
    head = build_cache("vllm-fp8:scales=head", model, tok)
    tensor = build_cache("vllm-fp8:scales=tensor", model, tok)
    ref = build_cache("baseline", model)
    with torch.no_grad():
        model(calibration_ids(tok), past_key_values=ref, use_cache=True)
    for h, t, r in zip(head.layers, tensor.layers, ref.layers):
        want = r.keys.float().abs().amax(dim=(0, 2, 3)) / 448                        # (H,)
        assert torch.equal(h.scales[0], want) and t.scales[0].item() == want.max().item()
    ids = tok("ROMEO:\n", return_tensors="pt").input_ids
    generate(model, ids, head, 2, keep_logits=False)
    n = ids.shape[1] + 1
    # one float32 scale per layer, K or V and head; one fp8 byte per element (against the formula: test_bytes.py)
    assert cache_nbytes(head) == CacheBytes(arch.elements_per_token * n, 2 * arch.layers * arch.kv_heads * 4, 0)
    with pytest.raises(KvplayError, match="needs the tokenizer"):
        build_cache("vllm-fp8:scales=head", tiny_llama(head_dim=64))


def test_the_methods_declare_where_people_meet_them():
    assert METHODS["llamacpp"].family == "llama.cpp / Ollama / LM Studio"
    assert METHODS["vllm"].family == "vLLM"
    assert METHODS["hf-fp8"].family == METHODS["quanto"].family == METHODS["hqq"].family == "transformers"

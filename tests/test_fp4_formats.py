"""The fp4 KV caches engines deploy, emulated: vLLM's NVFP4 (methods/vllm_nvfp4.py) and SGLang's block-16 FP4
(methods/sglang_fp4.py), with their shared e2m1 rounding (kvplay/cache/fp4.py).

Both are pinned bit for bit against the engines' own pure-PyTorch code, copied below under its Apache-2.0 licence:
vLLM's ref_nvfp4_quant and cast_to_fp4 (vllm-project/vllm
vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py at 055e47c28003) with the read side of
dequant_nvfp4_kv_cache and break_fp4_bytes (tests/kernels/quantization/nvfp4_utils.py at 0d6c41a2b01e), and
SGLang's FP4MXBlock16KVQuantizeUtil (sgl-project/sglang python/sglang/srt/layers/quantization/kvfp4_tensor.py at
0dae407b3cee, run eagerly, without its torch.compile). nvfp4_4over6 exists only as a CUDA kernel, so it is checked
against a scalar float32 transcription of its lines (nvfp4_candidate_scale, nvfp4_reconstruction_error,
cvt_warp_fp16_to_fp4_4over6 in csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu) and on blocks
worked by hand.
"""
import numpy as np
import pytest
import torch
from conftest import tiny_llama

from kvplay.cache import CacheBytes, analytic_nbytes, build_cache, cache_nbytes, dequantized_kv, fp4, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.methods.sglang_fp4 import mx16_dequantize, mx16_quantize
from kvplay.cache.methods.vllm_nvfp4 import nvfp4_dequantize, nvfp4_quantize
from kvplay.errors import KvplayError
from kvplay.lab.generate import decode_one_token, generate, prefill
from kvplay.lab.metrics import relative_error

# ---------------------------------------------------------------------------- vLLM's reference, copied
# SPDX-License-Identifier: Apache-2.0; Copyright contributors to the vLLM project.

FLOAT4_E2M1_MAX = 6.0
FLOAT4_E2M1_MAX_RECIPROCAL = 1 / FLOAT4_E2M1_MAX
kE2M1ToFloat = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def get_reciprocal(x):
    if isinstance(x, torch.Tensor):
        return 1.0 / (x + (x == 0) * 1e8)
    return 0.0 if x == 0 else 1.0 / x


def cast_to_fp4(x):
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def ref_nvfp4_quant(x, global_scale, block_size):
    assert global_scale.dtype == torch.float32
    assert x.ndim == 2
    m, n = x.shape
    x = torch.reshape(x, (m, n // block_size, block_size))
    vec_max = torch.max(torch.abs(x), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * FLOAT4_E2M1_MAX_RECIPROCAL)
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = get_reciprocal(scale * get_reciprocal(global_scale))

    scaled_x = x.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    # both outputs are float32
    return cast_to_fp4(clipped_x), scale.squeeze(-1)


def break_fp4_bytes(a, dtype):
    assert a.dtype == torch.uint8
    m, n = a.shape
    a_flat = a.flatten()
    high = (a_flat & 0xF0) >> 4  # Upper nibbles
    low = a_flat & 0x0F  # Lower nibbles
    combined = torch.stack((low, high), dim=1).flatten()
    signs = (combined & 0x08).to(torch.bool)  # Sign bits
    abs_vals = (combined & 0x07).to(torch.long)  # Magnitude indices
    values = kE2M1ToFloat[abs_vals] * torch.where(signs, -1.0, 1.0)
    return values.reshape(m, n * 2).to(dtype=dtype)


def ref_dequant_nvfp4_kv(fp4_packed, sf_linear, global_scale, head_size):
    """dequant_nvfp4_kv_cache's lines after its unswizzle (kvplay keeps the scales linear)."""
    shape = fp4_packed.shape
    fp4_vals = break_fp4_bytes(fp4_packed.reshape(-1, head_size // 2), torch.float32)
    fp4_vals = fp4_vals.reshape(*shape[:-1], head_size)
    sf_f32 = sf_linear.view(torch.float8_e4m3fn).to(torch.float32)
    return (fp4_vals.reshape(*shape[:-1], head_size // 16, 16)
            * (sf_f32 * global_scale).unsqueeze(-1)).reshape(*shape[:-1], head_size)


# ---------------------------------------------------------------------------- SGLang's reference, copied
# Copyright 2025 SGLang Team; Licensed under the Apache License, Version 2.0.

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def sglang_batched_quantize(tensor):
    b, m, n = tensor.shape
    reshaped = tensor.view(b, m * n // 16, 16)
    block_max = reshaped.abs().max(dim=-1, keepdim=True).values
    scale_exp = torch.ceil(torch.log2(torch.clamp(block_max / E2M1_MAX, min=1e-10)))
    scale_factors = (scale_exp + 127).squeeze(-1).to(torch.uint8)
    scaled = reshaped / torch.exp2(scale_exp)
    sign_bits = (scaled < 0).to(torch.uint8) << 3
    abs_vals = scaled.abs()
    bounds = tensor.new_tensor(E2M1_BOUNDS, dtype=torch.float32)
    magnitude_bits = torch.sum(abs_vals.unsqueeze(-1) >= bounds, dim=-1)
    fp4_vals = sign_bits + magnitude_bits.to(torch.uint8)
    fp4_reshaped = fp4_vals.view(b, m, n)
    packed = (fp4_reshaped[..., 1::2] << 4) + fp4_reshaped[..., 0::2]
    return packed, scale_factors


def sglang_batched_dequantize(quant_tensor, scale_factors, dtype=torch.bfloat16):
    b, m, n_half = quant_tensor.shape
    n = n_half * 2
    fp4_vals = torch.empty(b, m, n, dtype=torch.uint8, device=quant_tensor.device)
    fp4_vals[..., 0::2] = quant_tensor & 0x0F
    fp4_vals[..., 1::2] = (quant_tensor >> 4) & 0x0F
    values = quant_tensor.new_tensor(E2M1_VALUES, dtype=torch.float32)
    float_vals = values[fp4_vals.long()]
    reshaped = float_vals.view(b, m * n // 16, 16)
    scale_exp = scale_factors.float() - 127
    scaled = reshaped * torch.exp2(scale_exp.unsqueeze(-1))
    return scaled.view(b, m, n).to(dtype)


# ---------------------------------------------------------------------------- inputs

# Every midpoint of E2M1, both signs, with 6 so that a block's scale is exactly 1: the ties a rounding rule decides.
TIES = [6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5.0, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25, 0.0]


def kv_like(tokens=64, heads=3, head_dim=64, seed=0) -> torch.Tensor:
    """(tokens, heads, head_dim) bfloat16 values as a model hands them over, float32: normal ones at several
    magnitudes (0.01 to 300), one outlier channel, head 1 all zero every 7th token, and the tie block (scaled by
    powers of two) in the last head of token 3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    x = x * torch.logspace(-2, 2.5, tokens).view(-1, 1, 1)
    x[:, 0, 5] *= 40.0
    x[::7, 1] = 0.0
    for i in range(0, head_dim, 16):
        x[3, -1, i:i + 16] = torch.tensor(TIES) * 2.0 ** (i // 16 - 2)
    return x.to(torch.bfloat16).float()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------- the shared e2m1 rounding

def test_e2m1_ties_go_to_the_even_code_in_vllm_and_away_from_zero_in_sglang():
    x = torch.tensor(TIES)
    assert fp4.e2m1_values(fp4.e2m1_codes(x, "even")).tolist() == \
        [6, 4, 4, 2, 2, 1, 1, 0, -4, -4, -2, -2, -1, -1, -0.0, 0]
    assert fp4.e2m1_values(fp4.e2m1_codes(x, "up")).tolist() == \
        [6, 6, 4, 3, 2, 1.5, 1, 0.5, -6, -4, -3, -2, -1.5, -1, -0.5, 0]
    assert fp4.e2m1_values(fp4.e2m1_codes(torch.tensor([7.0, -100.0]))).tolist() == [6.0, -6.0]   # saturates
    codes = fp4.e2m1_codes(x)
    assert torch.equal(fp4.unpack(fp4.pack(codes)), codes)
    assert fp4.pack(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21          # element 0 in the low nibble


def test_e2m1_even_rounding_is_vllms_cast_to_fp4_on_every_float_near_a_threshold():
    grid = torch.cat([torch.linspace(0, 7, 70001), torch.tensor(fp4.MIDPOINTS)])
    near = torch.cat([grid, torch.nextafter(grid, torch.tensor(9.0)), torch.nextafter(grid, torch.tensor(-1.0))])
    near = torch.cat([near, -near])
    assert torch.equal(fp4.e2m1_values(fp4.e2m1_codes(near.clamp(-6, 6))), cast_to_fp4(near.clamp(-6, 6).clone()))


# ---------------------------------------------------------------------------- vLLM nvfp4, bit for bit

@pytest.mark.parametrize("k_scale", [1.0, "calibrated", 0.37])
def test_vllm_nvfp4_matches_ref_nvfp4_quant_and_its_kv_read_bit_for_bit(k_scale):
    x = kv_like()
    k = torch.tensor(float(x.abs().amax()) / (448 * 6) if k_scale == "calibrated" else k_scale)
    packed, sf = nvfp4_quantize(x, k)
    ref_codes, ref_sf = ref_nvfp4_quant(x.reshape(-1, 64), (1.0 / k).float(), 16)
    assert torch.equal(fp4.e2m1_values(fp4.unpack(packed)).reshape(-1, 64), ref_codes)
    assert torch.equal(sf.float().reshape(ref_sf.shape), ref_sf)
    assert torch.equal(break_fp4_bytes(packed.reshape(-1, 32), torch.float32), ref_codes)   # vLLM's nibble order
    assert torch.equal(nvfp4_dequantize(packed, sf, k), ref_dequant_nvfp4_kv(packed, sf.view(torch.uint8), k, 64))


def test_vllm_nvfp4_by_hand_ties_round_to_even_and_a_tiny_block_flushes_to_zero():
    block = torch.tensor(TIES).view(1, 16)
    packed, sf = nvfp4_quantize(block, torch.tensor(1.0))
    assert sf.float().item() == 1.0                     # e4m3(6 * fl(1/6)) = 1: the values are their own codes
    assert nvfp4_dequantize(packed, sf, torch.tensor(1.0)).tolist() == [[6, 4, 4, 2, 2, 1, 1, 0, -4, -4, -2, -2,
                                                                          -1, -1, 0, 0]]
    tiny = torch.full((1, 16), 0.005)                   # max/6 = 8.3e-4 < half of e4m3's least subnormal 2**-9
    packed, sf = nvfp4_quantize(tiny, torch.tensor(1.0))
    assert sf.float().item() == 0 and not nvfp4_dequantize(packed, sf, torch.tensor(1.0)).any()


# ---------------------------------------------------------------------------- vLLM nvfp4_4over6

def transcribed_4over6(block: np.ndarray, k_scale: float) -> tuple[float, list[float]]:
    """cvt_warp_fp16_to_fp4_4over6 for one block, scalar float32, exact reciprocals: (stored scale, codes' values)."""
    f = np.float32
    e4m3 = lambda v: f(torch.tensor(float(v)).clamp(max=448).to(torch.float8_e4m3fn).float().item())  # noqa: E731
    rcp = lambda v: f(f(1) / f(v))                                                                 # noqa: E731
    q = lambda v: f(fp4.e2m1_values(fp4.e2m1_codes(torch.tensor([float(v)]))).item())          # noqa: E731
    sf_scale = f(f(1) / f(k_scale))
    vmax = f(np.abs(block).max())
    cands = []
    for denominator in (6, 4):
        sf = e4m3(sf_scale * (vmax * rcp(denominator)))
        out = rcp(sf * rcp(sf_scale)) if sf != 0 else f(0)
        rebuild = rcp(out) if out != 0 else f(0)
        err = f(0)
        for i in range(0, 16, 2):
            dx, dy = f(q(block[i] * out) * rebuild - block[i]), f(q(block[i + 1] * out) * rebuild - block[i + 1])
            err = f(err + f(f(dx * dx) + f(dy * dy)))
        cands.append((sf, out, err))
    (sf6, out6, err6), (sf4, out4, err4) = cands
    sf, out = (sf4, out4) if err4 < err6 else (sf6, out6)
    return float(sf), [float(q(f(min(max(f(v * out), -6), 6)))) for v in block]


def test_vllm_nvfp4_4over6_matches_the_transcribed_kernel_on_random_blocks():
    x = kv_like(tokens=16, heads=2)
    for k_scale in (1.0, float(x.abs().amax()) / (448 * 6)):
        k = torch.tensor(k_scale)
        packed, sf = nvfp4_quantize(x, k, "4over6")
        values, scales = fp4.blocks(fp4.e2m1_values(fp4.unpack(packed))), sf.float()
        picked4 = 0
        for index in np.ndindex(*scales.shape):
            want_sf, want = transcribed_4over6(fp4.blocks(x)[index].numpy(), k_scale)
            assert scales[index].item() == want_sf and values[index].tolist() == want, index
            picked4 += want_sf != nvfp4_quantize(fp4.blocks(x)[index], k)[1].float().item()
        assert 0 < picked4 < scales.numel()     # both choices occur: 42 of 128 blocks took max/4 at k_scale 1.0, 52
                                                # at the calibrated one


def test_vllm_nvfp4_4over6_by_hand_max4_wins_only_where_it_rebuilds_better():
    one = torch.ones(1, 16)
    packed, sf = nvfp4_quantize(one, torch.tensor(1.0))            # max/6: e4m3(1/6) = 0.171875, 1 -> 6 -> 1.03125
    assert sf.float().item() == 0.171875 and nvfp4_dequantize(packed, sf, torch.tensor(1.0))[0, 0].item() == 1.03125
    packed, sf = nvfp4_quantize(one, torch.tensor(1.0), "4over6")  # max/4: 0.25, 1 -> 4 -> 1 exactly
    assert sf.float().item() == 0.25 and torch.equal(nvfp4_dequantize(packed, sf, torch.tensor(1.0)), one)
    tie = torch.tensor([6.0, 3.0] + [0.0] * 14).view(1, 16)         # both rebuild it exactly: the tie keeps max/6
    assert nvfp4_quantize(tie, torch.tensor(1.0), "4over6")[1].float().item() == 1.0


def test_vllm_nvfp4_4over6_errs_less_than_nvfp4_overall():
    x = kv_like(seed=3)
    k = torch.tensor(float(x.abs().amax()) / (448 * 6))     # calibrated: at 1.0 blocks past 2688 saturate
    errs = {s: relative_error(nvfp4_dequantize(*nvfp4_quantize(x, k, s), k), x) for s in ("max6", "4over6")}
    assert errs["4over6"] < errs["max6"] < 0.2               # measured 0.0684 and 0.0717


# ---------------------------------------------------------------------------- SGLang fp4, bit for bit

@pytest.mark.parametrize("seed", [0, 1])
def test_sglang_fp4_matches_its_batched_quantize_and_dequantize_bit_for_bit(seed):
    x = kv_like(seed=seed)
    packed, exponents = mx16_quantize(x)
    ref_packed, ref_scales = sglang_batched_quantize(x)
    assert torch.equal(packed, ref_packed) and torch.equal(exponents.reshape(ref_scales.shape), ref_scales)
    assert torch.equal(mx16_dequantize(packed, exponents), sglang_batched_dequantize(packed, ref_scales, torch.float32))


def test_sglang_fp4_by_hand_ties_round_away_from_zero_and_a_zero_block_takes_2_to_the_minus_33():
    block = torch.tensor(TIES).view(1, 16)
    packed, e = mx16_quantize(block)
    assert e.item() == 127                                    # ceil(log2(6 / 6)) = 0
    assert mx16_dequantize(packed, e).tolist() == [[6, 6, 4, 3, 2, 1.5, 1, 0.5, -6, -4, -3, -2, -1.5, -1, -0.5, 0]]
    _, e = mx16_quantize(torch.full((1, 16), 6.01))          # just past a power of two: the next exponent
    assert e.item() == 128
    _, e = mx16_quantize(torch.zeros(1, 16))
    assert e.item() == 127 - 33


# ---------------------------------------------------------------------------- the caches in a model

@pytest.mark.parametrize("name", ["vllm-nvfp4", "vllm-nvfp4-4over6", "sglang-fp4"])
def test_live_bytes_equal_the_formula_and_count_4_5_bits_an_element(model, ids, name):
    cache = build_cache(name, model)
    trace = generate(model, ids, cache, 5, keep_logits=False)
    assert trace.tokens.shape == (1, 5)
    arch, tokens = Arch.from_config(model.config), ids.shape[1] + 4
    measured = cache_nbytes(cache)
    assert measured == analytic_nbytes(parse_spec(name), arch, tokens)
    rows = 2 * arch.layers * arch.kv_heads * tokens                     # K and V rows of 64 values: 32 + 4 bytes
    globals_ = 2 * arch.layers * 4 if name.startswith("vllm") else 0    # vLLM's float32 k_scale and v_scale
    assert measured == CacheBytes(payload=rows * 32, metadata=rows * 4 + globals_)
    fp8 = analytic_nbytes(parse_spec("vllm-fp8"), arch, 4096)
    assert fp8.payload / analytic_nbytes(parse_spec("sglang-fp4"), arch, 4096).total == pytest.approx(16 / 9)


def test_vllm_nvfp4_prefill_attends_to_what_it_stored(model, ids):
    exact = build_cache("baseline", model)
    want = prefill(model, ids, torch.ones_like(ids), exact)
    cache = build_cache("vllm-nvfp4", model)
    got = prefill(model, ids, torch.ones_like(ids), cache)
    k, v = dequantized_kv(cache.layers[0])                              # layer 0 sees the 16-bit run's input
    ref = exact.layers[0]
    for stored, orig in ((k, ref.keys), (v, ref.values)):
        one = torch.tensor(1.0)
        assert torch.equal(stored, nvfp4_dequantize(*nvfp4_quantize(orig.float(), one), one).to(stored.dtype))
    assert not torch.equal(got, want)                                  # the prefill already read fp4


def test_sglang_fp4_prefill_attends_in_16_bit_and_decode_reads_the_cache(model, ids):
    exact = build_cache("baseline", model)
    want = prefill(model, ids, torch.ones_like(ids), exact)
    cache = build_cache("sglang-fp4", model)
    assert torch.equal(prefill(model, ids, torch.ones_like(ids), cache), want)   # SGLang's extend: 16-bit k, v
    layer, n = cache.layers[0], ids.shape[1]
    k = torch.randn(1, 1, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        chunk, _ = layer.update(k, k)                                   # a chunk: the prefix dequantized, k as is
        assert torch.equal(chunk[:, :, :n], dequantized_kv(layer)[0][:, :, :n]) and torch.equal(chunk[:, :, n:], k)
        step, _ = layer.update(k[:, :, :1], k[:, :, :1])               # a decode step: the whole cache, read back
    assert torch.equal(step, dequantized_kv(layer)[0]) and not torch.equal(step[:, :, -1:], k[:, :, :1])
    mask = torch.ones(1, n + 5, dtype=torch.long)
    assert decode_one_token(model, ids[:, :1], mask, build_cache("sglang-fp4", model)).isfinite().all()


def test_vllm_nvfp4_tensor_scales_are_max_over_448_times_6_on_the_calibration_text(bundled):
    from kvplay.cache.fragile import calibration_ids

    model, tok = bundled
    cache = build_cache("vllm-nvfp4:scales=tensor", model, tok)
    ref = build_cache("baseline", model)
    with torch.no_grad():
        model(calibration_ids(tok), past_key_values=ref, use_cache=True)
    generate(model, tok("ROMEO:\n", return_tensors="pt").input_ids, cache, 2, keep_logits=False)
    for layer, r in zip(cache.layers, ref.layers):
        assert layer.scales[0].item() == (r.keys.float().abs().amax() / (448 * 6)).item()
        assert layer.scales[1].item() == (r.values.float().abs().amax() / (448 * 6)).item()
    with pytest.raises(KvplayError, match="needs the tokenizer"):
        build_cache("vllm-nvfp4:scales=tensor", tiny_llama(head_dim=64))


@pytest.mark.parametrize("name", ["vllm-nvfp4", "sglang-fp4"])
def test_a_head_dim_that_is_not_a_multiple_of_16_is_refused_in_one_sentence(name):
    spec = parse_spec(name)
    with pytest.raises(KvplayError, match=r"multiple of 16.*this model's is 40; pick vllm-fp8 or kvplay-int4\.$"):
        spec.method.check_model(spec, tiny_llama(head_dim=40).config)
    spec.method.check_model(spec, tiny_llama(head_dim=48).config)


def test_the_methods_name_their_engines_flags_and_hardware():
    nv, nv46, sg = (parse_spec(s) for s in ("vllm-nvfp4", "vllm-nvfp4-4over6:scales=tensor", "sglang-fp4"))
    assert nv.method.own_recipe(nv)[0] == "vLLM" and "--kv-cache-dtype nvfp4 " in nv.method.own_recipe(nv)[1]
    assert "--kv-cache-dtype nvfp4_4over6 with per-layer" in nv46.method.own_recipe(nv46)[1]
    assert "SM100" in nv.method.description and "SM100" in nv.method.own_recipe(nv)[1]
    assert sg.method.own_recipe(sg) == ("SGLang", "--kv-cache-dtype fp4_mx_block16 (fp4_e2m1 before SGLang renamed "
                                                  "it) with --attention-backend triton")
    assert nv.method.family == "vLLM" and sg.method.family == "SGLang" and sg.method.shares_prefill
    assert nv.method.engine_name(nv46) == "vLLM nvfp4_4over6 (tensor scales), emulated"

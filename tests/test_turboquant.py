"""vLLM's TurboQuant KV caches (kvplay/cache/methods/vllm_turboquant.py) against vLLM's own arithmetic.

vLLM's store and read paths are Triton kernels (vllm/v1/attention/ops/triton_turboquant_store.py @ 0135d081,
triton_turboquant_decode.py @ 055e47c2): transcribed below, element by element in float32 numpy, from the cited
lines (re-derived, not copied: _store_quantized_value, the binary-search bucketize and 3/4-bit index packing of
_tq_fused_store_mse, the fp16 norm, scale and zero bytes, and _tq_full_dequant_kv's read), and the emulation is
pinned to them bit for bit on random rows with planted ties, and on blocks worked by hand. The PyTorch parts of
the launcher (the float32 norm, the division and the GEMM with the Hadamard matrix) are the same torch calls in
both. vLLM's Lloyd-Max centroids are checked against Max's published table (J. Max, "Quantizing for minimum
distortion", IRE Trans. Inf. Theory, 1960, Table I) scaled by 1/sqrt(d); the layouts' byte counts against the
expected sizes of vLLM's tests/quantization/test_turboquant.py (PRESET_EXPECTED, head_dim 128).
"""
import math

import numpy as np
import pytest
import torch
from conftest import tiny_arch, tiny_llama
from gemma3_tiny import tiny_gemma3
from test_bytes import check_bytes

from kvplay.cache import METHODS, analytic_nbytes, bits_per_element, build_cache, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.methods.vllm_turboquant import (
    PRESETS,
    BoundaryLayer,
    TurboQuantLayer,
    bucket,
    centroids,
    fp8_keys,
    hadamard,
    key_quantize,
    key_rotated,
    midpoints,
    value_dequantize,
    value_quantize,
)
from kvplay.errors import KvplayError

F = np.float32
NAMES = list(PRESETS)


# ---------------------------------------------------------------------------- the kernels, transcribed

def kernel_pack(codes, bits):
    """_tq_fused_store_mse / _store_quantized_value: 4-bit pairs (even element low), 3-bit groups of 8 in 24 bits."""
    out = []
    if bits == 4:
        for j in range(0, len(codes), 2):
            out.append((codes[j] & 0xF) | ((codes[j + 1] & 0xF) << 4))
        return out
    for g in range(0, len(codes), 8):
        word = sum((codes[g + i] & 0x7) << (3 * i) for i in range(8))
        out += [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    return out


def kernel_unpack(data, bits, d):
    """The read kernels' gather: a 16-bit window at byte (d * bits) // 8, shifted by (d * bits) % 8."""
    data = list(data) + [0]
    out = []
    for i in range(d):
        off = i * bits
        raw16 = data[off // 8] | (data[off // 8 + 1] << 8)
        out.append((raw16 >> (off % 8)) & ((1 << bits) - 1))
    return out


def kernel_value_store(row, bits):
    """One value row (float32) -> (bytes, float16 scale, float16 zero)."""
    row = [F(x) for x in row]
    lo, hi, top = min(row), max(row), (1 << bits) - 1
    scale = F(F(hi - lo) / F(top))
    scale = scale if scale > F(1e-8) else F(1e-8)
    codes = [min(max(int(F(F(x - lo) / scale) + F(0.5)), 0), top) for x in row]
    return kernel_pack(codes, bits), np.float16(scale), np.float16(lo)


def kernel_value_read(data, scale16, zero16, bits, d):
    return [F(c) * F(scale16) + F(zero16) for c in kernel_unpack(data, bits, d)]


def kernel_bucketize(y, mids):
    """The store's binary search over the sorted midpoints, MSE_BITS rounds, y >= mid moving right."""
    n = len(mids) + 1
    out = []
    for v in y:
        lo, hi = 0, n - 1
        for _ in range(int(math.log2(n))):
            mid = (lo + hi) >> 1
            m = mids[min(mid, n - 2)]
            lo, hi = (mid + 1, hi) if F(v) >= m else (lo, mid)
        out.append(min(lo, n - 1))
    return out


def kernel_key_read(codes, norm16, cents, correct):
    c = [F(cents[i]) for i in codes]
    if correct:
        sq = F(0)
        for x in c:
            sq = F(sq + F(x * x))
        inv = F(F(1) / F(np.sqrt(F(sq + F(1e-16)))))
        c = [F(x * inv) for x in c]
    return [F(F(norm16) * x) for x in c]


def random_rows(n, d, seed, spread=3.0):
    """bfloat16-representable rows (as a model hands them over), float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen) * spread).to(torch.bfloat16).float()


# ---------------------------------------------------------------------------- the arithmetic

@pytest.mark.parametrize("bits", [3, 4])
def test_values_match_the_store_and_read_kernels_bit_for_bit(bits):
    rows = random_rows(64, 64, seed=bits)
    rows[0] = torch.arange(64).float() * 0.25 - 8.0       # a row whose codes all sit on ties: (v - min) / s = k
    rows[1, :] = 1.5                                      # a constant row: the 1e-8 scale floor
    packed, scale, zero = value_quantize(rows, bits)
    read = value_dequantize(packed, scale, zero, bits)
    for r in range(len(rows)):
        data, s16, z16 = kernel_value_store(rows[r].tolist(), bits)
        assert packed[r].tolist() == data
        assert scale[r].view(torch.int16).item() == np.array(s16).view(np.int16)
        assert zero[r].view(torch.int16).item() == np.array(z16).view(np.int16)
        assert read[r].numpy().tobytes() == np.array(kernel_value_read(data, s16, z16, bits, 64), F).tobytes()


def test_values_on_blocks_worked_by_hand():
    v = torch.arange(16).float() * 0.25                   # min 0, max 3.75: scale 0.25, codes 0..15
    packed, scale, zero = value_quantize(v, 4)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert (scale.item(), zero.item()) == (0.25, 0.0)
    # min -1, max 0.875, scale 0.125; -1 + 0.125 k + 0.0625 sits half way: + 0.5 then truncation rounds it up
    ties = torch.tensor([-1.0] + [-1 + 0.125 * k + 0.0625 for k in range(14)] + [0.875])
    codes = value_dequantize(*value_quantize(ties, 4), 4)
    assert ((codes + 1) / 0.125).tolist() == [0.0] + [k + 1.0 for k in range(14)] + [15.0]
    v3 = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7] * 2)    # 3-bit codes 0..7: 0o76543210 = 0xFAC688, little-endian
    packed, scale, _ = value_quantize(v3, 3)
    assert packed.tolist() == [0x88, 0xC6, 0xFA] * 2 and scale.item() == 1.0


@pytest.mark.parametrize("bits", [3, 4])
def test_keys_match_the_store_kernel_bit_for_bit(bits):
    d = 64
    rows = random_rows(64, d, seed=10 + bits)
    norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)      # the launcher's torch calls, as written
    y = (rows / (norm + 1e-8)) @ hadamard(d)
    mids = midpoints(centroids(d, bits))
    y[0, :len(mids)] = mids                                          # planted ties: y == a midpoint goes up
    y[1, :len(mids)] = torch.nextafter(mids, torch.full_like(mids, -1.0))
    index = bucket(y, bits)
    for r in range(len(rows)):
        assert index[r].tolist() == kernel_bucketize(y[r].tolist(), mids.numpy())
    assert index[0, :len(mids)].tolist() == list(range(1, len(mids) + 1))
    assert index[1, :len(mids)].tolist() == list(range(len(mids)))
    packed, norm16 = key_quantize(rows, bits)
    rotated = key_rotated(packed, norm16, bits, True)
    for r in range(2, len(rows)):
        codes = kernel_bucketize(y[r].tolist(), mids.numpy())
        assert packed[r].tolist() == kernel_pack(codes, bits)
        assert kernel_unpack(packed[r].tolist(), bits, d) == codes
        assert norm16[r].view(torch.int16).item() == np.array(np.float16(norm[r].item())).view(np.int16)
        expected = np.array(kernel_key_read(codes, np.float16(norm[r].item()), centroids(d, bits).numpy(), True), F)
        # the norm correction's sum runs in another order: measured at most 3.5e-7 relative (3 ulp), bound 3.4x
        np.testing.assert_allclose(rotated[r].numpy(), expected, rtol=1.2e-6, atol=0)


def test_fp8_keys_round_to_nearest_even_and_saturate_without_a_scale():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1000.0, 2.0 ** -10, 3 * 2.0 ** -10, 448.0, -0.3])
    got = fp8_keys(x).float().tolist()
    assert got[:7] == [1.0, 1.25, 448.0, -448.0, 0.0, 2.0 ** -8, 448.0]
    assert got[7] == pytest.approx(-0.3, rel=1 / 16)


MAX_TABLE = {3: (0.2451, 0.7560, 1.3440, 2.1520),
             4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)}


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_are_the_lloyd_max_quantizer_of_a_gaussian_of_variance_one_over_d(bits, d):
    c = centroids(d, bits).double() * math.sqrt(d)
    assert torch.equal(c, -c.flip(0)) or torch.allclose(c, -c.flip(0), atol=1e-6, rtol=0)
    # 200-step trapezoids against Max's table: measured at most 0.0017 (the outermost level), bound 3x
    assert torch.allclose(c[2 ** (bits - 1):], torch.tensor(MAX_TABLE[bits], dtype=torch.float64), atol=0.005, rtol=0)


@pytest.mark.parametrize("d", [8, 64, 128])
def test_the_rotation_is_sylvesters_hadamard_over_sqrt_d(d):
    h = hadamard(d)
    sign = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(d)] for i in range(d)], dtype=torch.float32)
    assert torch.equal(h, sign / math.sqrt(d)) and torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(d), atol=1e-6)


def test_slot_sizes_are_vllms_at_head_dim_128():
    # vLLM's PRESET_EXPECTED (tests/quantization/test_turboquant.py @ 0135d081): key_packed_size, value_packed_size
    expected = {"vllm-turboquant-k8v4": (128, 68), "vllm-turboquant-4bit-nc": (66, 68),
                "vllm-turboquant-k3v4-nc": (50, 68), "vllm-turboquant-3bit-nc": (50, 52)}
    for name, (key, value) in expected.items():
        assert (sum(PRESETS[name].key_bytes(128)), sum(PRESETS[name].value_bytes(128))) == (key, value)


# ---------------------------------------------------------------------------- the cache

@pytest.fixture(scope="module")
def llama():
    return tiny_llama(head_dim=64, num_hidden_layers=6)


def states(t, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, 1, t, 64, generator=gen) * 2).to(torch.bfloat16) for _ in range(2))


def test_prefill_attends_its_own_states_and_later_chunks_read_what_vllm_reads():
    layer = TurboQuantLayer(PRESETS["vllm-turboquant-4bit-nc"])
    k, v = states(20, 1)
    assert all(a is b for a, b in zip(layer.update(k, v), (k, v)))          # empty cache: FlashAttention on them
    k2, v2 = states(16, 2)
    keys, values = layer.update(k2, v2)                                     # <= 128 tokens: the decode kernel
    assert keys.shape[-2] == 36 and torch.equal(keys, layer.store_k.dequantize(torch.bfloat16))
    assert not torch.equal(keys[..., 20:, :], k2)                            # its own tokens read back quantized
    k3, v3 = states(129, 3)
    keys, values = layer.update(k3, v3)                                     # > 128: 16-bit prefix, own states
    assert torch.equal(keys[..., 36:, :], k3) and torch.equal(values[..., 36:, :], v3)
    full = layer.store_k.dequantize(torch.float32, 36)                       # the stored prefix, float32 path
    gap = (keys[..., :36, :].float() - full).abs().max().item()
    assert 0 < gap <= 0.05, gap              # rounded through float16 and bfloat16: measured 0.018, bound 2.8x
    one = layer.update(*states(1, 4))
    assert one[0].shape[-2] == 166 and torch.equal(one[0], layer.store_k.dequantize(torch.bfloat16))


@pytest.mark.parametrize("name", NAMES)
def test_the_first_and_last_two_layers_stay_16_bit_and_bytes_match_the_formula(llama, name):
    cache = build_cache(name, llama)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [BoundaryLayer] * 2 + [TurboQuantLayer] * 2 + [BoundaryLayer] * 2
    assert "2 of 6 layers quantized (layers 0, 1, 4, 5 kept 16-bit" in cache.description
    check_bytes(llama, None, name)                                          # live bytes == formula, every length
    check_bytes(llama, None, f"{name}:boundary=1")


def test_bits_per_element_on_smollm2s_shape():
    smol = Arch("smollm2", layers=30, kv_heads=3, head_dim=64)
    # slot bits a (token, head) of K and V, over 128 elements: 100, 70, 62, 54 bytes; 4 of 30 layers 16-bit
    for name, slot in zip(NAMES, (100, 70, 62, 54)):
        bits = bits_per_element(analytic_nbytes(name, smol, 1024), smol, 1024)
        assert bits == pytest.approx((26 * slot * 8 / 128 + 4 * 16) / 30, rel=1e-12)
        alone = bits_per_element(analytic_nbytes(f"{name}:boundary=0", smol, 1024), smol, 1024)
        assert alone == slot * 8 / 128
    assert bits_per_element(analytic_nbytes("vllm-int4-pth", smol, 1024), smol, 1024) == 4.5


def test_logits_stay_near_the_16_bit_ones_and_3_bit_values_drift_furthest(llama):
    ids = torch.randint(3, 90, (1, 48), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name in ["baseline", *NAMES]:
        cache = build_cache(name if name == "baseline" else f"{name}:boundary=0", llama)
        with torch.no_grad():
            llama(ids[:, :16], past_key_values=cache, use_cache=True)        # a 16-bit prefill, then the cache
            logits[name] = llama(ids[:, 16:], past_key_values=cache, use_cache=True).logits.float()
    err = {n: ((logits[n] - logits["baseline"]).norm() / logits["baseline"].norm()).item() for n in NAMES}
    # measured: k8v4 0.032, 4bit_nc 0.033, k3v4_nc 0.032 (their 4-bit values dominate), 3bit_nc 0.070 (bound 3x)
    assert all(0 < e < 0.21 for e in err.values()), err
    assert err["vllm-turboquant-3bit-nc"] > 1.5 * max(err[n] for n in NAMES[:3])


# ---------------------------------------------------------------------------- refusals and the registry

def test_vllm_refuses_sliding_models_and_head_dims_its_backend_cannot_take():
    for name in NAMES:
        with pytest.raises(KvplayError, match=r"cannot run a model with sliding-window layers \(this one has 5 of 6\)"
                                              r" until vllm#54599 lands, so pick kvplay-int4 or kvplay-int2"):
            build_cache(name, tiny_gemma3())
        with pytest.raises(KvplayError, match="FlashAttention 2, which takes a head_dim that is a multiple of 8 up "
                                              "to 256, and this model's is 15"):
            build_cache(name, tiny_arch("gpt2-odd-head-dim"))
    hd96 = tiny_llama(head_dim=96, num_hidden_layers=6)
    for name in NAMES[1:]:
        with pytest.raises(KvplayError, match="power-of-two head_dim .* is 96.*pick vllm-turboquant-k8v4"):
            build_cache(name, hd96)
    assert isinstance(build_cache("vllm-turboquant-k8v4", hd96).layers[2], TurboQuantLayer)


def test_the_method_names_vllms_flags_and_says_when_no_flag_matches():
    method, specs = METHODS["vllm-turboquant"], [parse_spec(n) for n in NAMES]
    assert method.family == "vLLM" and [s.name for s in method.schemes] == NAMES
    assert [method.own_recipe(s) for s in specs] == [("vLLM", f"--kv-cache-dtype {p.vllm}") for p in PRESETS.values()]
    assert method.own_recipe(parse_spec("vllm-turboquant-4bit-nc:boundary=0")) is None
    assert "no vLLM setting" in method.snippet(parse_spec("vllm-turboquant-4bit-nc:boundary=1"))
    assert "vllm serve MODEL --kv-cache-dtype turboquant_3bit_nc" in method.snippet(specs[3])
    assert method.engine_name(specs[2]) == "vLLM turboquant_k3v4_nc, emulated"
    assert method.key_grouping(specs[0]) == ("float", 8, False) and method.key_grouping(specs[2]) == ("token", 3, True)

"""vLLM's per-token-head KV caches (kvplay/cache/methods/vllm_pth.py) against vLLM's own arithmetic.

The rotation of int4_per_token_head is PyTorch in vLLM: transcribed below from
vllm/v1/attention/ops/int4_per_token_head.py @ a7f284a2 (_get_rht_signs, fast_hadamard_transform's tier 3,
single_rht, _get_hadamard_matrix) and pinned bit for bit on random tensors. The write and read kernels are
Triton: pinned on blocks worked by hand from the kernel's arithmetic (ties where half away from zero, round to
nearest even and truncation part ways), and on random rows with planted ties against a scalar transcription of
_reshape_cache_int4_kernel and _reshape_cache_per_token_head (float32 numpy, one fma per a * b + c).
"""
import numpy as np
import pytest
import torch
from conftest import tiny_arch, tiny_llama
from gemma3_tiny import tiny_gemma3
from test_bytes import check_bytes
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvplay.cache import METHODS, build_cache, cache_nbytes, dequantized_kv, parse_spec
from kvplay.cache.methods.vllm_pth import FORMATS, VllmPthLayer, hadamard, rotate, unpack, unrotate
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate
from kvplay.lab.metrics import relative_error
from kvplay.show.style import colour_for, dash_and_marker

F = np.float32
INT8, FP8, INT4 = (FORMATS[n] for n in ("vllm-int8-pth", "vllm-fp8-pth", "vllm-int4-pth"))


def block(rows) -> torch.Tensor:
    """Rows of a head, as the kernels load them: bfloat16 values in float32, shaped (B=1, H, n=1, 1, D)."""
    return torch.tensor(rows, dtype=torch.bfloat16).float()[:, None, None, :].unsqueeze(0)


# ---------------------------------------------------------------------------- vLLM's PyTorch rotation, transcribed

def vllm_rht_signs(d, round_idx=0):
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9 + round_idx * 0x517CC1B7)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5, device="cpu"), generator=gen) - 1.0


def vllm_fast_hadamard_transform(x):        # tier 3, the PyTorch butterfly
    d = x.shape[-1]
    assert d & (d - 1) == 0, f"Requires power-of-2 dim, got {d}"
    h = 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        a = xv[..., 0, :]
        b = xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def vllm_single_rht(x, inverse=False):
    d1 = vllm_rht_signs(x.shape[-1])
    return vllm_fast_hadamard_transform(x) * d1 if inverse else vllm_fast_hadamard_transform(x * d1)


def vllm_hadamard_matrix(d):
    H = torch.ones(1, 1, dtype=torch.float32)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], dim=1), torch.cat([H, -H], dim=1)], dim=0)
    return H


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_the_rotation_is_vllms_single_rht_bit_for_bit(d):
    gen = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(2, 3, 17, d, generator=gen)).to(torch.bfloat16)
    # reshape_and_cache_int4: key = single_rht(key.float()).to(key.dtype)
    assert torch.equal(rotate(x), vllm_single_rht(x.float()).to(x.dtype).float())
    y = torch.randn(2, 3, 17, d, generator=gen)
    # unified_attention_int4: single_rht(out.float(), inverse=True) / head_size
    assert torch.equal(unrotate(y), vllm_single_rht(y, inverse=True) / d)
    # the butterfly is the Sylvester matrix (exact on small integers), and the pair is an inverse
    ints = torch.randint(-8, 9, (5, d), generator=gen).float()
    assert torch.equal(hadamard(ints), ints @ vllm_hadamard_matrix(d))
    assert torch.allclose(unrotate(rotate(y)), y, atol=1e-5)           # float32 in, float32 rounding only
    assert not torch.equal(vllm_rht_signs(d), torch.ones(d))


# ---------------------------------------------------------------------------- the write kernels, by hand

def test_int8_rounds_half_away_from_zero_with_an_absmax_scale_per_token_and_head():
    x = block([[127, 2.5, -2.5, 0.5, -0.5, 1.25, 63.5, -127],      # scale 1: ties 2.5, -2.5, 0.5, -0.5, 63.5
               [254, 5, -5, 3, 1, -1, -254, 0],                      # scale 2: x * 0.5 = 127, 2.5, -2.5, 1.5, ...
               [0] * 8])                                             # all zero: the 1e-6 floor
    codes, scale = INT8.encode(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes[0].flatten(1).tolist() == [[127, 3, -3, 1, -1, 1, 64, -127],   # round to even: 2, -2, 0, -0, 64;
                                         [127, 3, -3, 2, 1, -1, -127, 0],    # truncation (before vllm#45361):
                                         [0] * 8]                            # 2, -2, 0, 0, 63
    assert scale.flatten().tolist() == [1.0, 2.0, float(F(1e-6))]
    out = torch.empty(1, 3, 1, 8)
    INT8.decode((codes, scale), out)
    assert out[0, 1, 0].tolist() == [254, 6, -6, 4, 2, -2, -254, 0]


def test_fp8_casts_to_nearest_even_e4m3_after_an_absmax_over_448_scale():
    x = block([[448, 1.0625, 1.1875, -1.0625, 17, 0, -448, 3],     # ties: 1.0625 -> 1 (mantissa 000, not 001)
               [224, 0.53125, 0.59375, 8.5, 0, 0, 0, 0]])            # scale 0.5: x * 2 = 448, 1.0625, 1.1875, 17
    codes, scale = FP8.encode(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.flatten().tolist() == [1.0, 0.5]
    assert codes[0].float().flatten(1).tolist() == [[448, 1, 1.25, -1, 16, 0, -448, 3], [448, 1, 1.25, 16, 0, 0, 0, 0]]
    # an inexact scale (3 / 448): the clamp keeps the largest element at the edge of e4m3, never past it
    codes, _ = FP8.encode(block([[3, -3, 1, 0, 0, 0, 0, 0]]))
    assert codes.float().flatten()[:2].tolist() == [448, -448]


def test_int4_zero_point_hides_in_the_scale_and_the_read_kernel_unmasks_it():
    x = block([[-2.5, 12.5, 0.5, 1.5, -1, 7, 3.25, 12.5],        # scale 15/15 = 1, -min/scale = 2.5: zero point 3
               [0, 1.5, 0, 1.5, 0, 1.5, 0, 1.5],                  # scale 0.1: not exact in float32, low bits set
               [2] * 8])                                           # constant: scale 1e-6, zero point clamped to 0
    packed, stored = INT4.encode(x)
    # codes x / scale + zp rounded half away: 0.5 + 3 -> 1 (even: 0), 4.5 -> 5 (even: 4), 15.5 -> 15 (clamped)
    codes = [1, 15, 4, 5, 2, 10, 6, 15]
    assert [codes[i] | codes[i + 1] << 4 for i in (0, 2, 4, 6)] == [241, 84, 162, 246]      # even nibble low
    assert packed[0, 0].flatten().tolist() == [241, 84, 162, 246]
    bits = stored.view(torch.int32).flatten().tolist()
    tenth = int(np.array(F(F(1.5) / F(15))).view(np.int32))
    assert bits == [0x3F800000 | 3, tenth & -16, int(np.array(F(1e-6)).view(np.int32)) & -16]
    c, zp, scale = (a[0] for a in unpack(packed, stored))          # (rows, 1, 1, 8), (rows, 1, 1, 1) x2
    assert c[0].flatten().tolist() == codes and zp.flatten().tolist() == [3, 0, 0]
    assert (c[0] - zp[0]).flatten().tolist() == [-2, 12, 1, 2, -1, 7, 3, 12]
    # the read kernel multiplies by the masked scale, not the one the codes were made with
    masked = F(np.array(tenth & -16, np.int32).view(np.float32))
    assert c[1].flatten().tolist() == [0, 15] * 4 and masked != F(F(1.5) / F(15))
    assert scale.flatten().tolist() == [1.0, masked, F(np.array(bits[2], np.int32).view(np.float32))]
    assert c[2].flatten().tolist() == [15] * 8        # a constant head reads back as 15 * 1e-6, as in vLLM


# ---------------------------------------------------------------------------- the write kernels, random rows

def kernel_int8_row(row):
    """_reshape_cache_per_token_head for int8 (vllm#45361), one (token, head) row of float32, transcribed."""
    scale = max(F(F(np.abs(row).max()) / F(127)), F(1e-6))
    inv = F(F(1) / scale)
    out = []
    for v in row:
        q = F(float(v) * float(inv) + (0.5 if F(v * inv) >= 0 else -0.5))       # one fma
        out.append(int(min(max(q, F(-128)), F(127))))                            # clamp, truncating store
    return out, scale


def kernel_int4_row(row):
    """_reshape_cache_int4_kernel, one rotated (token, head) row of float32, transcribed."""
    lo, hi = F(row.min()), F(row.max())
    scale = max(F(F(hi - lo) / F(15)), F(1e-6))
    t = F(-lo / scale)
    zp = F(min(max(int(F(t + F(0.5))) if t >= 0 else int(F(t - F(0.5))), 0), 15))
    inv = F(F(1) / scale)
    codes = []
    for v in row:
        s = F(float(v) * float(inv) + float(zp))                                 # one fma
        codes.append(min(max(int(F(s + F(0.5))) if s >= 0 else int(F(s - F(0.5))), 0), 15))
    bits = (int(np.array(scale).view(np.int32)) & -16) | int(zp)
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)], bits


def half_steps(gen, s, lo, hi, n):
    return torch.randint(lo, hi + 1, (n,), generator=gen).float() * s / 2


def planted_rows(gen, n, d, symmetric):
    """Rows on a grid of half steps of a power-of-two step s whose scale comes out exactly s (int8: absmax 127 s;
    int4: max - min = 15 s), so that reciprocals are exact and x / s lands on ties; every other row plain normal."""
    rows = []
    for i in range(n):
        if i % 2:
            rows.append(torch.randn(d, generator=gen))
            continue
        s = 2.0 ** int(torch.randint(-4, 3, (1,), generator=gen))
        if symmetric:
            r = half_steps(gen, s, -254, 254, d)
            r[0] = 127 * s * (1 if i % 4 else -1)
        else:
            lo = -half_steps(gen, s, 0, 30, 1)
            r = lo + half_steps(gen, s, 0, 30, d)
            r[0], r[1] = lo, lo + 15 * s
        rows.append(r)
    return torch.stack(rows)


def test_int8_matches_the_kernel_on_random_rows_with_ties():
    gen = torch.Generator().manual_seed(8)
    rows = planted_rows(gen, 80, 64, symmetric=True)
    codes, scale = INT8.encode(rows[None, :, None, None, :])
    want = [kernel_int8_row(r.numpy()) for r in rows]
    assert codes[0].flatten(1).tolist() == [c for c, _ in want]
    assert scale.flatten().tolist() == [float(s) for _, s in want]
    p = rows / scale.flatten()[:, None]
    assert int(((p - p.floor()) == 0.5).sum()) > 100                    # ties were planted, and rounded away


def test_int4_matches_the_kernel_on_random_rows_with_ties():
    gen = torch.Generator().manual_seed(4)
    rows = planted_rows(gen, 80, 64, symmetric=False)
    packed, stored = INT4.encode(rows[None, :, None, None, :])
    want = [kernel_int4_row(r.numpy()) for r in rows]
    assert packed[0].flatten(1).tolist() == [p for p, _ in want]
    assert stored.view(torch.int32).flatten().tolist() == [b for _, b in want]
    _, zp, scale = unpack(packed, stored)
    s = rows / scale.flatten()[:, None] + zp.flatten()[:, None]
    assert int(((s - s.floor()) == 0.5).sum()) > 100


# ---------------------------------------------------------------------------- the read kernel

def test_int4_dequantize_then_attend_is_the_read_kernels_split_dot():
    """_attn_packed scores the rotated query against the codes, (q'.codes - sum(q') zp) * scale * sm_scale / d, and
    weighs values as sum(P scale (codes - zp)) before rotating back; kvplay attends the original query over the
    unrotated dequantized cache. Same numbers up to the bfloat16 rounding of vLLM's rotated query."""
    gen = torch.Generator().manual_seed(0)
    d, t = 64, 40
    k, v = (torch.randn(1, 1, t, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(d, generator=gen).to(torch.bfloat16)
    stored = {name: INT4.encode(INT4.prepare(x).unsqueeze(3)) for name, x in (("k", k), ("v", v))}
    sm_scale = d ** -0.5

    codes, zp, scale = (a.flatten(0, 3) for a in unpack(*stored["k"]))          # (t, d), (t, 1), (t, 1)

    def scores(q_rot):                                                        # the split dot, two nibble streams
        raw = codes[:, 0::2] @ q_rot[0::2] + codes[:, 1::2] @ q_rot[1::2]
        return (raw - q_rot.sum() * zp.flatten()) * (sm_scale / d * scale.flatten())

    s_vllm = scores(vllm_single_rht(q.float()).to(q.dtype).float())         # vLLM rounds q' to the model's dtype
    k_hat, v_hat = (torch.empty(1, 1, t, d) for _ in range(2))
    INT4.decode(stored["k"], k_hat)
    INT4.decode(stored["v"], v_hat)
    s_kvplay = k_hat[0, 0] @ q.float() * sm_scale
    assert relative_error(s_kvplay, scores(vllm_single_rht(q.float()))) < 1e-5   # measured 1.1e-7
    assert relative_error(s_kvplay, s_vllm) < 5e-3                 # measured 1.2e-3: the bf16 rounding of q'

    p = torch.softmax(s_vllm, 0)
    vc, vzp, vs = (a.flatten(0, 3) for a in unpack(*stored["v"]))
    acc = (p * vs.flatten()) @ vc - (p * vs.flatten() * vzp.flatten()).sum()
    out_vllm = vllm_single_rht(acc, inverse=True) / d
    assert relative_error(p @ v_hat[0, 0], out_vllm) < 1e-5       # measured 1.2e-6: float32 order only
    assert relative_error(k_hat, k) < 0.3                           # and it is K: measured 0.092


# ---------------------------------------------------------------------------- the cache on models

@pytest.fixture(scope="module")
def llama():
    return tiny_llama(head_dim=64)


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_token_is_stored_on_arrival_and_prefill_attends_the_stored_cache(llama, name):
    layer = VllmPthLayer(FORMATS[name])
    k, v = (torch.randn(2, 1, 9, 64).to(torch.bfloat16) for _ in range(2))
    k_out, v_out = layer.update(k, v)
    assert torch.equal(k_out, dequantized_kv(layer)[0]) and not torch.equal(k_out, k)
    assert layer.keys.shape[-2] == 0 and layer.get_seq_length() == 9          # nothing kept 16-bit

    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = build_cache(name, llama)
    trace = generate(llama, ids, cache, 6, keep_logits=False)
    assert trace.tokens.shape == (1, 6) and cache.get_seq_length() == 45
    assert all(isinstance(layer, VllmPthLayer) for layer in cache.layers)
    per_row = 64 * FORMATS[name].bits // 8                                    # codes of one (token, head, K or V)
    assert cache_nbytes(cache).payload == 2 * 2 * 45 * per_row                # 2 layers, K and V, 1 KV head
    assert cache_nbytes(cache).metadata == 2 * 2 * 45 * 4                     # one float32 scale per row


@pytest.mark.parametrize("name", list(FORMATS))
def test_live_bytes_equal_the_formula_on_llama_and_on_gemma3_with_sliding_layers(llama, name):
    check_bytes(llama, None, name)
    gemma = tiny_gemma3()
    check_bytes(gemma, None, name)
    cache = build_cache(name, gemma)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer] * 5 + [VllmPthLayer]
    assert "1 global layer quantized, 5 sliding layers kept in 16-bit" in cache.description


def test_int8_logits_stay_near_the_16_bit_ones_and_int4_further(llama):
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name in ["baseline", *FORMATS]:
        cache = build_cache(name, llama)
        with torch.no_grad():
            logits[name] = llama(ids, past_key_values=cache, use_cache=True).logits.float()
    err = {name: relative_error(logits[name], logits["baseline"]) for name in FORMATS}
    # measured: int8 0.0068, fp8 0.018, int4 0.048
    assert 0 < err["vllm-int8-pth"] < 0.02 and 0 < err["vllm-fp8-pth"] < 0.05 and 0 < err["vllm-int4-pth"] < 0.15
    assert err["vllm-int8-pth"] < err["vllm-fp8-pth"] < err["vllm-int4-pth"]


# ---------------------------------------------------------------------------- refusals and the registry

def test_vllm_refuses_head_dims_its_triton_backend_or_rotation_cannot_take():
    odd = tiny_arch("gpt2-odd-head-dim")
    for name in FORMATS:
        with pytest.raises(KvplayError, match="Triton attention backend, which needs head_dim >= 32 .* is 15"):
            build_cache(name, odd)
    hd96 = tiny_llama(head_dim=96)
    with pytest.raises(KvplayError, match="power-of-two head_dim .* is 96.*pick vllm-int8-pth or vllm-fp8-pth"):
        build_cache("vllm-int4-pth", hd96)
    for name in ("vllm-int8-pth", "vllm-fp8-pth"):
        assert isinstance(build_cache(name, hd96).layers[0], VllmPthLayer)


def test_the_method_names_vllms_own_flags_and_looks_apart_from_vllm_fp8():
    method, specs = METHODS["vllm-pth"], [parse_spec(name) for name in FORMATS]
    assert method.family == "vLLM" and [s.name for s in method.schemes] == list(FORMATS)
    assert [method.own_recipe(s) for s in specs] == [
        ("vLLM", f"--kv-cache-dtype {d}_per_token_head --kv-cache-dtype-skip-layers sliding_window")
        for d in ("int8", "fp8", "int4")]
    assert method.engine_name(specs[2]) == "vLLM int4_per_token_head, emulated"
    assert method.key_grouping(specs[2]) == ("token", 4, True)
    assert dash_and_marker("vllm-int4-pth") != dash_and_marker("vllm-fp8")
    assert len({colour_for(n) for n in ["vllm-fp8", *FORMATS]}) == 4

"""Tests for kvplay.cache.quant: bit packing, int/fp8 quantization, Hadamard rotation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplay.cache.quant import (
    FP16_MAX,
    INT_BITS,
    QuantizedInt,
    dequantize_fp8,
    dequantize_int,
    hadamard,
    int_group_nbytes,
    pack_bits,
    packed_len,
    quantize_fp8,
    quantize_int,
    rotate,
    unpack_bits,
    unrotate,
)

HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# Relative rounding of the final cast to the output dtype (half an ulp, with margin).
CAST_REL_TOL = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

# float32 arithmetic slack for the |x - deq| <= scale / 2 bound, relative to the group's magnitude.
# Measured on test_int_error_bound's cases: errors reach the scale / 2 term itself (the worst element uses 0.99999
# of the whole bound), and of the slack beyond it (this plus the cast's) at most 49% (8 bits; 2 bits 15%).
F32_SLACK = 2.0**-20


def _int_bound(q: QuantizedInt, bits: int, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element allowed |x - deq|: scale/2 + float32 slack + the output cast's rounding."""
    scale = q.scale.float()  # (..., G, 1)
    magnitude = q.zero.float().abs() + scale * ((1 << bits) - 1)  # (..., G, 1) >= |deq|
    deq_magnitude = x.float().abs() + scale  # >= |float32 deq|, what the output cast rounds
    return scale / 2 + F32_SLACK * magnitude + CAST_REL_TOL[out_dtype] * deq_magnitude + 1e-30


def _check_int_roundtrip(x: torch.Tensor, bits: int, out_dtype: torch.dtype = torch.float32) -> None:
    g = x.shape[-1]
    q = quantize_int(x, bits)
    assert q.packed.dtype == torch.uint8
    assert q.packed.shape == (*x.shape[:-1], math.ceil(g * bits / 8))          # written here, not packed_len
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert q.scale.shape == q.zero.shape == (*x.shape[:-1], 1)
    assert bool((q.scale >= 0).all())
    deq = dequantize_int(q, bits, g, out_dtype)
    assert deq.dtype == out_dtype and deq.shape == x.shape
    assert bool(torch.isfinite(deq).all())
    err = (x.float() - deq.float()).abs()
    bound = _int_bound(q, bits, x, out_dtype)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert bool(torch.isfinite(dequantize_int(q, bits, g, torch.float16)).all())


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 127, 128])
def test_pack_unpack_roundtrip_and_size(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (2, 3, n), dtype=torch.uint8, generator=gen)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, math.ceil(n * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", INT_BITS)
def test_pack_extreme_codes(bits: int) -> None:
    """All-ones and all-zeros codes survive (no bleed between neighbours)."""
    for fill in (0, (1 << bits) - 1):
        codes = torch.full((4, 13), fill, dtype=torch.uint8)
        assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 13), codes)


def test_pack_layout() -> None:
    codes = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert pack_bits(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4]          # one byte: planar = sequential
    assert pack_bits(codes, 4).tolist() == [1 | 3 << 4, 2]                 # planar: byte j holds codes j, j+P
    wide = torch.arange(32, dtype=torch.uint8) % 16                         # 16 bytes: the 64-bit path
    assert pack_bits(wide, 4)[:2].tolist() == [0 | 0 << 4, 1 | 1 << 4]
    three = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(three))
    assert pack_bits(three, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


def test_pack_8bit_is_identity_and_noncontiguous_input() -> None:
    codes = torch.randint(0, 256, (5, 6), dtype=torch.uint8)
    assert torch.equal(pack_bits(codes, 8), codes)
    strided = torch.randint(0, 4, (6, 10), dtype=torch.uint8).T  # (10, 6), non-contiguous
    assert torch.equal(unpack_bits(pack_bits(strided, 2), 2, 6), strided)


def test_pack_errors() -> None:
    with pytest.raises(ValueError, match=r"valid choices are \(2, 3, 4, 8\)"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="uint8"):
        pack_bits(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="need 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 4)


def test_packed_len_and_nbytes() -> None:
    assert [packed_len(n, 3) for n in (0, 1, 2, 3, 8, 9, 16)] == [0, 1, 1, 2, 3, 4, 6]
    assert packed_len(32, 2) == 8 and packed_len(33, 4) == 17 and packed_len(7, 8) == 7
    assert int_group_nbytes(10, 32, 4) == 10 * (16 + 4)
    assert int_group_nbytes(3, 128, 3) == 3 * (48 + 4)
    with pytest.raises(ValueError, match="bit width"):
        packed_len(8, 1)


@HYPOTHESIS
@given(
    bits=st.sampled_from(INT_BITS),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(0, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_property(bits: int, lead: list[int], n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), dtype=torch.uint8, generator=gen)
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.prod(lead) * math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


# --------------------------------------------------------------------------- integer quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("bits", INT_BITS)
def test_int_error_bound(bits: int, group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bits * 7 + group_size)
    x = torch.randn(2, 4, 8, 128, generator=gen) * 3  # (B, H, T, D)
    x[..., 5] *= 20  # an outlier channel, as in real keys
    x = x.to(dtype).reshape(2, 4, 8, 128 // group_size, group_size)  # (B, H, T, G, g)
    _check_int_roundtrip(x, bits, out_dtype=torch.float32)
    _check_int_roundtrip(x, bits, out_dtype=dtype)


def test_int_mean_error_shrinks_with_bits() -> None:
    x = torch.randn(4, 64, 4, 32, generator=torch.Generator().manual_seed(0))
    errors = []
    for bits in INT_BITS:
        q = quantize_int(x, bits)
        errors.append((x - dequantize_int(q, bits, 32, torch.float32)).abs().mean().item())
    assert errors == sorted(errors, reverse=True)
    # Roughly halving per extra bit: 8 bits is far better than 4 (measured 0.0039 against 0.065, 1/17).
    assert errors[-1] < errors[2] / 8


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, 0.1, -1e-6, 1e-9, 65504.0, -65504.0])
def test_int_constant_groups(bits: int, value: float) -> None:
    x = torch.full((3, 32), value)
    q = quantize_int(x, bits)
    deq = dequantize_int(q, bits, 32, torch.float32)
    assert bool(torch.isfinite(deq).all())
    if float(torch.tensor(value).half()) == value:  # float16-representable: exact, scale 0
        assert torch.equal(deq, x)
        assert bool((q.scale == 0).all())
    _check_int_roundtrip(x, bits)


def test_int_empty_and_bad_args() -> None:
    q = quantize_int(torch.zeros(0, 3, 32), 4)
    assert q.packed.shape == (0, 3, 16) and q.scale.shape == (0, 3, 1)
    assert dequantize_int(q, 4, 32, torch.float32).shape == (0, 3, 32)
    with pytest.raises(ValueError, match=r"valid choices are \(2, 3, 4, 8\)"):
        quantize_int(torch.zeros(2, 8), 6)
    with pytest.raises(ValueError, match="non-empty last"):
        quantize_int(torch.zeros(2, 0), 4)
    with pytest.raises(ValueError, match="need"):
        dequantize_int(quantize_int(torch.zeros(2, 8), 3), 3, 16, torch.float32)


_finite_f16 = st.floats(-FP16_MAX, FP16_MAX, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def _groups(draw: st.DrawFn) -> torch.Tensor:
    """Small (G, g) float32 tensors mixing constant, zero, tiny and huge groups."""
    n_groups = draw(st.integers(1, 4))
    g = draw(st.sampled_from([1, 2, 3, 8, 16, 17, 32]))
    rows = []
    for _ in range(n_groups):
        kind = draw(st.sampled_from(["free", "constant", "zero", "scaled"]))
        if kind == "free":
            rows.append(draw(st.lists(_finite_f16, min_size=g, max_size=g)))
        elif kind == "constant":
            rows.append([draw(_finite_f16)] * g)
        elif kind == "zero":
            rows.append([0.0] * g)
        else:
            magnitude = draw(st.sampled_from([1e-7, 1e-4, 1e-2, 1.0, 1e2, 1e4]))
            unit = st.floats(-1, 1, allow_nan=False, width=32)
            rows.append([magnitude * v for v in draw(st.lists(unit, min_size=g, max_size=g))])
    return torch.tensor(rows, dtype=torch.float32)


@HYPOTHESIS
@given(x=_groups(), bits=st.sampled_from(INT_BITS))
def test_int_roundtrip_property(x: torch.Tensor, bits: int) -> None:
    _check_int_roundtrip(x, bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_int_non_finite_raises(bad: float) -> None:
    x = torch.randn(2, 4, 32)
    x[1, 2, 7] = bad
    with pytest.raises(ValueError, match=r"^cannot quantize non-finite values \(NaN or inf\) in the KV cache$"):
        quantize_int(x, 4)
    quantize_int(x, 4, check_finite=False)  # skipped check: no error (result is garbage)


def test_int_out_of_float16_range_raises() -> None:
    x = torch.zeros(2, 16)
    x[0, 3] = 70000.0
    with pytest.raises(ValueError, match="float16 limit"):
        quantize_int(x, 8)
    quantize_int(x, 8, check_finite=False)


# --------------------------------------------------------------------------- fp8


def _check_fp8(x: torch.Tensor) -> None:
    """Documented bound: |x - deq| <= min(16 * scale, |x| * 2**-4 + scale * 2**-10) (+ f32 eps).

    16 * scale is half an e4m3 ulp at |x / scale| <= 448; 2**-4 is the relative half-ulp of
    3 mantissa bits; scale * 2**-10 covers e4m3 subnormals. Both imply the looser
    |x - deq| <= absmax * 2**-4 + scale * 2**-10.
    Measured on test_fp8_error_bound's cases, the worst element uses 0.999995 of the first bound (a half-ulp
    exactly), 0.94 of the second and of the third.
    """
    q = quantize_fp8(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale.dtype == torch.float16 and q.scale.shape == (*x.shape[:-1], 1)
    deq = dequantize_fp8(q, torch.float32)
    xf = x.float()
    err = (xf - deq).abs()
    scale = q.scale.float()
    eps = 2.0**-22 * xf.abs() + 1e-30
    assert bool((err <= 16 * scale * (1 + 2.0**-20) + eps).all())
    assert bool((err <= xf.abs() * 2.0**-4 + scale * 2.0**-10 + eps).all())
    absmax = xf.abs().amax(-1, keepdim=True)
    assert bool((err <= absmax * 2.0**-4 + scale * 2.0**-10 + eps).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 30.0, 1000.0])
def test_fp8_error_bound(magnitude: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(magnitude * 1e6) % 9973)
    x = torch.randn(2, 4, 16, 64, generator=gen) * magnitude  # (B, H, T, D)
    x[..., 3] *= 10  # outlier channel
    x = x.to(dtype)
    _check_fp8(x)
    assert dequantize_fp8(quantize_fp8(x), dtype).dtype == dtype


def test_fp8_zero_rows_and_extremes() -> None:
    x = torch.randn(4, 32)
    x[1] = 0.0
    x[2] = FP16_MAX * torch.sign(torch.randn(32))
    q = quantize_fp8(x)
    deq = dequantize_fp8(q, torch.float32)
    assert torch.equal(deq[1], torch.zeros(32))
    assert q.scale[1].item() == 0.0
    # Near the float16 limit the rounded-up scale can overshoot 65504 slightly; a
    # float16 output is clamped instead of overflowing to inf.
    assert bool(torch.isfinite(dequantize_fp8(q, torch.float16)).all())
    _check_fp8(x)


@HYPOTHESIS
@given(x=_groups())
def test_fp8_property(x: torch.Tensor) -> None:
    _check_fp8(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_non_finite_raises(bad: float) -> None:
    x = torch.randn(3, 16)
    x[2, 0] = bad
    with pytest.raises(ValueError, match=r"non-finite values \(NaN or inf\)"):
        quantize_fp8(x)
    quantize_fp8(x, check_finite=False)
    with pytest.raises(ValueError, match="float16 limit"):
        quantize_fp8(torch.full((2, 4), 1e6))


# --------------------------------------------------------------------------- Hadamard


@pytest.mark.parametrize(("dim", "block"), [(32, 32), (64, 64), (128, 128), (80, 16), (96, 32), (2, 2)])
def test_hadamard_orthonormal(dim: int, block: int) -> None:
    H = hadamard(dim)
    assert H.shape == (dim, dim) and H.dtype == torch.float32
    torch.testing.assert_close(H @ H.T, torch.eye(dim), atol=3e-7, rtol=0)     # measured at most 6.0e-8
    # Entries are +-1/sqrt(block) inside the diagonal blocks and 0 elsewhere (exactly: measured no difference).
    nonzero = H.abs() > 0
    assert torch.equal(H.abs()[nonzero], torch.full((dim * block,), 1 / math.sqrt(block)))
    assert int(nonzero.sum()) == dim * block


def test_hadamard_is_cached_per_dim_device_dtype() -> None:
    assert hadamard(64) is hadamard(64)
    assert hadamard(64, dtype=torch.float64) is not hadamard(64)
    assert hadamard(64, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("dim", [1, 3, 65, 0, -4])
def test_hadamard_rejects_odd_or_nonpositive(dim: int) -> None:
    with pytest.raises(ValueError, match="even head_dim" if dim > 0 else "positive"):
        hadamard(dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_rotate_unrotate_roundtrip(dim: int, dtype: torch.dtype) -> None:
    x = torch.randn(2, 4, 5, dim, generator=torch.Generator().manual_seed(dim)).to(dtype)  # (B, H, T, D)
    H = hadamard(dim)
    y = rotate(x, H)
    assert y.dtype == dtype and y.shape == x.shape
    back = unrotate(y, H)
    # measured largest errors: round trip float32 1.4e-6, bfloat16 7.8e-3 (one bfloat16 step near 1);
    # norms (~8 to 11) float32 1.9e-6, bfloat16 8.7e-3
    tol = 5e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(back.float(), x.float(), atol=tol, rtol=0)
    # Rotation preserves norms (up to output rounding).
    torch.testing.assert_close(y.float().norm(dim=-1), x.float().norm(dim=-1), atol=2 * tol, rtol=0)


def test_rotate_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="last dim"):
        rotate(torch.randn(3, 32), hadamard(64))


def test_rotation_spreads_outliers() -> None:
    """A one-hot outlier becomes flat after rotation, which is why it helps quantization."""
    x = torch.zeros(1, 128)
    x[0, 17] = 100.0
    y = rotate(x, hadamard(128))
    assert torch.equal(y.abs(), torch.full_like(y, 100 / math.sqrt(128)))     # exactly: measured no difference

"""Quantization primitives for the KV cache.

Everything here is vectorised torch code that runs on every decode step:

* bit packing of integer codes (2, 3, 4, 8 bits) into ``uint8`` (kvplay/cache/bits.py, re-exported here);
* asymmetric (affine) integer quantization with a per-group scale and zero, each float16 or, with
  ``meta="8bit"``, one byte each (a log-domain scale code and a zero in eighth steps, see META8_*);
* per-token fp8 (``float8_e4m3fn``) quantization with a float16 absmax scale;
* orthonormal Hadamard rotations used to spread outliers before quantizing (kvplay/cache/hadamard.py, re-exported).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvplay.cache.bits import INT_BITS, check_bits, pack_bits, packed_len, unpack_bits
from kvplay.cache.hadamard import hadamard, rotate, unrotate
from kvplay.errors import KvplayError

__all__ = [
    "INT_BITS",
    "FITS",
    "METAS",
    "META8_BIAS",
    "META8_STEPS",
    "meta_nbytes",
    "meta8_scale",
    "FP16_MAX",
    "FP8_MAX",
    "NON_FINITE_MESSAGE",
    "QuantizedInt",
    "QuantizedFp8",
    "packed_len",
    "pack_bits",
    "unpack_bits",
    "int_group_nbytes",
    "quantize_int",
    "dequantize_int",
    "quantize_fp8",
    "dequantize_fp8",
    "hadamard",
    "rotate",
    "unrotate",
]

FP16_MAX = 65504.0  # largest finite float16
FP8_MAX = 448.0  # largest finite float8_e4m3fn
NON_FINITE_MESSAGE = "cannot quantize non-finite values (NaN or inf) in the KV cache"

_SCALE_ZERO_NBYTES = 2 + 2  # float16 scale + float16 zero per group

# Per-group metadata: "fp16" stores a float16 scale and zero (4 bytes); "8bit" stores a uint8 scale code e,
# scale = 2 ** ((e - META8_BIAS) / META8_STEPS) (2**-11 .. 2**4.94, 4.4% apart), and an int8 zero z in
# eighth steps, zero = z * scale / 8 (2 bytes). A scale beyond the top code clips the group.
METAS: tuple[str, ...] = ("fp16", "8bit")
META8_BIAS, META8_STEPS = 176, 16
_ZERO_UNITS = 8             # zero steps per scale step under "8bit" (measured on SmolLM2: 4 costs 2-bit keys 5% more)


def meta_nbytes(meta: str) -> int:
    """Bytes of one group's scale and zero."""
    return _SCALE_ZERO_NBYTES if meta == "fp16" else 2


@functools.cache
def _meta8_table(device: torch.device) -> torch.Tensor:
    return torch.exp2((torch.arange(256, dtype=torch.float64) - META8_BIAS) / META8_STEPS).float().to(device)


def meta8_scale(code: torch.Tensor) -> torch.Tensor:
    """uint8 scale codes -> float32 scales (a 256-entry table)."""
    return _meta8_table(code.device)[code.long()]


def _meta_float(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored (scale, zero), float16 or 8-bit codes -> float32 (scale, zero)."""
    if scale.dtype == torch.uint8:
        s = meta8_scale(scale)
        return s, zero.float() * s / _ZERO_UNITS
    return scale.float(), zero.float()


def _meta8_minmax(xmin: torch.Tensor, xmax: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest scale code whose grid, from the zero rounded down to an eighth of a step, reaches xmax.

    (max - min) / (levels - 1/8) always does (the zero is at most an eighth of a step below min), and at least
    |min| * 8 / 127 keeps the zero code in range; the codes from (max - min) / levels up to that one are tried.
    """
    reach = xmin.abs() * _ZERO_UNITS / 127                  # the smallest scale whose zero code reaches xmin
    safe_e, safe_z = _meta8_encode(torch.maximum((xmax - xmin) / (levels - 1 / _ZERO_UNITS), reach), xmin, up=True)
    e_lo = _meta8_encode(torch.maximum((xmax - xmin) / levels, reach), xmin, up=True)[0]
    scale, zero, done = safe_e, safe_z, torch.zeros_like(xmin, dtype=torch.bool)
    for step in range(3):            # (levels - 1/8) / levels is at most 4.3% (2 bits): one code of 4.4% above e_lo
        e = (e_lo.int() + step).clamp(max=255).to(torch.uint8)
        e, z = _meta8_encode(meta8_scale(e), xmin, up=True)
        s = meta8_scale(e)
        fits = ~done & (e <= safe_e) & (z.float() * s / _ZERO_UNITS + levels * s >= xmax)
        scale, zero, done = torch.where(fits, e, scale), torch.where(fits, z, zero), done | fits
    return scale, zero


def _meta8_encode(scale: torch.Tensor, zero: torch.Tensor, up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scale (> 0) and zero -> (uint8 scale code, int8 zero code): the scale rounded up (`up`) or to the
    nearest code, the zero rounded down (`up`, so the group's minimum stays above it) or to the nearest."""
    logs = torch.log2(scale.clamp(min=2.0 ** -40)) * META8_STEPS + META8_BIAS
    e = (logs - 1e-4).ceil() if up else logs.round()
    e = e.clamp_(0, 255).to(torch.uint8)
    z = zero * _ZERO_UNITS / meta8_scale(e)
    z = (z + 1e-4).floor() if up else z.round()
    return e, z.clamp_(-128, 127).to(torch.int8)


def int_group_nbytes(n_groups: int, group_size: int, bits: int) -> int:
    """Storage of ``n_groups`` quantized groups: packed codes + float16 scale and zero."""
    return n_groups * (packed_len(group_size, bits) + _SCALE_ZERO_NBYTES)


# --------------------------------------------------------------------------- checks


def _raise_if_bad_range(lo: float, hi: float) -> None:
    """Raise for NaN/inf or magnitudes that float16 scale/zero cannot represent.

    These reach the user (a diverging model), so they are :class:`KvplayError` (a ValueError).
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise KvplayError(NON_FINITE_MESSAGE)
    if max(-lo, hi) > FP16_MAX:
        raise KvplayError(
            f"cannot quantize values with magnitude above the float16 limit {FP16_MAX:g} "
            f"(got range [{lo:g}, {hi:g}])"
        )


def _round_to_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Round float32 ``x`` to float16, directed up (toward +inf) or down (toward -inf)."""
    h = x.to(torch.float16)
    hf = h.float()
    wrong = hf < x if up else hf > x
    target = torch.full_like(h, math.inf if up else -math.inf)
    return torch.where(wrong, torch.nextafter(h, target), h)


def _cast(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a float32 reconstruction to ``dtype``.

    Rounded-up scales can overshoot the input range by ~0.1%, so values right at the
    float16 limit are clamped rather than overflowing to inf.
    """
    if dtype == torch.float16:
        out = out.clamp_(-FP16_MAX, FP16_MAX)
    return out.to(dtype)


# --------------------------------------------------------------------------- integer


@dataclass
class QuantizedInt:
    """Asymmetric integer quantization of groups along the last dim."""

    packed: torch.Tensor  # uint8 (..., G, packed_len(g, bits))
    scale: torch.Tensor  # float16 (..., G, 1)
    zero: torch.Tensor  # float16 (..., G, 1)


FITS: tuple[str, ...] = ("minmax", "mse")
_FIT_ROUNDS = 4  # least-squares refits after the min/max start (measured: more rounds change < 1% of the MSE)


def quantize_int(x: torch.Tensor, bits: int, *, axis: int = -1, check_finite: bool = True,
                 fit: str = "minmax", meta: str = "fp16") -> QuantizedInt:
    """Quantize groups along ``axis`` (-1: the last dim, (..., G, g); -2: the second to last,
    (..., g, D) with one group per column) -> codes in [0, 2**bits - 1], packed along the last dim.

    With the stored float16 ``scale``/``zero``, every element satisfies
    ``|x - dequantize_int(q, bits, g, torch.float32)| <= scale / 2`` (up to float32 rounding):
    ``zero`` is the group min rounded down to float16, ``scale`` is ``(max - zero) / (2**bits - 1)``
    rounded up to float16, and codes are computed from the stored values. A group whose
    values all equal a float16-representable constant gets ``scale == 0`` and is exact.

    ``check_finite`` costs one host sync; with it off, NaN/inf or |x| > 65504 give garbage.

    ``fit="mse"`` starts from that min/max solution and refits each group's scale and zero by least
    squares on its codes (a few Lloyd rounds on the uniform grid, which may clip the extremes); a
    group keeps whichever stored (scale, zero) gives the smaller squared error, so its error is never
    above min/max's. Same format, same bytes, same decoder: only the encoder changes.

    ``meta="8bit"`` stores the scale as a uint8 code and the zero as an int8 in eighth steps (METAS above):
    the scale is the smallest code covering the range with the zero rounded down to an eighth of a step
    (at most one code above ``(max - min) / (2**bits - 1.125)``, and at least ``|min| / 15.9`` so the zero
    fits), so the bound above holds for groups whose scale stays under the top code (2**4.94; larger groups
    clip).
    """
    check_bits(bits)
    if fit not in FITS:
        raise ValueError(f"unknown fit {fit!r}; valid choices are {FITS}")
    if meta not in METAS:
        raise ValueError(f"unknown metadata {meta!r}; valid choices are {METAS}")
    if axis not in (-1, -2):
        raise ValueError(f"axis must be -1 or -2, got {axis}")
    if x.ndim < -axis or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (group) dim, got shape {tuple(x.shape)}")
    lead, g = x.shape[:-1], x.shape[-1]
    if x.numel() == 0:
        meta_shape = (*lead, 1) if axis == -1 else (*x.shape[:-2], 1, g)
        sdt, zdt = (torch.float16, torch.float16) if meta == "fp16" else (torch.uint8, torch.int8)
        return QuantizedInt(
            packed=torch.empty(*lead, packed_len(g, bits), dtype=torch.uint8, device=x.device),
            scale=torch.empty(*meta_shape, dtype=sdt, device=x.device),
            zero=torch.empty(*meta_shape, dtype=zdt, device=x.device),
        )

    levels = (1 << bits) - 1
    xf = x.float()  # (..., G, g)
    xmin, xmax = torch.aminmax(xf, dim=axis, keepdim=True)  # (..., G, 1) or (..., 1, D); NaN propagates
    if check_finite:
        lo, hi = torch.stack([xmin.amin(), xmax.amax()]).tolist()
        _raise_if_bad_range(lo, hi)

    if meta == "fp16":
        zero = _round_to_fp16(xmin, up=False)  # (..., G, 1) float16, <= min
        scale = _round_to_fp16((xmax - zero.float()) / levels, up=True)  # (..., G, 1) float16, >= 0
    else:                                     # uint8 scale code, int8 zero code
        scale, zero = _meta8_minmax(xmin, xmax, levels)
    scale_f, zero_f = _meta_float(scale, zero)
    safe_scale = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = torch.round((xf - zero_f) / safe_scale).clamp_(0, levels)
    if fit == "mse":
        scale, zero, codes = _refit(xf, codes, scale, zero, levels, axis)
    return QuantizedInt(packed=pack_bits(codes.to(torch.uint8), bits), scale=scale, zero=zero)


def _refit(xf: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int,
           axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares refits of (scale, zero) per group; keeps the stored pair with the smallest error.

    xf float32 and codes (float, in [0, levels]) have the input's shape; scale/zero (float16, or 8-bit codes)
    are broadcast along ``axis``. Returns (scale, zero, codes) in the same shapes and dtypes.
    """
    eight = scale.dtype == torch.uint8

    def sq_error(c, s, z):
        s, z = _meta_float(s, z)
        return (c * s + z - xf).square_().sum(dim=axis, keepdim=True)

    best_err = sq_error(codes, scale, zero)
    n = xf.shape[axis]
    mean_x = xf.mean(dim=axis, keepdim=True)
    for _ in range(_FIT_ROUNDS):
        mean_c = codes.mean(dim=axis, keepdim=True)
        var = (codes - mean_c).square().sum(dim=axis, keepdim=True)
        cov = ((codes - mean_c) * (xf - mean_x)).sum(dim=axis, keepdim=True)
        ok = (var > 0) & (cov > 0)
        slope = torch.where(ok, cov / torch.where(ok, var, torch.ones_like(var)), _meta_float(scale, zero)[0])
        if eight:
            s_new = _meta8_encode(slope.clamp(min=2.0 ** -40), torch.zeros_like(slope), up=False)[0]
            z_new = _meta8_encode(meta8_scale(s_new), mean_x - meta8_scale(s_new) * mean_c, up=False)[1]
        else:
            s_new = slope.clamp(0, FP16_MAX).to(torch.float16)
            z_new = (mean_x - s_new.float() * mean_c).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        s_f, z_f = _meta_float(s_new, z_new)
        safe = torch.where(s_f > 0, s_f, torch.ones_like(s_f))
        c_new = torch.round((xf - z_f) / safe).clamp_(0, levels)
        err = sq_error(c_new, s_new, z_new)
        better = err < best_err
        scale, zero = torch.where(better, s_new, scale), torch.where(better, z_new, zero)
        codes = torch.where(better, c_new, codes)
        best_err = torch.minimum(err, best_err)
        if n == 1:
            break
    return scale, zero, codes


def dequantize_int(q: QuantizedInt, bits: int, group_size: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct (..., group_size) in ``dtype``: ``codes * scale + zero`` computed in float32.

    ``group_size`` is the number of codes in each packed row (the last dim). ``out``, if given, is
    filled in place (a view into a larger buffer, say), saving a copy.
    """
    codes = unpack_bits(q.packed, bits, group_size).float()  # (..., g) float32
    scale, zero = _meta_float(q.scale, q.zero)
    x = codes.mul_(scale).add_(zero)
    if dtype == torch.float16:
        x = x.clamp_(-FP16_MAX, FP16_MAX)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


# --------------------------------------------------------------------------- fp8


@dataclass
class QuantizedFp8:
    """Per-row (per-token) absmax-scaled float8_e4m3fn quantization."""

    data: torch.Tensor  # float8_e4m3fn (..., D)
    scale: torch.Tensor  # float16 (..., 1): row absmax / 448, rounded up


def quantize_fp8(x: torch.Tensor, *, check_finite: bool = True) -> QuantizedFp8:
    """Quantize to float8_e4m3fn with a float16 per-row scale (absmax / 448 along the last dim).

    Error bound per element: ``|x - deq| <= absmax * 2**-4 + scale * 2**-10`` (3 mantissa
    bits give a half-ulp of 2**-4 relative for normals; the second term covers e4m3
    subnormals and only matters for rows whose scale hits the float16 floor). All-zero
    rows round trip exactly.
    """
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    xf = x.float()  # (..., D)
    absmax = xf.abs().amax(dim=-1, keepdim=True)  # (..., 1); NaN propagates
    if check_finite and absmax.numel() > 0:
        m = absmax.amax().item()
        _raise_if_bad_range(-m, m)

    scale = _round_to_fp16(absmax / FP8_MAX, up=True)  # (..., 1) float16
    scale_f = scale.float()
    safe_scale = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    data = (xf / safe_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (..., D)
    return QuantizedFp8(data=data, scale=scale)


def dequantize_fp8(q: QuantizedFp8, dtype: torch.dtype) -> torch.Tensor:
    """Reconstruct (..., D) in ``dtype``: ``data * scale`` in float32, then cast."""
    return _cast(q.data.float() * q.scale.float(), dtype)

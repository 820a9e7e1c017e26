"""llama.cpp's KV-cache types, bit for bit: ggml's block formats and its reference quantizers.

llama.cpp (`-ctk/-ctv`, Ollama's OLLAMA_KV_CACHE_TYPE, LM Studio) stores each token's keys and values in
blocks of QK = 32 consecutive elements along head_dim, one block per 32 elements of one token and head:

    type     block bytes  bits/elem  block layout (ggml-common.h)
    q8_0         34          8.5     d fp16, qs int8[32]                         x = d * q
    q4_0         18          4.5     d fp16, qs uint8[16] (two 4-bit codes each) x = d * (q - 8)
    q4_1         20          5.0     d fp16, m fp16, qs uint8[16]                x = d * q + m
    q5_0         22          5.5     d fp16, qh uint8[4] (5th bits), qs[16]      x = d * (q - 16)
    q5_1         24          6.0     d fp16, m fp16, qh uint8[4], qs[16]         x = d * q + m
    iq4_nl       18          4.5     d fp16, qs uint8[16]                        x = d * kvalues_iq4nl[q]
    f16        2 per element  16     the value in float16 (not bfloat16)

qs byte j holds element j in its low nibble and element j + 16 in its high nibble; bit e of qh (a
little-endian uint32) is the 5th bit of element e. The quantizers follow ggml-quants.c's
quantize_row_*_ref, which the CPU backend's KV-cache writes call (ggml-cpu/quants.c; q8_0 has an x86 SIMD
variant that computes 127/amax instead of 1/d and rounds ties to even). Every step is float32 in the C
source's order: the scale is computed in float32, the codes from that float32 scale (not from the float16 d
that is stored), and d and m are rounded to float16 to nearest even. Two things a compiled llama.cpp may do
differently, both only at exact rounding ties: fused multiply-adds (GCC contracts a*b + c under
-march=native) and the x86 q8_0 variant above. iq4_nl's reference (ntry = -1) picks each code from the
scale -max/127 by the table's midpoints, then sets d by weighted least squares (weights x^2), summed in
order; the wider scale search (ntry = 7) serves model weights, not the cache.

Rotation (llama.cpp PR #21038, src/llama-kv-cache.cpp): with a quantized K (or V) type and head_dim a
multiple of 64, llama.cpp multiplies keys (and queries) by an orthonormal Walsh-Hadamard matrix in chunks
of n elements along head_dim before the cache write; n is the largest power of two dividing head_dim for
K, and 64 for V (whose attention output is rotated back). LLAMA_ATTN_ROT_DISABLE=1 turns it off.
"""
from __future__ import annotations

import functools

import torch

QK = 32
TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
CODE_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "iq4_nl": 4}     # bits of one code
# The parts each type stores, in storage order (payload first: codes, then high bits; metadata: d, m).
PARTS = {"f16": ("x",), "q8_0": ("qs", "d"), "q4_0": ("qs", "d"), "q4_1": ("qs", "d", "m"),
         "q5_0": ("qs", "qh", "d"), "q5_1": ("qs", "qh", "d", "m"), "iq4_nl": ("qs", "d")}
METADATA = ("d", "m")
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15


def quantized(kind: str) -> bool:
    """Whether llama.cpp counts this cache type as quantized (ggml_is_quantized): all but f16."""
    return kind != "f16"


def bits_per_element(kind: str) -> float:
    return 16.0 if kind == "f16" else BLOCK_BYTES[kind] * 8 / QK


def row_nbytes(kind: str, head_dim: int) -> tuple[int, int]:
    """(payload, metadata) bytes of one token's head_dim elements of one head (f16: all payload)."""
    if kind == "f16":
        return 2 * head_dim, 0
    blocks = head_dim // QK
    meta = 2 * sum(p in METADATA for p in PARTS[kind])
    return blocks * (BLOCK_BYTES[kind] - meta), blocks * meta


# ---------------------------------------------------------------------------- rounding as C does it

def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, ties away from zero (torch.round ties to even)."""
    t = torch.trunc(v)
    return t + torch.where((v - t).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """`d ? 1.0f/d : 0.0f` in float32."""
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _signed_max(xb: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude, the first on ties (ggml's `if (amax < fabsf(v))`), (..., 1)."""
    return xb.gather(-1, xb.abs().argmax(-1, keepdim=True))


# ---------------------------------------------------------------------------- packing

def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes < 16 -> (..., 16) uint8: byte j = code j | code (j + 16) << 4."""
    c = codes.to(torch.uint8)
    return (c[..., :16] & 0x0F) | ((c[..., 16:] & 0x0F) << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 -> (..., 32) int32 low nibbles first (elements 0..15), then high (16..31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)


_BIT = torch.arange(8, dtype=torch.uint8)


def _pack_high_bits(codes: torch.Tensor) -> torch.Tensor:
    """(..., 32) 5-bit codes -> qh (..., 4) uint8: bit e of the little-endian uint32 is bit 4 of element e."""
    bits = ((codes.to(torch.uint8) >> 4) & 1).unflatten(-1, (4, 8))            # (..., 4, 8)
    return (bits << _BIT.to(codes.device)).sum(-1, dtype=torch.uint8)


def _unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh (..., 4) uint8 -> (..., 32) int32 bit values 0 or 16."""
    bits = (qh.unsqueeze(-1) >> _BIT.to(qh.device)) & 1                         # (..., 4, 8)
    return bits.flatten(-2).to(torch.int32) << 4


# ---------------------------------------------------------------------------- quantize (x float32 (..., nb, 32))

def _q8_0(xb):
    d = xb.abs().amax(-1, keepdim=True) / 127
    qs = _roundf(xb * _inverse(d)).to(torch.int8)
    return {"qs": qs, "d": d.to(torch.float16)}


def _q_sym(xb, bits: int):
    """q4_0 / q5_0: d = max / -2^(bits-1), code = MIN(2^bits - 1, (int8_t)(x * id + 2^(bits-1) + 0.5))."""
    half = 1 << (bits - 1)
    d = _signed_max(xb) / -half
    codes = torch.trunc(xb * _inverse(d) + (half + 0.5)).clamp_(max=2 * half - 1)
    out = {"qs": _pack_nibbles(codes), "d": d.to(torch.float16)}
    if bits == 5:
        out["qh"] = _pack_high_bits(codes)
    return out


def _q_affine(xb, bits: int):
    """q4_1 / q5_1: d = (max - min) / (2^bits - 1), m = min, code = (x - min) * id + 0.5 truncated."""
    lo, hi = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
    d = (hi - lo) / ((1 << bits) - 1)
    # q4_1 clamps with MIN(15, ...); q5_1 does not, and its codes never pass 31 (the clamp is then a no-op)
    codes = torch.trunc((xb - lo) * _inverse(d) + 0.5).clamp_(max=(1 << bits) - 1)
    out = {"qs": _pack_nibbles(codes), "d": d.to(torch.float16), "m": lo.to(torch.float16)}
    if bits == 5:
        out["qh"] = _pack_high_bits(codes)
    return out


@functools.cache
def _kvalues(device) -> torch.Tensor:
    return torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=device)


def iq4nl_index(al: torch.Tensor) -> torch.Tensor:
    """best_index_int8(16, kvalues_iq4nl, al) of the vendored ggml: the nearest table entry, the upper one on
    a tie, computed as the C does (x - val[mu-1] < val[mu] - x)."""
    kv = _kvalues(al.device)
    mu = (al.unsqueeze(-1) >= kv).sum(-1).clamp_(1, 15)                         # val[mu-1] <= al < val[mu]
    lower = (al - kv[mu - 1]) < (kv[mu] - al)
    idx = torch.where(lower, mu - 1, mu)
    idx = torch.where(al <= kv[0], torch.zeros_like(idx), idx)
    return torch.where(al >= kv[15], torch.full_like(idx, 15), idx)


def _iq4_nl(xb):
    kv = _kvalues(xb.device)
    amax = xb.abs().amax(-1, keepdim=True)
    empty = amax < GROUP_MAX_EPS                                               # scale 0, codes 0
    d0 = _signed_max(xb) / KVALUES_IQ4NL[0]
    idx = iq4nl_index(xb * (1 / torch.where(empty, torch.ones_like(d0), d0)))
    idx = torch.where(empty, torch.zeros_like(idx), idx)
    q = kv[idx]
    wq = (xb * xb) * q                                                          # weight = x^2, then w * q
    sumqx = torch.zeros_like(amax)
    sumq2 = torch.zeros_like(amax)
    for j in range(QK):                                                         # summed in order, as the C loop
        sumqx = sumqx + wq[..., j:j + 1] * xb[..., j:j + 1]
        sumq2 = sumq2 + wq[..., j:j + 1] * q[..., j:j + 1]
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), torch.zeros_like(sumq2))
    d = torch.where(empty, torch.zeros_like(d), d)
    return {"qs": _pack_nibbles(idx), "d": d.to(torch.float16)}


_QUANTIZERS = {"q8_0": _q8_0, "q4_0": lambda xb: _q_sym(xb, 4), "q5_0": lambda xb: _q_sym(xb, 5),
               "q4_1": lambda xb: _q_affine(xb, 4), "q5_1": lambda xb: _q_affine(xb, 5), "iq4_nl": _iq4_nl}


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """x (..., D) with D a multiple of 32 -> the type's parts in PARTS order: (..., D/32, bytes) uint8/int8
    codes and (..., D/32, 1) float16 d and m; f16: (x as float16,)."""
    if kind == "f16":
        return (x.to(torch.float16),)
    parts = _QUANTIZERS[kind](x.float().unflatten(-1, (-1, QK)))
    return tuple(parts[p] for p in PARTS[kind])


def dequantize(parts: tuple[torch.Tensor, ...], kind: str) -> torch.Tensor:
    """Inverse of quantize, float32 (..., D), as ggml's dequantize_row_* computes it."""
    if kind == "f16":
        return parts[0].float()
    p = dict(zip(PARTS[kind], parts))
    d = p["d"].float()
    if kind == "q8_0":
        x = p["qs"].float() * d
    elif kind == "iq4_nl":
        x = d * _kvalues(d.device)[_unpack_nibbles(p["qs"])]
    else:
        codes = _unpack_nibbles(p["qs"])
        if "qh" in p:
            codes = codes | _unpack_high_bits(p["qh"])
        if "m" in p:
            x = codes.float() * d + p["m"].float()
        else:
            x = (codes - (16 if "qh" in p else 8)).float() * d
    return x.flatten(-2)


# ---------------------------------------------------------------------------- rotation

@functools.cache
def walsh_hadamard(n: int) -> torch.Tensor:
    """ggml_gen_hadamard: the orthonormal (n, n) Walsh-Hadamard matrix, n a power of two, float32, symmetric."""
    h = torch.zeros(n, n, dtype=torch.float32)
    h[0, 0] = 1.0 / n ** 0.5
    s = 1
    while s < n:
        h[s:2 * s, :s] = h[:s, :s]
        h[:s, s:2 * s] = h[:s, :s]
        h[s:2 * s, s:2 * s] = -h[:s, :s]
        s *= 2
    return h


def rotation_size(head_dim: int, part: str) -> int | None:
    """llama.cpp's chunk size for rotating keys ("k") or values ("v"); None where it does not rotate."""
    if head_dim % 64:
        return None
    if part == "v":
        return 64
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def rotation(head_dim: int, n: int, device=None) -> torch.Tensor:
    """(head_dim, head_dim) block diagonal of n x n Walsh-Hadamard blocks: x @ R rotates each chunk (R = R.T = R^-1)."""
    return torch.block_diag(*[walsh_hadamard(n)] * (head_dim // n)).to(device)

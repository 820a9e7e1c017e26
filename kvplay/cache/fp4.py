"""fp4 e2m1 codes: values rounded onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}, packed two to a byte, and read back.

Pure functions shared by the fp4 KV caches kvplay emulates (kvplay/cache/methods/vllm_nvfp4.py and
methods/sglang_fp4.py); this module registers nothing. A code is 4 bits: the sign (bit 3) and the index of the
magnitude in E2M1 (bits 0-2). Magnitudes past 6 saturate to 6. Where a value lies half way between two
neighbours the engines differ, so the rule is named:

    "even"  round half to even (the neighbour whose index, i.e. mantissa bit, is even): Blackwell's
            cvt.rn.satfinite.e2m1x2.f32, and vLLM's reference cast_to_fp4 spelled out,
            0.25->0  0.75->1  1.25->1  1.75->2  2.5->2  3.5->4  5->4
    "up"    half away from zero: SGLang's magnitude = sum(|x| >= bounds),
            0.25->0.5  0.75->1  1.25->1.5  1.75->2  2.5->3  3.5->4  5->6

Two codes share a byte with the even element in the low nibble, as both engines pack (vLLM's cvt writes
(x1 << 4) | x0, SGLang's x[1::2] << 4 + x[0::2]).
"""
from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)     # magnitudes by index
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # between index i and i + 1
E2M1_MAX = 6.0
BLOCK = 16                                            # values per block scale, in both engines
TIES = ("even", "up")


def e2m1_codes(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """x float32 (already divided by its scale) -> uint8 codes of the same shape, rounding to nearest."""
    if ties not in TIES:
        raise ValueError(f"ties={ties!r} is not a rounding rule; choose 'even' or 'up'.")
    a = x.abs().unsqueeze(-1)
    mid = x.new_tensor(MIDPOINTS)
    if ties == "up":
        index = (a >= mid).sum(-1)
    else:   # a tie moves up only onto an even index: the midpoints after odd indices (0.75, 1.75, 3.5) take >=
        index = (a > mid[0::2]).sum(-1) + (a >= mid[1::2]).sum(-1)
    return (index | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float32 values."""
    magnitude = torch.tensor(E2M1, device=codes.device)[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(..., D) uint8 codes -> (..., D / 2) bytes, element 2j in the low nibble of byte j."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(..., D / 2) bytes -> (..., D) uint8 codes (the inverse of pack)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D / 16, 16): the engines' scale blocks, 16 consecutive values of one head."""
    return x.unflatten(-1, (-1, BLOCK))

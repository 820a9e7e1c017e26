"""Bit packing of integer codes (2, 3, 4 or 8 bits) into uint8, the layout kvplay's store and its C kernels read
(8 3-bit codes in 3 bytes, the first in the lowest bits). Split from kvplay/cache/quant.py, which re-exports it."""
from __future__ import annotations

import functools

import torch

__all__ = ["INT_BITS", "check_bits", "packed_len", "pack_bits", "unpack_bits"]

INT_BITS: tuple[int, ...] = (2, 3, 4, 8)
# How many codes fill a whole number of bytes, per bit width (3 bits: 8 codes -> 3 bytes).
_CODES_PER_CHUNK: dict[int, int] = {2: 4, 3: 8, 4: 2, 8: 1}


def check_bits(bits: int) -> None:
    if bits not in INT_BITS:
        raise ValueError(f"unsupported bit width {bits!r}; valid choices are {INT_BITS}")


def packed_len(n: int, bits: int) -> int:
    """Bytes needed to pack ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    check_bits(bits)
    if n < 0:
        raise ValueError(f"number of codes must be >= 0, got {n}")
    return (n * bits + 7) // 8


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``t`` up to ``size``."""
    pad = size - t.shape[-1]
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:-1], pad)], dim=-1)


@functools.cache
def _shifts(stop: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cached bit offsets ``range(0, stop, step)``, e.g. (0, 2, 4, 6) for 2-bit codes in a byte."""
    return torch.arange(0, stop, step, dtype=dtype, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (values < 2**bits) along the last dim: (..., n) -> (..., packed_len(n, bits)).

    3 bits: a little-endian bit stream (8 codes in 3 bytes, the first code in the lowest bits).
    2 and 4 bits: planar, byte j holds codes j, j+P, j+2P, ... (lowest bits first) for P bytes,
    so unpacking needs no interleave and runs on 64-bit words.
    Values >= 2**bits are not checked and corrupt their neighbours.
    """
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got {codes.dtype}")
    if codes.ndim == 0:
        raise ValueError("codes must have at least one dimension")
    if bits == 8:
        return codes.contiguous()

    lead, n = codes.shape[:-1], codes.shape[-1]
    per_chunk = _CODES_PER_CHUNK[bits]
    n_chunks = -(-n // per_chunk)
    chunks = _pad_last(codes, n_chunks * per_chunk).reshape(*lead, n_chunks, per_chunk)

    if bits == 3:
        # 8 codes -> one 24-bit word -> 3 bytes.
        code_shifts = _shifts(24, 3, torch.int32, codes.device)
        words = (chunks.to(torch.int32) << code_shifts).sum(dim=-1, dtype=torch.int32)  # (..., C)
        byte_shifts = _shifts(24, 8, torch.int32, codes.device)
        packed = ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)  # (..., C, 3)
        # Padding codes sit in the high bits, so bytes past ceil(3n/8) are zero: drop them.
        return packed.reshape(*lead, n_chunks * 3)[..., : packed_len(n, bits)].contiguous()

    # 2 / 4 bits, planar: with P = packed_len bytes, byte j holds codes j, j + P, j + 2P, ... so that
    # unpacking is one broadcast shift whose output is already in order (see unpack_bits).
    per_byte = per_chunk
    planes = _pad_last(codes, n_chunks * per_byte).reshape(*lead, per_byte, n_chunks)  # (..., k, P)
    packed = planes[..., 0, :].clone()
    for slot in range(1, per_byte):
        packed |= planes[..., slot, :] << (slot * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: (..., packed_len(n, bits)) uint8 -> (..., n) uint8."""
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be torch.uint8, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension")
    expected = packed_len(n, bits)
    if packed.shape[-1] != expected:
        raise ValueError(
            f"packed last dim is {packed.shape[-1]} but {n} codes of {bits} bits need {expected} bytes"
        )
    if bits == 8:
        return packed

    lead = packed.shape[:-1]
    if bits == 3:
        n_chunks = -(-n // 8)
        chunks = _pad_last(packed, n_chunks * 3).reshape(*lead, n_chunks, 3).to(torch.int32)
        words = chunks[..., 0] | (chunks[..., 1] << 8) | (chunks[..., 2] << 16)  # (..., C)
        code_shifts = _shifts(24, 3, torch.int32, packed.device)
        codes = ((words.unsqueeze(-1) >> code_shifts) & 0b111).to(torch.uint8)  # (..., C, 8)
        return codes.reshape(*lead, n_chunks * 8)[..., :n]

    per_byte = 8 // bits
    shifts = _shifts(8, bits, torch.int64, packed.device)[:, None]  # (k, 1)
    width = packed.shape[-1]
    if width and width % 8 == 0 and packed.is_contiguous():
        # Eight bytes at a time: shifting a 64-bit word moves bits across byte boundaries, but the
        # per-byte mask keeps, in each byte, only the bits that came from that same byte.
        words = packed.view(torch.int64)                                  # (..., P/8)
        mask = int.from_bytes(bytes([(1 << bits) - 1]) * 8, "little", signed=True)
        planes = (words.unsqueeze(-2) >> shifts) & mask                   # (..., k, P/8)
        codes = planes.view(torch.uint8)                                  # (..., k, P)
    else:
        codes = (packed.unsqueeze(-2).to(torch.int64) >> shifts) & ((1 << bits) - 1)
        codes = codes.to(torch.uint8)                                     # (..., k, P)
    return codes.reshape(*lead, per_byte * width)[..., :n]



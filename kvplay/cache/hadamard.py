"""Orthonormal Hadamard rotations: kvplay rotates keys and values by them (rotation=hadamard) before quantizing,
so an outlier channel's energy spreads over a block of channels; llama.cpp's cache rotation is the same matrix
(kvplay/cache/ggml.py). Split from kvplay/cache/quant.py, which re-exports them."""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["hadamard", "rotate", "unrotate"]


@functools.cache
def hadamard(
    dim: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Orthonormal Hadamard-type matrix (dim, dim) with ``H @ H.T == I``.

    Sylvester construction scaled by ``1/sqrt(n)``; if ``dim`` is not a power of two, a
    block diagonal of Sylvester blocks whose size is the largest power of two dividing
    ``dim``. Cached per (dim, device, dtype): treat the result as read-only. Built outside inference mode even
    when first asked for inside it (a decode's), so that a later fit with autograd (rotations.py) may save it.
    """
    with torch.inference_mode(False):
        return _sylvester(dim).to(device=device, dtype=dtype)


def _sylvester(dim: int) -> torch.Tensor:
    if dim <= 0:
        raise ValueError(f"Hadamard dim must be positive, got {dim}")
    block = dim & -dim  # largest power of two dividing dim
    if block == 1:
        raise ValueError(f"Hadamard rotation needs an even head_dim, got {dim}")
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.kron(h, base)
    h = h / math.sqrt(block)
    return torch.kron(torch.eye(dim // block, dtype=torch.float64), h)  # (dim, dim) block diagonal


def _check_rot(x: torch.Tensor, H: torch.Tensor) -> None:
    if H.ndim != 2 or H.shape[0] != H.shape[1] or x.shape[-1] != H.shape[0]:
        raise ValueError(
            f"rotation needs a square (D, D) matrix matching x's last dim; "
            f"got x {tuple(x.shape)} and H {tuple(H.shape)}"
        )


def rotate(x: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``x @ H`` for x (..., D), computed in float32 and returned in ``x.dtype``."""
    _check_rot(x, H)
    return (x.float() @ H.float()).to(x.dtype)


def unrotate(x: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``x @ H.T`` for x (..., D) (inverse of :func:`rotate`), float32 compute, ``x.dtype`` out."""
    _check_rot(x, H)
    return (x.float() @ H.float().mT).to(x.dtype)

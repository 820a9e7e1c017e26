"""Exact cache bytes: measured from a live cache, and predicted from the formulas.

Each cache method counts its own layers and owns its formula (kvplay/cache/methods/);
this module sums over layers and dispatches. Both count the same things, in the same categories:
  payload         quantized codes (bit-packed), or fp8 values
  metadata        scales and zero points
  full_precision  16-bit tokens: the residual window, attention sinks, unquantized caches
A layer of a class no registered method declares is an error, never counted as 16-bit.
CacheBytes.allocated_bytes adds spare capacity: kvplay's block buffers grow ahead of use (at most one
block per layer and stream, or 16 tokens' worth for one-token blocks), and so do the preallocated 16-bit
buffers of baseline:store=prealloc (an eighth of the need, at least 256 tokens); transformers' caches
concatenate to size, so for them allocated == in use.
"""
from __future__ import annotations

from transformers.cache_utils import Cache

from kvplay.cache.arch import Arch
from kvplay.cache.methods.base import CacheBytes, method_for_layer
from kvplay.cache.spec import CacheSpec, parse_spec

__all__ = ["CacheBytes", "layer_nbytes", "cache_nbytes", "analytic_nbytes", "bits_per_element"]


def layer_nbytes(layer) -> CacheBytes:
    """Exact bytes one cache layer holds now, counted by the method that created it."""
    return method_for_layer(layer).layer_nbytes(layer)


def cache_nbytes(cache: Cache) -> CacheBytes:
    """Measured bytes a cache holds now, summed over layers: in use by category, plus .allocated_bytes."""
    total = CacheBytes()
    for layer in cache.layers:
        total = total + layer_nbytes(layer)
    return total


def analytic_nbytes(spec: CacheSpec | str, arch: Arch, tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                    prefill: int | None = None) -> CacheBytes:
    """Bytes the cache should hold after `tokens` tokens, from the formulas alone.

    `prefill` matters only for transformers' QuantizedCache, whose residual window
    restarts at the prompt: it assumes a prefill of `prefill` tokens (default: all
    of them) followed by one-token decode steps.
    """
    spec = parse_spec(spec)
    return spec.method.analytic_nbytes(spec, arch, tokens, batch=batch, dtype_bytes=dtype_bytes, prefill=prefill)


def bits_per_element(nbytes: CacheBytes | int, arch: Arch, tokens: int, batch: int = 1) -> float:
    """Average stored bits per cached K/V element, metadata and window included: the one formula every view uses.
    nbytes: a CacheBytes or its total; arch: anything with elements_per_token (an Arch, a GGUF's shape)."""
    total = nbytes.total if isinstance(nbytes, CacheBytes) else nbytes
    return 8 * total / (arch.elements_per_token * tokens * batch)

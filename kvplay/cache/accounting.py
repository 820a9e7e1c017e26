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
Sliding-window layers (Gemma 3 has 15 of 18) are kept in 16-bit by every method that runs on such a model, in
transformers' DynamicSlidingWindowLayer, which stops growing at its window: analytic_nbytes adds their bytes to
the method's formula (which covers the full-attention layers), and bits_per_element divides by the elements
every layer holds (Arch.elements), so a 16-bit cache is exactly 16 bits on any model.
"""
from __future__ import annotations

from transformers.cache_utils import Cache

from kvplay.cache.arch import Arch, split_words
from kvplay.cache.methods.base import CacheBytes, method_for_layer
from kvplay.cache.spec import CacheSpec, parse_spec

__all__ = ["CacheBytes", "layer_nbytes", "cache_nbytes", "analytic_nbytes", "bits_per_element", "layer_split"]


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
    full = spec.method.analytic_nbytes(spec, arch, tokens, batch=batch, dtype_bytes=dtype_bytes, prefill=prefill)
    return full + CacheBytes(full_precision=arch.sliding_nbytes(tokens, batch, dtype_bytes))


def bits_per_element(nbytes: CacheBytes | int, arch: Arch, tokens: int, batch: int = 1) -> float:
    """Average stored bits per cached K/V element, metadata, window and 16-bit sliding layers included: the one
    formula every view uses. nbytes: a CacheBytes or its total; arch: anything with elements(tokens, batch) (an
    Arch, a GGUF's shape)."""
    total = nbytes.total if isinstance(nbytes, CacheBytes) else nbytes
    return 8 * total / arch.elements(tokens, batch)


def layer_split(cache: Cache) -> dict:
    """How a live cache stores its layers, as data for the cards: {"quantized": n, "sliding": n, "window": tokens,
    "text": "3 global layers quantized, 15 sliding layers kept in 16-bit (512 tokens each)"} ("text" is "" when
    no layer is a sliding one, or when the cache is the 16-bit reference)."""
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    window = max((getattr(layer, "sliding_window", 0) for layer in sliding), default=0)
    full = len(cache.layers) - len(sliding)
    quantized = full if any(method_for_layer(layer).quantized for layer in cache.layers) else 0
    text = split_words(full, len(sliding), window) if sliding and quantized else ""
    return {"quantized": quantized, "sliding": len(sliding), "window": window, "text": text}

"""Exact cache bytes: measured from a live cache, and predicted from the formulas.

Both count the same things, in the same categories:
  payload         quantized codes (bit-packed), or fp8 values
  metadata        scales and zero points
  full_precision  16-bit tokens: the residual window, attention sinks, unquantized caches
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import singledispatch

import torch
from transformers.cache_utils import Cache, DynamicLayer, QuantizedLayer

from ..arch import Arch
from .engine import KVPlayLayer, TensorFormat
from .hf import hqq_padded_numel
from .quant import packed_len
from .spec import CacheSpec, parse_spec


@dataclass(frozen=True)
class CacheBytes:
    payload: int = 0
    metadata: int = 0
    full_precision: int = 0

    @property
    def total(self) -> int:
        return self.payload + self.metadata + self.full_precision

    def __add__(self, other: "CacheBytes") -> "CacheBytes":
        return CacheBytes(self.payload + other.payload, self.metadata + other.metadata,
                          self.full_precision + other.full_precision)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@singledispatch
def layer_nbytes(layer) -> CacheBytes:
    raise TypeError(f"kvplay cannot count the bytes of a {type(layer).__name__} cache layer.")


@layer_nbytes.register
def _(layer: DynamicLayer) -> CacheBytes:
    if not layer.is_initialized:
        return CacheBytes()
    return CacheBytes(full_precision=_nbytes(layer.keys, layer.values))


@layer_nbytes.register
def _(layer: KVPlayLayer) -> CacheBytes:
    if not layer.is_initialized:
        return CacheBytes()
    (pk, mk), (pv, mv) = layer.store_k.nbytes(), layer.store_v.nbytes()
    return CacheBytes(pk + pv, mk + mv, _nbytes(layer.sink_k, layer.sink_v, layer.keys, layer.values))


def _hf_quantized(q) -> tuple[int, int]:
    """(payload, metadata) of one transformers-quantized tensor: quanto QTensor or HQQ (data, meta)."""
    if q is None:
        return 0, 0
    if isinstance(q, tuple):  # HQQ: packed uint8 data and a meta dict with scale and zero
        data, meta = q
        return _nbytes(data), _nbytes(meta.get("scale"), meta.get("zero"))
    data = q._data  # quanto: a PackedTensor wrapping the real uint8 storage; element_size() of q lies
    return _nbytes(getattr(data, "_data", data)), _nbytes(q._scale, q._shift)


@layer_nbytes.register
def _(layer: QuantizedLayer) -> CacheBytes:
    if not layer.is_initialized:
        return CacheBytes()
    pk, mk = _hf_quantized(layer._quantized_keys)
    pv, mv = _hf_quantized(layer._quantized_values)
    return CacheBytes(pk + pv, mk + mv, _nbytes(layer.keys, layer.values))


def cache_nbytes(cache: Cache) -> CacheBytes:
    """Measured bytes a cache holds now, summed over layers (storage in use, not spare capacity)."""
    total = CacheBytes()
    for layer in cache.layers:
        total = total + layer_nbytes(layer)
    return total


# ---------------------------------------------------------------------------- formulas

def _stored_bytes(fmt: TensorFormat, tokens: int, head_dim: int) -> tuple[int, int]:
    """(payload, metadata) for `tokens` quantized tokens of one head (tokens a multiple of the block)."""
    if fmt.fmt == "fp8":
        return tokens * head_dim, tokens * 2
    if fmt.grouping == "channel":  # codes packed along head_dim; one scale and zero per channel per block
        return tokens * packed_len(head_dim, fmt.bits), (tokens // fmt.group) * head_dim * 4
    groups = head_dim // fmt.group
    return tokens * groups * packed_len(fmt.group, fmt.bits), tokens * groups * 4


def analytic_nbytes(spec: CacheSpec | str, arch: Arch, tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                    prefill: int | None = None) -> CacheBytes:
    """Bytes the cache should hold after `tokens` tokens, from the formulas alone.

    `prefill` matters only for transformers' QuantizedCache, whose residual window
    restarts at the prompt: it assumes a prefill of `prefill` tokens (default: all
    of them) followed by one-token decode steps.
    """
    spec = parse_spec(spec)
    heads = arch.layers * batch * arch.kv_heads  # independent (layer, sequence, head) streams
    d = arch.head_dim
    if spec.backend == "dynamic":
        return CacheBytes(full_precision=2 * heads * tokens * d * dtype_bytes)
    if spec.backend in ("quanto", "hqq"):
        prefill = tokens if prefill is None else min(prefill, tokens)
        residual = (tokens - prefill) % spec.residual if spec.residual else 0
        per_tensor = batch * arch.kv_heads * (tokens - residual) * d      # one layer's keys (or values)
        numel = 0
        for axis in (spec.axis_key, spec.axis_value):
            if spec.backend == "hqq" and axis == 1 and per_tensor > 0:      # see PaddedHQQLayer
                stored = hqq_padded_numel(per_tensor, spec.group, spec.scheme.bits)
            elif spec.backend == "quanto":  # quanto packs 8/bits group rows per byte row, rounding the rows up
                rows_per_byte = 8 // spec.scheme.bits
                stored = -(-(per_tensor // spec.group) // rows_per_byte) * rows_per_byte * spec.group
            else:
                stored = per_tensor
            numel += arch.layers * stored
        groups = 2 * arch.layers * (per_tensor // spec.group)  # padding groups of HQQ carry metadata too
        if spec.backend == "hqq":
            groups = numel // spec.group
        return CacheBytes(payload=numel * spec.scheme.bits // 8,
                          metadata=groups * 2 * dtype_bytes,
                          full_precision=2 * heads * residual * d * dtype_bytes)
    layer = KVPlayLayer(spec)
    sink = min(tokens, spec.sink)
    quantized = layer.block * (max(0, tokens - sink - spec.residual) // layer.block)
    window = tokens - sink - quantized
    pk, mk = _stored_bytes(layer.key_fmt, quantized, d)
    pv, mv = _stored_bytes(layer.value_fmt, quantized, d)
    return CacheBytes(payload=heads * (pk + pv), metadata=heads * (mk + mv),
                      full_precision=2 * heads * (sink + window) * d * dtype_bytes)


def bits_per_element(nbytes: CacheBytes, arch: Arch, tokens: int, batch: int = 1) -> float:
    """Average stored bits per cached K/V element, metadata and window included."""
    return 8 * nbytes.total / (arch.elements_per_token * tokens * batch)

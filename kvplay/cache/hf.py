"""transformers' own QuantizedCache (quanto and HQQ backends), the reference users know.

One shim, for an upstream limitation rather than a behaviour change: HQQ bit-packs
rows of groups in chunks (2 rows per byte at 4 bits, 4 at 2 bits) and crashes when
the number of groups is not a multiple of that, which happens for most batch sizes
and token counts with per-token grouping. PaddedHQQLayer pads the flattened tensor
with whole zero groups before quantizing and drops them after dequantizing; the
grouping, rounding and residual behaviour are HQQ's and transformers' own.
"""
from __future__ import annotations

import torch
from transformers import QuantizedCache
from transformers.cache_utils import HQQQuantizedLayer

from ..errors import KvplayError
from .spec import CacheSpec

HQQ_ROWS_PER_PACK = {8: 1, 4: 2, 3: 10, 2: 4, 1: 8}


def hqq_padded_numel(numel: int, group: int, nbits: int) -> int:
    """Elements HQQ stores for a per-token (axis 1) tensor of `numel` elements, padding included."""
    chunk = group * HQQ_ROWS_PER_PACK[nbits]
    return -(-numel // chunk) * chunk


class PaddedHQQLayer(HQQQuantizedLayer):
    def _quantize(self, tensor, axis):
        if axis != 1:  # axis 0 packs along group_size rows, which always divides
            return super()._quantize(tensor, axis)
        flat = tensor.reshape(1, -1)                                  # same groups: runs of q_group_size elements
        padded = hqq_padded_numel(flat.shape[1], self.q_group_size, self.nbits)
        flat = torch.nn.functional.pad(flat, (0, padded - flat.shape[1]))
        qtensor, meta = super()._quantize(flat, axis)
        meta["kvplay_shape"] = tensor.shape
        return qtensor, meta

    def _dequantize(self, qtensor):
        tensor = super()._dequantize(qtensor)
        shape = qtensor[1].get("kvplay_shape")
        return tensor if shape is None else tensor[:, :shape.numel()].reshape(shape)


def build_hf_cache(spec: CacheSpec, config) -> QuantizedCache:
    kwargs = dict(nbits=spec.scheme.bits, axis_key=spec.axis_key, axis_value=spec.axis_value,
                  q_group_size=spec.group, residual_length=spec.residual)
    try:
        cache = QuantizedCache(backend=spec.backend, config=config, **kwargs)
    except ValueError as exc:
        if "only supported for models with only full attention" in str(exc):
            raise KvplayError(f"{spec}: transformers' QuantizedCache refuses models with sliding-window or chunked "
                              "attention layers; use a kvplay-* spec, which keeps those layers in 16-bit.") from exc
        raise KvplayError(f"{spec}: {exc}") from exc
    if spec.backend == "hqq":
        cache.layers = [PaddedHQQLayer(**kwargs) for _ in cache.layers]
    return cache

"""transformers' own QuantizedCache (quanto and HQQ backends), the reference users know.

TransformersQuantized is the part both backends share (options, build, byte counting,
read-back, reproduce snippet); methods/quanto.py and methods/hqq.py add their axis
conventions, group checks and byte formulas.

MemoizedDequantize, for time rather than behaviour: QuantizedLayer.update dequantizes the whole quantized
history on every step, although it changes only when the residual window is flushed. Where no step is
timed (Compare's lockstep rows, kvplay.cache.rows.memoized), the layer keeps the last dequantized tensors
and hands out the very same values again; Compare times each cache afterwards with it off, as shipped.

One shim, for an upstream limitation rather than a behaviour change: HQQ bit-packs
rows of groups in chunks (2 rows per byte at 4 bits, 4 at 2 bits) and crashes when
the number of groups is not a multiple of that, which happens for most batch sizes
and token counts with per-token grouping. PaddedHQQLayer pads the flattened tensor
with whole zero groups before quantizing and drops them after dequantizing; the
grouping, rounding and residual behaviour are HQQ's and transformers' own.
"""
from __future__ import annotations

import json

import torch
from transformers import QuantizedCache
from transformers.cache_utils import HQQQuantizedLayer

from kvplay.cache.methods.base import SNIPPET_HEAD, SNIPPET_LOAD, CacheBytes, CacheMethod, tensor_nbytes
from kvplay.errors import KvplayError

HQQ_ROWS_PER_PACK = {8: 1, 4: 2, 3: 10, 2: 4, 1: 8}


def hqq_padded_numel(numel: int, group: int, nbits: int) -> int:
    """Elements HQQ stores for a per-token (axis 1) tensor of `numel` elements, padding included."""
    chunk = group * HQQ_ROWS_PER_PACK[nbits]
    return -(-numel // chunk) * chunk


class MemoizedDequantize:
    """Mixin for transformers' quantized layers: while `memoize` is on, each quantized tensor (replaced only at a
    flush) is dequantized once and its result handed out again; off (the default), every step dequantizes."""

    memoize = False

    def _dequantize(self, qtensor):
        if not self.memoize:
            return super()._dequantize(qtensor)
        memo = self.__dict__.setdefault("_dequantized", {})      # id -> (quantized tensor, dequantized)
        hit = memo.get(id(qtensor))
        if hit is not None and hit[0] is qtensor:
            return hit[1]
        out = super()._dequantize(qtensor)
        live = (self._quantized_keys, self._quantized_values)
        for key in [k for k, (q, _) in memo.items() if not any(q is x for x in live)]:
            del memo[key]                                        # results of tensors a flush replaced
        memo[id(qtensor)] = (qtensor, out)
        return out


class PaddedHQQLayer(MemoizedDequantize, HQQQuantizedLayer):
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


def _quantized_parts(q) -> tuple[int, int]:
    """(payload, metadata) of one transformers-quantized tensor: quanto QTensor or HQQ (data, meta)."""
    if q is None:
        return 0, 0
    if isinstance(q, tuple):  # HQQ: packed uint8 data and a meta dict with scale and zero
        data, meta = q
        return tensor_nbytes(data), tensor_nbytes(meta.get("scale"), meta.get("zero"))
    data = q._data  # quanto: a PackedTensor wrapping the real uint8 storage; element_size() of q lies
    return tensor_nbytes(getattr(data, "_data", data)), tensor_nbytes(q._scale, q._shift)


class TransformersQuantized(CacheMethod):
    """transformers' QuantizedCache with one backend (`name` is transformers' backend name)."""

    family = "transformers"          # where people meet it (the UI's cache picker groups by this)
    full_attention_only = True       # transformers' QuantizedCache refuses other layer types
    formula_any_arrival = False      # its residual restarts at the prompt: the formula assumes prefill + decode
    window = "flush"                 # residual_length tokens accumulate, then the whole cache is re-quantized
    per_token_axis: int = 0          # the axis value at which this backend groups per token (quanto 0, HQQ 1)
    layer_class: type = HQQQuantizedLayer

    def layer_kwargs(self, spec) -> dict:
        return dict(nbits=spec.scheme.bits, axis_key=spec.axis_key, axis_value=spec.axis_value,
                    q_group_size=spec.group, residual_length=spec.residual)

    def build(self, spec, model, tokenizer=None):
        kwargs = self.layer_kwargs(spec)
        try:
            cache = QuantizedCache(backend=self.name, config=model.config, **kwargs)
        except ValueError as exc:                 # sliding-window models are refused up front by check_model
            raise KvplayError(f"{spec}: {exc}") from exc
        if self.layer_class is not type(cache.layers[0]):
            cache.layers = [self.layer_class(**kwargs) for _ in cache.layers]
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        pk, mk = _quantized_parts(layer._quantized_keys)
        pv, mv = _quantized_parts(layer._quantized_values)
        return CacheBytes(pk + pv, mk + mv, tensor_nbytes(layer.keys, layer.values))

    def stored_numel(self, spec, per_tensor: int, axis: int) -> int:
        """Elements stored for one layer's keys (or values) of `per_tensor` elements, padding included."""
        return per_tensor

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        """`prefill` tokens (default: all) quantized at once, then one-token decode steps."""
        d, bits = arch.head_dim, spec.scheme.bits
        prefill = tokens if prefill is None else min(prefill, tokens)
        residual = (tokens - prefill) % spec.residual if spec.residual else 0
        per_tensor = batch * arch.kv_heads * (tokens - residual) * d          # one layer's keys (or values)
        numel = sum(arch.layers * self.stored_numel(spec, per_tensor, axis)
                    for axis in (spec.axis_key, spec.axis_value))
        return CacheBytes(payload=numel * bits // 8,
                          metadata=self.groups(spec, arch, per_tensor, numel) * 2 * dtype_bytes,
                          full_precision=2 * arch.layers * batch * arch.kv_heads * residual * d * dtype_bytes)

    def groups(self, spec, arch, per_tensor: int, numel: int) -> int:
        """Quantization groups stored (each with a scale and a zero)."""
        return 2 * arch.layers * (per_tensor // spec.group)

    def dequantized_kv(self, layer):
        keys = layer._dequantize(layer._quantized_keys)
        values = layer._dequantize(layer._quantized_values)
        if layer.keys.dim() == 4:                 # the 16-bit residual; an empty 1-d tensor right after a flush
            keys = torch.cat([keys.to(layer.keys.dtype), layer.keys], dim=-2)
            values = torch.cat([values.to(layer.values.dtype), layer.values], dim=-2)
        return keys, values

    def key_grouping(self, spec) -> tuple[str, int, bool]:
        return ("token" if spec.axis_key == self.per_token_axis else "channel"), int(spec.scheme.bits), False

    def own_recipe(self, spec) -> tuple[str, str] | None:
        config = {"backend": self.name, "nbits": spec.scheme.bits, "q_group_size": spec.group,
                  "residual_length": spec.residual, "axis_key": spec.axis_key, "axis_value": spec.axis_value}
        return "transformers", 'cache_implementation="quantized", cache_config=' + json.dumps(config)

    snippet_note = ""

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        config = {"backend": self.name, "nbits": spec.scheme.bits, "q_group_size": spec.group,
                  "residual_length": spec.residual, "axis_key": spec.axis_key, "axis_value": spec.axis_value}
        return (SNIPPET_HEAD + (load or SNIPPET_LOAD) + self.snippet_note +
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False,\n"
                f"                     cache_implementation=\"quantized\",\n"
                f"                     cache_config={config!r})\n")

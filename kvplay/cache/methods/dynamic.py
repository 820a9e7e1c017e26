"""The 16-bit reference: transformers' DynamicCache in the model's own dtype."""
from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .base import SNIPPET_HEAD, SNIPPET_LOAD, CacheBytes, CacheMethod, Scheme, register, tensor_nbytes


class Dynamic(CacheMethod):
    name = "dynamic"
    description = "transformers' DynamicCache: every token in the model's 16-bit dtype (the reference)"
    schemes = (Scheme("baseline", "bf16", 16, "transformers' DynamicCache in the model's 16-bit dtype: the reference"),)
    # DynamicSlidingWindowLayer also serves the 16-bit sliding-window layers other caches keep.
    layer_types = (DynamicLayer, DynamicSlidingWindowLayer)
    quantized = False

    def build(self, spec, config):
        return DynamicCache(config=config)

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        return CacheBytes(full_precision=tensor_nbytes(layer.keys, layer.values))

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        return CacheBytes(full_precision=2 * arch.layers * batch * arch.kv_heads * tokens * arch.head_dim * dtype_bytes)

    def dequantized_kv(self, layer):
        return layer.keys, layer.values

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        return (SNIPPET_HEAD + (load or SNIPPET_LOAD) +
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False)\n")


METHOD = register(Dynamic())

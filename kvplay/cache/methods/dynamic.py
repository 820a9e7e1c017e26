"""The 16-bit reference: transformers' DynamicCache in the model's own dtype.

`baseline:attention=fused` keeps the same cache but runs decode attention through kvplay's fused kernel
(attention.py) on the 16-bit keys and values, so the kernel's own speed can be told from the gain of
reading fewer bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvplay.cache import attention
from kvplay.cache.methods.base import (
    ATTENTION,
    ATTENTION_HELP,
    SNIPPET_HEAD,
    SNIPPET_LOAD,
    CacheBytes,
    CacheMethod,
    Scheme,
    option,
    register,
    tensor_nbytes,
)


@dataclass(frozen=True)
class DynamicOptions:
    attention: str = option("sdpa", choices=ATTENTION, label="decode attention", help=ATTENTION_HELP)


class FusedDynamicLayer(DynamicLayer):
    """transformers' DynamicLayer whose CPU decode steps hand attention placeholders (attention.DecodeView)."""

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> all keys and values so far, or placeholders when decoding."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] != 1 or key_states.device.type != "cpu":
            return keys, values
        return attention.DecodeView(keys[:, :, :0], values[:, :, :0], keys, values).placeholders()


class Dynamic(CacheMethod):
    name = "dynamic"
    description = "transformers' DynamicCache: every token in the model's 16-bit dtype (the reference)"
    Options = DynamicOptions
    schemes = (Scheme("baseline", "bf16", 16, "transformers' DynamicCache in the model's 16-bit dtype: the reference"),)
    # DynamicSlidingWindowLayer also serves the 16-bit sliding-window layers other caches keep.
    layer_types = (DynamicLayer, DynamicSlidingWindowLayer, FusedDynamicLayer)
    quantized = False
    shares_prefill = True          # DynamicLayer returns the keys and values it was given
    colour_family, line_dash, marker = "grey", "solid", "circle"     # the reference stays grey
    family = "16-bit reference"

    def build(self, spec, model, tokenizer=None):
        config = model.config
        cache = DynamicCache(config=config)
        fused = spec.attention == "fused" and attention.model_uses_it(config.get_text_config(decoder=True))
        if fused:
            cache.layers = [FusedDynamicLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        cache.description = f"{spec}: 16-bit; decode attention: " + (
            "kvplay's fused kernel on the 16-bit cache (on CPU)" if fused else "transformers' sdpa")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        return CacheBytes(full_precision=tensor_nbytes(layer.keys, layer.values))

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        return CacheBytes(full_precision=2 * arch.layers * batch * arch.kv_heads * tokens * arch.head_dim * dtype_bytes)

    def dequantized_kv(self, layer):
        return layer.keys, layer.values

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        if spec.attention == "fused":
            return super().snippet(spec, max_new_tokens, load)
        return (SNIPPET_HEAD + (load or SNIPPET_LOAD) +
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False)\n")


METHOD = register(Dynamic())

"""transformers' QuantizedCache with its fp8 backend (transformers 5.23), run as transformers ships it.

Fp8QuantizedLayer stores keys and values as float8_e4m3fn with one float32 scale per layer for K and one for
V: absmax / 448 of the first update (the prompt), then frozen; later tokens are divided by that scale and
cast (torch saturates at +-448). No residual window and no re-quantization. The first update hands
attention its own unquantized keys and values, so the prompt attends in 16-bit and only decode steps read
the fp8 history. transformers refuses models with sliding-window layers for every QuantizedCache backend.
"""
from __future__ import annotations

from transformers import QuantizedCache
from transformers.cache_utils import Fp8QuantizedLayer

from kvplay.cache.methods.base import (
    SNIPPET_HEAD,
    SNIPPET_LOAD,
    CacheBytes,
    CacheMethod,
    Scheme,
    register,
    tensor_nbytes,
)
from kvplay.errors import KvplayError

SCALE_BYTES = 4          # one float32 scale tensor (0-d) per layer for keys and one for values


class HfFp8(CacheMethod):
    name = "hf-fp8"
    order = 30
    family = "transformers"
    colour_family, line_dash, marker = "slate", "longdash", "x"
    description = "transformers' QuantizedCache, fp8 backend: e4m3, one scale per layer fixed at the prompt"
    schemes = (Scheme("hf-fp8", "fp8", 8, "transformers' QuantizedCache, fp8 backend: float8 e4m3 with one "
                      "per-tensor scale per layer, set by the prompt and frozen, no 16-bit window"),)
    layer_types = (Fp8QuantizedLayer,)
    full_attention_only = True

    def build(self, spec, model, tokenizer=None):
        try:
            return QuantizedCache(backend="fp8", config=model.config)
        except ValueError as exc:                 # sliding-window models are refused up front by check_model
            raise KvplayError(f"{spec}: {exc}") from exc

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (data_k, scale_k), (data_v, scale_v) = layer._quantized_keys, layer._quantized_values
        return CacheBytes(payload=tensor_nbytes(data_k, data_v), metadata=tensor_nbytes(scale_k, scale_v),
                          full_precision=tensor_nbytes(layer.keys, layer.values))     # empty: nothing kept 16-bit

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        if tokens == 0:
            return CacheBytes()
        return CacheBytes(payload=2 * arch.layers * batch * arch.kv_heads * tokens * arch.head_dim,
                          metadata=2 * arch.layers * SCALE_BYTES)

    def dequantized_kv(self, layer):
        return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)

    def own_recipe(self, spec) -> tuple[str, str] | None:
        return "transformers", 'QuantizedCache(backend="fp8", config=model.config)'

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        return (SNIPPET_HEAD + (load or SNIPPET_LOAD) +
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False,\n"
                "                     cache_implementation=\"quantized\", cache_config={\"backend\": \"fp8\"})\n")


METHOD = register(HfFp8())

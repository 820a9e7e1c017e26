"""SGLang's FP4 KV cache (`--kv-cache-dtype fp4_e2m1`, now `fp4_mx_block16`), emulated.

What SGLang stores (FP4MXBlock16KVQuantizeUtil.batched_quantize, sgl-project/sglang
python/sglang/srt/layers/quantization/kvfp4_tensor.py at 0dae407b3cee; the recipe FP4MXBlock16KVCacheMethod in
python/sglang/srt/layers/quantization/fp4_kv_cache_quant_method.py at 02719cd147d2), per token and block of 16
consecutive values of a head, keys and values apart, with no global scale:

    e      = ceil(log2(max(max|block| / 6, 1e-10)))       (float32)
    scale  = uint8(e + 127)                               (an e8m0-style power of two, MX style, not fp8)
    codes  = e2m1(x / 2**e)                               (half away from zero: sum(|x| >= bounds), unlike
                                                           vLLM's round half to even; never past 6)

stored as packed 4-bit codes (head_dim / 2 bytes) and one scale byte per 16 values (head_dim / 16 bytes: 4.5 bits an
element, the "about 1.78x the tokens of FP8" of SGLang's docs, docs/advanced_features/quantized_kv_cache.md at
03cd2ec4af85), read back as e2m1 * 2**(scale - 127). SGLang compiles the quantizer with torch.compile, whose
kernels compute in float32 as kvplay does; only a block whose max/6 lies within an ulp of a power of two could
take the other exponent there.

When attention reads what (the triton backend, python/sglang/srt/layers/attention/triton_backend.py): a prefill or
prefill chunk (extend) attends to the cached prefix dequantized and to its own new keys and values as computed,
in 16 bits; a decode step writes its token first and attends to the whole cache dequantized, itself included. The
recipe runs on SGLang's triton, torch_native, flex_attention and trtllm_mha backends (fa4 for prefill), so it needs
no Blackwell GPU (SGLang's separate nvfp4 recipe does). SGLang blocks the flattened heads of a token, which is
blocks of one head when head_dim is a multiple of 16; kvplay refuses any other head_dim. Sliding-window layers stay
16-bit here.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvplay.cache import fp4
from kvplay.cache.arch import Arch
from kvplay.cache.engine import StoredLayer
from kvplay.cache.methods.base import CacheBytes, CacheMethod, Scheme, register, tensor_nbytes
from kvplay.cache.store import BlockStore
from kvplay.errors import KvplayError

EXPONENT_BIAS = 127
FLOOR = 1e-10                     # SGLang's clamp before log2: an all-zero block takes 2**-33


def mx16_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float32 -> (packed codes uint8 (..., D/2), biased exponents uint8 (..., D/16))."""
    xb = fp4.blocks(x)
    e = torch.ceil(torch.log2(torch.clamp(xb.abs().amax(-1, keepdim=True) / fp4.E2M1_MAX, min=FLOOR)))
    codes = fp4.e2m1_codes(xb / torch.exp2(e), ties="up")
    return fp4.pack(codes.flatten(-2)), (e + EXPONENT_BIAS).squeeze(-1).to(torch.uint8)


def mx16_dequantize(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The stored codes and exponents -> float32 (..., D): e2m1 * 2**(exponent - 127)."""
    values = fp4.blocks(fp4.e2m1_values(fp4.unpack(packed)))
    return (values * torch.exp2(exponents.float() - EXPONENT_BIAS).unsqueeze(-1)).flatten(-2)


class Mx16Format:
    """SGLang's block-16 FP4 as a BlockStore format of one token per block."""

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, H, n, 1, D) float32 -> (codes (B, H, n, 1, D/2), exponents (B, H, n, 1, D/16)), both uint8."""
        return mx16_quantize(x)

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_(mx16_dequantize(*stored).flatten(2, 3))                            # (B, H, n, D)


class SglangFp4Layer(StoredLayer):
    """One decoder layer's FP4 keys and values, every token stored on arrival."""

    def formats(self):
        return Mx16Format(), Mx16Format()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> what SGLang's attention reads, (B, H, seen, D): a decode step
        (one token after others) the whole cache dequantized; a prefill or chunk the dequantized prefix, then its
        own keys and values as given."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before, new = self.seen, key_states.shape[-2]
        self.seen += new
        self.store_k.append(key_states.float().unsqueeze(3))                         # (B, H, T, 1, D)
        self.store_v.append(value_states.float().unsqueeze(3))
        if before and new == 1:
            return self.store_k.dequantize(self.dtype), self.store_v.dequantize(self.dtype)
        return self._extend(self.store_k, key_states, before), self._extend(self.store_v, value_states, before)

    def _extend(self, store: BlockStore, fresh: torch.Tensor, before: int) -> torch.Tensor:
        if not before:
            return fresh
        out = fresh.new_empty(fresh.shape[:2] + (before + fresh.shape[-2], fresh.shape[-1]))
        store.dequantize_into(out[:, :, :before], before)
        out[:, :, before:] = fresh
        return out


class SglangFp4(CacheMethod):
    name = "sglang"
    order = 65
    family = "SGLang"
    colour_family, colour_offset, line_dash, marker = "cyan", 3, "longdashdot", "triangle-down"   # hqq takes 0-2
    description = ("SGLang's FP4 KV cache (--kv-cache-dtype fp4_e2m1, now fp4_mx_block16), emulated: e2m1 codes "
                   "and a power-of-two scale per 16 values, any GPU")
    shares_prefill = True           # an empty cache's prefill attends to its own 16-bit keys and values
    schemes = (Scheme("sglang-fp4", "fp4", 4, "SGLang's --kv-cache-dtype fp4_e2m1 (fp4_mx_block16): e2m1 codes, a "
                      "uint8 power-of-two scale per 16 values; 4.5 bits an element"),)
    layer_types = (SglangFp4Layer,)

    def check(self, spec, arch) -> None:
        if arch.head_dim % fp4.BLOCK:
            raise KvplayError(f"{spec}: SGLang's FP4 KV cache scales blocks of 16 values and kvplay needs head_dim to "
                              f"be a multiple of 16, this model's is {arch.head_dim}; pick vllm-fp8 or kvplay-int4.")

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        layers = []
        for kind, kwargs in zip(*get_layer_types_and_kwargs(config)):
            if kind == "full_attention":
                layers.append(SglangFp4Layer())
            elif kind in ("sliding_attention", "chunked_attention") and kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))       # bounded: kept 16-bit
            else:
                raise KvplayError(f"{spec}: kvplay's SGLang emulation does not support {kind!r} layers.")
        cache = Cache(layers=layers)
        split = Arch.from_config(config).layer_split()
        cache.description = (f"{spec}: FP4 e2m1, power-of-two scales per 16 values" + (f" ({split})" if split else "")
                             + "; attention: dequantize then attend")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (codes_k, e_k), (codes_v, e_v) = layer.store_k.used(), layer.store_v.used()
        return CacheBytes(payload=tensor_nbytes(codes_k, codes_v), metadata=tensor_nbytes(e_k, e_v),
                          allocated=layer.store_k.allocated() + layer.store_v.allocated())

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        rows = 2 * arch.layers * batch * arch.kv_heads * tokens                  # K and V rows of head_dim values
        return CacheBytes(payload=rows * arch.head_dim // 2, metadata=rows * (arch.head_dim // fp4.BLOCK))

    def dequantized_kv(self, layer):
        return layer.store_k.dequantize(layer.dtype), layer.store_v.dequantize(layer.dtype)

    def engine_name(self, spec) -> str | None:
        return "SGLang fp4_e2m1, emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        return "SGLang", ("--kv-cache-dtype fp4_mx_block16 (fp4_e2m1 before SGLang renamed it) with "
                          "--attention-backend triton")


METHOD = register(SglangFp4())

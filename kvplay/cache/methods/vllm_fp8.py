"""vLLM's fp8 KV cache (`kv_cache_dtype="fp8"`, e4m3), emulated: every token stored on arrival.

vLLM's cache write (reshape_and_cache_flash) divides each key and value by a float32 scale and converts to
float8 e4m3 with saturation at +-448; attention reads the history back as fp8 * scale, prefill included
(the FlashAttention backend attends to the cache it has just written). Where the scales come from
(`scales`), as vLLM's docs describe them (features/quantization/quantized_kvcache):

    unit    vLLM's default with no calibration: k_scale = v_scale = 1.0 for every layer
    prompt  --calculate-kv-scales: from the first forward, per layer, k_scale = max|K| / 200 and
            v_scale = max|V| / 100 (K_SCALE_CONSTANT, V_SCALE_CONSTANT; vllm/attention/layer.py
            calc_kv_scales), then frozen
    tensor  calibrated on a text, as llm-compressor's static min-max observer: max|K| / 448 per layer
    head    calibrated on a text, one scale per KV head (k/v_scale = [num_kv_heads]; vLLM takes those with
            its FlashAttention backend): max|K of that head| / 448

The calibration text is the one fragile.py uses (512 tokens from the end of The Tempest), run once per model
through a 16-bit cache; the observer's moving average over many samples is not emulated (one text, one max).
The FlashAttention-3 path also quantizes the query to fp8; that is not emulated either.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvplay.cache.arch import Arch
from kvplay.cache.engine import StoredLayer
from kvplay.cache.fragile import calibration_ids
from kvplay.cache.methods.base import CacheBytes, CacheMethod, Scheme, option, register, tensor_nbytes
from kvplay.cache.store import BlockStore
from kvplay.errors import KvplayError

FP8_MAX = 448.0
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0          # vllm/envs.py defaults
_CALIBRATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {layer: (k absmax, v absmax) (H,)}


@dataclass(frozen=True)
class VllmFp8Options:
    scales: str = option("unit", choices=("unit", "prompt", "tensor", "head"), label="fp8 scales",
                         help="unit: vLLM's default, every scale 1.0; prompt: --calculate-kv-scales, max|K|/200 and "
                              "max|V|/100 of the first forward; tensor: one scale per layer, max/448 on a calibration "
                              "text (llm-compressor); head: one per KV head, calibrated the same way")


@dataclass
class Fp8Format:
    """float8 e4m3 with a fixed float32 scale (shape () or (1, H, 1, 1, 1)) as a BlockStore format."""

    scale: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, H, n, 1, D) float32 -> (fp8 (B, H, n, 1, D),): x / scale, saturated at +-448."""
        return ((x / self.scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),)

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_((stored[0].float() * self.scale).flatten(2, 3))                 # (B, H, n, D)


class VllmFp8Layer(StoredLayer):
    """One decoder layer's fp8 keys and values; `scales` (k, v) float32 fixed at build, or None: set by the prompt."""

    def __init__(self, scales: tuple[torch.Tensor, torch.Tensor] | None):
        super().__init__()
        self.scales = scales
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.scales is None:                         # calc_kv_scales on the first forward
            self.scales = (key_states.float().abs().amax() / K_SCALE_CONSTANT,
                           value_states.float().abs().amax() / V_SCALE_CONSTANT)
        k_scale, v_scale = (s.to(self.device, torch.float32) for s in self.scales)
        self.scales = (k_scale, v_scale)
        d = key_states.shape[-1]
        self.keys = self.values = key_states.new_empty(key_states.shape[:2] + (0, d))   # nothing kept 16-bit
        self.store_k = BlockStore(Fp8Format(_broadcast(k_scale)), 1, d)
        self.store_v = BlockStore(Fp8Format(_broadcast(v_scale)), 1, d)
        self.is_initialized = True


def _broadcast(scale: torch.Tensor) -> torch.Tensor:
    """() -> (); (H,) -> (1, H, 1, 1, 1), to divide (B, H, n, 1, D)."""
    return scale if scale.dim() == 0 else scale.view(1, -1, 1, 1, 1)


def calibrated_absmax(model, tokenizer, spec) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer index: (max|K|, max|V|) per KV head, (H,) float32} over the calibration text, once per model."""
    if model not in _CALIBRATED:
        if tokenizer is None:
            raise KvplayError(f"{spec} calibrates its scales on a text, so it needs the tokenizer: "
                              "build_cache(spec, model, tokenizer=tok).")
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(calibration_ids(tokenizer).to(model.device), past_key_values=cache, use_cache=True)
        absmax = lambda t: t.float().abs().amax(dim=(0, 2, 3))            # noqa: E731  (B, H, T, D) -> (H,)
        _CALIBRATED[model] = {i: (absmax(layer.keys), absmax(layer.values))
                              for i, layer in enumerate(cache.layers) if layer.is_initialized}
    return _CALIBRATED[model]


def layer_scales(spec, model, tokenizer, index: int):
    """(k_scale, v_scale) float32 for layer `index` (() or (H,)), or None where the prompt sets them."""
    if spec.scales == "unit":
        return torch.tensor(1.0), torch.tensor(1.0)
    if spec.scales == "prompt":
        return None
    k, v = calibrated_absmax(model, tokenizer, spec)[index]
    if spec.scales == "tensor":
        k, v = k.amax(), v.amax()
    tiny = torch.finfo(torch.float32).tiny                                    # an all-zero head: no null scale
    return (k / FP8_MAX).clamp(min=tiny), (v / FP8_MAX).clamp(min=tiny)


class VllmFp8(CacheMethod):
    name = "vllm"
    order = 60
    family = "vLLM"
    colour_family, line_dash, marker = "magenta", "longdashdot", "hexagon"
    description = "vLLM's fp8 KV cache (kv_cache_dtype='fp8'), emulated: e4m3 with per-tensor or per-head scales"
    Options = VllmFp8Options
    schemes = (Scheme("vllm-fp8", "fp8", 8, "vLLM's kv_cache_dtype='fp8': float8 e4m3, every token on arrival, "
                      "scales 1.0 (vLLM's default; `scales=` calibrates them per tensor or per head)"),)
    layer_types = (VllmFp8Layer,)

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        layers = []
        for i, (kind, kwargs) in enumerate(zip(*get_layer_types_and_kwargs(config))):
            if kind == "full_attention":
                layers.append(VllmFp8Layer(layer_scales(spec, model, tokenizer, i)))
            elif kind in ("sliding_attention", "chunked_attention") and kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))       # bounded: kept 16-bit
            else:
                raise KvplayError(f"{spec}: kvplay's vLLM emulation does not support {kind!r} layers.")
        cache = Cache(layers=layers)
        split = Arch.from_config(config).layer_split()
        cache.description = (f"{spec}: fp8 e4m3, scales {spec.scales}" + (f" ({split})" if split else "") +
                             "; decode attention: dequantize then attend")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        payload, metadata = tensor_nbytes(*layer.store_k.used(), *layer.store_v.used()), tensor_nbytes(*layer.scales)
        return CacheBytes(payload=payload, metadata=metadata,
                          allocated=layer.store_k.allocated() + layer.store_v.allocated() + metadata)

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        if tokens == 0:
            return CacheBytes()
        scales = arch.kv_heads if spec.scales == "head" else 1
        return CacheBytes(payload=2 * arch.layers * batch * arch.kv_heads * tokens * arch.head_dim,
                          metadata=2 * arch.layers * scales * 4)

    def dequantized_kv(self, layer):
        return layer.store_k.dequantize(layer.dtype), layer.store_v.dequantize(layer.dtype)

    def engine_name(self, spec) -> str | None:
        return f"vLLM fp8 ({spec.scales} scales), emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        """vLLM's own flags for each way it sets the scales (features/quantization/quantized_kvcache)."""
        how = {"unit": "(every scale 1.0, the default)", "prompt": "--calculate-kv-scales",
               "tensor": "with per-tensor scales calibrated by llm-compressor",
               "head": "with per-head scales calibrated by llm-compressor (FlashAttention backend)"}
        return "vLLM", f"--kv-cache-dtype fp8_e4m3 {how[spec.scales]}"


METHOD = register(VllmFp8())

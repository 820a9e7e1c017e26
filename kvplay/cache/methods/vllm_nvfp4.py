"""vLLM's NVFP4 KV cache (`--kv-cache-dtype nvfp4` and `nvfp4_4over6`), emulated: every token stored on arrival.

What vLLM's cache write does (reshape_and_cache_nvfp4_kernel, vllm-project/vllm
csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu at c46deb951c24, its nvfp4_4over6 branch as
vllm#45187 merged it, and cvt_warp_fp16_to_fp4 in csrc/libtorch_stable/quantization/fp4/nvfp4_utils.cuh at
20b4ad8eb933), per token, head, and block of 16 consecutive values of head_dim, for keys and values apart:

    global = 1 / k_scale                                  (float32; k_scale is the layer's checkpoint scale)
    sf     = e4m3(global * (max|block| * (1/6)))          (saturating at 448, round to nearest even)
    codes  = e2m1(x * 1 / (sf * (1/global)))              (round half to even, saturating at 6; 0 where sf is 0)

stored as packed 4-bit codes (head_dim / 2 bytes) and one e4m3 byte per 16 values (head_dim / 16 bytes), and read
back as e2m1 * (sf * k_scale) (dequant_nvfp4_kv_cache, tests/kernels/quantization/nvfp4_utils.py at
0d6c41a2b01e). The arithmetic follows vLLM's pure-PyTorch reference ref_nvfp4_quant / cast_to_fp4
(vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py at 055e47c28003), which uses exact
reciprocals where the kernel uses rcp.approx.ftz.f32: a value within an ulp of a rounding threshold may round
the other way on the GPU.

nvfp4_4over6 (search=4over6) tries two block scales, max/6 and max/4, rounds the block with each, and keeps max/4
only where its squared reconstruction error (each value rebuilt as q * 1/outputScale, summed in float32 over the
16 values in pairs) is strictly smaller; the layout and the read are nvfp4's. nvcc may contract that sum into
fused multiply-adds, so a near-tie may be decided the other way on the GPU.

Scales (`scales`): unit is vLLM's default when the checkpoint has none (k_scale = v_scale = 1.0,
model_executor/layers/quantization/kv_cache.py); tensor is a checkpoint calibrated the NVFP4 way, one k_scale per
layer of max|K| / (448 * 6) (SGLang's loader notes ModelOpt stores amax / (6 * 448)), measured here on the
calibration text vllm_fp8.py uses. vLLM runs this cache on Blackwell (SM100) only, through FlashInfer's trtllm-gen
attention, and refuses a head_dim that is not a multiple of 16. Sliding-window layers stay 16-bit (vLLM's
--kv-cache-dtype-skip-layers sliding_window). Not emulated: the trtllm-gen kernel takes an fp8 query and writes
an fp8 output (kvplay attends in the model's dtype), and the V scales' 4x4 swizzle (a layout, not a value).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvplay.cache import fp4
from kvplay.cache.arch import Arch
from kvplay.cache.engine import StoredLayer
from kvplay.cache.methods.base import CacheBytes, CacheMethod, Scheme, option, register, tensor_nbytes
from kvplay.cache.methods.vllm_fp8 import calibrated_absmax
from kvplay.errors import KvplayError

FP8_MAX = 448.0
SEARCHES = {"max6": (6.0,), "4over6": (6.0, 4.0)}          # the block-scale denominators each search tries
FLAG = {"max6": "nvfp4", "4over6": "nvfp4_4over6"}         # vLLM's --kv-cache-dtype for each


@dataclass(frozen=True)
class VllmNvfp4Options:
    search: str = option("max6", choices=tuple(SEARCHES), label="block scale",
                         help="max6: --kv-cache-dtype nvfp4, each block's scale is max/6; 4over6: nvfp4_4over6, "
                              "max/6 or max/4, whichever rebuilds the block with less squared error")
    scales: str = option("unit", choices=("unit", "tensor"), label="global scales",
                         help="unit: vLLM's default without checkpoint scales, k_scale = v_scale = 1.0; tensor: one "
                              "per layer as an NVFP4 checkpoint calibrates it, max/(448*6) on a calibration text")


# ---------------------------------------------------------------------------- the format, as plain functions

def block_scale(vmax: torch.Tensor, global_scale: torch.Tensor, denominator: float):
    """(e4m3 block scale, float32 outputScale) of blocks whose max|x| is vmax: nvfp4_candidate_scale."""
    reciprocal = torch.tensor(1.0 / denominator, dtype=torch.float32)
    sf = (global_scale * (vmax * reciprocal)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    sff = sf.float()
    out = torch.where(sff == 0, torch.zeros_like(sff), 1.0 / (sff * (1.0 / global_scale)))
    return sf, out


def squared_error(xb: torch.Tensor, output_scale: torch.Tensor) -> torch.Tensor:
    """Each block's reconstruction error under one candidate, as nvfp4_reconstruction_error sums it (float32)."""
    rebuild = torch.where(output_scale == 0, torch.zeros_like(output_scale), 1.0 / output_scale)
    d = fp4.e2m1_values(fp4.e2m1_codes(xb * output_scale)) * rebuild - xb
    err = torch.zeros_like(d[..., 0])
    for i in range(0, fp4.BLOCK, 2):
        err = err + (d[..., i] * d[..., i] + d[..., i + 1] * d[..., i + 1])
    return err


def nvfp4_quantize(x: torch.Tensor, k_scale: torch.Tensor, search: str = "max6"):
    """x (..., D) float32 -> (packed codes uint8 (..., D/2), block scales float8_e4m3fn (..., D/16))."""
    global_scale = 1.0 / k_scale.float()
    xb = fp4.blocks(x)
    vmax = xb.abs().amax(-1, keepdim=True)
    candidates = [block_scale(vmax, global_scale, d) for d in SEARCHES[search]]
    sf, output_scale = candidates[0]
    if len(candidates) == 2:
        (sf4, out4) = candidates[1]
        use4 = (squared_error(xb, out4) < squared_error(xb, output_scale)).unsqueeze(-1)
        sf, output_scale = torch.where(use4, sf4.float(), sf.float()).to(torch.float8_e4m3fn), \
            torch.where(use4, out4, output_scale)
    codes = fp4.e2m1_codes((xb * output_scale).clamp(-fp4.E2M1_MAX, fp4.E2M1_MAX))
    return fp4.pack(codes.flatten(-2)), sf.squeeze(-1)


def nvfp4_dequantize(packed: torch.Tensor, sf: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The stored codes and block scales -> float32 (..., D): e2m1 * (sf * k_scale)."""
    values = fp4.blocks(fp4.e2m1_values(fp4.unpack(packed)))
    return (values * (sf.float() * k_scale.float()).unsqueeze(-1)).flatten(-2)


@dataclass
class Nvfp4Format:
    """NVFP4 with a fixed float32 k_scale (the layer's), as a BlockStore format of one token per block."""

    k_scale: torch.Tensor
    search: str = "max6"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, H, n, 1, D) float32 -> (codes (B, H, n, 1, D/2) uint8, block scales (B, H, n, 1, D/16) e4m3)."""
        return nvfp4_quantize(x, self.k_scale, self.search)

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_(nvfp4_dequantize(*stored, self.k_scale).flatten(2, 3))              # (B, H, n, D)


# ---------------------------------------------------------------------------- the cache

class VllmNvfp4Layer(StoredLayer):
    """One decoder layer's NVFP4 keys and values; `scales` (k_scale, v_scale) float32, fixed at build."""

    def __init__(self, scales: tuple[torch.Tensor, torch.Tensor], search: str):
        super().__init__()
        self.scales, self.search = scales, search
        self.seen = 0

    def formats(self):
        self.scales = tuple(s.to(self.device, torch.float32) for s in self.scales)
        return Nvfp4Format(self.scales[0], self.search), Nvfp4Format(self.scales[1], self.search)


def layer_scales(spec, model, tokenizer, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) float32 of layer `index`: 1.0, or max/(448*6) over the calibration text."""
    if spec.scales == "unit":
        return torch.tensor(1.0), torch.tensor(1.0)
    k, v = calibrated_absmax(model, tokenizer, spec)[index]
    tiny = torch.finfo(torch.float32).tiny                                    # an all-zero layer: no null scale
    return tuple((m.amax() / (FP8_MAX * fp4.E2M1_MAX)).clamp(min=tiny) for m in (k, v))


class VllmNvfp4(CacheMethod):
    name = "vllm-nvfp4"
    order = 61
    family = "vLLM"
    colour_family, colour_offset, line_dash, marker = "magenta", 1, "dash", "pentagon"   # vllm-fp8 takes the first
    description = ("vLLM's NVFP4 KV cache (--kv-cache-dtype nvfp4, Blackwell SM100 only), emulated: e2m1 codes, an "
                   "e4m3 scale per 16 values and a float32 scale per layer")
    Options = VllmNvfp4Options
    schemes = (
        Scheme("vllm-nvfp4", "fp4", 4, "vLLM's --kv-cache-dtype nvfp4 (Blackwell SM100): e2m1 codes, an e4m3 scale "
               "(max/6) per 16 values, k/v scales 1.0; 4.5 bits an element"),
        Scheme("vllm-nvfp4-4over6", "fp4", 4, "vLLM's --kv-cache-dtype nvfp4_4over6 (Blackwell SM100): nvfp4 with "
               "each block's scale max/6 or max/4, whichever rebuilds it better", {"search": "4over6"}),
    )
    layer_types = (VllmNvfp4Layer,)

    def check(self, spec, arch) -> None:
        if arch.head_dim % fp4.BLOCK:
            raise KvplayError(f"{spec}: vLLM's NVFP4 KV cache needs head_dim to be a multiple of 16 and this model's "
                              f"is {arch.head_dim}; pick vllm-fp8 or kvplay-int4.")

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        layers = []
        for i, (kind, kwargs) in enumerate(zip(*get_layer_types_and_kwargs(config))):
            if kind == "full_attention":
                layers.append(VllmNvfp4Layer(layer_scales(spec, model, tokenizer, i), spec.search))
            elif kind in ("sliding_attention", "chunked_attention") and kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))       # bounded: kept 16-bit
            else:
                raise KvplayError(f"{spec}: kvplay's vLLM emulation does not support {kind!r} layers.")
        cache = Cache(layers=layers)
        split = Arch.from_config(config).layer_split()
        cache.description = (f"{spec}: NVFP4 ({FLAG[spec.search]}), k/v scales {spec.scales}" +
                             (f" ({split})" if split else "") + "; decode attention: dequantize then attend")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (codes_k, sf_k), (codes_v, sf_v) = layer.store_k.used(), layer.store_v.used()
        scales = tensor_nbytes(*layer.scales)                                 # the layer's float32 k and v scale
        return CacheBytes(payload=tensor_nbytes(codes_k, codes_v), metadata=tensor_nbytes(sf_k, sf_v) + scales,
                          allocated=layer.store_k.allocated() + layer.store_v.allocated() + scales)

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        if tokens == 0:
            return CacheBytes()
        rows = 2 * arch.layers * batch * arch.kv_heads * tokens                  # K and V rows of head_dim values
        return CacheBytes(payload=rows * arch.head_dim // 2,
                          metadata=rows * (arch.head_dim // fp4.BLOCK) + 2 * arch.layers * 4)

    def dequantized_kv(self, layer):
        return layer.store_k.dequantize(layer.dtype), layer.store_v.dequantize(layer.dtype)

    def engine_name(self, spec) -> str | None:
        return f"vLLM {FLAG[spec.search]} ({spec.scales} scales), emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        how = {"unit": "(k/v scales 1.0, the default without checkpoint scales)",
               "tensor": "with per-layer k/v scales from an NVFP4-calibrated checkpoint"}
        return "vLLM", f"--kv-cache-dtype {FLAG[spec.search]} {how[spec.scales]}, on Blackwell (SM100)"


METHOD = register(VllmNvfp4())

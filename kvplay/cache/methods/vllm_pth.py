"""vLLM's per-token-head KV caches (`--kv-cache-dtype int8_per_token_head | fp8_per_token_head | int4_per_token_head`),
emulated: every token stored on arrival, one float32 scale per token, head and K or V, computed as it is written.

Read in vLLM (github.com/vllm-project/vllm, the code index's snapshots; a path without a commit was read in the
version the index holds, whose commit it does not show):
  vllm/config/cache.py @ 002f10e0cfa1373a19a0d2756598a34b700d20e5: CacheDType lists the three; an empty
      kv_cache_dtype_skip_layers by default ("sliding_window" or layer indices skip layers from quantization)
  vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, _reshape_cache_per_token_head (int8, fp8; vllm#38378):
      per (token, head) scale = max(absmax / QUANT_MAX, 1e-6) in float32; stored x * (1.0 / scale) clamped to
      [QUANT_MIN, QUANT_MAX] = int8 (-128, 127), fp8 e4m3 (-448, 448), cast on store. The float-to-int8 store
      truncates; vllm#45361 (merged 2026-06) adds the rounding: where(q >= 0, q + 0.5, q - 0.5), half away from
      zero, then the clamp and the truncating store (the merged diff was not in the index: taken from its text and
      the kernel's later ports). fp8 keeps the cast: round to nearest even, as cvt.rn.satfinite on sm89+ (a
      Triton that lowers it through fp16 rounds twice, now and then one step lower: not emulated).
  vllm/v1/attention/ops/int4_per_token_head.py @ a7f284a2e24b86c171ef714c5ff492acf0baee6d (vllm#40835):
      reshape_and_cache_int4 rotates K and V first, single_rht: H_d (x * signs), H_d the unnormalised Sylvester
      Hadamard matrix (the PyTorch butterfly, tier 3 of fast_hadamard_transform), signs +-1 drawn by
      torch.bernoulli(0.5) from a CPU generator seeded 0x9E3779B9, then cast back to the model's dtype.
      _reshape_cache_int4_kernel: per (token, head) scale = max((max - min) / 15, 1e-6), zero point
      zp = clamp(round_half_away(-min / scale), 0, 15), codes clamp(round_half_away(x * (1 / scale) + zp), 0, 15)
      (round_half_away: (s +- 0.5) truncated), two codes a byte (even element low nibble, odd high) and zp hidden
      in the scale's four low mantissa bits: (bits & -16) | zp, so the cache holds no zero points. The read kernel
      _attn_packed unmasks the scale (bits & -16: the scale it reads is not quite the one it quantized with) and
      subtracts zp: x = (code - zp) * scale; it rotates the query the same way, divides the softmax scale by d
      and rotates the output back (H_d out * signs / d).
  vllm/v1/attention/ops/triton_unified_attention.py (USE_PER_TOKEN_HEAD_SCALES): scores dot(Q, codes) *
      (softmax_scale * k_scale[token]), values P * v_scale[token]: the dequantized cache, attended.
  vllm/model_executor/layers/attention/attention.py: query_quant is never built for "*per_token_head", so the
      query stays 16-bit; vllm/v1/attention/backends/triton_attn.py @ 63013883d93ca538eab430b4f5242916b878f618
      supports_head_size: head_size >= 32.
Bytes: one float32 scale per (token, head) for K and for V beside the codes (vLLM keeps it inline after each head's
data): head_dim 256 in bfloat16 takes 1024 bytes a token-head, int8 520 (1.97x), int4 264 (3.88x), which matches
the published 1.95x and 3.86x tokens of vllm#39074 on Qwen3.5-35B-A3B (its Mamba state takes a fixed share).

What kvplay does differently, and assumes:
  * sliding-window layers stay 16-bit (transformers' DynamicSlidingWindowLayer), as in every kvplay cache: vLLM
    quantizes them unless told `--kv-cache-dtype-skip-layers sliding_window`, so that flag is in the recipe.
  * attention dequantizes then attends in the model's dtype; vLLM folds the scales into float32 scores and bf16
    probabilities, and for int4 attends in the rotated basis with a bf16-rounded rotated query.
  * the Triton kernels divide with div.full.f32 (within 2 ulp) and fuse a * b + c into one fma (Triton's
    enable_fp_fusion default): kvplay divides with IEEE rounding and forms the fma in float64, exact for every
    product that can move a code, so a code differs only where a value sits within 2 ulp of a rounding boundary.
  * the rotation follows vLLM's PyTorch butterfly (its CPU path); on CUDA sm80+ vLLM runs hadacore in bf16,
    which agrees for head_dim 64 and 256 and can differ in the last bf16 bit for 128.
vLLM refuses, and so does kvplay: head_dim < 32 (these dtypes run only in the Triton backend) and, for int4, a
head_dim that is not a power of two (the Hadamard transform asserts it: vLLM aborts at start-up, vllm#56197).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvplay.cache.arch import Arch
from kvplay.cache.engine import StoredLayer
from kvplay.cache.methods.base import CacheBytes, CacheMethod, Scheme, register
from kvplay.errors import KvplayError

SCALE_FLOOR = 1e-6          # every kernel: tl.maximum(scale, 1e-6)
SCALE_BYTES = 4             # float32, one per (token, head) for K and for V
RHT_SEED = 0x9E3779B9       # int4_per_token_head.py _get_rht_signs(d, round_idx=0)
MIN_HEAD_DIM = 32           # TritonAttentionBackend.supports_head_size


def fma(a: torch.Tensor, b: torch.Tensor, c) -> torch.Tensor:
    """a * b + c rounded once to float32, as Triton's fused multiply-add: the float32 product is exact in
    float64, and so is the sum wherever it can change a code."""
    return (a.double() * b.double() + c).float()


def half_away(s: torch.Tensor) -> torch.Tensor:
    """The kernels' where(s >= 0, s + 0.5, s - 0.5) truncated toward zero, in float32."""
    return torch.where(s >= 0, s + 0.5, s - 0.5).trunc()


@functools.cache
def rht_signs(d: int) -> torch.Tensor:
    """vLLM's +-1 signs of length d (float32, CPU), drawn as _get_rht_signs draws them."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform along the last dimension (H_d x, H_d H_d = d I), vLLM's PyTorch
    butterfly in x's dtype and its order of additions."""
    d, h = x.shape[-1], 1
    while h < d:
        v = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([v[..., 0, :] + v[..., 1, :], v[..., 0, :] - v[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """single_rht(x.float()).to(x.dtype), as float32: what int4_per_token_head quantizes."""
    return hadamard(x.float() * rht_signs(x.shape[-1]).to(x.device)).to(x.dtype).float()


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse the read path applies to its output: H_d y * signs / d (float32)."""
    d = y.shape[-1]
    return hadamard(y) * rht_signs(d).to(y.device) / d


# ---------------------------------------------------------------------------- the formats, as data

@dataclass(frozen=True)
class AbsmaxFormat:
    """int8_per_token_head and fp8_per_token_head as a BlockStore format: codes and a float32 absmax scale per
    (token, head), x (B, H, n, 1, D) float32."""

    vllm: str
    store: torch.dtype
    qmin: float
    qmax: float
    rounds: bool                 # int8 rounds half away from zero before its truncating store; fp8 casts
    bits: int = 8
    rotated: bool = False

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (x.abs().amax(-1, keepdim=True) / self.qmax).clamp_min(SCALE_FLOOR)
        inv = 1.0 / scale
        if not self.rounds:
            return (x * inv).clamp(self.qmin, self.qmax).to(self.store), scale
        q = torch.where(x * inv >= 0, fma(x, inv, 0.5), fma(x, inv, -0.5))
        return q.clamp(self.qmin, self.qmax).trunc().to(self.store), scale

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        codes, scale = stored
        out.copy_((codes.float() * scale).flatten(2, 3))


@dataclass(frozen=True)
class Int4Format:
    """int4_per_token_head as a BlockStore format: x (B, H, n, 1, D) float32, already rotated -> packed codes
    (B, H, n, 1, D/2) uint8 and the scale with the zero point in its low bits (B, H, n, 1, 1) float32."""

    vllm: str = "int4_per_token_head"
    bits: int = 4
    rotated: bool = True

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp_min(SCALE_FLOOR)
        zp = half_away(-lo / scale).clamp(0.0, 15.0)
        codes = half_away(fma(x, 1.0 / scale, zp.double())).clamp(0.0, 15.0).to(torch.uint8)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scale = ((scale.view(torch.int32) & -16) | zp.to(torch.int32)).view(torch.float32)
        return packed, scale

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        codes, zp, scale = unpack(*stored)
        out.copy_(unrotate((codes - zp) * scale).flatten(2, 3))


def unpack(packed: torch.Tensor, stored_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What _attn_packed reads from int4 storage: (codes (..., D), zero points, unmasked scales), float32."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    bits = stored_scale.view(torch.int32)
    return codes, (bits & 0xF).float(), (bits & -16).view(torch.float32)


FORMATS = {
    "vllm-int8-pth": AbsmaxFormat("int8_per_token_head", torch.int8, -128.0, 127.0, rounds=True),
    "vllm-fp8-pth": AbsmaxFormat("fp8_per_token_head", torch.float8_e4m3fn, -448.0, 448.0, rounds=False),
    "vllm-int4-pth": Int4Format(),
}


# ---------------------------------------------------------------------------- the cache layer

class VllmPthLayer(StoredLayer):
    """One decoder layer's keys and values in a per-token-head format, each token quantized as it arrives."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt
        self.seen = 0

    def formats(self):
        return self.fmt, self.fmt

    def prepare(self, states: torch.Tensor) -> torch.Tensor:
        return self.fmt.prepare(states)


# ---------------------------------------------------------------------------- the method

class VllmPerTokenHead(CacheMethod):
    name = "vllm-pth"
    order = 62
    family = "vLLM"
    colour_family, colour_offset, line_dash, marker = "magenta", 3, "dot", "triangle-down"   # after fp8, nvfp4's 2
    description = ("vLLM's per-token-head KV caches (int8, fp8, int4 _per_token_head), emulated: one float32 scale "
                   "per token and head; int4 rotated and asymmetric")
    schemes = (
        Scheme("vllm-int8-pth", "int", 8, "vLLM's --kv-cache-dtype int8_per_token_head: int8 codes, one float32 "
               "absmax scale per token and head, rounded half away from zero"),
        Scheme("vllm-fp8-pth", "fp8", 8, "vLLM's --kv-cache-dtype fp8_per_token_head: float8 e4m3, one float32 "
               "absmax scale per token and head"),
        Scheme("vllm-int4-pth", "int", 4, "vLLM's --kv-cache-dtype int4_per_token_head: a randomized Hadamard "
               "rotation, then 4-bit codes with a zero point hidden in each token's and head's float32 scale"),
    )
    layer_types = (VllmPthLayer,)

    def check(self, spec, arch) -> None:
        fmt = FORMATS[spec.name]
        if arch.head_dim < MIN_HEAD_DIM:
            raise KvplayError(f"{spec}: vLLM runs {fmt.vllm} only in its Triton attention backend, which needs "
                              f"head_dim >= {MIN_HEAD_DIM} (this model's is {arch.head_dim}).")
        if fmt.rotated and arch.head_dim & (arch.head_dim - 1):
            raise KvplayError(f"{spec}: vLLM's int4_per_token_head rotates each head with a Hadamard transform that "
                              f"needs a power-of-two head_dim (this model's is {arch.head_dim}; vLLM aborts at "
                              "start-up), so pick vllm-int8-pth or vllm-fp8-pth.")

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        arch, fmt, layers = Arch.from_config(config), FORMATS[spec.name], []
        self.check(spec, arch)                          # a checked CacheSpec skips check_model: refuse here too
        for kind, kwargs in zip(*get_layer_types_and_kwargs(config)):
            if kind == "full_attention":
                layers.append(VllmPthLayer(fmt))
            elif kind in ("sliding_attention", "chunked_attention") and kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))       # bounded: kept 16-bit
            else:
                raise KvplayError(f"{spec}: kvplay's vLLM emulation does not support {kind!r} layers.")
        cache = Cache(layers=layers)
        split = arch.layer_split()
        cache.description = (f"{spec}: {fmt.vllm}, a float32 scale per token and head" +
                             (f" ({split})" if split else "") + "; decode attention: dequantize then attend")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (pk, mk), (pv, mv) = layer.store_k.nbytes(), layer.store_v.nbytes()
        return CacheBytes(payload=pk + pv, metadata=mk + mv,
                          allocated=layer.store_k.allocated() + layer.store_v.allocated())

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        rows = 2 * arch.layers * batch * arch.kv_heads * tokens          # K and V rows of head_dim elements
        return CacheBytes(payload=rows * arch.head_dim * FORMATS[spec.name].bits // 8, metadata=rows * SCALE_BYTES)

    def dequantized_kv(self, layer):
        return layer.store_k.dequantize(layer.dtype), layer.store_v.dequantize(layer.dtype)

    def key_grouping(self, spec) -> tuple[str, int, bool]:
        fmt = FORMATS[spec.name]
        return ("float" if spec.scheme.fmt == "fp8" else "token"), fmt.bits, fmt.rotated

    def engine_name(self, spec) -> str | None:
        return f"vLLM {FORMATS[spec.name].vllm}, emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        """vLLM's flags for this cache: the dtype, and sliding-window layers left 16-bit as kvplay leaves them (a
        no-op on models without them)."""
        return "vLLM", f"--kv-cache-dtype {FORMATS[spec.name].vllm} --kv-cache-dtype-skip-layers sliding_window"


METHOD = register(VllmPerTokenHead())

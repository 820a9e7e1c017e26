"""vLLM's TurboQuant KV caches (`--kv-cache-dtype turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc |
turboquant_3bit_nc`), emulated: every token stored on arrival, keys and values of one (token, head) in one slot.

Read in vLLM (github.com/vllm-project/vllm, the code index's snapshots, each at the commit the index shows for it):
  vllm/model_executor/layers/quantization/turboquant/config.py @ 1471680b24719d9d3b2fe1235878196142af89cc:
      TQ_PRESETS: k8v4 = fp8 keys + 4-bit values; 4bit_nc = 4-bit keys + 4-bit values; k3v4_nc = 3-bit keys +
      4-bit values; 3bit_nc = 3-bit keys + 3-bit values; "_nc" = norm correction. A slot per (token, KV head):
      keys ceil(D * bits / 8) bytes + a float16 norm (fp8 keys: D bytes, nothing else), values ceil(D * bits / 8)
      bytes + a float16 scale and a float16 zero, rounded up to an even size (never needed at the head_dims
      kvplay accepts). get_boundary_skip_layers: the first and last n = min(2, layers // 2) layers of a dense
      model, which vllm/engine/arg_utils.py (the index's version; commit not shown) adds to
      --kv-cache-dtype-skip-layers for every turboquant_* dtype: those layers keep the model's 16-bit dtype.
  vllm/model_executor/layers/quantization/turboquant/centroids.py @ 06d0369d75e060e83dffac3e0190ceff8fc37e12:
      solve_lloyd_max(d, bits): Lloyd-Max centroids for N(0, 1/d), trapezoid integrals of 200 steps, 200
      iterations at most, float64, returned as float32 (re-derived below in the same order of operations).
  vllm/v1/attention/backends/turboquant_attn.py @ 0135d081c30fa476130ae77a152539ce317ab8b1: the rotation is
      the Sylvester Hadamard matrix / sqrt(D) in float32 (no random signs), shared by every layer; midpoints are
      (c[i] + c[i+1]) / 2 of the sorted float32 centroids. Prefill of an empty cache attends to its own 16-bit
      keys and values (FlashAttention); a later chunk of at most 128 tokens runs the decode kernel over the cache
      it has just written, itself included; a longer chunk attends to the cached prefix dequantized to float16
      (keys rotated back by a float16 matmul) and to its own 16-bit keys and values; decode reads the cache.
  vllm/v1/attention/ops/triton_turboquant_store.py @ 0135d081c30fa476130ae77a152539ce317ab8b1:
      keys (3/4-bit): norm = ||k|| (float32), y = (k / (norm + 1e-8)) @ H, index = the number of midpoints
      <= y (a binary search with y >= mid), norm stored as float16. fp8 keys: k cast to float8 e4m3 (e4nv,
      round to nearest even, saturating at 448) with no scale. Values: min, max over D (float32),
      scale = (max - min) / (2**bits - 1), floored at 1e-8, codes = int32((v - min) / scale + 0.5) clamped,
      scale and min stored as float16 (the codes were computed with the float32 scale). 4-bit codes two a byte,
      even element in the low nibble; 3-bit codes eight to three bytes, element j at bits 3j of a little-endian
      24-bit word.
  vllm/v1/attention/ops/triton_turboquant_decode.py @ 055e47c28003156421365af985d676fc921cb075 (the read side):
      key = norm16 * c[index], with norm correction c / sqrt(sum(c * c) + 1e-16) first, in the rotated basis
      (the kernel rotates the query instead: q @ H, the same product); value = code * scale16 + zero16.

What kvplay does differently, and assumes:
  * attention dequantizes, rotates the keys back (float32 @ H) and attends in the model's dtype; vLLM scores
    the float32 rotated query against the centroids and accumulates in float32.
  * the float32 norm and the rotation GEMM run on the CPU here, on the GPU (cuBLAS) in vLLM, and the Triton
    kernels divide with div.full.f32 (within 2 ulp): a value within an ulp or two of a midpoint or a code
    boundary may land the other way. Triton's sqrt in the read side's norm correction may be approximate.
  * on GPUs below sm89 (Ampere, Turing) vLLM stores turboquant_k8v4's keys as Triton's float8e4b15, another
    fp8 format, which kvplay does not emulate; sm89+ (Ada, Hopper, Blackwell) store e4m3 as here.
  * a chunk longer than 128 tokens after the first: the prefix's float16 rotation is done as a float32 product
    rounded to float16 (cuBLAS's float16 GEMM may round partial sums).
vLLM's docs do not describe these dtypes yet (vllm#45422, a docs PR, is open); from its code: the TURBOQUANT
attention backend (Triton kernels, FlashAttention 2 for prefill, which vLLM forces for it) on a GPU (CUDA; the
kernels also take XPU's and ROCm's paths).
vLLM runs them only on models without sliding-window layers (vllm#54599 is open), and kvplay refuses those too;
prefill's FlashAttention 2 takes head_dim multiples of 8 up to 256, and the 3- and 4-bit keys need a
power-of-two head_dim for the Hadamard matrix built by doubling.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvplay.cache.arch import Arch
from kvplay.cache.engine import StoredLayer
from kvplay.cache.methods.base import (
    CacheBytes,
    CacheMethod,
    Scheme,
    option,
    refuse_sliding_layers,
    register,
    tensor_nbytes,
)
from kvplay.cache.store import BlockStore
from kvplay.errors import KvplayError

FP8_MAX = 448.0
NORM_EPS = 1e-8                  # k / (||k|| + 1e-8)
VALUE_SCALE_FLOOR = 1e-8         # where(scale > 1e-8, scale, 1e-8)
NC_EPS = 1e-16                   # 1 / sqrt(sum(c * c) + 1e-16)
CONTINUATION_DECODE_THRESHOLD = 128   # a later prefill chunk up to this many tokens reads the cache it wrote
BOUNDARY = 2                     # get_boundary_skip_layers(model_config, n=2)
MAX_HEAD_DIM = 256               # FlashAttention 2's prefill


@dataclass(frozen=True)
class Preset:
    vllm: str                    # --kv-cache-dtype
    key_bits: int                # 8: fp8 keys; 3, 4: Lloyd-Max indices of the rotated, normalised key
    value_bits: int
    norm_correction: bool

    @property
    def fp8_keys(self) -> bool:
        return self.key_bits == 8

    def key_bytes(self, d: int) -> tuple[int, int]:
        """(payload, metadata) bytes of one key row: fp8 codes, or packed indices and a float16 norm."""
        return (d, 0) if self.fp8_keys else (math.ceil(d * self.key_bits / 8), 2)

    def value_bytes(self, d: int) -> tuple[int, int]:
        """(payload, metadata) bytes of one value row: packed codes, a float16 scale and a float16 zero."""
        return math.ceil(d * self.value_bits / 8), 4


PRESETS = {
    "vllm-turboquant-k8v4": Preset("turboquant_k8v4", 8, 4, False),
    "vllm-turboquant-4bit-nc": Preset("turboquant_4bit_nc", 4, 4, True),
    "vllm-turboquant-k3v4-nc": Preset("turboquant_k3v4_nc", 3, 4, True),
    "vllm-turboquant-3bit-nc": Preset("turboquant_3bit_nc", 3, 3, True),
}


@dataclass(frozen=True)
class TurboQuantOptions:
    boundary: int = option(BOUNDARY, lo=0, hi=64, grid=(0, BOUNDARY), label="16-bit layers at each end",
                           help="how many of the first and of the last layers stay 16-bit: vLLM adds the first and "
                                "last 2 (at most half the layers) to --kv-cache-dtype-skip-layers on every model "
                                "without sliding layers; more is --kv-cache-dtype-skip-layers with their indices; "
                                "fewer is no vLLM setting")


# ---------------------------------------------------------------------------- the arithmetic, as plain functions

@functools.cache
def centroids(d: int, bits: int) -> torch.Tensor:
    """The 2**bits Lloyd-Max centroids of N(0, 1/d), float32, sorted: solve_lloyd_max's float64 iteration."""
    levels, var = 2 ** bits, 1.0 / d
    sigma = math.sqrt(var)

    def pdf(x: float) -> float:
        return (1.0 / math.sqrt(2 * math.pi * var)) * math.exp(-x * x / (2 * var))

    def trapz(f, a: float, b: float, n: int = 200) -> float:
        h = (b - a) / n
        total = 0.5 * (f(a) + f(b))
        for i in range(1, n):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [lo * 3] + [(c[i] + c[i + 1]) / 2.0 for i in range(levels - 1)] + [hi * 3]
        new = []
        for i in range(levels):
            a, b = edges[i], edges[i + 1]
            num, den = trapz(lambda x: x * pdf(x), a, b), trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(new[i] - c[i]) for i in range(levels)) < 1e-10:
            break                                    # vLLM keeps the centroids before the converged step
        c = new
    return torch.tensor(c, dtype=torch.float32)


def midpoints(c: torch.Tensor) -> torch.Tensor:
    """Decision boundaries between sorted centroids, in float32."""
    s = c.sort().values
    return (s[:-1] + s[1:]) / 2


@functools.cache
def hadamard(d: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order d divided by sqrt(d), float32 (symmetric: its own inverse)."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) integer codes -> (..., ceil(D * bits / 8)) uint8 as vLLM's store kernels lay them out."""
    codes = codes.to(torch.int32)
    if bits == 4:
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    word = (codes.unflatten(-1, (-1, 8)) << (3 * torch.arange(8, device=codes.device))).sum(-1)     # (..., D/8)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], -1).flatten(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack: (..., D) int64 codes."""
    p = packed.long()
    if bits == 4:
        return torch.stack([p & 0xF, p >> 4], -1).flatten(-2)
    g = p.unflatten(-1, (-1, 3))
    word = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    return ((word.unsqueeze(-1) >> (3 * torch.arange(8, device=p.device))) & 7).flatten(-2)


def value_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v (..., D) float32 -> (packed codes, float16 scale (..., 1), float16 zero (..., 1)): _store_quantized_value."""
    top = 2 ** bits - 1
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = (hi - lo) / float(top)
    scale = torch.where(scale > VALUE_SCALE_FLOOR, scale, torch.full_like(scale, VALUE_SCALE_FLOOR))
    codes = ((v - lo) / scale + 0.5).to(torch.int32).clamp(0, top)          # truncation: round half up
    return pack(codes, bits), scale.half(), lo.half()


def value_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """code * scale16 + zero16 in float32 (exact products: a code and a float16 scale fit float32's mantissa)."""
    return unpack(packed, bits).float() * scale.float() + zero.float()


def key_quantize(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (..., D) float32 -> (packed centroid indices, float16 norm (..., 1)): the MSE path of the store."""
    d = k.shape[-1]
    norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    y = (k / (norm + NORM_EPS)) @ hadamard(d).to(k.device)
    return pack(bucket(y, bits), bits), norm.half()


def bucket(y: torch.Tensor, bits: int) -> torch.Tensor:
    """The centroid index of each rotated coordinate y (..., D): how many midpoints are <= y (a tie goes up)."""
    mids = midpoints(centroids(y.shape[-1], bits)).to(y.device)
    return torch.searchsorted(mids, y.contiguous(), right=True)


def key_rotated(packed: torch.Tensor, norm: torch.Tensor, bits: int, correct: bool) -> torch.Tensor:
    """What the read kernels score against, float32 (..., D): norm16 * c[index], c renormalised when `correct`."""
    index = unpack(packed, bits)
    c = centroids(index.shape[-1], bits).to(packed.device)[index]
    if correct:
        c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS))
    return norm.float() * c


def fp8_keys(k: torch.Tensor) -> torch.Tensor:
    """k float32 -> float8 e4m3, round to nearest even, saturating at +-448 (cvt.rn.satfinite), no scale."""
    return k.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------- the formats, for BlockStore

@dataclass(frozen=True)
class KeyFormat:
    """Keys of one preset, x (B, H, n, 1, D) float32 -> stored parts; decode writes the keys attention reads."""

    preset: Preset

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.preset.fp8_keys:
            return (fp8_keys(x),)
        return key_quantize(x, self.preset.key_bits)

    def values(self, stored: tuple[torch.Tensor, ...], half: bool = False) -> torch.Tensor:
        """The keys (B, H, n, 1, D), float32; half: as the long-continuation path reads them (float16)."""
        if self.preset.fp8_keys:
            k = stored[0].float()
            return k.half().float() if half else k
        k = key_rotated(*stored, self.preset.key_bits, self.preset.norm_correction)
        h = hadamard(k.shape[-1]).to(k.device)
        if half:
            return (k.half().float() @ h.half().float()).half().float()
        return k @ h

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_(self.values(stored).flatten(2, 3))


@dataclass(frozen=True)
class ValueFormat:
    preset: Preset

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return value_quantize(x, self.preset.value_bits)

    def values(self, stored: tuple[torch.Tensor, ...], half: bool = False) -> torch.Tensor:
        v = value_dequantize(*stored, self.preset.value_bits)
        return v.half().float() if half else v

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_(self.values(stored).flatten(2, 3))


# ---------------------------------------------------------------------------- the cache layers

class TurboQuantLayer(StoredLayer):
    """One quantized decoder layer: every token stored on arrival; what attention reads follows vLLM's paths."""

    def __init__(self, preset: Preset):
        super().__init__()
        self.preset = preset
        self.seen = 0

    def formats(self):
        return KeyFormat(self.preset), ValueFormat(self.preset)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> what vLLM's attention reads, (B, H, seen, D): an empty cache's
        prefill its own 16-bit states; a later chunk of <= 128 tokens, or a decode step, the whole cache
        dequantized; a longer chunk the prefix dequantized through float16, then its own states."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before, new = self.seen, key_states.shape[-2]
        if not torch.isfinite(key_states).all() or not torch.isfinite(value_states).all():
            raise KvplayError("The model produced NaN or inf keys/values; they cannot be quantized.")
        self.seen += new
        self.store_k.append(key_states.float().unsqueeze(3))                         # (B, H, T, 1, D)
        self.store_v.append(value_states.float().unsqueeze(3))
        if not before:
            return key_states, value_states
        if new <= CONTINUATION_DECODE_THRESHOLD:
            return self.store_k.dequantize(self.dtype), self.store_v.dequantize(self.dtype)
        return self._continue(self.store_k, key_states, before), self._continue(self.store_v, value_states, before)

    def _continue(self, store: BlockStore, fresh: torch.Tensor, before: int) -> torch.Tensor:
        prefix = store.fmt.values(store.used(before), half=True).flatten(2, 3).to(fresh.dtype)
        return torch.cat([prefix, fresh], dim=-2)


class BoundaryLayer(DynamicLayer):
    """A layer vLLM keeps in the model's 16-bit dtype (--kv-cache-dtype-skip-layers), as transformers keeps it."""


# ---------------------------------------------------------------------------- the method

def boundary_layers(layers: int, n: int) -> set[int]:
    """The layer indices get_boundary_skip_layers returns for a dense model: the first and last min(n, L // 2)."""
    n = min(n, layers // 2)
    return set(range(n)) | set(range(layers - n, layers)) if n > 0 else set()


class VllmTurboQuant(CacheMethod):
    name = "vllm-turboquant"
    order = 63
    family = "vLLM"
    colour_family, colour_offset, line_dash, marker = "magenta", 6, "dash", "triangle-left"   # after int4-pth's
    description = ("vLLM's TurboQuant KV caches (--kv-cache-dtype turboquant_*), emulated: Hadamard-rotated keys "
                   "on Lloyd-Max centroids with a float16 norm (or fp8 keys), 3- or 4-bit values with a float16 "
                   "scale and zero per token and head; the first and last 2 layers 16-bit")
    Options = TurboQuantOptions
    full_attention_only = True          # vLLM's TurboQuant backend runs no sliding-window layers (vllm#54599)
    shares_prefill = True               # an empty cache's prefill attends to its own 16-bit keys and values
    schemes = (
        Scheme("vllm-turboquant-k8v4", "tq", 4, "vLLM's --kv-cache-dtype turboquant_k8v4: fp8 e4m3 keys with no "
               "scale, 4-bit values with a float16 scale and zero per token and head; 6.25 bits an element at "
               "head_dim 64, the first and last 2 layers 16-bit"),
        Scheme("vllm-turboquant-4bit-nc", "tq", 4, "vLLM's --kv-cache-dtype turboquant_4bit_nc: keys Hadamard-"
               "rotated onto 16 Lloyd-Max centroids with a float16 norm, 4-bit values; 4.375 bits an element at "
               "head_dim 64, the first and last 2 layers 16-bit"),
        Scheme("vllm-turboquant-k3v4-nc", "tq", 3, "vLLM's --kv-cache-dtype turboquant_k3v4_nc: keys on 8 Lloyd-Max "
               "centroids, 4-bit values; 3.875 bits an element at head_dim 64, the first and last 2 layers 16-bit"),
        Scheme("vllm-turboquant-3bit-nc", "tq", 3, "vLLM's --kv-cache-dtype turboquant_3bit_nc: keys on 8 Lloyd-Max "
               "centroids, 3-bit values; 3.375 bits an element at head_dim 64, the first and last 2 layers 16-bit"),
    )
    layer_types = (TurboQuantLayer, BoundaryLayer)

    def check_model(self, spec, config) -> None:
        refuse_sliding_layers(spec, config, "vLLM's TurboQuant KV cache",
                              " until vllm#54599 lands, so pick kvplay-int4 or kvplay-int2, or vllm-int4-pth, which "
                              "vLLM serves with those layers kept 16-bit.")
        self.check(spec, Arch.from_config(config))

    def check(self, spec, arch) -> None:
        preset, d = PRESETS[spec.name], arch.head_dim
        if d % 8 or d > MAX_HEAD_DIM:
            raise KvplayError(f"{spec}: vLLM's TurboQuant backend prefills with FlashAttention 2, which takes a "
                              f"head_dim that is a multiple of 8 up to {MAX_HEAD_DIM}, and this model's is {d}.")
        if not preset.fp8_keys and d & (d - 1):
            raise KvplayError(f"{spec}: vLLM's {preset.vllm} rotates keys with a Hadamard matrix built by doubling, "
                              f"which needs a power-of-two head_dim (this model's is {d}), so pick "
                              "vllm-turboquant-k8v4, whose fp8 keys are not rotated.")

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        self.check_model(spec, config)                  # a checked CacheSpec skips check_model: refuse here too
        preset, layers = PRESETS[spec.name], config.num_hidden_layers
        kept = boundary_layers(layers, spec.boundary)
        cache_layers = [BoundaryLayer() if i in kept else TurboQuantLayer(preset) for i in range(layers)]
        cache = Cache(layers=cache_layers)
        cache.description = (f"{spec}: {preset.vllm}, {layers - len(kept)} of {layers} layers quantized "
                             + (f"(layers {', '.join(map(str, sorted(kept)))} kept 16-bit, as vLLM skips them)"
                                if kept else "(no layer kept 16-bit)")
                             + "; prefill attends to its own 16-bit keys and values, later chunks and decode: "
                               "dequantize then attend")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        if isinstance(layer, BoundaryLayer):
            return CacheBytes(full_precision=tensor_nbytes(layer.keys, layer.values))
        (pk, mk), (pv, mv) = layer.store_k.nbytes(), layer.store_v.nbytes()
        return CacheBytes(payload=pk + pv, metadata=mk + mv,
                          allocated=layer.store_k.allocated() + layer.store_v.allocated())

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        preset, d = PRESETS[spec.name], arch.head_dim
        kept = len(boundary_layers(arch.layers, spec.boundary))
        rows = (arch.layers - kept) * batch * arch.kv_heads * tokens           # quantized (token, head) slots
        (kp, km), (vp, vm) = preset.key_bytes(d), preset.value_bytes(d)
        return CacheBytes(payload=rows * (kp + vp), metadata=rows * (km + vm),
                          full_precision=2 * kept * batch * arch.kv_heads * tokens * d * dtype_bytes)

    def dequantized_kv(self, layer):
        if isinstance(layer, BoundaryLayer):
            return layer.keys, layer.values
        return layer.store_k.dequantize(layer.dtype), layer.store_v.dequantize(layer.dtype)

    def key_grouping(self, spec) -> tuple[str, int, bool]:
        preset = PRESETS[spec.name]
        return ("float", 8, False) if preset.fp8_keys else ("token", preset.key_bits, True)

    def engine_name(self, spec) -> str | None:
        return f"vLLM {PRESETS[spec.name].vllm}, emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        """vLLM's flag for this cache; more 16-bit layers are skip-layer indices; fewer than 2 is no vLLM setting."""
        flag = f"--kv-cache-dtype {PRESETS[spec.name].vllm}"
        if spec.boundary < BOUNDARY:
            return None
        more = spec.boundary - BOUNDARY
        return "vLLM", flag + (f" --kv-cache-dtype-skip-layers with the indices of the first and last {spec.boundary} "
                               "layers" if more else "")

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        recipe = self.own_recipe(spec)
        engine = (f"vllm serve MODEL {recipe[1]}" if recipe else
                  f"no vLLM setting keeps fewer than {BOUNDARY} layers at each end 16-bit")
        return (super().snippet(spec, max_new_tokens, load) + f"# the real engine: {engine}\n"
                "# (vLLM's TURBOQUANT backend: Triton kernels, FlashAttention 2 prefill, CUDA; models without "
                "sliding-window layers)\n")


METHOD = register(VllmTurboQuant())

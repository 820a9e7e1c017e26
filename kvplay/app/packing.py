"""Linear weights prepacked for oneDNN on the CPU: the same bfloat16 products, less time per decode step.

torch computes a bfloat16 nn.Linear on the CPU with oneDNN, whose AMX and AVX-512 kernels read weights in a
blocked layout of their own. A plain nn.Linear holds the row-major weight, so every call reorders it first:
at a decode step's few rows that reorder costs about as much as the product. A decode step of SmolLM2-135M
makes 211 linear calls (7 per layer and the head): 25.1 ms of products at batch 1 and 25.8 ms at batch 9 on
2 cores, against 17.5 and 16.9 ms with the weights packed once (docs/benchmarks.md, "Compare in lockstep").

pack_linears(model) turns every bfloat16 nn.Linear of a CPU model into a PackedLinear: still an nn.Linear with
its dense weight (weight quantization, copies and saving see nothing new), plus the same weight in oneDNN's
layout (torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU backend packs weights with), used
for inputs of at most PACKED_ROWS rows: decode steps, Compare's lockstep batch. There its outputs equal
nn.Linear's bit for bit; at some larger row counts oneDNN's inner product and nn.Linear's matrix product
round differently in the last bit (64 and 257 rows, not 1,300, in tests/test_packing.py), so longer inputs,
prefill among them, keep nn.Linear's own path and every result stays what plain transformers computes.
The packed copy costs the linear weights' bytes once more (270 MiB for SmolLM2-135M, head included), so
kvplay.app.models packs a model only where twice its weights leave half the free memory free.
Where the op is missing or refuses a weight, or where on this CPU its products differ from nn.Linear's on a check
of PACKED_ROWS random rows at packing time, the module stays a plain nn.Linear.

On CPUs without bfloat16 arithmetic (x86 without AVX512-BF16 or AMX, such as AVX2-only EPYCs and most laptops),
torch emulates a bfloat16 product, and longer inputs are where it shows: on a 2-core AVX2 EPYC a (1,274 x 576)
by (576 x 1,536) bfloat16 product ran at 15.6 GFLOP/s against 67.1 in float32, and SmolLM2-135M's prefill of
Compare's 1,274-token default prompt took 19.6 s against 4.3 s with float32 products (docs/benchmarks.md). There
pack_linears(model, wide=True) also keeps a float32 copy of each weight, and inputs of more than PACKED_ROWS rows
multiply in float32 and round the result to bfloat16 once: as exact as the emulated product (mean error against
float64 6.55e-4 for both on random (33 x 576) inputs), though not bit for bit the same numbers. Decode steps keep
the bfloat16 product, which reads half the bytes (a 64-token prompt and 33 new tokens there: 2.71 s with every
product in bfloat16, 3.38 s with every product in float32).
BFLOAT16_ARITHMETIC says which CPU this is.
KVPLAY_PACK_WEIGHTS=0 (Settings.pack_weights) leaves every model plain nn.Linear.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

PACKED_ROWS = 32      # rows (tokens x sequences) up to which the packed product equals nn.Linear's bit for bit


def _bfloat16_arithmetic() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); False where torch cannot tell."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


BFLOAT16_ARITHMETIC = _bfloat16_arithmetic()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight (out, in) in oneDNN's layout for small batches, or None where oneDNN cannot take it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except (AttributeError, RuntimeError):
        return None


def _same_products(linear: nn.Linear, packed: torch.Tensor) -> bool:
    """Whether the packed weight's products equal nn.Linear's bit for bit on PACKED_ROWS random rows."""
    x = torch.randn(PACKED_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.no_grad():
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], ""), linear(x))


class PackedLinear(nn.Linear):
    """An nn.Linear that also keeps its bfloat16 weight in oneDNN's layout, for inputs of few rows, and where
    `wide`, in float32, for inputs of more."""

    packed: torch.Tensor | None       # an opaque mkldnn tensor: not a parameter, never saved
    wide: tuple[torch.Tensor, torch.Tensor | None] | None   # float32 (weight, bias), or None

    @classmethod
    def of(cls, linear: nn.Linear, wide: bool = False) -> PackedLinear | None:
        """A PackedLinear sharing `linear`'s weight and bias parameters (ties stay tied). Its weight is packed
        unless oneDNN cannot pack it, or on this CPU the packed product differs from nn.Linear's in any element
        of PACKED_ROWS random rows (oneDNN picks its kernels per CPU; where they round differently, nothing is
        packed); None if that leaves nothing to do (not packed, and not `wide`)."""
        packed = _pack(linear.weight)
        if packed is not None and not _same_products(linear, packed):
            packed = None
        if packed is None and not wide:
            return None
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  dtype=linear.weight.dtype)
        new.weight, new.bias, new.packed = linear.weight, linear.bias, packed
        new.wide = _widen(linear) if wide else None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (..., in) -> (..., out)
        if x.dtype == torch.bfloat16:
            few = x.numel() <= PACKED_ROWS * self.in_features
            if few and self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if not few and self.wide is not None:
                return nn.functional.linear(x.float(), *self.wide).to(x.dtype)
        return super().forward(x)

    def __deepcopy__(self, memo):
        """A copy with its own packed weight (an mkldnn tensor has no storage for copy.deepcopy to copy)."""
        twin = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        twin.packed = _pack(twin.weight) if self.packed is not None else None
        return twin

    def extra_repr(self) -> str:
        return (super().extra_repr() + (", packed for oneDNN" if self.packed is not None else "")
                + (", float32 products for long inputs" if self.wide is not None else ""))


def _widen(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 (weight, bias) of a linear layer, detached copies."""
    bias = None if linear.bias is None else linear.bias.detach().float()
    return linear.weight.detach().float(), bias


def pack_linears(model: nn.Module, wide: bool = False) -> int:
    """Swap the bfloat16 nn.Linear layers of a CPU model for PackedLinear ones, in place; returns how many.
    wide: also multiply inputs of more than PACKED_ROWS rows in float32 (for CPUs without BFLOAT16_ARITHMETIC)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu" and (packed := PackedLinear.of(child, wide)) is not None):
                setattr(parent, name, packed)
                count += 1
    return count

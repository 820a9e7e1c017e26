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
KVPLAY_PACK_WEIGHTS=0 (Settings.pack_weights) leaves every model unpacked.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

PACKED_ROWS = 32      # rows (tokens x sequences) up to which the packed product equals nn.Linear's bit for bit


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
    """An nn.Linear that also keeps its bfloat16 weight in oneDNN's layout, for inputs of few rows."""

    packed: torch.Tensor              # an opaque mkldnn tensor: not a parameter, never saved

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear | None:
        """A PackedLinear sharing `linear`'s weight and bias parameters (ties stay tied), or None if oneDNN cannot
        pack the weight, or if on this CPU its product differs from nn.Linear's in any element of PACKED_ROWS
        random rows (oneDNN picks its kernels per CPU; where they round differently, nothing is packed)."""
        packed = _pack(linear.weight)
        if packed is None or not _same_products(linear, packed):
            return None
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  dtype=linear.weight.dtype)
        new.weight, new.bias, new.packed = linear.weight, linear.bias, packed
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (..., in) -> (..., out)
        if x.numel() <= PACKED_ROWS * self.in_features and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return super().forward(x)

    def __deepcopy__(self, memo):
        """A copy with its own packed weight (an mkldnn tensor has no storage for copy.deepcopy to copy)."""
        twin = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        twin.packed = _pack(twin.weight)
        return twin

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed for oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Swap the bfloat16 nn.Linear layers of a CPU model for PackedLinear ones, in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu" and (packed := PackedLinear.of(child)) is not None):
                setattr(parent, name, packed)
                count += 1
    return count

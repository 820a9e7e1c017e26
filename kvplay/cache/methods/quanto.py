"""transformers' QuantizedCache with the optimum-quanto backend."""
from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import QuantoQuantizedLayer

from kvplay.cache.methods.base import Scheme, option, register, require_group_divides
from kvplay.cache.methods.hf import MemoizedDequantize, TransformersQuantized
from kvplay.errors import KvplayError


class CheckedQuantoLayer(MemoizedDequantize, QuantoQuantizedLayer):
    """transformers' quanto layer, with quanto's group-size error on a per-channel axis said in one sentence:
    axis -1 groups each channel across the tokens quantized at once, so their count must suit the group; and
    with MemoizedDequantize's switch for rows that are never timed."""

    def _quantize(self, tensor, axis):
        try:
            return super()._quantize(tensor, axis)
        except ValueError as exc:
            if "divisor" not in str(exc):
                raise
            raise KvplayError(f"quanto with axis -1 groups each channel across the tokens it quantizes at once, "
                              f"and {tensor.shape[-2]} tokens do not fill whole groups of {self.q_group_size}; "
                              "use axis 0 (per token) or a group size that divides the prompt.") from None


@dataclass(frozen=True)
class QuantoOptions:
    group: int = option(64, lo=1, hi=4096, grid=(32, 64, 128), label="group size",
                         help="elements per quantization group of the flattened tensor")
    residual: int = option(128, lo=0, hi=65536, grid=(0, 32, 128), label="residual window (tokens)",
                           help="recent tokens kept in 16-bit until the window fills and everything is re-quantized")
    axis_key: int = option(0, choices=(0, -1), label="key axis", help="quanto's axis: 0 groups per token")
    axis_value: int = option(0, choices=(0, -1), label="value axis", help="quanto's axis: 0 groups per token")


class Quanto(TransformersQuantized):
    name = "quanto"
    order = 10
    description = "transformers' QuantizedCache, optimum-quanto backend"
    Options = QuantoOptions
    schemes = (Scheme("quanto-int4", "int", 4, "transformers' QuantizedCache, optimum-quanto backend, 4-bit"),
               Scheme("quanto-int2", "int", 2, "transformers' QuantizedCache, optimum-quanto backend, 2-bit"))
    layer_class = CheckedQuantoLayer
    layer_types = (CheckedQuantoLayer,)
    shares_prefill = True          # QuantizedLayer's first update returns the 16-bit states it quantized
    colour_family, line_dash, marker = "blue", "dash", "square"

    def check(self, spec, arch) -> None:
        require_group_divides(spec, spec.group, arch.head_dim, "for quanto")   # quanto groups the flattened tensor

    def stored_numel(self, spec, per_tensor, axis):
        # quanto packs 8/bits group rows per byte row, rounding the rows up
        rows_per_byte = 8 // spec.scheme.bits
        return -(-(per_tensor // spec.group) // rows_per_byte) * rows_per_byte * spec.group


METHOD = register(Quanto())

"""transformers' QuantizedCache with the HQQ backend (padded so any batch or length packs, see hf.py)."""
from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import HQQQuantizedLayer

from kvplay.cache.methods.base import Scheme, option, register, require_group_divides
from kvplay.cache.methods.hf import PaddedHQQLayer, TransformersQuantized, hqq_padded_numel


@dataclass(frozen=True)
class HqqOptions:
    group: int = option(64, lo=1, hi=4096, grid=(32, 64, 128), label="group size",
                        help="elements per quantization group")
    residual: int = option(128, lo=0, hi=65536, grid=(0, 32, 128), label="residual window (tokens)",
                           help="recent tokens kept in 16-bit until the window fills and everything is re-quantized")
    axis_key: int = option(1, choices=(0, 1), label="key axis", help="HQQ's axis: 1 groups per token")
    axis_value: int = option(1, choices=(0, 1), label="value axis", help="HQQ's axis: 1 groups per token")


class Hqq(TransformersQuantized):
    name = "hqq"
    order = 20
    description = "transformers' QuantizedCache, HQQ backend"
    Options = HqqOptions
    schemes = (Scheme("hqq-int8", "int", 8, "transformers' QuantizedCache, HQQ backend, 8-bit"),
               Scheme("hqq-int4", "int", 4, "transformers' QuantizedCache, HQQ backend, 4-bit"),
               Scheme("hqq-int2", "int", 2, "transformers' QuantizedCache, HQQ backend, 2-bit"))
    layer_class = PaddedHQQLayer
    per_token_axis = 1             # HQQ's axis 1 groups per token
    layer_types = (PaddedHQQLayer, HQQQuantizedLayer)
    shares_prefill = True          # QuantizedLayer's first update returns the 16-bit states it quantized
    colour_family, line_dash, marker = "cyan", "dot", "diamond"
    snippet_note = "# kvplay pads HQQ's groups so any batch or length packs; plain HQQ may need counts divisible by 4\n"

    def check(self, spec, arch) -> None:
        require_group_divides(spec, spec.group, arch.head_dim, or_multiple=True)

    def stored_numel(self, spec, per_tensor, axis):
        if axis == 1 and per_tensor > 0:                  # see PaddedHQQLayer
            return hqq_padded_numel(per_tensor, spec.group, spec.scheme.bits)
        return per_tensor

    def groups(self, spec, arch, per_tensor, numel):
        return numel // spec.group                        # padding groups carry metadata too


METHOD = register(Hqq())

"""kvplay's cache layer: specs, cache construction and exact byte accounting.

    spec = parse_spec("kvplay-int4:rotation=hadamard")
    cache = build_cache(spec, model)
    model.generate(**inputs, past_key_values=cache)
    cache_nbytes(cache).total
"""
from __future__ import annotations

from transformers import DynamicCache

from ..arch import Arch
from ..errors import KvplayError
from .accounting import CacheBytes, analytic_nbytes, bits_per_element, cache_nbytes
from .engine import KVPlayCache, KVPlayLayer
from .hf import build_hf_cache
from .spec import DEFAULT_SPECS, SCHEMES, CacheSpec, Scheme, defaults, parse_spec

__all__ = ["SCHEMES", "DEFAULT_SPECS", "CacheSpec", "Scheme", "CacheBytes", "KVPlayCache", "KVPlayLayer",
           "parse_spec", "defaults", "build_cache", "cache_nbytes", "analytic_nbytes", "bits_per_element",
           "check_spec_for_model"]


def check_spec_for_model(spec: CacheSpec, config) -> None:
    """Refuse, before any run, a spec that cannot work on this architecture."""
    if spec.backend in ("quanto", "hqq"):
        from transformers.cache_utils import get_layer_types_and_kwargs

        other = set(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]) - {"full_attention"}
        if other:
            raise KvplayError(f"{spec}: transformers' QuantizedCache refuses models with sliding-window or chunked "
                              f"attention layers ({', '.join(sorted(other))}); use a kvplay-* spec, which keeps "
                              "those layers in 16-bit.")
    arch = Arch.from_config(config)
    if spec.backend == "kvplay" and spec.scheme.fmt == "int":
        for part, grouping in (("keys", spec.keys), ("values", spec.values)):
            if grouping == "token" and arch.head_dim % spec.group:
                raise KvplayError(f"{spec}: group size {spec.group} must divide head_dim {arch.head_dim} "
                                  f"when {part} are grouped per token.")
    if spec.backend == "kvplay" and spec.rotation == "hadamard" and arch.head_dim % 2:
        raise KvplayError(f"{spec}: Hadamard rotation needs an even head_dim, and this model's is {arch.head_dim}.")
    if spec.backend == "quanto" and arch.head_dim % spec.group:  # quanto groups the flattened tensor
        raise KvplayError(f"{spec}: group size {spec.group} must divide head_dim {arch.head_dim} for quanto.")
    if spec.backend == "hqq" and arch.head_dim % spec.group and spec.group % arch.head_dim:
        raise KvplayError(f"{spec}: group size {spec.group} must divide head_dim {arch.head_dim} or be a multiple of it.")


def build_cache(spec: CacheSpec | str, model):
    """The transformers Cache object for `spec`, ready for model.generate(past_key_values=...)."""
    spec = parse_spec(spec)
    config = model.config
    check_spec_for_model(spec, config)
    if spec.backend == "dynamic":
        return DynamicCache(config=config)
    if spec.backend == "kvplay":
        return KVPlayCache(spec, config)
    return build_hf_cache(spec, config)

"""Capacity: the longest context (batch 1) and the largest batch (at a context) each cache fits on a GPU, from
the byte formulas of a published architecture: a cache-only bound, no model runs."""
from __future__ import annotations

import math

from transformers import LlamaConfig

from kvplay.cache import analytic_nbytes, baseline_first, bits_per_element, check_spec_for_model, parse_spec
from kvplay.cache.arch import Arch, published_archs
from kvplay.errors import KvplayError
from kvplay.results import CapacityResult, CapacityRow

REFERENCE_ARCH = "Llama-3-8B"          # default_bits: head_dim 128, as in most published models


WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}


CAPACITY_NOTE = "Cache-only bound: ignores activations, framework overhead and fragmentation."


def capacity(specs_bits: dict[str, float], arch: Arch, gpu_gib: float, weight_dtype: str = "float16",
             context: int = 4096) -> CapacityResult:
    """How much cache fits beside the weights: longest context at batch 1, largest batch at `context`.

    specs_bits maps a spec's name to its bits per element (measured, or from default_bits).
    """
    if isinstance(gpu_gib, bool) or not isinstance(gpu_gib, (int, float)) or not gpu_gib > 0 \
            or not math.isfinite(gpu_gib):
        raise KvplayError("GPU memory must be a positive number of GiB.")
    if weight_dtype not in WEIGHT_BYTES:
        raise KvplayError(f"Unknown weight dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_BYTES)}.")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise KvplayError(f"The context must be a whole number of tokens, at least 1, got {context!r}.")
    weight_bytes = int(round(arch.params * WEIGHT_BYTES[weight_dtype]))
    free = gpu_gib * 2**30 - weight_bytes
    rows = []
    for spec, bits in specs_bits.items():
        if not bits > 0:
            raise KvplayError(f"{spec}: bits per element must be positive, got {bits}.")
        per_token = bits / 8 * arch.elements_per_token
        fits = math.floor(free / per_token) if free > 0 else 0
        capped = bool(arch.context) and fits > arch.context
        rows.append(CapacityRow(spec=spec, bits_per_element=float(bits), bytes_per_token=per_token,
                                max_context=arch.context if capped else fits,
                                max_batch=math.floor(free / (per_token * context)) if free > 0 else 0,
                                cache_fits=fits if capped else None))
    return CapacityResult(arch=arch.name, gpu_gib=float(gpu_gib), weight_dtype=weight_dtype,
                          weight_bytes=weight_bytes, context=context, note=CAPACITY_NOTE, caches=rows,
                          context_limit=arch.context or None)


def _arch_config(arch: Arch):
    """A minimal config with `arch`'s cache shape, so spec checks run without a model."""
    return LlamaConfig(num_hidden_layers=arch.layers, num_attention_heads=arch.kv_heads,
                       num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                       hidden_size=arch.kv_heads * arch.head_dim)


def default_bits(spec, tokens: int = 8192) -> float:
    """Bits per element the formulas give for `spec` after `tokens` tokens on the reference architecture.

    No model runs: transformers' QuantizedCache is taken right after a prefill of all
    `tokens` (its residual empty); kvplay's window and sink are counted in 16-bit.
    """
    spec = parse_spec(spec)
    arch = published_archs()[REFERENCE_ARCH]
    check_spec_for_model(spec, _arch_config(arch))
    return bits_per_element(analytic_nbytes(spec, arch, tokens), arch, tokens)


def capacity_for(specs, arch_name: str, gpu_gib: float, weight_dtype: str = "float16",
                 context: int = 4096) -> CapacityResult:
    """capacity() for a published architecture, each spec at its default_bits; baseline first."""
    archs = published_archs()
    if arch_name not in archs:
        raise KvplayError(f"Unknown architecture {arch_name!r}; choose one of {', '.join(archs)}.")
    bits = {str(s): default_bits(s) for s in baseline_first(specs)}
    return capacity(bits, archs[arch_name], gpu_gib, weight_dtype, context)

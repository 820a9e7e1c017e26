"""Storage formats added for quality on a real model (docs/quality-ablation.md).

kfit/vfit=mse: the same codes, float16 scale and zero and decoder as min/max, with each group's
scale and zero refitted by least squares. Its bounds are derived: a group keeps min/max's pair
unless the refit has a smaller squared error, so its error never exceeds min/max's, whose
per-element error is at most scale / 2 = (max - min) / (2 * (2**bits - 1)).
"""
from __future__ import annotations

import pytest
import torch

from kvplay.cache import CacheBytes, analytic_nbytes, build_cache, cache_nbytes, parse_spec, quant
from kvplay.cache.arch import Arch
from kvplay.cache.engine import TensorFormat
from tests.conftest import tiny_llama

SMOLLM2 = Arch("smollm2-135m-instruct", layers=30, kv_heads=3, head_dim=64)


def _data(seed: int) -> torch.Tensor:
    """Heavy-tailed groups (normal over a random scale per element group) with per-row scales, (64, 16, 32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, 32, generator=g) / torch.rand(64, 16, 1, generator=g).add(0.2)
    return x * torch.rand(64, 1, 1, generator=g).mul(4)


@pytest.mark.parametrize("bits", quant.INT_BITS)
@pytest.mark.parametrize("axis", (-1, -2))
def test_mse_fit_never_worse_than_minmax_per_group(bits, axis):
    x = _data(bits)
    g = x.shape[-1]
    errors = {}
    for fit in quant.FITS:
        q = quant.quantize_int(x, bits, axis=axis, fit=fit)
        errors[fit] = (quant.dequantize_int(q, bits, g, torch.float32) - x).square().sum(axis)     # per group
    assert (errors["mse"] <= errors["minmax"]).all()       # measured: groups that keep min/max's pair tie exactly
    # Derived RMS bound: min/max's per-element error is <= (max - min) / (2 * levels), up to float16 rounding
    # of scale and zero (relative 2**-10 of the range, bounded here by 2**-9 of it). Measured: the worst group's
    # RMS error is 0.71 of (max - min) / (2 * levels), so the allowance for rounding goes unused here.
    span = x.amax(axis) - x.amin(axis)
    rms = (errors["mse"] / x.shape[axis]).sqrt()
    assert (rms <= span * (1 / (2 * ((1 << bits) - 1)) + 2 ** -9) + 1e-6).all()


def test_mse_fit_buys_two_bit_error():
    """On Gaussian-like groups the refit cuts 2-bit squared error by ~39% (measured ratio 0.61; bound 0.75)."""
    x = torch.randn(256, 64, 32, generator=torch.Generator().manual_seed(1))
    err = {}
    for fit in quant.FITS:
        q = quant.quantize_int(x, 2, fit=fit)
        err[fit] = float((quant.dequantize_int(q, 2, 32, torch.float32) - x).square().sum())
    assert err["mse"] / err["minmax"] < 0.75


def test_mse_fit_keeps_constant_groups_exact_and_rejects_unknown():
    x = torch.full((4, 8), 1.5)
    q = quant.quantize_int(x, 2, fit="mse")
    assert torch.equal(quant.dequantize_int(q, 2, 8, torch.float32), x)
    with pytest.raises(ValueError, match="unknown fit"):
        quant.quantize_int(x, 2, fit="lloyd")


@pytest.mark.parametrize("grouping", ("channel", "token"))
def test_fitted_format_decodes_like_eager(grouping):
    """The fitted format is min/max's: the kernel (where built) and eager decode give the same bits."""
    fmt = TensorFormat("int", 2, grouping, 32, "mse")
    x = torch.randn(1, 2, 3, 32, 64, generator=torch.Generator().manual_seed(2))            # (B, H, n, T, D)
    stored = fmt.encode(x)
    out = torch.empty(1, 2, 3 * 32, 64, dtype=torch.bfloat16)
    fmt.decode(stored, out)
    if grouping == "channel":
        view = quant.dequantize_int(quant.QuantizedInt(*stored), 2, 64, torch.bfloat16)
    else:
        view = quant.dequantize_int(quant.QuantizedInt(*stored), 2, 32, torch.bfloat16).flatten(-2)
    assert torch.equal(out, view.flatten(2, 3))
    assert (out.float() - x.flatten(2, 3)).square().mean() < (fmt_minmax_error(x, grouping))


def fmt_minmax_error(x: torch.Tensor, grouping: str) -> float:
    fmt = TensorFormat("int", 2, grouping, 32)
    out = torch.empty(1, 2, 3 * 32, 64)
    fmt.decode(fmt.encode(x), out)
    return float((out - x.flatten(2, 3)).square().mean())


@pytest.mark.parametrize("spec", ["kvplay-int2:vfit=mse,kfit=mse", "kvplay-int2:sink=4,residual=124,vfit=mse",
                                  "kvplay-int4:sink=4,residual=60,vfit=mse"])
def test_exact_bytes_of_new_options(spec):
    """Measured bytes == a count written here, category by category (the fit changes no byte; against the
    formula: tests/test_bytes.py)."""
    model = tiny_llama(head_dim=64)
    cache = build_cache(spec, model)
    ids = torch.randint(0, 96, (1, 301), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    s = parse_spec(spec)
    arch = Arch.from_config(model.config)
    d, heads = arch.head_dim, arch.layers * arch.kv_heads
    quantized = s.group * ((301 - s.sink - s.residual) // s.group)
    codes = d * s.kbits // 8 + d * s.vbits // 8                                               # per token
    value_scales = (d // s.group) * 4                 # per token: a float16 scale and zero per group of channels
    key_scales = (quantized // s.group) * d * 4       # per block: a float16 scale and zero per channel
    assert cache_nbytes(cache) == CacheBytes(heads * quantized * codes, heads * (quantized * value_scales + key_scales),
                                             heads * (301 - quantized) * 2 * d * 2)


@pytest.mark.parametrize("name, target", [("kvplay-int2", 4.8), ("kvplay-int4", 3.4)])
def test_default_presets_meet_memory_targets(name, target):
    """Issue 14's memory targets at 8,192 tokens on SmolLM2's cache shape, metadata, sink and window included."""
    bf16 = analytic_nbytes("baseline", SMOLLM2, 8192).total
    assert bf16 / analytic_nbytes(name, SMOLLM2, 8192).total >= target

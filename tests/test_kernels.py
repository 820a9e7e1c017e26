"""The compiled CPU dequantization kernel computes exactly what the eager PyTorch path computes."""
import warnings
from unittest import mock

import pytest
import torch

from kvplay.cache import build_cache, engine, kernels

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler for kvplay's kernel")

# (B, H, n blocks, T tokens per block, D head_dim, token group): odd sizes exercise the scalar tails
# of the vector loop and planes that the codes only partly fill.
SHAPES = [(1, 2, 3, 64, 64, 64), (3, 2, 2, 16, 40, 20), (2, 1, 2, 8, 38, 38), (1, 3, 1, 4, 36, 12)]


def _recording():
    """Patch the kernel entry point to record what it returned (True: the kernel did the work)."""
    returned, real = [], kernels.dequantize_rows

    def spy(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]
    return returned, mock.patch.object(kernels, "dequantize_rows", spy)


def _eager(fmt, stored, out):
    with mock.patch.object(kernels, "dequantize_rows", return_value=False):
        fmt.decode(stored, out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grouping", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_eager_bit_for_bit(shape, bits, grouping, dtype):
    b, h, n, t, d, group = shape
    fmt = engine.TensorFormat("int", bits, grouping, t if grouping == "channel" else group)
    gen = torch.Generator().manual_seed(sum(shape) + bits)
    x = torch.randn(b, h, n, t, d, generator=gen) * torch.logspace(-2, 1, d)    # per-channel spread, as keys
    stored = fmt.encode(x)
    # Write into the middle of a larger buffer, as assemble() does between the sink and the window.
    fast = torch.full((b, h, n * t + 7, d), 123.0, dtype=dtype)
    slow = fast.clone()
    returned, patch = _recording()
    with patch:
        fmt.decode(stored, fast[:, :, 3:3 + n * t])
    assert returned == [True]
    _eager(fmt, stored, slow[:, :, 3:3 + n * t])
    assert torch.equal(fast, slow)
    assert (fast[:, :, :3] == 123).all() and (fast[:, :, 3 + n * t:] == 123).all()   # nothing written outside
    err = (fast[:, :, 3:3 + n * t].float() - x.flatten(2, 3)).abs().max()
    assert err < x.abs().max() * (0.7 if bits == 2 else 0.2)                          # and it is a reconstruction


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_kernel_matches_eager_bit_for_bit(shape, dtype):
    b, h, n, t, d, _ = shape
    fmt = engine.TensorFormat("fp8", 8, "token", 1)
    x = torch.randn(b, h, n, t, d, generator=torch.Generator().manual_seed(sum(shape))) * 3
    x[..., 0, 0] = 0.0                                                         # an all-zero row would be rarer
    stored = fmt.encode(x)
    fast = torch.full((b, h, n * t + 5, d), 7.0, dtype=dtype)
    slow = fast.clone()
    returned, real = [], kernels.dequantize_fp8_rows

    def spy(*args):
        returned.append(real(*args))
        return returned[-1]
    with mock.patch.object(kernels, "dequantize_fp8_rows", spy):
        fmt.decode(stored, fast[:, :, 2:2 + n * t])
    assert returned == [True]
    with mock.patch.object(kernels, "dequantize_fp8_rows", return_value=False):
        fmt.decode(stored, slow[:, :, 2:2 + n * t])
    assert torch.equal(fast, slow)
    assert (fast[:, :, :2] == 7).all() and (fast[:, :, 2 + n * t:] == 7).all()


@needs_kernel
def test_engine_uses_the_kernel_on_cpu(bundled):
    model, tokenizer = bundled
    ids = tokenizer("ROMEO: " * 60, return_tensors="pt").input_ids[:, :300]

    def prefill_then_step():
        cache = build_cache("kvplay-int4:residual=32", model)
        with torch.no_grad():
            model(ids[:, :-1], past_key_values=cache)               # quantizes all but the last ~32 tokens
            return model(ids[:, -1:], past_key_values=cache).logits  # reads them back

    returned, patch = _recording()
    with patch:
        fast = prefill_then_step()
    assert returned and all(returned), "the engine did not use the kernel"
    with mock.patch.object(kernels, "dequantize_rows", return_value=False):
        slow = prefill_then_step()
    assert torch.equal(fast, slow)


def test_layouts_it_does_not_handle_fall_back():
    fmt = engine.TensorFormat("int", 4, "token", 16)
    stored = fmt.encode(torch.randn(1, 2, 1, 8, 32))
    packed, scale, zero = stored[0].flatten(2, 3), stored[1].flatten(2, 3).squeeze(-1), stored[2].flatten(2, 3).squeeze(-1)
    kw = dict(bits=4, group=16, rows_per_scale=1, per_code=False)
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 8, 32, dtype=torch.float16), **kw)
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 32, 8).mT, **kw)   # columns not contiguous
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 8, 32), **{**kw, "bits": 3})


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLAY_KERNEL_DIR", str(tmp_path))
    kernels._library.cache_clear()
    yield tmp_path
    kernels._library.cache_clear()


def test_kvplay_kernels_0_turns_it_off(fresh_library, monkeypatch):
    monkeypatch.setenv("KVPLAY_KERNELS", "0")
    assert not kernels.available()
    assert not list(fresh_library.iterdir())     # nothing was built


def test_a_failed_build_warns_once_and_the_cache_still_works(fresh_library, monkeypatch, bundled):
    monkeypatch.setenv("CC", "false")           # a compiler that always fails
    with pytest.warns(RuntimeWarning, match="kernel unavailable"):
        assert not kernels.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.available()          # once, not per call
    model, tokenizer = bundled
    ids = tokenizer("ROMEO: " * 50, return_tensors="pt").input_ids[:, :200]
    with torch.no_grad():
        model(ids, past_key_values=build_cache("kvplay-int2:residual=16", model))


@needs_kernel
def test_the_build_is_cached_per_user(fresh_library):
    first = kernels._build()
    stamp = first.stat().st_mtime_ns
    assert kernels._build() == first and first.stat().st_mtime_ns == stamp
    assert first.parent == fresh_library

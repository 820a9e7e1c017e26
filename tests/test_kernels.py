"""The compiled CPU dequantization kernel computes exactly what the eager PyTorch path computes."""
import os
import warnings
from unittest import mock

import pytest
import torch

from kvplay.cache import build_cache, engine, kernels

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler for kvplay's kernel")

# (B, H, n blocks, T tokens per block, D head_dim, token group): odd sizes exercise the scalar tails
# of the vector loop and planes that the codes only partly fill.
SHAPES = [(1, 2, 3, 64, 64, 64), (3, 2, 2, 16, 40, 20), (2, 1, 2, 8, 38, 38), (1, 3, 1, 4, 36, 12)]
# Worst reconstruction error |decoded - x| over SHAPES, both groupings and both output dtypes, as a fraction of
# max |x|, per bit width: measured 0.260 (2 bits), 0.0653 (4), 0.00433 (8) (2026-12-02); 3x. (quant.py's
# bound, scale / 2 <= max |x| / (2**bits - 1), is 0.333, 0.0667 and 0.0039, plus bfloat16's rounding of the output.)
MAX_ERR = {2: 0.78, 4: 0.2, 8: 0.013}


def _recording(entry: str = "dequantize_rows"):
    """Patch a kernel entry point to record what it returned (True: the kernel did the work)."""
    returned, real = [], getattr(kernels, entry)

    def spy(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]
    return returned, mock.patch.object(kernels, entry, spy)


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
    assert err < x.abs().max() * MAX_ERR[bits]                                      # and it is a reconstruction


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
    returned, patch = _recording("dequantize_fp8_rows")
    with patch:
        fmt.decode(stored, fast[:, :, 2:2 + n * t])
    assert returned == [True]
    with mock.patch.object(kernels, "dequantize_fp8_rows", return_value=False):
        fmt.decode(stored, slow[:, :, 2:2 + n * t])
    assert torch.equal(fast, slow)
    assert (fast[:, :, :2] == 7).all() and (fast[:, :, 2 + n * t:] == 7).all()


# float16 bit patterns planted in stored scales and zeros: NaNs (quiet, signalling, negative, and 0x7FFF and
# 0xFFFF, whose payloads fill the low bits bfloat16 drops, so rounding them with no NaN guard carries into the
# sign and gives -0.0 and +0.0), and both infinities.
POISON = [0x7FFF, 0xFFFF, 0x7E00, 0xFE00, 0x7C01, 0x7C00, 0xFC00]
NONFINITE = [("int", 8, "channel", None), ("int", 2, "channel", None), ("int", 4, "token", 20),
             ("int", 8, "token", 20), ("fp8", 8, "token", 1)]


def _plant(t: torch.Tensor, gen: torch.Generator) -> None:
    """Write POISON's bit patterns at random places of the float16 tensor t (in place)."""
    flat = t.view(-1).view(torch.int16)
    flat[torch.randperm(flat.numel(), generator=gen)[:len(POISON)]] = torch.tensor(POISON).to(torch.int16)


@needs_kernel
@pytest.mark.parametrize("source", ["planted scales", "beyond float16"])
@pytest.mark.parametrize("fmt_args", NONFINITE, ids=lambda a: "fp8" if a[0] == "fp8" else f"int{a[1]}-{a[2]}")
def test_nan_and_inf_come_out_as_torch_makes_them(fmt_args, source):
    """NaN and inf reach the kernel: the cache refuses NaN/inf keys and values, but a finite bfloat16 value
    beyond float16's 65504 overflows a scale or zero to inf (then inf * 0 and inf - inf are NaN), and
    dequantize_rows takes any scales. The bfloat16 result equals torch's float32 -> bfloat16 conversion of
    the same float32 sums bit for bit, infinities included; a NaN comes out a NaN, as torch's does (torch's own
    NaN bits are not one thing to match: 0x7FC0 from its scalar code, 0xFFFF from its AVX2/AVX-512 code).
    The kernel's NaN is its float32 NaN with the sign and top mantissa bits kept and the quiet bit set."""
    kind, bits, grouping, group = fmt_args
    b, h, n, t, d = 2, 2, 2, 16, 40                        # 40 channels: vector loops and their scalar tails
    fmt = engine.TensorFormat(kind, bits, grouping, t if group is None else group)
    gen = torch.Generator().manual_seed(bits + len(grouping))
    x = torch.randn(b, h, n, t, d, generator=gen)
    if source == "beyond float16":
        x[0, 1, 1, 3, 5] = -2.0 ** 30                      # a finite bfloat16 key or value the cache accepts
    stored = fmt.encode(x)
    if source == "planted scales":
        for meta in stored[1:]:
            _plant(meta, gen)
        if kind == "fp8":                                  # and the two fp8 NaNs among the codes
            stored[0].view(-1).view(torch.uint8)[:2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    entry = "dequantize_fp8_rows" if kind == "fp8" else "dequantize_rows"
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        outs[dtype] = torch.empty(b, h, n * t, d, dtype=dtype)
        returned, patch = _recording(entry)
        with patch:
            fmt.decode(stored, outs[dtype])
        assert returned == [True]
    fast, f32 = outs[torch.bfloat16], outs[torch.float32]
    slow = torch.empty_like(fast)
    with mock.patch.object(kernels, entry, return_value=False):
        fmt.decode(stored, slow)
    nan = slow.isnan()
    assert nan.any() and (source == "beyond float16" or slow.isinf().any())    # the poison reached the output
    assert torch.equal(fast.isnan(), nan) and torch.equal(f32.isnan(), nan)
    assert torch.equal(fast[~nan], slow[~nan]) and torch.equal(fast[~nan], f32[~nan].bfloat16())
    got = fast.view(torch.int16).int() & 0xFFFF
    want = ((f32.view(torch.int32) >> 16) | 0x40) & 0xFFFF
    assert torch.equal(got[nan], want[nan])


@needs_kernel
def test_engine_uses_the_kernel_on_cpu(bundled):
    model, tokenizer = bundled
    ids = tokenizer("ROMEO: " * 60, return_tensors="pt").input_ids[:, :300]

    def prefill_then_step():
        cache = build_cache("kvplay-int4:residual=32,attention=sdpa", model)   # the path that dequantizes
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
    packed = stored[0].flatten(2, 3)
    scale, zero = stored[1].flatten(2, 3).squeeze(-1), stored[2].flatten(2, 3).squeeze(-1)
    kw = dict(bits=4, group=16, rows_per_scale=1, per_code=False)
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 8, 32, dtype=torch.float16), **kw)
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 32, 8).mT, **kw)  # columns not contiguous
    assert not kernels.dequantize_rows(packed, scale, zero, torch.empty(1, 2, 8, 32), **{**kw, "bits": 3})


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    folder = tmp_path / "kernels"
    monkeypatch.setenv("KVPLAY_KERNEL_DIR", str(folder))
    kernels._library.cache_clear()
    yield folder
    kernels._library.cache_clear()


def test_kvplay_kernels_0_turns_it_off(fresh_library, monkeypatch):
    monkeypatch.setenv("KVPLAY_KERNELS", "0")
    assert not kernels.available()
    assert not fresh_library.exists()            # nothing was built


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


# ---------------------------------------------------------------------------- safety of the build cache

def _fake_compiler(folder, version: str):
    """A compiler that reports `version` and otherwise runs the real one."""
    real, _ = kernels._compiler()
    script = folder / f"cc-{version.replace(' ', '-')}"
    script.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\nexec {real} "$@"\n')
    script.chmod(0o755)
    return script


@needs_kernel
def test_the_cache_key_follows_the_compilers_identity(tmp_path, monkeypatch):
    keys = []
    for version in ("cc 1.0", "cc 2.0"):
        monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, version)))
        path, identity = kernels._compiler()
        assert version in identity and str(tmp_path) in identity    # the version and the resolved path
        keys.append(kernels._key(identity))
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path / "..", "cc 2.0")))   # same version, another path
    keys.append(kernels._key(kernels._compiler()[1]))
    assert len(set(keys)) == 3


@needs_kernel
@pytest.mark.parametrize("plant", ["world-writable", "group-writable", "symlink", "someone else's"])
def test_a_planted_cache_folder_is_refused(fresh_library, tmp_path, plant):
    if plant == "someone else's":
        if os.getuid() != 0:
            pytest.skip("only root can give a folder to another user")
        fresh_library.mkdir(mode=0o700)
        os.chown(fresh_library, 65534, 65534)     # nobody's, private to them
        planted = fresh_library
    elif plant == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        fresh_library.symlink_to(target)          # a private folder, but reached through a link
        planted = target
    else:
        fresh_library.mkdir()
        fresh_library.chmod(0o777 if plant == "world-writable" else 0o770)
        planted = fresh_library
    # a library already waiting under the name the build would use
    name = f"dequant-{kernels._key(kernels._compiler()[1])}.so"
    (planted / name).write_bytes(b"not a library")
    folder = kernels._cache_dir()
    assert folder != fresh_library and kernels._private(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    lib = kernels._build()
    assert lib.parent == folder and lib.name == name and lib.read_bytes() != b"not a library"
    assert (planted / name).read_bytes() == b"not a library"   # left alone


@needs_kernel
def test_a_foreign_file_in_a_private_folder_is_not_loaded(fresh_library):
    fresh_library.mkdir(mode=0o700)
    name = f"dequant-{kernels._key(kernels._compiler()[1])}.so"
    (fresh_library / name).symlink_to("/dev/null")
    lib = kernels._build()
    assert lib.parent != fresh_library and lib.stat().st_size > 0


@needs_kernel
@pytest.mark.parametrize("name", sorted(kernels.SOURCES))
def test_the_build_emits_no_warnings(tmp_path, name):
    cc, _ = kernels._compiler()
    done = kernels._compile(cc, tmp_path / f"{name}.so", kernels.SOURCES[name])
    assert done.returncode == 0 and "-Wall" in kernels.FLAGS
    assert done.stderr.strip() == ""


@needs_kernel
def test_openmp_follows_torchs_thread_count(monkeypatch):
    lib = kernels._library()
    assert lib.kvplay_threads(1) == 1
    assert lib.kvplay_threads(2) in (1, 2)        # 1 only when the compiler had no OpenMP
    calls = []
    real = lib.kvplay_dequant_fp8
    monkeypatch.setattr(lib, "kvplay_dequant_fp8", lambda *args: calls.append(args[-1]) or real(*args))
    fmt = engine.TensorFormat("fp8", 8, "token", 1)
    stored = fmt.encode(torch.randn(1, 2, 1, 8, 32))
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            fmt.decode(stored, torch.empty(1, 2, 8, 32))
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 2]


@needs_kernel
def test_the_app_compiles_both_kernels_at_start_up_off_the_main_thread(monkeypatch):
    """A fresh machine compiles csrc/ once (23.5 s on 2 cores: attend.c 20.1 s, dequant.c 3.4 s); the app does it in
    a daemon thread as it starts, so the first Compare does not wait for the compiler. Here the libraries are
    cached already, so _build only finds them; what is checked is that both are asked for, from that thread, and
    that launch() starts it before the page."""
    import threading

    from kvplay.app import startup
    from kvplay.ui import app as ui_app

    asked, real = [], kernels._build

    def recording(source=kernels.SOURCE):
        asked.append((source.stem, threading.current_thread().name))
        return real(source)
    monkeypatch.setattr(kernels, "_build", recording)
    kernels.library.cache_clear()
    kernels._library.cache_clear()
    try:
        thread = startup.build_kernels_in_background()
        thread.join(120)
        assert thread.daemon and not thread.is_alive()
        assert sorted(asked) == [("attend", "kvplay-kernel-build"), ("dequant", "kvplay-kernel-build")]
    finally:
        kernels.library.cache_clear()
        kernels._library.cache_clear()

    order = []
    monkeypatch.setattr(startup, "build_kernels_in_background", lambda: order.append("kernels"))
    monkeypatch.setattr(ui_app, "build_app", lambda: mock.Mock(launch=lambda **kw: order.append("page")))
    ui_app.launch()
    assert order == ["kernels", "page"]

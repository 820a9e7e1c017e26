"""The Trade-offs commands: pareto, window-sweep, drift and recipe (`python -m kvplay <command> --help`)."""
from __future__ import annotations

import json
from pathlib import Path

from kvplay.app.tradeoffs import drift, pareto, window_sweep
from kvplay.lab.tradeoffs.measure import FULL, QUICK, RESIDUALS, SINKS, WindowSweepResult, to_dict
from kvplay.lab.tradeoffs.recipes import recipe


def add_parsers(sub, common) -> None:
    """The Trade-offs commands on the CLI's subparsers (`common` adds --model/--device/--json/...)."""
    p = sub.add_parser("pareto", help="every cache on one quality-versus-bytes chart, the frontier marked")
    common(p, caches=())          # --caches: measure only these specs instead of the grid
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help=f"presets plus a few variants, {QUICK.tokens} tokens (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help=f"every variant the registry declares, {FULL.tokens} tokens")
    p.add_argument("--tokens", type=int, default=None, help="context length the bits and KL are measured at")
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward pass")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the held-out play)")

    p = sub.add_parser("window-sweep", help="mean KL and top-1 against the 16-bit window and attention sinks")
    common(p, model=True)
    p.add_argument("--scheme", default="kvplay-int2")
    p.add_argument("--residuals", type=int, nargs="+", default=list(RESIDUALS))
    p.add_argument("--sinks", type=int, nargs="+", default=list(SINKS))
    p.add_argument("--transformers", nargs="*", default=["quanto-int2", "hqq-int2"], metavar="SPEC",
                   help="transformers' caches swept along residual_length (they flush rather than slide)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32)

    p = sub.add_parser("drift", help="KL along a long text, and at several context lengths")
    common(p, model=True)
    p.add_argument("--tokens", type=int, default=None, help="text length (default: 2048 or the model's limit)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=64, help="tokens per smoothing window")

    p = sub.add_parser("recipe", help="the nearest settings in transformers, llama.cpp, vLLM, SGLang and exllamav3")
    p.add_argument("spec")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH")


COMMANDS = ("pareto", "window-sweep", "drift", "recipe")


def _write(rows: list[dict], data: dict, args) -> None:
    import csv
    import io

    if args.json:
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    if args.csv and rows:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
        args.csv.write_text(buf.getvalue(), encoding="utf-8")


def run_cli(args) -> int:
    """Run one Trade-offs command: print its table, write --json / --csv. KvplayError propagates (exit 2)."""
    from kvplay.cli.main import _print_table, _progress, cli_settings

    if args.command == "recipe":
        data = recipe(args.spec)
        rows = [{"engine": e["engine"], "setting": e["setting"], "exact": "yes" if e["exact"] else "nearest",
                 "cannot express": "; ".join(e["cannot"])} for e in data["engines"]]
        _print_table(rows)
        _write(rows, data, args)
        return 0
    settings = cli_settings()
    update, close = _progress()
    common = dict(device=args.device, dtype=args.dtype, settings=settings, progress=update)
    try:
        if args.command == "pareto":
            from kvplay.app.commands import read_text_file

            text = read_text_file(args.text) if args.text else None
            result = pareto(args.model, quick=args.quick, specs=args.caches or None, tokens=args.tokens,
                            chunk=args.chunk, text=text, **common)
        elif args.command == "window-sweep":
            result = window_sweep(args.model, args.scheme, residuals=args.residuals, sinks=args.sinks,
                                  transformers_schemes=args.transformers, tokens=args.tokens, chunk=args.chunk,
                                  **common)
        else:
            caches = None if args.caches == list(_default_specs()) else args.caches
            result = drift(args.model, caches, tokens=args.tokens, chunk=args.chunk, window=args.window, **common)
    finally:
        close()
    rows = result.summary_rows()
    _print_table(rows)
    if isinstance(result, WindowSweepResult):
        print(result.note)
    _write(rows, to_dict(result), args)
    return 0


def _default_specs():
    from kvplay.cache import DEFAULT_SPECS

    return DEFAULT_SPECS

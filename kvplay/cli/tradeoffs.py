"""The Trade-offs commands: pareto, window-sweep, drift and recipe (`python -m kvplay <command> --help`)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from kvplay.app.checks import read_text_file
from kvplay.app.tradeoffs import TASK_CONTEXTS, TASK_SPECS, drift, pareto, tasks, window_sweep
from kvplay.cache import DEFAULT_SPECS
from kvplay.cli import scale
from kvplay.cli.common import add_common, print_table, run_options
from kvplay.lab.tasks.run import SAMPLES
from kvplay.lab.tasks.suite import KINDS
from kvplay.lab.tradeoffs.measure import FULL, QUICK, RESIDUALS, SINKS
from kvplay.lab.tradeoffs.recipes import recipe
from kvplay.show.tradeoffs import measured_cell


def add_parsers(sub) -> None:
    """The Trade-offs commands on the CLI's subparsers."""
    p = sub.add_parser("pareto", help="every cache on one quality-versus-bytes chart, the frontier marked")
    add_common(p, caches=())          # --caches: measure only these specs instead of the grid
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help=f"presets plus a few variants, {QUICK.tokens} tokens (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help=f"every variant the registry declares, {FULL.tokens} tokens")
    p.add_argument("--tokens", type=int, default=None, help="context length the bits and KL are measured at")
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward pass")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the held-out play)")
    scale.add_ray(p)

    p = sub.add_parser("window-sweep", help="mean KL and top-1 against the 16-bit window and attention sinks")
    add_common(p, model=True)
    p.add_argument("--scheme", default="kvplay-int2")
    p.add_argument("--residuals", type=int, nargs="+", default=list(RESIDUALS))
    p.add_argument("--sinks", type=int, nargs="+", default=list(SINKS))
    p.add_argument("--transformers", nargs="*", default=["quanto-int2", "hqq-int2"], metavar="SPEC",
                   help="transformers' caches swept along residual_length (they flush rather than slide)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32)

    p = sub.add_parser("drift", help="KL along a long text, and at several context lengths")
    add_common(p, model=True)
    p.add_argument("--tokens", type=int, default=None, help="text length (default: 2048 or the model's limit)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=64, help="tokens per smoothing window")

    p = sub.add_parser("tasks", help="tasks with answers (needles, variable tracking, word counts) through each cache, "
                                     "quantized or evicting, against the 16-bit ceiling, with bits per element")
    add_common(p, caches=TASK_SPECS)
    p.add_argument("--contexts", type=int, nargs="+", default=list(TASK_CONTEXTS), help="context lengths in tokens")
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS, help="task kinds (default: all)")
    p.add_argument("--samples", type=int, default=SAMPLES, help="tasks per kind and context (seeds)")
    p.add_argument("--seed", type=int, default=0)
    scale.add_ray(p)

    p = sub.add_parser("recipe", help="the nearest settings in transformers, llama.cpp, vLLM, SGLang and exllamav3")
    p.add_argument("spec")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH")


COMMANDS = ("pareto", "window-sweep", "drift", "tasks", "recipe")


def _recipe(args) -> None:
    """The recipe is a table of settings, not a measurement: printed and written here."""
    data = recipe(args.spec)
    rows = [{"engine": e["engine"], "setting": e["setting"], "exact": "yes" if e["exact"] else "nearest",
             "cannot express": "; ".join(e["cannot"]), "measured (the real engine)": measured_cell(e["measured"])}
            for e in data["engines"]]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    if args.csv and rows:
        with open(args.csv, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def run(args, progress, settings) -> list:
    """Run one Trade-offs command; kvplay.cli.main prints and writes its result like every command's."""
    if args.command == "recipe":
        _recipe(args)
        return []
    options = run_options(args, progress, settings)
    options.pop("weights")
    if args.command == "pareto":
        text = read_text_file(args.text) if args.text else None
        if args.ray is not None:
            return [scale.pareto(args, options, text)]
        return [pareto(args.model, quick=args.quick, specs=args.caches or None, tokens=args.tokens, chunk=args.chunk,
                       text=text, **options)]
    if args.command == "window-sweep":
        return [window_sweep(args.model, args.scheme, residuals=args.residuals, sinks=args.sinks,
                             transformers_schemes=args.transformers, tokens=args.tokens, chunk=args.chunk, **options)]
    if args.command == "tasks" and args.ray is not None:
        return [scale.tasks(args, options)]
    if args.command == "tasks":
        return [tasks(args.model, args.caches, contexts=args.contexts, kinds=args.kinds, samples=args.samples,
                      seed=args.seed, **options)]
    caches = None if args.caches == list(DEFAULT_SPECS) else args.caches
    return [drift(args.model, caches, tokens=args.tokens, chunk=args.chunk, window=args.window, **options)]

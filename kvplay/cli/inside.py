"""`python -m kvplay outliers | needle | errors | attention | kept`: the Inside views on the command line."""
from __future__ import annotations

from kvplay.app import inside
from kvplay.cli import scale
from kvplay.cli.common import add_common, run_options
from kvplay.errors import KvplayError
from kvplay.lab.inside import QUICK_DEPTHS, QUICK_LENGTHS, SCAN_TOKENS

COMMANDS = ("outliers", "needle", "errors", "attention", "kept")


def add_parsers(sub) -> None:
    """The outliers, needle, errors, attention and kept subcommands."""
    p = sub.add_parser("outliers", help="key/value outlier channels per layer and head, and the schemes at risk")
    add_common(p)
    p.add_argument("--tokens", type=int, default=SCAN_TOKENS, help="tokens of the held-out play to scan")
    p = sub.add_parser("needle", help="find a passkey hidden in filler, at context lengths x depths, per cache")
    add_common(p, caches=inside.INSIDE_SPECS)      # the Inside views' default caches, one definition
    p.add_argument("--quick", action="store_true", help=f"lengths {list(QUICK_LENGTHS)} x depths {list(QUICK_DEPTHS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths, fractions 0..1")
    p.add_argument("--seed", type=int, default=0)
    scale.add_ray(p)
    p = sub.add_parser("errors", help="relative key and value reconstruction error per layer and KV head, per cache")
    add_common(p, caches=inside.INSIDE_SPECS)
    p.add_argument("--tokens", type=int, default=SCAN_TOKENS, help="tokens of the held-out play to store")
    p = sub.add_parser("attention", help="one layer and head's attention over the context: 16-bit cache against one "
                                         "quantized cache, for one generated token")
    add_common(p, caches=("kvplay-int2",))
    p.add_argument("--prompt", default=None, help="prompt text (default: a pass code in filler for a chat model, "
                                                  "otherwise the held-out play's opening)")
    p.add_argument("--step", type=int, default=8, help="the generated token (1 = the second one)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--head", type=int, default=0, help="query head")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens the 16-bit cache generates first")
    p = sub.add_parser("kept", help="which prompt positions each evicting cache kept, per layer, with a pass code "
                                    "hidden in the prompt")
    add_common(p, caches=inside.KEPT_SPECS)
    p.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens")
    p.add_argument("--depth", type=float, default=0.5, help="where the pass code sits, 0 (start) to 1 (end)")
    p.add_argument("--seed", type=int, default=0)


def run(args, progress, settings) -> list:
    """Run one Inside command; its result is printed and written by kvplay.cli.main like every command's."""
    options = run_options(args, progress, settings)
    if args.command == "outliers":
        return [inside.outliers(args.model, tokens=args.tokens, **options)]
    if args.command == "kept":
        return [inside.kept(args.model, args.caches, tokens=args.tokens, depth=args.depth, seed=args.seed, **options)]
    if args.command == "errors":
        return [inside.error_maps(args.model, args.caches, tokens=args.tokens, **options)]
    if args.command == "attention":
        if len(args.caches) != 1:
            raise KvplayError(f"Give one cache to compare its attention with the 16-bit cache's, got "
                              f"{len(args.caches)}.")
        return [inside.shift(args.model, args.prompt, args.caches[0], step=args.step, layer=args.layer,
                             head=args.head, new_tokens=args.new_tokens, **options)]
    if args.ray is not None:
        return [scale.needle(args, options)]
    return [inside.needle(args.model, args.caches, quick=args.quick, lengths=args.lengths, depths=args.depths,
                          seed=args.seed, **options)]

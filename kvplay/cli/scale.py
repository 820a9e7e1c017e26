"""`--ray [ADDRESS]` on the sweeps (`ppl --models`, `tasks`, `pareto`, `needle`): the flags, and each sweep's call
through kvplay.app.scale, which prints its cell-to-worker plan on stderr and returns the same result as a run without
Ray."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm

from kvplay.app import scale

RAY_HELP = ("spread the sweep's cells over Ray (pip install -r requirements-ray.txt): alone, a local Ray instance on "
            "this machine; with an address (what `ray start --head` prints, or auto), that cluster (docs/scale.md)")


def add_ray(p) -> None:
    """--ray [ADDRESS] and --ray-cpus on a sweep's parser."""
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help=RAY_HELP)
    p.add_argument("--ray-cpus", type=int, default=1, metavar="N", help=(
                   "with --ray: CPU cores per worker where cells run on CPUs (default 1); a GPU worker takes one GPU"))


def note(text: str) -> None:
    """The plan and where each cell ran, on stderr above the progress bar: stdout keeps the table a run without
    Ray prints."""
    tqdm.write(text, file=sys.stderr)


def ppl_models(args, specs, run: dict):
    return scale.ppl_models(args.models, specs, ray=args.ray, cpus=args.ray_cpus, needle=args.needle, note=note,
                            **run)


def tasks(args, options: dict):
    return scale.tasks(args.model, args.caches, ray=args.ray, cpus=args.ray_cpus, contexts=args.contexts,
                       kinds=args.kinds, samples=args.samples, seed=args.seed, note=note, **options)


def pareto(args, options: dict, text):
    return scale.pareto(args.model, ray=args.ray, cpus=args.ray_cpus, quick=args.quick, specs=args.caches or None,
                        tokens=args.tokens, chunk=args.chunk, text=text, note=note, **options)


def needle(args, options: dict):
    return scale.needle(args.model, args.caches, ray=args.ray, cpus=args.ray_cpus, quick=args.quick,
                        lengths=args.lengths, depths=args.depths, seed=args.seed, note=note, **options)

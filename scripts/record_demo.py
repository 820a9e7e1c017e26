"""Record the Compare tab's default task and each example: real compares, stored for the page to show on open.

    python scripts/record_demo.py                       # every task of the default model; rewrites docs/demo.md
    python scripts/record_demo.py --model gemma-3-270m  # another catalogue model's tasks
    python scripts/record_demo.py --only pass-code-in-the-tempest
    python scripts/record_demo.py --docs-only           # rewrite docs/demo.md from the recordings already there

Each task runs through kvplay.app.compare.compare with the presets the UI starts with (the 16-bit baseline first),
the chat template for chat models and the task's own max new tokens, exactly as pressing Compare does; the
result goes to assets/recorded/<model>/<slug>.json (kvplay.show.recorded) with today's date and the machine in
words. Then docs/demo.md's marked section is rewritten from every model's recordings, so its figures are theirs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvplay.app import compare, prompts  # noqa: E402
from kvplay.app.catalogue import MODELS, REAL_MODEL  # noqa: E402
from kvplay.app.settings import Settings  # noqa: E402
from kvplay.cache.spec import DEFAULT_SPECS  # noqa: E402
from kvplay.show import recorded  # noqa: E402

DOC = ROOT / "docs" / "demo.md"


def machine(result) -> str:
    """Where it ran, in words: "2-core CPU" or the GPU's name."""
    if result.env.gpu:
        return result.env.gpu
    return f"{os.cpu_count()}-core CPU"


def _graded(run) -> str:
    """The lab's grade of a cache's answer, in a word."""
    return "-" if run.answer_right is None else "right" if run.answer_right else "WRONG"


def record(task, model: str, settings: Settings) -> recorded.Recording:
    t0 = time.perf_counter()
    result = compare.compare(model, list(DEFAULT_SPECS), task.prompt, task.max_new_tokens, settings=settings,
                             progress=lambda frac, desc: None)
    rec = recorded.Recording(slug=task.slug, title=task.title, date=datetime.date.today().isoformat(),
                             machine=machine(result), result=result)
    out = recorded.save(rec)
    base = result.caches[0]
    print(f"{task.slug}: {result.prompt_tokens} prompt tokens, {time.perf_counter() - t0:.0f} s, 16-bit answer "
          f"{base.text!r} {_graded(base)} -> {out}", flush=True)
    for run in result.caches[1:]:
        print(f"  {run.spec}: {_graded(run)} {run.text[:80]!r}", flush=True)
    return rec


def docs_models() -> dict:
    """Every catalogue model with recordings, in catalogue order: its recordings of its current tasks, and their
    order (the default task first)."""
    out = {}
    for name in MODELS:
        order = [t.slug for t in prompts.tasks(name)]
        recs = [r for r in recorded.all_recordings(name) if r.slug in order]
        if recs:
            out[name] = (recs, order)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REAL_MODEL)
    p.add_argument("--only", nargs="+", default=None, help="task slugs (default: every task of the model)")
    p.add_argument("--docs-only", action="store_true", help="only rewrite docs/demo.md from the recordings")
    args = p.parse_args(argv)
    tasks = prompts.tasks(args.model)
    known = {t.slug for t in tasks}
    unknown = [s for s in args.only or [] if s not in known]
    if unknown:
        p.error(f"unknown task {unknown[0]!r}; the tasks are {', '.join(sorted(known))}")
    if not args.docs_only:
        settings = Settings(default_model=args.model)
        for task in tasks:
            if args.only is None or task.slug in args.only:
                record(task, args.model, settings)
    changed = recorded.rewrite_docs(DOC, docs_models())
    print(f"{DOC.relative_to(ROOT)}: {'rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

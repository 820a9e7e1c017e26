"""Record the Deploy tab's answers (assets/recorded/deploy/<model>/<engine>.json) and write docs/deploy.md's
evidence from them:

    python scripts/record_deploy.py --models smollm2-135m-instruct --engines ollama llama.cpp
    python scripts/record_deploy.py --docs-only          # rewrite docs/deploy.md from the recordings kept

Each answer is kvplay.app.advise.advise with its defaults (a 24 GB GPU, the model's limit, the default bar, 512
tokens of the held-out play at 16 a forward and the pass-code task), measured on this machine (or read from the
measurement store), one model at a time. On a machine busy with other work, KVPLAY_TORCH_THREADS=1 measured the
same settings 5-15x faster than two threads (SmolLM2, 2 cores, load 6).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvplay.app.settings import Settings, bound_openmp_spin  # noqa: E402  (imports no torch)

bound_openmp_spin()              # as `python -m kvplay` does, before torch starts its threads

from kvplay.app.advise import advise, recorded, save_recording  # noqa: E402
from kvplay.app.catalogue import GEMMA, QWEN, REAL_MODEL  # noqa: E402
from kvplay.app.startup import apply_settings  # noqa: E402
from kvplay.lab.advise import ENGINES  # noqa: E402
from kvplay.lab.bench import cpu_name  # noqa: E402
from kvplay.show.advise import DOCS_END, DOCS_START, docs_section  # noqa: E402

DOC = ROOT / "docs" / "deploy.md"
MODELS = (REAL_MODEL, QWEN, GEMMA)


def rewrite_docs() -> bool:
    answers = {m: [r for e in ENGINES if (r := recorded(m, e)) is not None] for m in MODELS}
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(DOCS_START, 1)
    new = head + docs_section({m: a for m, a in answers.items() if a}) + rest.split(DOCS_END, 1)[1]
    if new != text:
        DOC.write_text(new, encoding="utf-8")
    return new != text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES))
    ap.add_argument("--docs-only", action="store_true")
    args = ap.parse_args()
    if not args.docs_only:
        apply_settings(Settings.from_env(hosted=False))     # KVPLAY_TORCH_THREADS=1 beside other work
        where = f"on {cpu_name()}"
        for model in args.models:
            for engine in args.engines:
                result = advise(model, engine, device="cpu",
                                progress=lambda f, what, m=model, e=engine: print(f"\r{m} {e}: {what[:60]:<60}",
                                                                                   end="", flush=True))
                print(f"\r{save_recording(result, where)}: {result.recommended} ({datetime.datetime.now():%H:%M})")
    print("docs/deploy.md", "rewritten" if rewrite_docs() else "unchanged")


if __name__ == "__main__":
    main()

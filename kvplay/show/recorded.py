"""Recorded Compare runs: the default task's and each example's, shown the moment the page opens.

Each is one JSON file under assets/recorded/, written by scripts/record_demo.py from a real compare:

    {"kind": "recording", "slug": ..., "title": ..., "date": "2025-01-31", "machine": "2-core CPU",
     "result": <the compare JSON, kvplay.results.to_dict>}

The UI rebuilds the result with kvplay.results.from_dict and draws it with the same code as a live run
(kvplay.show.cards, kvplay.show.plots, kvplay.show.tables);
no model runs. A recording is shown only for the model it was
made on and the prompt it was made with, so an edited task never shows a stale answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvplay.results import CompareResult, from_dict, to_dict
from kvplay.show.cards import fmt_kl, tone

RECORDED = Path(__file__).resolve().parents[2] / "assets" / "recorded"


@dataclass
class Recording:
    slug: str
    title: str
    date: str                 # YYYY-MM-DD, the day it was recorded
    machine: str              # "2-core CPU": where it ran, in words
    result: CompareResult

    def label(self) -> str:
        return f"Recorded on a {self.machine}, {self.date}; press Compare to run it live."


def path(slug: str, folder: Path = RECORDED) -> Path:
    return folder / f"{slug}.json"


def save(recording: Recording, folder: Path = RECORDED) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = path(recording.slug, folder)
    data = {"kind": "recording", "slug": recording.slug, "title": recording.title, "date": recording.date,
            "machine": recording.machine, "result": to_dict(recording.result)}
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def read(file: Path) -> Recording:
    """One recording file, rebuilt with the current result classes (a format that drifted raises here)."""
    data = json.loads(file.read_text(encoding="utf-8"))
    if data.get("kind") != "recording":
        raise ValueError(f"{file} is not a recording (kind {data.get('kind')!r}).")
    result = from_dict(data["result"])
    result.measured_on = f"a {data['machine']}, {data['date']} (recorded)"    # its speeds: where and when, not here
    return Recording(slug=data["slug"], title=data["title"], date=data["date"], machine=data["machine"],
                     result=result)


def for_task(task, model_name: str | None, folder: Path = RECORDED) -> Recording | None:
    """The task's recording when it was made on this model with this very prompt; None otherwise."""
    if task is None or not path(task.slug, folder).is_file():
        return None
    rec = read(path(task.slug, folder))
    same_model = rec.result.env is not None and rec.result.env.model == (model_name or "").strip().lower()
    return rec if same_model and rec.result.prompt == task.prompt else None


def all_recordings(folder: Path = RECORDED) -> list[Recording]:
    return [read(f) for f in sorted(folder.glob("*.json"))]


# ---------------------------------------------------------------------------- docs/demo.md's figures

DOCS_START = "<!-- recorded runs: written by scripts/record_demo.py from assets/recorded/; do not edit by hand -->"
DOCS_END = "<!-- end of recorded runs -->"


def _answer(run, result) -> str:
    if result.expected is None or run.answer is None:
        return "(no answer to check)"
    return f"{run.answer} ✓" if run.answer_right else f"{run.answer} ✗"


def markdown(recordings: list[Recording], order: list[str] | None = None) -> str:
    """docs/demo.md's recorded section: the default task's table, then one line per example (`order`: slugs)."""
    rank = {s: i for i, s in enumerate(order or [])}
    recs = sorted(recordings, key=lambda r: (rank.get(r.slug, len(rank)), r.slug))
    if not recs:
        return f"{DOCS_START}\n(no recordings yet: run `python scripts/record_demo.py`)\n{DOCS_END}"
    first, out = recs[0], [DOCS_START]
    res = first.result
    out.append(f"**{first.title}** ({res.prompt_tokens:,} prompt tokens, chat template, greedy, up to "
               f"{res.max_new_tokens} new tokens; {res.env.model}, {res.env.dtype}; "
               f"{first.label().replace('; press Compare to run it live.', '')}):\n")
    out.append("| cache | answer | verdict | size vs 16-bit at 8k tokens | picks 16-bit's next token | mean KL |")
    out.append("|---|---|---|---|---|---|")
    for i, run in enumerate(res.caches):
        verdict = "reference" if i == 0 else tone(run)
        size = "1.0x" if i == 0 or run.long_context_compression is None else f"{run.long_context_compression:.2f}x"
        top1 = "-" if i == 0 else f"{100 * run.top1_agreement:.0f}%"
        kl = "-" if i == 0 else fmt_kl(run.mean_kl)
        out.append(f"| {run.spec} | {_answer(run, res)} | {verdict} | {size} | {top1} | {kl} |")
    if len(recs) > 1:
        out.append("\nThe examples (pick one under the prompt to see its recording):\n")
        for rec in recs[1:]:
            r = rec.result
            answers = ", ".join(f"{run.spec} {_answer(run, r)}" for run in r.caches)
            if r.expected is None:
                tones = ", ".join(f"{run.spec} {tone(run)} (KL {fmt_kl(run.mean_kl)})" for run in r.caches[1:])
                out.append(f"- **{rec.title}** ({r.prompt_tokens:,} tokens, no answer to check): {tones}.")
            else:
                out.append(f"- **{rec.title}** ({r.prompt_tokens:,} tokens, expected {r.expected}): {answers}.")
    out.append(DOCS_END)
    return "\n".join(out)


def rewrite_docs(doc: Path, recordings: list[Recording], order: list[str] | None = None) -> bool:
    """Replace the marked section of `doc` with markdown(recordings); True when the file changed."""
    text = doc.read_text(encoding="utf-8")
    if DOCS_START not in text or DOCS_END not in text:
        raise ValueError(f"{doc} has no recorded-runs section (the two markers {DOCS_START!r} ... {DOCS_END!r}).")
    head, rest = text.split(DOCS_START, 1)
    tail = rest.split(DOCS_END, 1)[1]
    new = head + markdown(recordings, order) + tail
    if new != text:
        doc.write_text(new, encoding="utf-8")
    return new != text

"""Recorded Compare runs: each catalogue model's default task and examples, shown the moment the page opens and
whenever a model or an example is picked.

Each is one JSON file, assets/recorded/<model>/<slug>.json, written by scripts/record_demo.py from a real compare:

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

from kvplay.paths import assets
from kvplay.results import CompareResult, from_dict, to_dict
from kvplay.show.cards import fmt_kl, refusals, tone

RECORDED = assets("recorded")


@dataclass
class Recording:
    slug: str
    title: str
    date: str                 # YYYY-MM-DD, the day it was recorded
    machine: str              # "2-core CPU": where it ran, in words
    result: CompareResult

    @property
    def model(self) -> str:
        return self.result.env.model if self.result.env is not None else ""

    def where(self) -> str:
        """Where and when it ran, in words: "on a 2-core CPU, 2026-12-04"."""
        return f"on a {self.machine}, {self.date}"

    def label(self) -> str:
        return f"Recorded {self.where()}, with {self.model}; press Compare to run it live."


def path(slug: str, model: str, folder: Path = RECORDED) -> Path:
    return folder / model.strip().lower() / f"{slug}.json"


def save(recording: Recording, folder: Path = RECORDED) -> Path:
    out = path(recording.slug, recording.model, folder)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    if task is None or not model_name or not path(task.slug, model_name, folder).is_file():
        return None
    rec = read(path(task.slug, model_name, folder))
    same_model = rec.model == model_name.strip().lower()
    return rec if same_model and rec.result.prompt == task.prompt else None


def all_recordings(model: str, folder: Path = RECORDED) -> list[Recording]:
    return [read(f) for f in sorted((folder / model.strip().lower()).glob("*.json"))]


# ---------------------------------------------------------------------------- docs/demo.md's figures

DOCS_START = "<!-- recorded runs: written by scripts/record_demo.py from assets/recorded/; do not edit by hand -->"
DOCS_END = "<!-- end of recorded runs -->"


def _answer(run, result) -> str:
    if result.expected is None or run.answer is None:
        return "(no answer to check)"
    return f"{run.answer} ✓" if run.answer_right else f"{run.answer} ✗"


def markdown(recordings: list[Recording], order: list[str] | None = None) -> str:
    """One model's part of docs/demo.md's recorded section: the default task's table, then one line per example
    (`order`: the model's task slugs, the default first)."""
    rank = {s: i for i, s in enumerate(order or [])}
    recs = sorted(recordings, key=lambda r: (rank.get(r.slug, len(rank)), r.slug))
    if not recs:
        return "(no recordings yet: run `python scripts/record_demo.py`)"
    first = recs[0]
    res = first.result
    prompting = "chat template" if res.chat else "plain text to complete"
    out = [f"**{first.title}** ({res.prompt_tokens:,} prompt tokens, {prompting}, greedy, up to "
           f"{res.max_new_tokens} new tokens; {res.env.model}, {res.env.dtype}; recorded {first.where()}):\n",
           "| cache | answer | verdict | size vs 16-bit at 8k tokens | picks 16-bit's next token | mean KL |",
           "|---|---|---|---|---|---|"]
    for i, run in enumerate(res.caches):
        verdict = "reference" if i == 0 else tone(run)
        size = "1.0x" if i == 0 or run.long_context_compression is None else f"{run.long_context_compression:.2f}x"
        top1 = "-" if i == 0 else f"{100 * run.top1_agreement:.0f}%"
        kl = "-" if i == 0 else fmt_kl(run.mean_kl)
        out.append(f"| {run.spec} | {_answer(run, res)} | {verdict} | {size} | {top1} | {kl} |")
    if res.refused:
        out.append("\nNot run on this model:\n")
        out += [f"- {line}" for line in refusals(res.refused)]
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
    return "\n".join(out)


def section(models: dict[str, tuple[list[Recording], list[str]]]) -> str:
    """docs/demo.md's whole recorded section: for each model (name -> its recordings and task order), a heading and
    its markdown(), between the two markers."""
    parts = [f"#### {name}\n\n{markdown(recs, order)}" for name, (recs, order) in models.items()]
    return "\n".join([DOCS_START, "\n\n".join(parts), DOCS_END])


def rewrite_docs(doc: Path, models: dict[str, tuple[list[Recording], list[str]]]) -> bool:
    """Replace the marked section of `doc` with section(models); True when the file changed."""
    text = doc.read_text(encoding="utf-8")
    if DOCS_START not in text or DOCS_END not in text:
        raise ValueError(f"{doc} has no recorded-runs section (the two markers {DOCS_START!r} ... {DOCS_END!r}).")
    head, rest = text.split(DOCS_START, 1)
    tail = rest.split(DOCS_END, 1)[1]
    new = head + section(models) + tail
    if new != text:
        doc.write_text(new, encoding="utf-8")
    return new != text

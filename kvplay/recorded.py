"""Recorded Compare runs: the default task's and each example's, shown the moment the page opens.

Each is one JSON file under assets/recorded/, written by scripts/record_demo.py from a real compare:

    {"kind": "recording", "slug": ..., "title": ..., "date": "2025-01-31", "machine": "2-core CPU",
     "result": <the compare JSON, kvplay.results.to_dict>}

The UI rebuilds the result with kvplay.results.from_dict and draws it with the same code as a live run
(kvplay.render, kvplay.plots, kvplay.tables); no model runs. A recording is shown only for the model it was
made on and the prompt it was made with, so an edited task never shows a stale answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .catalogue import ASSETS
from .results import CompareResult, from_dict, to_dict

RECORDED = ASSETS / "recorded"


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
    return Recording(slug=data["slug"], title=data["title"], date=data["date"], machine=data["machine"],
                     result=from_dict(data["result"]))


def for_task(task, model_name: str | None, folder: Path = RECORDED) -> Recording | None:
    """The task's recording when it was made on this model with this very prompt; None otherwise."""
    if task is None or not path(task.slug, folder).is_file():
        return None
    rec = read(path(task.slug, folder))
    same_model = rec.result.env is not None and rec.result.env.model == (model_name or "").strip().lower()
    return rec if same_model and rec.result.prompt == task.prompt else None

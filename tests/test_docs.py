"""The documents: docs/results/ holds the current result files and its README indexes exactly them (what each shows,
the command that made it); the README stays a user's page with the commands CI runs; every local link resolves."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"


def indexed() -> list[str]:
    """The files the index's table rows link to (first column), in order."""
    return re.findall(r"^\| \[([^\]]+)\]\(\1\) \|", INDEX.read_text(encoding="utf-8"), re.M)


def test_every_result_file_is_indexed_and_every_entry_exists():
    on_disk = {p.name for p in RESULTS.iterdir() if p.is_file() and p != INDEX}
    listed = indexed()
    assert len(listed) == len(set(listed)), "an index entry is listed twice"
    assert on_disk - set(listed) == set(), "files in docs/results/ missing from its README.md index"
    assert set(listed) - on_disk == set(), "docs/results/README.md lists files that are not there"


def test_each_entry_says_what_it_shows_and_the_command():
    rows = re.findall(r"^\| \[([^\]]+)\]\(\1\) \| ([^|]+) \| (.+) \|$", INDEX.read_text(encoding="utf-8"), re.M)
    assert len(rows) == len(indexed())
    for name, shows, command in rows:
        assert len(shows.split()) >= 5, f"{name}: say what it shows"
        assert re.search(r"`[^`]*(python|--)[^`]*`", command), f"{name}: give the command that made it"


def test_result_files_live_only_in_docs_results():
    stray = [p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".json", ".jsonl")]
    assert stray == [], f"move {stray} to docs/results/ and index them"


# ---------------------------------------------------------------------------- the README, a user's document

README = ROOT / "README.md"


def test_the_readme_is_a_users_page_of_at_most_150_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150, "move the detail to a docs/ page and link it"


def test_the_readme_gives_the_commands_ci_runs():
    """CI runs the README's two commands as written (.ci/run): the app's and the tests'."""
    text, ci = README.read_text(encoding="utf-8"), (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    tests = "pip install -r requirements-test.txt && ruff check . && lint-imports && python -m pytest -q"
    assert f"\n{tests}\n" in text and f"\n{tests}\n" in ci
    assert "\npip install -r requirements.txt && python app.py\n" in text
    assert "pip install -q -r requirements.txt" in ci and "python scripts/smoke.py" in ci


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
def test_every_local_link_resolves(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        if not re.match(r"[a-z]+:", target):
            assert (path.parent / target).exists(), f"{page} links to a missing {target}"

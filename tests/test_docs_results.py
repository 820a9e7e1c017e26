"""docs/results/ holds the current result files, and its README indexes exactly them: every file is listed with what
it shows and the command that made it, and every entry exists. Result files live nowhere else under docs/."""
import re
from pathlib import Path

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


def test_the_docs_link_only_to_result_files_that_exist():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for page in pages:
        for target in re.findall(r"\]\(((?:docs/)?results/[^)#]+)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"

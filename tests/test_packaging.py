"""`pip install .` carries kvplay's data: a wheel built from this checkout, installed into an empty folder, finds the
bundled model, the held-out text, the published architectures and the recorded runs the page opens on, from another
directory (kvplay.paths.assets).
About 15 s: the build, then one process that imports kvplay from the installed copy."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_an_installed_wheel_carries_the_assets_and_runs_from_another_directory(tmp_path):
    src, dist, site, elsewhere = (tmp_path / name for name in ("src", "dist", "site", "elsewhere"))
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):     # a clean copy: the build writes build/
        shutil.copy2(ROOT / name, src / name)
    for folder in ("kvplay", "assets"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "_assets"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(dist.glob("kvplay-*.whl"))
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

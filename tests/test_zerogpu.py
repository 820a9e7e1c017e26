"""On a ZeroGPU Space, every handler that runs a model borrows the GPU through `spaces.GPU`, and nothing else does.

Spaces installs the `spaces` package; kvplay.ui.common takes its GPU decorator when it imports. Here a stand-in
`spaces` module that marks what it decorates is put first on the path of a fresh interpreter, which builds the page
and lists its endpoints: each one that runs a model (concurrency_id "model", one at a time per device) must be
marked, and no other.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_SPACES = '''
def GPU(fn=None, duration=None):
    """spaces.GPU's two forms, @GPU and @GPU(duration=...): mark the function, run it as it is."""
    def mark(f):
        f.borrows_gpu = True
        return f
    return mark(fn) if fn is not None else mark
'''

LIST_ENDPOINTS = '''
import json
from kvplay.app.settings import Settings
from kvplay.ui import app as ui

ui.warm_start = lambda settings, name: None                  # no background model run
page = ui.build_app(Settings(default_model="shakespeare-llama"))
print(json.dumps([[f.api_name, f.concurrency_id == "model", getattr(f.fn, "borrows_gpu", False)]
                  for f in page.fns.values() if f.api_name]))
'''


def test_every_model_run_borrows_the_gpu_on_zerogpu_and_nothing_else_does(tmp_path):
    (tmp_path / "spaces.py").write_text(FAKE_SPACES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "HF_HUB_OFFLINE": "1",
           "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-c", LIST_ENDPOINTS], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    endpoints = json.loads(out.stdout.strip().splitlines()[-1])
    runs_model = {name for name, model, _ in endpoints if model}
    borrows = {name for name, _, marked in endpoints if marked}
    assert {"compare", "quality", "quality_beside_recorded", "advise"} <= runs_model     # the view has them
    assert borrows == runs_model, (sorted(runs_model - borrows), sorted(borrows - runs_model))
    assert len(endpoints) > len(runs_model)                   # and light endpoints too, which borrow nothing

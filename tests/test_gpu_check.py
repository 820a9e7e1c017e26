"""scripts/gpu_check.py: the GPU check's steps (device tests, the default Compare, the decode bench at two contexts,
ppl --models) run end to end on the CPU at tiny sizes with --dry-run, each writing its JSON; without a GPU the real
run is one sentence."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvplay import results

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.slow          # 100-147 s on 2 busy cores: a pytest run and three CLI runs, each a fresh process
def test_the_dry_run_runs_every_step_on_the_cpu_and_writes_its_json(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    check = json.loads((tmp_path / "gpu-check.json").read_text())
    assert check["dry_run"] and check["device"] == "cpu"
    assert [s["step"] for s in check["steps"]] == ["device tests", "default Compare", "decode bench", "ppl --models"]
    assert all(s["exit"] == 0 and s["seconds"] > 0 for s in check["steps"])
    assert " passed" in json.loads((tmp_path / "gpu-tests.json").read_text())["tail"]
    compare = results.from_dict(json.loads((tmp_path / "gpu-compare.json").read_text()))
    assert compare.env.device == "cpu" and compare.caches[0].spec == "baseline" and len(compare.caches) > 1
    decode = json.loads((tmp_path / "gpu-decode.json").read_text())
    assert {(c["context"], c["spec"]) for c in decode["cells"]} == {
        (n, s) for n in (128, 256) for s in ("baseline", "kvplay-int4", "kvplay-int2", "quanto-int4")}
    assert all(c["tokens_per_s"] > 0 for c in decode["cells"])
    ppl = results.from_dict(json.loads((tmp_path / "gpu-ppl-three-models.json").read_text()))
    assert len(ppl.runs) == 2 and all(r.env.device == "cpu" for r in ppl.runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the real run would start")
def test_without_a_gpu_the_real_run_is_one_sentence():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: no CUDA GPU here; run with --dry-run to check the steps on the CPU."

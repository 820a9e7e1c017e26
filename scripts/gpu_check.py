"""Every view on a GPU (issue 53): run on a machine with an NVIDIA GPU, it writes docs/results/gpu-*.json.

    python scripts/gpu_check.py                  # --device cuda: docs/results/gpu-*.json
    python scripts/gpu_check.py --dry-run        # the same steps on the CPU at tiny sizes, into a temporary folder

The steps, each a CLI command in a fresh process (start-up and model load included) where one exists:
  1. the device-marked tests: KVPLAY_TEST_DEVICE=cuda python -m pytest -m device       -> gpu-tests.json
  2. the default Compare: python -m kvplay compare --device cuda                        -> gpu-compare.json
  3. the decode bench at 8k and 32k tokens: each cache's decode tokens/s after filling it to that context, on a
     model trained for 32k positions (kvplay.lab.bench.decode_speeds, as `bench` times decode)  -> gpu-decode.json
  4. ppl on the three catalogue models: python -m kvplay ppl --models ... --device cuda -> gpu-ppl-three-models.json
gpu-check.json records each step's command, exit status and wall seconds, and the device. A step that fails is
recorded and the others still run; the script exits 1 when any failed. tests/test_gpu_check.py runs --dry-run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))             # run from a checkout, installed or not

import torch  # noqa: E402

from kvplay.app.models import load_model  # noqa: E402
from kvplay.cache import runnable_specs  # noqa: E402
from kvplay.lab.bench import cpu_name, decode_speeds  # noqa: E402
from kvplay.lab.texts import long_text_ids  # noqa: E402

THREE_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]
# The GPU's sizes, and the dry run's: the bundled model (16k positions) at tiny lengths, by name and by folder for
# ppl --models' two models.
# 32,640 tokens: the timed steps (3 rounds of 16, and one more each) stay within Qwen2.5's 32,768 positions.
FULL = dict(device="cuda", compare=[], decode_model="qwen2.5-coder-0.5b-instruct", contexts=(8192, 32640),
            steps=16, repeats=3, ppl=["--models", *THREE_MODELS])
DRY = dict(device="cpu", compare=["--model", "shakespeare-llama", "--max-new-tokens", "8"],
           decode_model="shakespeare-llama", contexts=(128, 256), steps=2, repeats=1,
           ppl=["--models", "shakespeare-llama", str(ROOT / "assets" / "shakespeare-llama"), "--max-tokens", "64",
                "--caches", "kvplay-int4", "quanto-int4"])
DECODE_SPECS = ["baseline", "kvplay-int4", "kvplay-int2", "quanto-int4"]


def run(name: str, command: list[str], steps: list, env: dict | None = None) -> None:
    """Run one step's command from the checkout's root, recording its exit status, wall time and output's tail."""
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    steps.append({"step": name, "command": " ".join(command), "exit": done.returncode,
                  "seconds": round(time.perf_counter() - t0, 1), "tail": (done.stdout + done.stderr)[-1500:]})
    print(f"{name}: exit {done.returncode} in {steps[-1]['seconds']} s", flush=True)


def decode_bench(sizes: dict, out: Path, steps: list) -> None:
    """Step 3 in this process: each cache filled to each context, then timed decode steps (kvplay.lab.bench)."""
    t0 = time.perf_counter()
    try:
        model, tok = load_model(sizes["decode_model"], device=sizes["device"])
        specs, refused = runnable_specs(DECODE_SPECS, model.config, require_one=False)
        ids = long_text_ids(tok, max(sizes["contexts"]) + 1).to(model.device)
        cells = []
        for context in sizes["contexts"]:
            for spec, (rate, share, peak) in decode_speeds(model, ids, [str(s) for s in specs], context, 1,
                                                           sizes["steps"], sizes["repeats"]).items():
                cells.append({"context": context, "spec": spec, "tokens_per_s": round(rate, 2),
                              "share_in_cache_update": round(share, 4), "peak_bytes": peak})
        gpu = torch.cuda.max_memory_allocated() if model.device.type == "cuda" else None
        result = {"model": sizes["decode_model"], "device": str(model.device), "dtype": str(model.dtype),
                  "batch": 1, "timed_steps": sizes["steps"] * sizes["repeats"], "cells": cells, "refused": refused,
                  "cuda_max_memory_allocated": gpu}
        (out / "gpu-decode.json").write_text(json.dumps(result, indent=1))
        status, tail = 0, ""
    except Exception as exc:  # noqa: BLE001 - recorded, and the other steps still run
        status, tail = 1, f"{type(exc).__name__}: {exc}"
    steps.append({"step": "decode bench", "command": f"decode_speeds at {list(sizes['contexts'])} tokens",
                  "exit": status, "seconds": round(time.perf_counter() - t0, 1), "tail": tail})
    print(f"decode bench: exit {status} in {steps[-1]['seconds']} s", flush=True)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else cpu_name()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the JSON files go (default: docs/results, or a temporary folder with --dry-run)")
    args = ap.parse_args(argv)
    sizes = DRY if args.dry_run else FULL
    out = args.out or (Path(tempfile.mkdtemp(prefix="kvplay-gpu-check-")) if args.dry_run else ROOT / "docs/results")
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU here; run with --dry-run to check the steps on the CPU.", file=sys.stderr)
        return 2
    device, py, steps = sizes["device"], sys.executable, []
    run("device tests", [py, "-m", "pytest", "-q", "-m", "device", "-p", "no:cacheprovider"], steps,
        env={"KVPLAY_TEST_DEVICE": device})
    (out / "gpu-tests.json").write_text(json.dumps({"device": device, **steps[-1]}, indent=1))
    run("default Compare", [py, "-m", "kvplay", "compare", "--device", device, *sizes["compare"],
                            "--json", str(out / "gpu-compare.json")], steps)
    decode_bench(sizes, out, steps)
    run("ppl --models", [py, "-m", "kvplay", "ppl", *sizes["ppl"], "--device", device,
                                    "--json", str(out / "gpu-ppl-three-models.json")], steps)
    summary = {"dry_run": args.dry_run, "device": device, "device_name": device_name(device),
               "python": platform.python_version(), "steps": steps}
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
    failed = [s["step"] for s in steps if s["exit"]]
    print(f"wrote {out}/gpu-*.json" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Time what kvplay's presets calibrate on a model it has not seen: the fragile-layer rankings (the Fisher ranking, the
default, against the exhaustive one) and the key rotations. Issue 49's targets: all presets' calibration at most 45 s
for a 0.5B model and 120 s for a 1.5B one, on 2 idle cores.

    PYTHONPATH=. python scripts/time_calibration.py          # writes docs/results/calibration-times.json
    PYTHONPATH=. python scripts/time_calibration.py --models smollm2-135m-instruct --json /tmp/t.json
    PYTHONPATH=. python scripts/time_calibration.py --compare-only --json docs/results/calibration-compare.json
    PYTHONPATH=. python scripts/time_calibration.py --now-only --json docs/results/calibration-times-fast.json

Each model is loaded as kvplay loads it (CPU, bfloat16; the load is not timed), with nothing kept: the shipped seeds
and this machine's caches are out of reach. Wall seconds:
  - now: calibrate() of each rotation- or ranking-calibrated preset in turn (kvplay-int2, kvplay-3bit, kvplay-2.5bit),
    as a first run does, split by its progress messages into the Fisher pass, the rankings and each key-rotation fit;
  - before: the exhaustive ranking of kvplay-int2's keys (2 x layers + 1 forwards of 512 tokens) measured in full;
    the other rankings (1,024 and 2,048 tokens) and the key-rotation fits as they were (one forward each, then a
    per-query loss: rotations.score_noise) timed over their first --layers layers and scaled to all of them;
  - --compare-only: a first default Compare with nothing kept (time_compare), as a user's first click meets it;
  - --now-only: "now" alone, each preset beside the estimate kvplay says before it starts (calibration_time.py).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from kvplay.app.models import load_model
from kvplay.cache import calibrate, calibration_time, fragile, parse_spec, quant, rotations
from kvplay.cache.methods.kvplay import _full_attention
from kvplay.lab.bench import machine
from scripts import shaped_model

MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
PRESETS = ("kvplay-int2", "kvplay-3bit", "kvplay-2.5bit")
TARGETS_S = {"0.5B": 45.0, "1.5B": 120.0}


class Stop(Exception):
    """Raised from a progress callback: enough layers timed."""


def forget(model) -> None:
    """Nothing kept: no seeds, no cache on disk or in memory."""
    fragile.SEEDS = rotations.SEEDS = Path(tempfile.mkdtemp()) / "none"
    os.environ["KVPLAY_RANKING_DIR"] = tempfile.mkdtemp()
    os.environ["KVPLAY_ROTATION_DIR"] = tempfile.mkdtemp()
    for kept in (fragile._RANKINGS, fragile._FISHERS, rotations._FITTED):
        kept.pop(model, None)


def shaped(name: str) -> dict:
    """{"shaped": what scripts/shaped_model.py wrote} for a folder it made (random weights: its times only mean
    anything), else {}."""
    marker = Path(name) / shaped_model.MARKER
    return {"shaped": json.loads(marker.read_text())} if marker.is_file() else {}


def phase(what: str) -> str:
    """Which part of a calibration a progress message starts: the Fisher pass, weighing a ranking, a rotation fit
    (the estimate's opening message counts as setup)."""
    if "(estimated)" in what:
        return "setup"
    return "rotations" if "key rotations" in what else "ranking" if "weighing each layer" in what else "fisher pass"


def estimated_phases(spec, model) -> dict[str, float]:
    """calibration_time's estimate of what calibrate() will measure for spec, in the phases phase() names."""
    phases: dict[str, float] = {}
    for part, seconds in spec.method.calibration_parts(spec, model).items():
        name = ("fisher pass" if part.startswith("Fisher pass") else "rotations" if part.startswith("group=") else
                "outlier pass" if part == "outlier pass" else "ranking")
        phases[name] = round(phases.get(name, 0.0) + seconds, 1)
    return phases


def time_now(model, tok) -> dict:
    """calibrate() of each preset, as a first run: seconds per preset and per phase (progress messages' times)."""
    forget(model)
    os.environ["KVPLAY_RANKING"] = "fisher"
    out = {}
    for name in PRESETS:
        estimated = estimated_phases(parse_spec(name), model)
        start = time.perf_counter()
        stamps = [(start, "setup")]                               # the fingerprint, the kept rankings looked up
        calibrate([parse_spec(name)], model, tok,
                  lambda fraction, what, seen=stamps: seen.append((time.perf_counter(), phase(what))))
        end = time.perf_counter()
        phases: dict[str, float] = {}
        for (t, p), (t_next, _) in zip(stamps, stamps[1:] + [(end, None)]):
            phases[p] = phases.get(p, 0.0) + t_next - t
        out[name] = {"seconds": round(end - start, 1), "phases": {k: round(v, 1) for k, v in phases.items()},
                     "estimated": {"seconds": round(sum(estimated.values()), 1), "phases": estimated}}
        print(name, out[name], flush=True)
    return out


def exhaustive(model, tok, spec, layers, part, first: int | None) -> dict:
    """rank_layers' seconds: in full (first None), or the reference forward and the first `first` layers' forwards,
    scaled to all layers."""
    stamps = []

    def progress(fraction, what):
        stamps.append(time.perf_counter())
        if first is not None and len(stamps) == first + 2:     # the start, the reference, then `first` layers
            raise Stop
    start = time.perf_counter()
    try:
        fragile.rank_layers(model, tok, spec, layers, part, progress)
    except Stop:
        per_layer = (stamps[-1] - stamps[1]) / first
        return {"seconds": round(stamps[1] - start + per_layer * len(layers), 1), "measured_layers": first}
    return {"seconds": round(time.perf_counter() - start, 1), "measured_layers": len(layers)}


def old_fit_seconds(model, tok, spec, layers, first: int) -> dict:
    """The key rotations as fitted before (one forward; per layer 300 Adam steps on rotations.score_noise, a product
    per query), timed over `first` layers and scaled to all."""
    start = time.perf_counter()
    seen = rotations.queries_and_keys(model, fragile.calibration_ids(tok, rotations.CALIBRATION_TOKENS))
    forward = time.perf_counter() - start
    start = time.perf_counter()
    for i in layers[:first]:
        q, k = seen[i]
        hkv, d = k.shape[0], k.shape[-1]
        q = q.unflatten(0, (hkv, -1)).flatten(1, 2)
        w = rotations.block_mass(q, k, spec.group, spec.sink)
        begin = quant.hadamard(d).expand(hkv, d, d)
        a = torch.zeros(hkv, d, d, requires_grad=True)
        opt = torch.optim.Adam([a], lr=rotations.LR)
        for _ in range(rotations.STEPS):
            loss = rotations.score_noise(begin @ torch.linalg.matrix_exp(a - a.mT), q, k, w, spec.group, spec.sink)
            opt.zero_grad()
            loss.backward()
            opt.step()
    per_layer = (time.perf_counter() - start) / first
    return {"seconds": round(forward + per_layer * len(layers), 1), "measured_layers": first}


def time_before(model, tok, layers, first: int) -> dict:
    os.environ["KVPLAY_RANKING"] = "exhaustive"
    out = {"rankings": {}, "rotations": {}}
    for name in PRESETS:
        spec = parse_spec(name)
        for part in fragile.PARTS:
            if fragile.ranks(spec, part):
                full = name == "kvplay-int2"
                out["rankings"][f"{name} {part}"] = exhaustive(model, tok, spec, layers, part, None if full else first)
                print(name, part, out["rankings"][f"{name} {part}"], flush=True)
        if spec.rotation == "calibrated":
            out["rotations"][f"{name} group={spec.group}"] = old_fit_seconds(model, tok, spec, layers, first)
            print(name, "rotations", out["rotations"][f"{name} group={spec.group}"], flush=True)
    return out


def time_compare(model, tok, name: str) -> dict:
    """A default Compare (DEFAULT_SPECS, the default prompt and its task, 64 new tokens) on the model with nothing
    kept, as its first run is: seconds until the first quantized cache's card has a token, until the caches that
    need no calibration have decoded, until the calibrating ones have joined, and until every speed is timed."""
    from kvplay.app import prompts
    from kvplay.cache import DEFAULT_SPECS
    from kvplay.lab.compare import Task, iter_compare

    forget(model)
    os.environ["KVPLAY_RANKING"] = "fisher"
    prompt = prompts.default_prompt(name, tok)
    chat = prompts.is_chat(name, tok)
    task = prompts.task_for(prompt, name)
    specs = [parse_spec("baseline"), *map(parse_spec, DEFAULT_SPECS)]
    start, seen = time.perf_counter(), {}
    for result in iter_compare(model, tok, specs, prompt, 64, model_name=name, chat=chat,
                               prompt_ids=prompts.encode(tok, prompt, chat),
                               task=Task(task.title, task.expected, task.check) if task else None):
        now = round(time.perf_counter() - start, 1)
        if any(r.token_ids for r in result.caches[1:]):
            seen.setdefault("first_card_s", now)
        if result.calibrating and all(r.answer_right is not None or not task for r in result.caches[1:]):
            seen.setdefault("others_decoded_s", now)
            seen.setdefault("calibrating", list(result.calibrating))
        if (not result.calibrating and len(result.caches) == len(specs)
                and all(r.answer_right is not None or not task for r in result.caches[1:])):
            seen.setdefault("all_answers_s", now)
    seen["done_s"] = now
    seen["answers"] = {r.spec: r.answer_right for r in result.caches[1:]}
    print(name, "compare", seen, flush=True)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--layers", type=int, default=3, help="layers timed where a time is scaled to all of them")
    ap.add_argument("--json", type=Path, default=Path("docs/results/calibration-times.json"))
    ap.add_argument("--compare-only", action="store_true", help="time only a first default Compare (--json: its file)")
    ap.add_argument("--now-only", action="store_true", help="time only what kvplay does now, not the exhaustive "
                    "ranking and thorough fits of before")
    args = ap.parse_args()
    if args.compare_only:
        found = {name: {**time_compare(*load_model(name, device="cpu"), name), **shaped(name)}
                 for name in args.models}
        where = {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
        args.json.write_text(json.dumps({"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                                         "machine": where, "compare": found}, indent=1) + "\n")
        return
    results = {}
    for name in args.models:
        model, tok = load_model(name, device="cpu")
        layers = _full_attention(model.config.get_text_config(decoder=True))
        load = os.getloadavg()[0]
        now = time_now(model, tok)
        before = {"rankings": {}, "rotations": {}} if args.now_only else time_before(model, tok, layers, args.layers)
        config, ct = model.config, calibration_time
        results[name] = {
            "layers": len(layers), "load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
            "counted": {"pass_flops": ct.pass_flops(config), "logit_elements": ct.logit_elements(config),
                        **{f"fit_probe {p} (setup, step) s per layer": ct.fit_probe(
                            *(ct._shape(config)[x] for x in ("heads", "kv_heads", "head_dim")),
                            rotations.chosen_fitter().block(parse_spec(p).group), parse_spec(p).sink,
                            rotations.chosen_fitter()) for p in PRESETS[1:]}},
            **shaped(name),
            "now": now, "before": before,
            "totals_s": {
                "now_all_presets": round(sum(r["seconds"] for r in now.values()), 1),
                "now_rankings": round(sum(r["phases"].get(p, 0.0) for r in now.values()
                                          for p in ("fisher pass", "ranking")), 1),
                "now_rotations": round(sum(r["phases"].get("rotations", 0.0) for r in now.values()), 1),
                "now_one_ranking": now["kvplay-int2"]["seconds"],
                "before_all_presets": round(sum(r["seconds"] for group in before.values() for r in group.values()), 1),
                "before_rankings": round(sum(r["seconds"] for r in before["rankings"].values()), 1),
                "before_rotations": round(sum(r["seconds"] for r in before["rotations"].values()), 1),
                "before_one_ranking": before["rankings"].get("kvplay-int2 keys", {}).get("seconds")}}
        print(name, results[name]["totals_s"], flush=True)
    out = {"measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": {**machine(), "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                       "note": "a shared machine: other engineers' jobs ran beside these"},
           "targets_all_presets_s": TARGETS_S, "rotation_fitter": vars(rotations.chosen_fitter()),
           "probed_gflops": {str(t): round(calibration_time.probed_rate(t) / 1e9, 1)
                             for t in (torch.float32, torch.bfloat16)},
           "seconds_per_probed_flop": calibration_time.SECONDS_PER_PROBED_FLOP,
           "miniature_factor": calibration_time.MINIATURE_FACTOR, "models": results}
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Parity: kvplay's emulation of llama.cpp's cache types next to the real llama.cpp, under one protocol.

    python scripts/engines_parity.py                       # writes assets/engines_parity.json, prints the table
    python scripts/engines_parity.py --types q8_0 q4_0 --tokens 1024 --out /tmp/parity.json
    python scripts/engines_parity.py --model my-model.gguf --real-only --types q8_0 q4_0 iq4_nl --out mine.json

The protocol is llama-perplexity's (--kl-divergence): one chunk of --tokens tokens of each text goes through
the cache in a single pass (every key and value is written to the cache before attention reads it), and only
the second half of the chunk is scored. Each engine is compared with its own 16-bit run:
  real      llama.cpp (llama-cpp-python, kvplay/lab/llamacpp.py) on the model's GGUF, -ctk/-ctv TYPE, flash
            attention, against llama.cpp's f16 cache; n_batch = the chunk, n_ubatch 512 (llama-perplexity's);
  emulated  kvplay's `llamacpp-TYPE` cache (kvplay/cache/methods/llamacpp.py, which quantizes prefill tokens
            before attention reads them) in transformers, the whole chunk in one forward, against kvplay's
            16-bit baseline (DynamicCache) read the same way.
Both read the same token ids (kvplay's tokenizer of the GGUF); no BOS is inserted. --real-only measures only
llama.cpp, on any GGUF (a file or a folder holding one), tokenized by llama.cpp itself. Needs llama-cpp-python
(pip install -r requirements-llamacpp.txt) and the cached catalogue model. CPU-heavy: run it once, niced.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvplay.app import fetch  # noqa: E402
from kvplay.cache import parse_spec  # noqa: E402
from kvplay.lab import llamacpp  # noqa: E402
from kvplay.results.environment import package_version as version  # noqa: E402


def _types(t: str) -> tuple[str, str]:
    """'q4_0' -> (q4_0, q4_0); 'q8_0/f16' -> K q8_0, V f16."""
    k, _, v = t.partition("/")
    return k, v or k


def real_spec(t: str) -> str:
    k, v = _types(t)
    return f"llama.cpp:{k}" if k == v else f"llama.cpp:ctk={k},ctv={v}"


def emulated_spec(t: str) -> str:
    k, v = _types(t)
    return f"llamacpp-{k}" if k == v else f"llamacpp-q8_0:ctk={k},ctv={v}"


TEXTS = (ROOT / "assets" / "texts" / "tempest.txt", ROOT / "assets" / "texts" / "python-reference.txt")


def emulated_rows(model, ids, types, score_from: int) -> list[dict]:
    """kvplay's 16-bit baseline, then each `llamacpp-TYPE` spec that is registered, the chunk in one forward."""
    import torch

    from kvplay.cache import SCHEMES, build_cache
    from kvplay.lab.metrics import kl_per_step, perplexity, token_logprob, top1_agree
    from kvplay.lab.quality import chunked_logits

    ids_t = torch.tensor([ids], device=model.device)                                        # (1, N)
    targets = ids_t[0, score_from + 1:]
    rows, p, base_ppl = [], None, None
    for t, spec in [(None, "baseline")] + [(t, emulated_spec(t)) for t in types]:
        if spec.split(":")[0] not in SCHEMES:
            rows.append({"spec": spec, "type": t, "missing": "not registered in this checkout"})
            continue
        t0 = time.perf_counter()
        q = chunked_logits(model, ids_t, build_cache(spec, model), len(ids))[score_from:]   # (M, V)
        ppl = perplexity(-token_logprob(q[:-1], targets))
        p, base_ppl = (q, ppl) if p is None else (p, base_ppl)
        kl = kl_per_step(p, q)
        rows.append({"spec": spec, "type": t, "ppl": ppl, "delta_ppl_pct": 100 * (ppl / base_ppl - 1),
                     "mean_kl": float(kl.mean()), "top1_agreement": float(top1_agree(p, q).float().mean()),
                     "seconds": time.perf_counter() - t0})
        print(f"  {spec}: KL {rows[-1]['mean_kl']:.5f} top-1 {rows[-1]['top1_agreement']:.4f}", flush=True)
    return rows


def real_rows(model_name, ids, types, score_from: int) -> list[dict]:
    specs = [parse_spec(real_spec(t)) for t in types]
    t0 = time.perf_counter()
    runs = llamacpp.ppl_runs(fetch.gguf_path(model_name), ids, specs, chunk=len(ids), score_from=score_from)
    rows = [{"spec": r.spec, "type": t, "ppl": r.ppl, "delta_ppl_pct": r.delta_ppl_pct, "mean_kl": r.mean_kl,
             "top1_agreement": r.top1_agreement} for t, r in zip([None] + list(types), runs)]
    for r in rows:
        print(f"  {r['spec']}: KL {r['mean_kl']:.5f} top-1 {r['top1_agreement']:.4f}", flush=True)
    print(f"  llama.cpp: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def table(result: dict) -> str:
    """The Markdown parity table docs/engines.md carries."""
    lines = ["| text | type | real llama.cpp KL | kvplay emulation KL | emulation / real | real top-1 | "
             "emulated top-1 | top-1 gap (points) |", "|---|---|---|---|---|---|---|---|"]
    for text in result["texts"]:
        real = {r["type"]: r for r in text["real"]}
        emul = {r["type"]: r for r in text["emulated"] if "mean_kl" in r}
        for t in result["types"]:
            a, b = real.get(t), emul.get(t)
            if a is None or b is None:
                kl = f"{a['mean_kl']:.4f}" if a else "not measured"
                lines.append(f"| {text['name']} | {t} | {kl} | {'' if b else 'not measured'} | | | | |")
                continue
            lines.append(f"| {text['name']} | {t} | {a['mean_kl']:.4f} | {b['mean_kl']:.4f} | "
                         f"{b['mean_kl'] / a['mean_kl']:.2f} | {100 * a['top1_agreement']:.1f}% | "
                         f"{100 * b['top1_agreement']:.1f}% | "
                         f"{100 * (b['top1_agreement'] - a['top1_agreement']):+.1f} |")
    return "\n".join(lines)


def real_only(args) -> int:
    result = {"protocol": f"one chunk of {args.tokens} tokens per text, the second half scored, against llama.cpp's "
                          "f16 cache", "model": str(args.model), "tokens": args.tokens, "types": args.types,
              "env": {"llama_cpp_python": version("llama-cpp-python"), "threads": llamacpp.threads()}, "texts": []}
    for path in args.texts:
        ids = llamacpp.tokenize(fetch.gguf_path(args.model), path.read_text(encoding="utf-8"))[:args.tokens]
        print(f"{path.name}: {len(ids)} tokens", flush=True)
        result["texts"].append({"name": path.name, "tokens": len(ids), "scored_from": len(ids) // 2,
                                "real": real_rows(args.model, ids, args.types, len(ids) // 2), "emulated": []})
    args.out.write_text(json.dumps(result, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per text: one chunk, the second half scored")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0", "q4_1"],
                    help="cache types; K/V for two, e.g. q8_0/f16 (-ctk q8_0 -ctv f16)")
    ap.add_argument("--texts", nargs="+", type=Path, default=list(TEXTS))
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "engines_parity.json")
    ap.add_argument("--real-only", action="store_true", help="only llama.cpp, tokenized by llama.cpp (any GGUF)")
    args = ap.parse_args(argv)
    llamacpp.require()
    if args.real_only:
        return real_only(args)
    import importlib.util

    if importlib.util.find_spec("kvplay.cache.methods.llamacpp"):      # the emulation, if this checkout has it
        importlib.import_module("kvplay.cache.methods.llamacpp")
    from kvplay.app.models import load_model

    model, tok = load_model(args.model)
    result = {"protocol": f"one chunk of {args.tokens} tokens per text through the cache in a single pass, the "
                          f"second half scored (llama-perplexity --kl-divergence); each engine against its own "
                          "16-bit run",
              "model": args.model, "tokens": args.tokens, "types": args.types, "kvplay_dtype": str(model.dtype),
              "env": {"llama_cpp_python": version("llama-cpp-python"), "torch": version("torch"),
                      "transformers": version("transformers"), "machine": platform.machine(),
                      "threads": llamacpp.threads()}, "texts": []}
    for path in args.texts:
        ids = tok(path.read_text(encoding="utf-8"), verbose=False).input_ids[:args.tokens]
        print(f"{path.name}: {len(ids)} tokens", flush=True)
        half = len(ids) // 2
        result["texts"].append({"name": path.name, "tokens": len(ids), "scored_from": half,
                                "real": real_rows(args.model, ids, args.types, half),
                                "emulated": emulated_rows(model, ids, args.types, half)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

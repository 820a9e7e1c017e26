"""The benchmark page: docs/benchmarks.md written from a run's result (and, when given, a GPU run's and a
real-model run's), tables first, then the targets and how to reproduce them."""
from __future__ import annotations

from kvplay.results.bench_targets import real_targets, targets  # noqa: F401  (targets: the CLI reads them here)


def _md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _tables(r: dict) -> dict:
    """Markdown tables for one result: targets, memory, speed, absolute speed, quality."""
    specs = list(r["memory"])
    lens = list(r["memory"]["baseline"])
    ctxs = list(r["decode_speed"]["baseline"])
    b4 = bool(r["decode_speed_batch4"])
    share_key = max(r["update_share"], key=lambda k: int(k.split("_")[0][3:]))  # the longest context
    rss = r.get("peak_decode_rss_bytes", {})
    return {
        "targets": _md_table(["target", "measured", "goal", "holds"],
                             [[t["target"], t["measured"], t["goal"], _holds(t)] for t in targets(r)]),
        "memory": _md_table(["spec"] + [f"{n} tokens" for n in lens] + [f"of limit @ {lens[-1]}",
                                                                          f"allocated / in use @ {lens[-1]}"],
                            [[s] + [f"{r['memory'][s][n]:.2f}x" for n in lens] + [f"{r['limits'][s][lens[-1]]:.3f}"]
                             + [_allocated(r, s, lens[-1])] for s in specs]),
        "decode_memory": _md_table(["spec"] + [k.replace("ctx", "").replace("_b", " tok, b") for k in rss],
                                   [[s] + [f"{rss[k][s] / 2**20:,.1f}" for k in rss] for s in specs]),
        "speed": _md_table(["spec"] + [f"decode @ {c}, b1" for c in ctxs]
                           + ([f"decode @ {c}, b4" for c in ctxs] if b4 else [])
                           + ["prefill", f"time in cache.update ({share_key})"],
                           [[s] + [f"{r['decode_speed'][s][c]:.2f}x" for c in ctxs]
                            + ([f"{r['decode_speed_batch4'][s][c]:.2f}x" for c in ctxs] if b4 else [])
                            + [f"{r['prefill_speed'][s]:.2f}x", f"{100 * r['update_share'][share_key][s]:.0f}%"]
                            for s in specs]),
        "speed_fastest": _speed_vs_fastest(r, specs, ctxs),
        "absolute": _md_table(["spec"] + list(r["decode_tokens_per_s"]),
                              [[s] + [row[s] for row in r["decode_tokens_per_s"].values()] for s in specs]),
        "quality": _md_table(["spec", "PPL", "delta PPL", "mean KL", "top-1 agreement"],
                             [[s, q["ppl"], f"{q['delta_ppl_pct']:+.3f}%", f"{q['mean_kl']:.5f}",
                               f"{q['top1_agreement']:.4f}"] for s, q in r["quality"].items()]),
        "peak": _md_table(["spec", "peak GPU memory"],
                          [[s, f"{b / 2**20:,.1f} MiB"] for s, b in r["peak_memory_bytes"].items()])
        if r.get("peak_memory_bytes") else "",
    }


def _holds(target: dict) -> str:
    """'yes', or a bold 'no' linked to where the page explains what limits the target."""
    if target["holds"]:
        return "yes"
    return f"**no** ([why]({target['why']}))" if target.get("why") else "**no**"


KEPT = ("<!-- Written by hand from here on: `python -m kvplay bench` keeps everything below this line when it "
        "rewrites the page. -->")


def keep_hand_written(page: str, old: str | None) -> str:
    """A freshly generated page followed by the old page's hand-written part (from the KEPT line on), so the
    analyses that explain the targets survive a new run."""
    if not old or KEPT not in old:
        return page
    return page.rstrip("\n") + "\n\n" + old[old.index(KEPT):]


def _speed_vs_fastest(r: dict, specs: list[str], ctxs: list[str]) -> str:
    """Decode speed over the fastest 16-bit path's in the same cell (the faster preallocated 16-bit row, named
    per cell), or a line saying the run predates it."""
    b1, b4 = r.get("decode_speed_vs_fastest_16bit"), r.get("decode_speed_batch4_vs_fastest_16bit")
    if not b1:
        return ("This run predates the fastest 16-bit path (`baseline:store=prealloc`): its speeds are quoted "
                "against DynamicCache only.")
    cells = [(c, 1, b1) for c in ctxs] + ([(c, 4, b4) for c in ctxs] if b4 else [])
    table = _md_table(["spec"] + [f"decode @ {c}, b{b}" for c, b, _ in cells],
                      [[s] + [f"{vs[s][c]:.2f}x" for c, _, vs in cells] for s in specs])
    fastest = "; ".join(f"{c} tokens, batch {b}: `{r['fastest_16bit'][f'ctx{c}_b{b}']}`" for c, b, _ in cells)
    return f"{table}\n\nThe fastest 16-bit path in each cell: {fastest}."


def _allocated(r: dict, spec: str, n: str) -> str:
    """Bytes the cache's buffers hold over bytes in use, at n tokens ("-" for runs that did not record it)."""
    held = r.get("allocated_bytes", {}).get(spec, {}).get(n)
    return f"{held / r['memory_bytes'][spec][n]:.4f}" if held else "-"


def _presets(r: dict) -> str:
    """One line per quantized spec: every option it ran with (runs before presets were recorded say so)."""
    if "presets" not in r:
        return "The run predates recorded presets: see docs/options.md for what each name means now."
    return "Presets as measured: " + "; ".join(f"`{s}` = {o}" for s, o in r["presets"].items() if o) + "."


def _where(r: dict) -> str:
    m = r["machine"]
    model = r["model"].rstrip("/").rsplit("/", 1)[-1] if r["model"].startswith("/") else r["model"]  # no local paths
    return (f"`{r['command']}` on {r['date']}, in one run, on {m.get('gpu') or m['processor']} "
            f"({m['platform']}, torch {m['torch']}, {m['threads']} threads), model `{model}` in {r['dtype']}")


GPU_HOWTO = """No GPU run is recorded here yet. The same command runs unchanged on CUDA (timings synchronise the
device around every step; peak memory comes from `torch.cuda.max_memory_allocated`):

```bash
python -m kvplay bench --device cuda --json docs/results/bench-gpu.json --markdown /tmp/gpu.md
python -m kvplay bench --from-json docs/results/bench-cpu.json --gpu-json docs/results/bench-gpu.json  # both, here
```"""


REAL_HOWTO = """No full benchmark run on the real model is recorded here yet; its memory (exact), quality and retrieval
figures measured so far are in [real-model.md](real-model.md). To add this section:

```bash
python -m kvplay bench --model smollm2-135m-instruct --json docs/results/bench-smollm2.json --markdown /tmp/real.md
python -m kvplay bench --from-json docs/results/bench-cpu.json --real-json docs/results/bench-smollm2.json
```"""


FASTEST_WHY = ("The baseline, transformers' DynamicCache, concatenates its whole history into a new tensor on every "
               "decode step, which any cache that avoids it is faster for, quantized or not; the fastest 16-bit "
               "path keeps the same 16-bit tokens in preallocated buffers written in place "
               "(`baseline:store=prealloc`, with sdpa or kvplay's fused kernel), and each cell is divided by the "
               "faster of the two measured in that cell.")


def _rounds(r: dict) -> str:
    """How a result's speed cells were measured."""
    c = r["config"]
    return (f"Each cell fills every spec's cache once; then, {c['repeats']} times, the specs take turns decoding "
            f"{c['decode_steps']} steps (one more first, discarded), and tokens/s is the batch over the median "
            f"step.")


def real_section(real: dict | None) -> str:
    """The real model's section: the numbers people came to see, measured like the bundled model's."""
    if not real:
        return REAL_HOWTO
    t = _tables(real)
    return f"""Measured by {_where(real)}; its GGUF Q4_1 weights are unpacked to bfloat16 at load, and the KV
cache is bfloat16 or quantized. Speed: {_rounds(real)} Whole run: {real['wall_s']} s.
{_presets(real)}

### Targets

{t['targets']}

### Quality on the held-out play ({real['config']['ppl_tokens']} tokens, chunk {real['config']['ppl_chunk']})

{t['quality']}

### Memory (baseline bytes / spec bytes, measured)

{t['memory']}

### Speed (ratio to baseline)

{t['speed']}

### Decode speed against the fastest 16-bit path (ratio, the same cells)

{FASTEST_WHY}

{t['speed_fastest']}

Absolute decode tokens/s (all sequences of the batch):

{t['absolute']}

### Memory during decode (MiB)

The cache's allocated bytes after its fill, plus the process's largest resident-memory growth over one of its
decode turns (a dequantized 16-bit history, DynamicLayer's concatenated copy, attention's temporaries):

{t['decode_memory']}"""


def markdown(r: dict, gpu: dict | None = None, real: dict | None = None) -> str:
    t = _tables(r)
    if gpu:
        g = _tables(gpu)
        gpu_section = f"""Measured by {_where(gpu)}. Whole run: {gpu['wall_s']} s.

{g['targets']}

{g['speed']}

{g['peak']}

{g['memory']}"""
    else:
        gpu_section = GPU_HOWTO
    kernel = ("on" if r["machine"].get("kvplay_cpu_kernel") else "off (PyTorch fallback)")
    return f"""# Benchmarks

Measured by {_where(r)}. kvplay's compiled CPU kernel: {kernel}.
Speed figures are ratios to the 16-bit baseline measured side by side in the same run. {_rounds(r)}
Whole run: {r['wall_s']} s. Regenerate with `python -m kvplay bench --json docs/results/bench-cpu.json`.
{_presets(r)}
Where the time and the error go, what was tried and what a missed target would need:
[benchmark-analysis.md](benchmark-analysis.md).

## Targets

{t['targets']}

## Memory (baseline bytes / spec bytes, measured)

"of limit" is the measured ratio divided by the formula's ratio at that length (1.000 = the format's
theoretical size, metadata and 16-bit window included). The ratios count bytes in use; "allocated / in use" is
what the cache's buffers hold, spare capacity included, over that.

{t['memory']}

## Speed (ratio to baseline)

{t['speed']}

Decode speed against the fastest 16-bit path, the same cells. {FASTEST_WHY}

{t['speed_fastest']}

"time in cache.update" is the share of decode time spent inside the cache's `update()`: quantizing tokens that
leave the 16-bit window, dequantizing the history for attention, and bookkeeping.

Absolute decode tokens/s (all sequences of the batch):

{t['absolute']}

## Memory during decode (MiB)

The cache's allocated bytes after its fill, plus the process's largest resident-memory growth over one of its
decode turns:

{t['decode_memory']}

## Quality on the held-out play ({r['config']['ppl_tokens']} tokens, chunk {r['config']['ppl_chunk']})

{t['quality']}

## SmolLM2-135M-Instruct (the real model)

{real_section(real)}

## GPU

{gpu_section}
"""

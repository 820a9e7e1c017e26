"""The benchmark: kvplay's engine against transformers' backends, in ONE run, as ratios.

    python -m kvplay bench --json bench.json            # full run, writes docs/benchmarks.md too
    python -m kvplay bench --quick --json quick.json    # under two minutes

Shared machines are noisy, so every speed figure is a ratio to the baseline measured
in the same run, each measurement is repeated and the median quoted.
"""
from __future__ import annotations

import ctypes
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psutil
import torch

from kvplay.cache import analytic_nbytes, build_cache, cache_nbytes, kernels, parse_spec
from kvplay.cache.arch import Arch
from kvplay.lab.generate import decode_one_token, prefill, sync
from kvplay.lab.quality import perplexity_run
from kvplay.lab.sweeps import long_text_ids

BENCH_SPECS = ["baseline", "baseline:attention=fused", "quanto-int4", "quanto-int2", "hqq-int8", "hqq-int4",
               "hqq-int2", "kvplay-int8", "kvplay-int4", "kvplay-int2", "kvplay-fp8", "kvplay-int4:rotation=none",
               "kvplay-int2:rotation=none", "kvplay-int2:group=64"]     # int4 and int2 rotate by default
# HQQ is left out on a real model: its proximal optimizer re-runs over the whole quantized history at every
# flush, and filling one 8,192-token SmolLM2 cache took over 10 minutes on 2 CPU cores.
REAL_BENCH_SPECS = ["baseline", "baseline:attention=fused", "quanto-int4", "quanto-int2", "kvplay-int4", "kvplay-int2"]


@dataclass
class BenchConfig:
    memory_lengths: tuple = (2048, 8192, 16384)   # the trained context to the model's limit (16,384)
    speed_contexts: tuple = (1024, 4096)          # decode speed at these contexts
    batches: tuple = (1, 4)
    decode_steps: int = 32                         # timed steps per spec per round (one more, discarded)
    repeats: int = 3                               # rounds: the specs take turns, every round
    ppl_tokens: int = 2048                         # held-out tokens for quality (the trained context)
    ppl_chunk: int = 16
    prefill_tokens: int = 1024

    @classmethod
    def smoke(cls) -> BenchConfig:
        """Seconds: keeps the benchmark from rotting in CI; its numbers mean nothing."""
        return cls(memory_lengths=(256,), speed_contexts=(128,), batches=(1, 4), decode_steps=3, repeats=1,
                   ppl_tokens=128, prefill_tokens=64)

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(memory_lengths=(2048,), speed_contexts=(512,), batches=(1,), decode_steps=8, repeats=1,
                   ppl_tokens=256, prefill_tokens=256)

    @classmethod
    def real(cls, quick: bool = False) -> BenchConfig:
        """A real model with 8,192 positions (SmolLM2): decode at 2k and 8k tokens at batch 1 and 4. Each cell
        fills every spec's cache once (a minute per cache at 8k tokens, batch 4, on 2 CPU cores), then the specs
        take turns for 4 rounds of 8 steps: 32 timed steps each, a median over all of them. (One fill and 8
        steps per spec, back to back, moved a cell by up to 0.5x between runs.)"""
        if quick:
            return cls(memory_lengths=(2048,), speed_contexts=(1024,), batches=(1,), decode_steps=8, repeats=1,
                       ppl_tokens=512, prefill_tokens=512)
        return cls(memory_lengths=(2048, 8192), speed_contexts=(2048, 8000), batches=(1, 4), decode_steps=8,
                   repeats=4, ppl_tokens=2048, prefill_tokens=1024)

    def decode_cell(self) -> tuple[int, int]:
        """(tokens, batch) of the largest decode cell, its last step included."""
        return max(self.speed_contexts) + (self.decode_steps + 1) * self.repeats, max(self.batches)

    def largest_runs(self) -> list[tuple[int, int]]:
        """(tokens, batch) of the largest runs it makes, for the memory check before it starts. (A decode cell
        also holds every other spec's cache meanwhile: see service.bench.)"""
        return [(max(self.memory_lengths), 1), self.decode_cell(), (max(self.ppl_tokens, self.prefill_tokens), 1)]


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["kvplay_cpu_kernel"] = kernels.available()
    return info


class UpdateTimer:
    """Accumulates wall time spent inside a cache's update() (quantize + dequantize + bookkeeping)."""

    def __init__(self, cache, device):
        self.total, self.device = 0.0, device
        for layer in cache.layers:
            layer.update = self._wrap(layer.update)

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.total += time.perf_counter() - t0
            return out
        return timed


def _fill(model, ids: torch.Tensor, cache, chunk: int = 1024) -> None:
    """Feed ids (B, T) into the cache in chunks, as a long prompt would arrive."""
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start:start + chunk]
        prefill(model, part, torch.ones(ids.shape[0], start + part.shape[1], dtype=torch.long,
                                        device=ids.device), cache)


def memory_ratios(model, ids, specs, lengths) -> tuple[dict, dict, dict, dict, dict]:
    """Measured bytes at each length, ratio to baseline, ratio to the formula's limit, on CUDA the
    peak memory allocated while filling each cache to the longest length (weights included), and the
    bytes each cache's buffers hold at each length (spare capacity included)."""
    arch = Arch.from_config(model.config)
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    cuda = model.device.type == "cuda"
    measured, peak, allocated = {}, {}, {}
    for spec in specs:
        cache, done = build_cache(spec, model), 0
        measured[spec], allocated[spec] = {}, {}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(model.device)
        for n in lengths:
            _fill(model, ids[:, done:n], cache) if done else _fill(model, ids[:, :n], cache)
            done = n
            nbytes = cache_nbytes(cache)
            measured[spec][str(n)], allocated[spec][str(n)] = nbytes.total, nbytes.allocated_bytes
        if cuda:
            peak[spec] = int(torch.cuda.max_memory_allocated(model.device))
        del cache
    memory = {s: {n: measured["baseline"][n] / b for n, b in m.items()} for s, m in measured.items()}
    limits = {}
    for spec in specs:
        limits[spec] = {}
        for n in measured[spec]:
            # the formula as the data arrived: HF caches flush on every 1,024-token chunk (residual 0 left)
            formula = analytic_nbytes(spec, arch, int(n), dtype_bytes=dtype_bytes,
                                      prefill=int(n) if spec.startswith(("quanto", "hqq")) else None).total
            base = analytic_nbytes("baseline", arch, int(n), dtype_bytes=dtype_bytes).total
            limits[spec][n] = round(memory[spec][n] / (base / formula), 4)
    return measured, memory, limits, peak, allocated


def _rss() -> int:
    """This process's resident memory, after handing freed heap pages back to the system (glibc's malloc_trim),
    so that memory a previous run freed is not silently reused and hidden from the next run's growth."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


@dataclass
class _Decoding:
    """One spec's cache during decode_speeds: filled, then decoding in turn with the others."""

    cache: object
    timer: UpdateTimer
    mask: torch.Tensor                   # (B, tokens so far)
    token: torch.Tensor                  # (B, 1) the next token to feed
    held: int                            # the cache's allocated bytes after its fill
    steps: list = field(default_factory=list)   # seconds per timed decode step
    peak: int = 0                        # held + the largest RSS growth over one of its decode turns
    decode_s: float = 0.0                # every step, discarded ones included (the share's denominator)


@torch.inference_mode()
def decode_speeds(model, ids, specs, context: int, batch: int, steps: int, repeats: int) -> dict:
    """{spec: (decode tokens/s, share of decode time inside cache.update, peak decode memory in bytes)} at `context`
    tokens, batch `batch`.

    Every spec's cache is filled first; then, `repeats` times, each spec decodes `steps` + 1 steps in turn (the
    first of each turn discarded), so every spec sees the same machine state, round by round. Tokens/s is the
    batch over the median step: one slow step (another process waking up) moves a median, not a mean.
    The memory figure is the cache's allocated bytes after its fill plus the process's largest resident-memory
    growth over one of its decode turns: what decode allocates on the way (a dequantized 16-bit history,
    DynamicLayer's concatenated copy, attention's temporaries). Each turn starts from a trimmed heap (_rss), so
    one spec's freed memory is not silently reused by the next and hidden from its growth."""
    x = ids[:, :context].expand(batch, -1).contiguous()
    runs = {}
    for spec in specs:
        cache = build_cache(spec, model)
        _fill(model, x, cache)
        runs[spec] = _Decoding(cache, UpdateTimer(cache, model.device),
                               torch.ones(batch, context, dtype=torch.long, device=x.device), x[:, -1:],
                               held=cache_nbytes(cache).allocated_bytes)
    for _ in range(repeats):
        for run in runs.values():
            base = _rss()                                  # trimmed: this turn's growth is its own
            for i in range(steps + 1):
                run.mask = torch.cat([run.mask, run.mask.new_ones(batch, 1)], dim=-1)
                sync(model.device)
                t0 = time.perf_counter()
                logits = decode_one_token(model, run.token, run.mask, run.cache)
                sync(model.device)
                dt = time.perf_counter() - t0
                run.decode_s += dt
                if i:
                    run.steps.append(dt)
                run.token = logits.argmax(-1, keepdim=True)
                run.peak = max(run.peak, run.held + max(0, psutil.Process().memory_info().rss - base))
    out = {spec: (batch / statistics.median(run.steps), min(1.0, run.timer.total / max(run.decode_s, 1e-9)),
                  run.peak) for spec, run in runs.items()}
    del runs
    return out


def run_bench(model, tokenizer, *, quick: bool = False, specs=BENCH_SPECS, progress=None, command: str = "",
              config: BenchConfig | None = None) -> dict:
    cfg = config or (BenchConfig.quick() if quick else BenchConfig())
    progress = progress or (lambda f, d: None)
    specs = [str(parse_spec(s)) for s in specs]
    ids = long_text_ids(tokenizer, max(cfg.memory_lengths + cfg.speed_contexts) + 64).to(model.device)
    t_start = time.perf_counter()

    progress(0.0, "memory")
    measured, memory, limits, peak, allocated = memory_ratios(model, ids, specs, cfg.memory_lengths)

    # warm-up: one-off costs (quanto's extension build, allocator growth) outside the timings
    decode_speeds(model, ids, specs, 64, 1, 2, 1)
    speed, share, rss, prefill_speed = {}, {}, {}, {}
    total = len(cfg.speed_contexts) * len(cfg.batches)
    for done, (ctx, batch) in enumerate((c, b) for c in cfg.speed_contexts for b in cfg.batches):
        progress(0.2 + 0.5 * done / total, f"decode ctx {ctx} batch {batch}")
        for spec, (tps, sh, grew) in decode_speeds(model, ids, specs, ctx, batch, cfg.decode_steps,
                                                   cfg.repeats).items():
            speed.setdefault((ctx, batch), {})[spec] = [tps]
            share.setdefault((ctx, batch), {})[spec] = [sh]
            rss.setdefault((ctx, batch), {})[spec] = [grew]
    for _ in range(cfg.repeats):
        for spec in specs:
            cache = build_cache(spec, model)
            sync(model.device)
            t0 = time.perf_counter()
            _fill(model, ids[:, :cfg.prefill_tokens], cache, chunk=cfg.prefill_tokens)
            sync(model.device)
            prefill_speed.setdefault(spec, []).append(cfg.prefill_tokens / (time.perf_counter() - t0))

    def ratios(ctx, batch):
        med = {s: statistics.median(v) for s, v in speed[(ctx, batch)].items()}
        return med, {s: round(v / med["baseline"], 4) for s, v in med.items()}

    decode_speed_b1 = {s: {} for s in specs}
    decode_speed_b4 = {s: {} for s in specs}
    absolute = {}
    for ctx in cfg.speed_contexts:
        for batch in cfg.batches:
            med, rel = ratios(ctx, batch)
            absolute[f"ctx{ctx}_b{batch}"] = {s: round(v, 2) for s, v in med.items()}
            target = decode_speed_b1 if batch == 1 else decode_speed_b4
            for s in specs:
                target[s][str(ctx)] = rel[s]
    prefill_med = {s: statistics.median(v) for s, v in prefill_speed.items()}

    progress(0.75, "quality")
    ppl = perplexity_run(model, tokenizer, specs, max_tokens=cfg.ppl_tokens, chunk=cfg.ppl_chunk)
    quality = {r.spec: {"ppl": round(r.ppl, 4), "delta_ppl_pct": round(r.delta_ppl_pct, 4),
                        "mean_kl": round(r.mean_kl, 6), "top1_agreement": round(r.top1_agreement, 4)}
               for r in ppl.caches}
    progress(1.0, "done")
    return {
        "command": command or " ".join(["python -m kvplay"] + sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "machine": machine(),
        "model": getattr(model.config, "_name_or_path", ""),
        "dtype": str(model.dtype).replace("torch.", ""),
        "config": cfg.__dict__,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "memory": {s: {n: round(r, 4) for n, r in m.items()} for s, m in memory.items()},
        "memory_bytes": measured,
        "allocated_bytes": allocated,   # what the cache's buffers hold, spare capacity included (>= memory_bytes)
        "limits": limits,
        "peak_memory_bytes": peak,   # CUDA only: torch.cuda.max_memory_allocated while filling each cache
        # CPU and CUDA: the cache's allocated bytes plus the process's largest RSS growth (psutil, from a heap
        # trimmed with malloc_trim) over one of its decode turns
        "peak_decode_rss_bytes": {f"ctx{c}_b{b}": {s: max(v) for s, v in rss[(c, b)].items()} for (c, b) in rss},
        "decode_speed": decode_speed_b1,
        "decode_speed_batch4": decode_speed_b4 if 4 in cfg.batches else {},
        "decode_tokens_per_s": absolute,
        "update_share": {f"ctx{c}_b{b}": {s: round(statistics.median(v), 4) for s, v in share[(c, b)].items()}
                         for (c, b) in share},
        "prefill_speed": {s: round(v / prefill_med["baseline"], 4) for s, v in prefill_med.items()},
        "prefill_tokens_per_s": {s: round(v, 1) for s, v in prefill_med.items()},
        "quality": quality,
        # what each name meant in this run: presets change (kvplay-int2 gained sinks and rotation), numbers don't
        "presets": {s: ",".join(f"{k}={v}" for k, v in parse_spec(s).option_values().items()) for s in specs},
    }


# ---------------------------------------------------------------------------- targets and the write-up

def real_targets(r: dict) -> list[dict]:
    """The targets on a real model (SmolLM2): the engine-quality and decode-speed goals of docs/benchmarks.md."""
    rows = []

    def add(name, value, goal, ok):
        rows.append({"target": name, "measured": value, "goal": goal, "holds": bool(ok)})

    mem, q, ds = r["memory"], r["quality"], r["decode_speed"]
    if "8192" in mem.get("kvplay-int4", {}):
        add("kvplay-int4 memory at 8,192 tokens", f"{mem['kvplay-int4']['8192']:.2f}x", ">= 3.4x",
            mem["kvplay-int4"]["8192"] >= 3.4)
        add("kvplay-int2 memory at 8,192 tokens", f"{mem['kvplay-int2']['8192']:.2f}x", ">= 4.8x",
            mem["kvplay-int2"]["8192"] >= 4.8)
    k2, k4, q4 = q["kvplay-int2"], q["kvplay-int4"], q["quanto-int4"]
    add("kvplay-int2 delta PPL", f"{k2['delta_ppl_pct']:+.2f}%", "<= 5%", k2["delta_ppl_pct"] <= 5)
    add("kvplay-int2 top-1 agreement", f"{k2['top1_agreement']:.3f}", ">= 0.90", k2["top1_agreement"] >= 0.90)
    add("kvplay-int2 mean KL", f"{k2['mean_kl']:.4f}", "<= 0.05", k2["mean_kl"] <= 0.05)
    add("kvplay-int4 |delta PPL|", f"{k4['delta_ppl_pct']:+.3f}%", "<= 0.5%", abs(k4["delta_ppl_pct"]) <= 0.5)
    add("kvplay-int4 mean KL vs quanto-int4's", f"{k4['mean_kl']:.4f} vs {q4['mean_kl']:.4f}", "<= 1/4",
        k4["mean_kl"] <= q4["mean_kl"] / 4)
    ctx = max(ds["baseline"], key=int)
    add(f"kvplay-int4 decode at {ctx} tokens, batch 1, vs baseline", f"{ds['kvplay-int4'][ctx]:.2f}x", ">= 1.5x",
        ds["kvplay-int4"][ctx] >= 1.5)
    b4 = r.get("decode_speed_batch4") or {}
    if b4:
        add(f"kvplay-int4 decode at {ctx} tokens, batch 4, vs baseline", f"{b4['kvplay-int4'][ctx]:.2f}x", ">= 2x",
            b4["kvplay-int4"][ctx] >= 2)
    add(f"kvplay-int4 decode at {ctx} tokens vs quanto-int4", f"{ds['kvplay-int4'][ctx] / ds['quanto-int4'][ctx]:.2f}x",
        ">= 2x", ds["kvplay-int4"][ctx] / ds["quanto-int4"][ctx] >= 2)
    return rows


def targets(r: dict) -> list[dict]:
    """kvplay's engine's targets (docs/benchmarks.md), each with the measured figure and whether it holds."""
    if "kvplay-int2:group=64" not in r["quality"]:      # the real-model suite (REAL_BENCH_SPECS)
        return real_targets(r)
    rows = []

    def add(name, value, goal, ok):
        rows.append({"target": name, "measured": value, "goal": goal, "holds": bool(ok)})

    mem = r["memory"]
    if "8192" in mem.get("kvplay-int4", {}):
        add("kvplay-int4 memory at 8,192 tokens", f"{mem['kvplay-int4']['8192']:.2f}x", ">= 3.3x",
            mem["kvplay-int4"]["8192"] >= 3.3)
        add("kvplay-int2 memory at 8,192 tokens", f"{mem['kvplay-int2']['8192']:.2f}x", ">= 4.8x",
            mem["kvplay-int2"]["8192"] >= 4.8)
    ds = r["decode_speed"]
    ctx = max(ds["baseline"], key=int)
    k4, q4 = ds["kvplay-int4"][ctx], ds["quanto-int4"][ctx]
    add(f"kvplay-int4 decode at {ctx} tokens vs baseline", f"{k4:.2f}x", ">= 0.85x", k4 >= 0.85)
    add(f"kvplay-int4 decode at {ctx} tokens vs quanto-int4", f"{k4 / q4:.2f}x", ">= 1.2x", k4 / q4 >= 1.2)
    q = r["quality"]
    add("kvplay-int4 delta PPL", f"{q['kvplay-int4']['delta_ppl_pct']:.3f}%", "<= 1%",
        q["kvplay-int4"]["delta_ppl_pct"] <= 1.0)
    k2, qq2 = q["kvplay-int2:group=64"]["delta_ppl_pct"], q["quanto-int2"]["delta_ppl_pct"]
    add("kvplay-int2:group=64 delta PPL vs quanto-int2's", f"{k2:.3f}% vs {qq2:.3f}%", "<= 1/3",
        k2 <= qq2 / 3 if qq2 > 0 else k2 <= 0)
    n = max(mem["kvplay-int2:group=64"], key=int)  # the longest run: the 16-bit window's share is smallest
    same = mem["kvplay-int2:group=64"][n] / mem["quanto-int2"][n]
    add(f"kvplay-int2:group=64 bytes vs quanto-int2 at {n} tokens", f"{1 / same:.3f}x", "within 5%",
        abs(1 / same - 1) <= 0.05)
    return rows


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
                             [[t["target"], t["measured"], t["goal"], "yes" if t["holds"] else "**no**"]
                              for t in targets(r)]),
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
        "absolute": _md_table(["spec"] + list(r["decode_tokens_per_s"]),
                              [[s] + [row[s] for row in r["decode_tokens_per_s"].values()] for s in specs]),
        "quality": _md_table(["spec", "PPL", "delta PPL", "mean KL", "top-1 agreement"],
                             [[s, q["ppl"], f"{q['delta_ppl_pct']:+.3f}%", f"{q['mean_kl']:.5f}",
                               f"{q['top1_agreement']:.4f}"] for s, q in r["quality"].items()]),
        "peak": _md_table(["spec", "peak GPU memory"],
                          [[s, f"{b / 2**20:,.1f} MiB"] for s, b in r["peak_memory_bytes"].items()])
        if r.get("peak_memory_bytes") else "",
    }


def _allocated(r: dict, spec: str, n: str) -> str:
    """Bytes the cache's buffers hold over bytes in use, at n tokens ("-" for runs that did not record it)."""
    held = r.get("allocated_bytes", {}).get(spec, {}).get(n)
    return f"{held / r['memory_bytes'][spec][n]:.4f}" if held else "-"


def _presets(r: dict) -> str:
    """One line per quantized spec: every option it ran with (runs before presets were recorded say so)."""
    if "presets" not in r:
        return "The run predates recorded presets: see the preset table in the README for what each name meant."
    return "Presets as measured: " + "; ".join(f"`{s}` = {o}" for s, o in r["presets"].items() if o) + "."


def _where(r: dict) -> str:
    m = r["machine"]
    model = r["model"].rstrip("/").rsplit("/", 1)[-1] if r["model"].startswith("/") else r["model"]  # no local paths
    return (f"`{r['command']}` on {r['date']}, in one run, on {m.get('gpu') or m['processor']} "
            f"({m['platform']}, torch {m['torch']}, {m['threads']} threads), model `{model}` in {r['dtype']}")


GPU_HOWTO = """No GPU run is recorded here yet. The same command runs unchanged on CUDA (timings synchronise the
device around every step; peak memory comes from `torch.cuda.max_memory_allocated`):

```bash
python -m kvplay bench --device cuda --json docs/bench-gpu.json --markdown /tmp/gpu.md
python -m kvplay bench --from-json docs/bench-cpu.json --gpu-json docs/bench-gpu.json   # both, in this file
```"""


REAL_HOWTO = """No full benchmark run on the real model is recorded here yet; its memory (exact), quality and retrieval
figures measured so far are in [real-model.md](real-model.md). To add this section:

```bash
python -m kvplay bench --model smollm2-135m-instruct --json docs/bench-smollm2.json --markdown /tmp/real.md
python -m kvplay bench --from-json docs/bench-cpu.json --real-json docs/bench-smollm2.json
```"""


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
Whole run: {r['wall_s']} s. Regenerate with `python -m kvplay bench --json docs/bench-cpu.json`.
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

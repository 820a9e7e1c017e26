"""The benchmark: kvplay's engine against transformers' backends, in ONE run, as ratios.

    python -m kvplay bench --json bench.json            # full run, writes docs/benchmarks.md too
    python -m kvplay bench --quick --json quick.json    # under two minutes

Shared machines are noisy, so every speed figure is a ratio measured in the same run: to the baseline
(transformers' DynamicCache, what users get) and to the fastest 16-bit path (FASTEST_16BIT: the 16-bit
tokens preallocated and written in place); each measurement is repeated and the median quoted.
"""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from kvplay.cache import analytic_nbytes, build_cache, cache_nbytes, kernels, parse_spec
from kvplay.cache.arch import Arch
from kvplay.lab.generate import decode_one_token, prefill, step_rate, sync
from kvplay.lab.quality import perplexity_run
from kvplay.lab.texts import long_text_ids

# The fastest 16-bit path kvplay builds: the 16-bit tokens preallocated and written in place, with sdpa or the fused
# kernel. Each speed cell also quotes every cache against the faster of these two, measured in the same cell:
# DynamicCache (baseline) concatenates its whole history on every step, which a quantized cache skips for reasons
# that have nothing to do with quantization.
FASTEST_16BIT = ["baseline:store=prealloc", "baseline:store=prealloc,attention=fused"]
BENCH_SPECS = ["baseline", "baseline:attention=fused", *FASTEST_16BIT, "quanto-int4", "quanto-int2", "hqq-int8",
               "hqq-int4", "hqq-int2", "kvplay-int8", "kvplay-int4", "kvplay-int2", "kvplay-fp8",
               "kvplay-int4:rotation=none", "kvplay-int2:rotation=none", "kvplay-int2:group=64",  # int4, int2 rotate
               "kvplay-3bit", "kvplay-2.5bit"]
# HQQ is left out on a real model: its proximal optimizer re-runs over the whole quantized history at every
# flush, and filling one 8,192-token SmolLM2 cache took over 10 minutes on 2 CPU cores.
# The bit-budget presets (issue 27) ride along: their bits, quality and fused decode are judged here too.
REAL_BENCH_SPECS = ["baseline", "baseline:attention=fused", *FASTEST_16BIT, "quanto-int4", "quanto-int2",
                    "kvplay-int4", "kvplay-int2", "kvplay-3bit", "kvplay-2.5bit"]


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
    compare_runs: int = 0                          # whole CLI runs of the default Compare and of the baseline alone

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
                   repeats=4, ppl_tokens=2048, prefill_tokens=1024, compare_runs=2)

    def decode_cell(self) -> tuple[int, int]:
        """(tokens, batch) of the largest decode cell, its last step included."""
        return max(self.speed_contexts) + (self.decode_steps + 1) * self.repeats, max(self.batches)

    def largest_runs(self) -> list[tuple[int, int]]:
        """(tokens, batch) of the largest runs it makes, for the memory check before it starts. (A decode cell
        also holds every other spec's cache meanwhile: see service.bench.)"""
        return [(max(self.memory_lengths), 1), self.decode_cell(), (max(self.ppl_tokens, self.prefill_tokens), 1)]


def cpu_name() -> str:
    """The CPU's model name and core count ("AMD EPYC, 2 cores"): platform.processor() says only "x86_64"."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpu": cpu_name(),
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
                                      prefill=None if parse_spec(spec).method.formula_any_arrival else int(n)).total
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
    out = {spec: (step_rate(run.steps, batch), min(1.0, run.timer.total / max(run.decode_s, 1e-9)),
                  run.peak) for spec, run in runs.items()}
    del runs
    return out


def compare_cli_runs(model_name: str, repeats: int) -> dict:
    """Whole CLI runs, as a user types them: `python -m kvplay compare --model NAME` (the default Compare) and the
    same with `--caches baseline` (the 16-bit run alone), taking turns `repeats` times, each a fresh process
    (start-up, imports and model load included). Wall and CPU seconds of each run, and the medians' ratio."""
    runs: dict[str, list[dict]] = {"compare": [], "baseline": []}
    for _ in range(repeats):
        for name, extra in (("compare", []), ("baseline", ["--caches", "baseline"])):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "kvplay", "compare", "--model", model_name, *extra],
                                  capture_output=True, text=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode != 0:
                raise RuntimeError(f"`kvplay compare` exited {done.returncode}: {done.stderr.strip()[-300:]}")
            cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            runs[name].append({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)})
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("wall_s", "cpu_s")} for k, v in runs.items()}
    return {"runs": runs, "median": med, "ratio": round(med["compare"]["wall_s"] / med["baseline"]["wall_s"], 3)}


def run_bench(model, tokenizer, *, quick: bool = False, specs=BENCH_SPECS, progress=None, command: str = "",
              config: BenchConfig | None = None, model_name: str = "") -> dict:
    cfg = config or (BenchConfig.quick() if quick else BenchConfig())
    progress = progress or (lambda f, d: None)
    specs = [str(parse_spec(s)) for s in specs]
    ids = long_text_ids(tokenizer, max(cfg.memory_lengths + cfg.speed_contexts) + 64).to(model.device)
    t_start = time.perf_counter()
    compare_cli = {}
    if cfg.compare_runs and model_name:             # first, while nothing of this run is held in memory
        progress(0.0, "whole CLI runs: the default Compare and the baseline alone")
        compare_cli = compare_cli_runs(model_name, cfg.compare_runs)

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
    vs_fastest_b1, vs_fastest_b4 = ({s: {} for s in specs} for _ in range(2))
    absolute, fastest = {}, {}
    paths = [s for s in (str(parse_spec(f)) for f in FASTEST_16BIT) if s in specs]
    for ctx in cfg.speed_contexts:
        for batch in cfg.batches:
            med, rel = ratios(ctx, batch)
            absolute[f"ctx{ctx}_b{batch}"] = {s: round(v, 2) for s, v in med.items()}
            target = decode_speed_b1 if batch == 1 else decode_speed_b4
            for s in specs:
                target[s][str(ctx)] = rel[s]
            if paths:                              # the faster preallocated 16-bit row of this very cell
                top = fastest[f"ctx{ctx}_b{batch}"] = max(paths, key=med.get)
                for s in specs:
                    (vs_fastest_b1 if batch == 1 else vs_fastest_b4)[s][str(ctx)] = round(med[s] / med[top], 4)
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
        "model": model_name or getattr(model.config, "_name_or_path", ""),     # the name the user typed
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
        # the same cells against the fastest 16-bit path: per cell, the faster of the FASTEST_16BIT rows
        "fastest_16bit": fastest,
        "decode_speed_vs_fastest_16bit": vs_fastest_b1 if fastest else {},
        "decode_speed_batch4_vs_fastest_16bit": vs_fastest_b4 if fastest and 4 in cfg.batches else {},
        "update_share": {f"ctx{c}_b{b}": {s: round(statistics.median(v), 4) for s, v in share[(c, b)].items()}
                         for (c, b) in share},
        "prefill_speed": {s: round(v / prefill_med["baseline"], 4) for s, v in prefill_med.items()},
        "prefill_tokens_per_s": {s: round(v, 1) for s, v in prefill_med.items()},
        "quality": quality,
        "compare_cli": compare_cli,     # whole `kvplay compare` runs: the default Compare and the baseline alone
        # what each name meant in this run: presets change (kvplay-int2 gained sinks and rotation), numbers don't
        "presets": {s: ",".join(f"{k}={v}" for k, v in parse_spec(s).option_values().items()) for s in specs},
    }

"""Tables for people: titled columns with units, rounded numbers, MiB. Results in, rows out (no model runs).

results.*.summary_rows() stay the machine-readable contract (CSV, JSON); these are what the UI
and the HTML report show.
"""
from __future__ import annotations

import pandas as pd

from kvplay.results import (
    TASK_LABELS,
    CapacityResult,
    CompareResult,
    DriftResult,
    MemoryResult,
    ModelsResult,
    ParetoResult,
    PplResult,
    TasksResult,
    ThroughputResult,
    WindowSweepResult,
    speed_reason,
    timed,
)

GLOSSARY = """**Reading the numbers**
- **Smaller than 16-bit**: the 16-bit cache's bytes divided by this cache's, measured on the live cache. *Now* is
  this run; *at long context* comes from the byte formulas for this model, where the 16-bit window of newest tokens
  is a small share.
- **Bits per element**: stored bits per key or value number, all-in: codes, scales, zero points and every 16-bit token
  (window, sinks) included. *At long context* it is 16 bits divided by the ratio to 16-bit there.
- **KL (nats)**: how far this cache's next-token probabilities are from 16-bit's, with both reading the 16-bit text
  (teacher-forced). 0 means identical; 0.01 is barely visible; above 0.5 the model is often unsure of 16-bit's choice.
- **Top-1 agreement**: share of steps where this cache's most likely next token is 16-bit's (teacher-forced).
- **Same text until token / text match**: each cache's own greedy text against 16-bit's: the first token that differs,
  and the share of positions that hold the same token. After one different token a cache writes its own text, so a
  low match can sit beside a high top-1 agreement.
- **Speed**: decode tokens per second, the median over decode steps with the middle half of steps in brackets,
  measured where the verdict says (a shared machine is noisy: compare ratios within one run). A cache without a
  speed says why, in the same words as the verdict and the chart.
"""


def _mib(n: float) -> float:
    return round(n / 2**20, 3)


def _speed(c) -> str:
    if not timed(c):
        return f"not timed: {speed_reason(c)}"
    lo, hi = c.decode_spread or [c.decode_tokens_per_s] * 2
    return f"{c.decode_tokens_per_s:.0f} ({lo:.0f}-{hi:.0f})"


def compare_rows(result: CompareResult) -> list[dict]:
    """The verdict's columns first, so a phone shows them without scrolling: the task's answer, KL, top-1 and the
    size at long context; then the sizes now, the text match and the speed."""
    long = next((c.long_context_tokens for c in result.caches if c.long_context_tokens), None)
    rows = []
    for c in result.caches:
        row = {"Cache": c.spec}
        if result.expected is not None:
            row["Answer"] = "-" if c.answer is None else f"{c.answer} {'✓' if c.answer_right else '✗'}"
        row.update({"Mean KL (nats)": round(c.mean_kl, 4), "Top-1 agreement (%)": round(100 * c.top1_agreement, 1)})
        if long:
            row[f"Smaller at {long:,} tokens (x)"] = (round(c.long_context_compression, 2)
                                                      if c.long_context_compression else "n/a")
            # all-in at the long context: 16 bits over the formulas' ratio to 16-bit
            row[f"Bits per element at {long:,} tokens"] = (round(16 / c.long_context_compression, 2)
                                                           if c.long_context_compression else "n/a")
        row.update({"Size now (MiB)": _mib(c.cache_bytes), "Smaller than 16-bit, now (x)": round(c.compression, 2),
                    "Bits per element, now": round(c.bits_per_element, 2),
                    "Same text until token": "all" if c.first_divergence is None else c.first_divergence,
                    "Text match (%)": round(100 * c.match_fraction, 1),
                    "Decode tok/s, median (middle half)": _speed(c)})
        rows.append(row)
    return rows


def memory_rows(result: MemoryResult) -> list[dict]:
    return [{"Cache": c.spec, "Context (tokens)": int(c.points[-1][0]), "Size (MiB)": _mib(c.points[-1][1]),
             "Bits per element": round(c.extra.get("bits_per_element", 0.0), 2)} for c in result.caches]


def throughput_rows(result: ThroughputResult) -> list[dict]:
    return [{"Cache": c.spec, **{f"Batch {int(b)} (tok/s)": round(t, 1) for b, t in c.points},
             **{f"Context {int(n):,} (tok/s)": round(t, 1) for n, t in c.context_points}} for c in result.caches]


def _pm(value: float, err: float | None, digits: int, scale: float = 1.0) -> str:
    """'0.0324 ± 0.0011': a mean with its standard error over chunks (the mean alone where none was measured)."""
    return f"{scale * value:.{digits}f}" + ("" if err is None else f" ± {scale * err:.{digits}f}")


def _opt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ppl_rows(result: PplResult) -> list[dict]:
    """The verdict's columns first (KL, top-1, perplexity change), then llama.cpp's --kl-divergence statistics."""
    return [{"Cache": c.spec, "Mean KL (nats)": _pm(c.mean_kl, c.kl_sem, 4),
             "Top-1 agreement (%)": _pm(c.top1_agreement, c.top1_sem, 1, 100),
             "Change vs 16-bit (%)": round(c.delta_ppl_pct, 2), "Perplexity": round(c.ppl, 3),
             "KL median": _opt(c.kl_median, 4), "KL 99th pct": _opt(c.kl_p99, 3), "KL max": _opt(c.kl_max, 3),
             "Δp of 16-bit's top token (pp, mean / rms)":
                 "-" if c.delta_p_mean is None else f"{c.delta_p_mean:+.2f} / {c.delta_p_rms:.2f}"}
            for c in result.caches]


def capacity_rows(result: CapacityResult) -> list[dict]:
    return [{"Cache": r.spec, "Bits per element": round(r.bits_per_element, 2),
             "Per token (KiB)": round(r.bytes_per_token / 1024, 1),
             "Longest context, batch 1 (tokens)": f"{r.max_context:,}" + (
                 f" (the model's limit; the cache alone fits {r.cache_fits:,})" if r.cache_fits else ""),
             f"Largest batch at {result.context:,} tokens": r.max_batch} for r in result.caches]


def pareto_rows(result: ParetoResult) -> list[dict]:
    """The equal-bytes chart's points, fewest bits first (the order of ParetoResult.summary_rows)."""
    long = result.long_tokens
    rows = []
    for p in sorted(result.points, key=lambda p: p.bits_per_element):
        row = {"Cache": p.spec, "Bits per element": round(p.bits_per_element, 2)}
        if long:
            row[f"Bits per element at {long:,} tokens"] = "n/a" if p.bits_long is None else round(p.bits_long, 2)
        row.update({"Mean KL (nats)": round(p.mean_kl, 4), "Top-1 agreement (%)": round(100 * p.top1_agreement, 1),
                    "Change vs 16-bit (%)": round(p.delta_ppl_pct, 2),
                    "On the frontier": "yes" if p.on_frontier else ""})
        rows.append(row)
    return rows


def window_rows(result: WindowSweepResult) -> list[dict]:
    return [{"Cache": c.spec, "Window": c.semantics, "16-bit window (tokens)": int(p[0]), "Sinks (tokens)": int(p[1]),
             "Mean KL (nats)": round(p[2], 4), "Top-1 agreement (%)": round(100 * p[3], 1)}
            for c in result.caches for p in c.points]


def drift_rows(result: DriftResult) -> list[dict]:
    return [{"Cache": c.spec, "Mean KL (nats)": round(c.mean_kl, 4),
             **{f"KL at {int(n):,} tokens": round(v, 4) for n, v in c.by_context}} for c in result.caches]


def _share(score: float | None) -> str:
    return "-" if score is None else f"{score:.0%}"


def tasks_rows(result: TasksResult) -> list[dict]:
    """Per cache: its lever, measured bits at each context, its mean score per task kind (each context, " / "
    between; failed-by-16-bit kinds are left out), and its score against 16-bit's on the tasks 16-bit got right."""
    failed = set(result.failed_by_16bit())
    rows = []
    for c in result.caches:
        row = {"Cache": c.spec, "Lever": c.lever}
        row.update({f"Bits at {n:,} tokens": b for n, b in zip(result.contexts, c.bits)})
        for k in (k for k in result.kinds if k not in failed):
            row[TASK_LABELS[k].capitalize()] = " / ".join(_share(c.score(n, k, counted=False)) for n in result.contexts)
        row["Against 16-bit"] = "-" if c.relative is None else f"{c.relative:.0%}"
        rows.append(row)
    return rows


def not_run_note(result) -> str:
    """The caches the model refused in a run (result.refused), each with its one sentence; "" when none."""
    refused = getattr(result, "refused", None) or {}
    return f"Not run on this model: {' '.join(refused.values())}" if refused else ""


def tasks_note(result: TasksResult) -> str:
    """What the table leaves out, in a sentence: the kinds the 16-bit cache failed, which count for no cache."""
    failed = result.failed_by_16bit()
    contexts = " / ".join(f"{n:,}" for n in result.contexts)
    note = (f"Scores at {contexts} tokens, {result.samples} task(s) each; 'Against 16-bit': a cache's score over "
            "the 16-bit cache's, on the tasks 16-bit got anything right. Over 100%: a cache found answers 16-bit "
            "missed on those tasks (on a small sample, one answer moves it far).")
    if failed:
        note += (f" The 16-bit cache scored 0 on every {', '.join(TASK_LABELS[k] for k in failed)} task: this model "
                 "cannot do them, so they count for no cache and have no column.")
    return note


def tasks_models_frame(results: list[TasksResult]) -> pd.DataFrame:
    """The same tasks on several models: a row per model and cache, its score against that model's 16-bit cache
    at each context (in %) and its bits per element there."""
    rows = []
    for r in results:
        ceiling = {n: r.caches[0].counted_total(n) for n in r.contexts}
        for cache in r.caches[1:]:
            row = {"Model": r.model, "Cache": cache.spec}
            for i, n in enumerate(r.contexts):
                share = 100 * cache.counted_total(n) / ceiling[n] if ceiling[n] else None
                row[f"Against 16-bit at {n:,} (%)"] = "-" if share is None else round(share)
                row[f"Bits at {n:,}"] = cache.bits[i]
            rows.append(row)
    return pd.DataFrame(rows)


def pareto_models_frame(results: list[ParetoResult]) -> pd.DataFrame:
    """The equal-bytes runs of several models: a row per model and cache, its bits at the long context, mean KL,
    top-1 and whether it is on that model's frontier there."""
    rows = []
    for r in results:
        on = r.with_frontier("mean_kl", "long")
        for p, x, f in zip(r.points, r.bits("long"), on):
            if p.spec != "baseline":
                rows.append({"Model": r.env.model, "Cache": p.spec, f"Bits at {r.long_tokens:,}": x and round(x, 2),
                             "Mean KL (nats)": round(p.mean_kl, 5),
                             "Top-1 agreement (%)": round(100 * p.top1_agreement, 1),
                             "On the frontier": "yes" if f else ""})
    return pd.DataFrame(rows)


def models_rows(result: ModelsResult) -> list[dict]:
    """The same caches on several models: a row per cache and model, caches in the order run."""
    long, rows = result.long_tokens, []
    for r in result.summary_rows():
        row = {"Cache": r["spec"], "Model": r["model"]}
        if r["refused"] != "-":
            row.update({"Change vs 16-bit (%)": "not run", "Mean KL (nats)": "-", "Top-1 agreement (%)": "-"})
        else:
            row.update({"Change vs 16-bit (%)": r["delta_ppl_pct"], "Mean KL (nats)": r["mean_kl"],
                        "Top-1 agreement (%)": round(100 * r["top1_agreement"], 1)})
        bits = r[f"bits_at_{long}"]
        row[f"Bits per element at {long:,} tokens"] = "-" if bits is None else bits
        row["Found the number"] = r["needle"]
        rows.append(row)
    return rows


ROWS = {CompareResult: compare_rows, MemoryResult: memory_rows, ThroughputResult: throughput_rows,
        PplResult: ppl_rows, CapacityResult: capacity_rows, ParetoResult: pareto_rows,
        WindowSweepResult: window_rows, DriftResult: drift_rows, TasksResult: tasks_rows, ModelsResult: models_rows}


def rows(result) -> list[dict]:
    return ROWS[type(result)](result)


def frame(result):
    return pd.DataFrame(rows(result))

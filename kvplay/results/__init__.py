"""Result dataclasses: what every command returns, the UI shows and the JSON contract holds.

Plain numbers and strings only (no tensors), so results serialise to JSON and
plots never need a live model. Field names are the documented JSON contract.
"""
from __future__ import annotations

import csv
import io
import json
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass
class Environment:
    model: str
    dtype: str
    device: str
    gpu: str | None = None
    weights: str = "16-bit"        # or "quanto int8" / "quanto int4" when weights are quantized too
    torch: str = field(default_factory=lambda: _version("torch"))
    transformers: str = field(default_factory=lambda: _version("transformers"))
    optimum_quanto: str = field(default_factory=lambda: _version("optimum-quanto"))
    hqq: str = field(default_factory=lambda: _version("hqq"))
    python: str = field(default_factory=platform.python_version)
    machine: str = field(default_factory=lambda: f"{platform.machine()} {platform.processor() or ''}".strip())


@dataclass
class CacheRun:
    """One spec's run in a Compare."""

    spec: str
    text: str                          # generated continuation only
    token_ids: list[int]
    tokens: list[str]                  # decoded pieces, one per token, for highlighting
    first_divergence: int | None       # index of the first generated token that differs from the baseline
    match_fraction: float              # fraction of positions equal to the baseline's
    diff_spans: list[list[int]]        # [start, end) token spans that differ
    kl: list[float]                    # per step, teacher-forced KL(p_baseline || p_spec), nats
    top1: list[bool]                   # per step, same top-1 token as the baseline
    baseline_logprob: list[float]      # per step, log p_spec(baseline token)
    mean_kl: float
    max_kl: float
    top1_agreement: float
    context_tokens: list[int]          # cache length at each point of cache_bytes_per_step
    cache_bytes_per_step: list[int]
    cache_bytes: int                   # in use at the end: payload, scales and zeros, 16-bit tokens
    baseline_bytes: int
    compression: float                 # baseline_bytes / cache_bytes
    bits_per_element: float
    prefill_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    wall_s: float
    peak_memory_bytes: int | None = None
    description: str = ""
    allocated_bytes: int | None = None         # cache_bytes plus the buffers' spare capacity (>= cache_bytes)
    # Speed over repeats: each timed decode step is one repeat (the first is discarded as warm-up).
    decode_timed_steps: int = 0                # below MIN_TIMED_STEPS no speed is quoted
    decode_spread: list[float] = field(default_factory=list)   # [p25, p75] tokens/s over the timed steps
    # Compression once the context is long (from the formulas, for this model's shape): the 16-bit
    # window's share shrinks as the context grows.
    long_context_tokens: int | None = None
    long_context_compression: float | None = None
    # Per step, teacher-forced (the 16-bit text as history): this cache's five most likely next tokens.
    top5_ids: list[list[int]] = field(default_factory=list)
    top5_probs: list[list[float]] = field(default_factory=list)
    top5_tokens: list[list[str]] = field(default_factory=list)
    # Speed from a timing of this cache alone after the run, taking turns with the baseline (kvplay.lab.compare):
    # the cache length it was timed at (None: timed as it ran, or not timed), and why it was not timed ("").
    decode_context_tokens: int | None = None
    speed_note: str = ""
    partial: bool = False              # the run was still stepping: these numbers cover the steps so far


MIN_TIMED_STEPS = 8      # fewer timed decode steps than this: too short to quote a speed


def _timed(run: CacheRun) -> bool:
    """Enough timed decode steps to quote a speed (results saved before the count existed keep theirs)."""
    return run.decode_timed_steps >= MIN_TIMED_STEPS or (run.decode_timed_steps == 0 and run.decode_tokens_per_s > 0)


@dataclass
class CompareResult:
    prompt: str
    prompt_tokens: int
    max_new_tokens: int
    batch_size: int
    sampling: dict
    env: Environment
    caches: list[CacheRun]
    chat: bool = False        # the prompt went through the model's chat template
    # The task's answer to check each cache's text against (kvplay.app.prompts.Task); None: no answer to check.
    task: str = ""            # the task's title, "" for a typed prompt
    expected: str | None = None
    check: str = "number"     # how the answer is found: kvplay.app.prompts.grade

    def baseline(self) -> CacheRun:
        return self.caches[0]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "cache_bytes": c.cache_bytes, "allocated_bytes": c.allocated_bytes,
                 "compression": round(c.compression, 3),
                 "bits_per_element": round(c.bits_per_element, 3), "mean_kl": round(c.mean_kl, 5),
                 "max_kl": round(c.max_kl, 5), "top1_agreement": round(c.top1_agreement, 4),
                 "first_divergence": c.first_divergence, "match_fraction": round(c.match_fraction, 4),
                 "decode_tokens_per_s": round(c.decode_tokens_per_s, 2) if _timed(c) else "too short to time",
                 "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1)} for c in self.caches]


@dataclass
class SeriesResult:
    """One spec's series of [x, y] points (memory against context, tokens/s against batch)."""

    spec: str
    points: list[list[float]]
    context_points: list[list[float]] = field(default_factory=list)   # throughput against context length
    extra: dict = field(default_factory=dict)


@dataclass
class MemoryResult:
    max_context: int
    chunk: int
    env: Environment
    caches: list[SeriesResult]        # points: [[context_tokens, bytes], ...]
    projections: dict = field(default_factory=dict)   # arch -> spec -> [[tokens, bytes], ...]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "context_tokens": int(c.points[-1][0]), "bytes": int(c.points[-1][1]),
                 "bits_per_element": round(c.extra.get("bits_per_element", 0.0), 3)} for c in self.caches]


@dataclass
class ThroughputResult:
    batch_sizes: list[int]
    context: int
    new_tokens: int
    env: Environment
    caches: list[SeriesResult]        # points: [[batch_size, tokens_per_s]], context_points: [[context, tokens_per_s]]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, **{f"batch {int(b)}": round(t, 2) for b, t in c.points},
                 **{f"context {int(n)}": round(t, 2) for n, t in c.context_points}} for c in self.caches]


@dataclass
class PplRun:
    spec: str
    ppl: float
    delta_ppl_pct: float
    mean_kl: float
    top1_agreement: float
    kl_along_text: list[float]         # mean KL per window of the text, for plotting
    layer_key_error: list[float]       # relative reconstruction error of K per layer
    layer_value_error: list[float]


@dataclass
class PplResult:
    text_name: str
    tokens: int
    chunk: int
    env: Environment
    caches: list[PplRun]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "ppl": round(c.ppl, 4), "delta_ppl_pct": round(c.delta_ppl_pct, 3),
                 "mean_kl": round(c.mean_kl, 5), "top1_agreement": round(c.top1_agreement, 4)} for c in self.caches]


@dataclass
class CapacityRow:
    spec: str
    bits_per_element: float
    bytes_per_token: float
    max_context: int                   # batch 1, cache-only bound
    max_batch: int                     # at `context`


@dataclass
class CapacityResult:
    arch: str
    gpu_gib: float
    weight_dtype: str
    weight_bytes: int
    context: int
    note: str
    caches: list[CapacityRow]

    def summary_rows(self) -> list[dict]:
        return [asdict(r) for r in self.caches]


INSIDE_KINDS = ("outliers", "needle", "head_errors", "attention_shift")   # kvplay.lab.inside.RESULT_KINDS
RESULT_TYPES = {"compare": CompareResult, "memory": MemoryResult, "throughput": ThroughputResult,
                "ppl": PplResult, "capacity": CapacityResult}


def to_dict(result) -> dict:
    kind = next(k for k, t in RESULT_TYPES.items() if isinstance(result, t))
    return {"kind": kind, **asdict(result)}


def to_json(result, path=None) -> str:
    text = json.dumps(to_dict(result), indent=1)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def to_csv(result, path=None) -> str:
    rows = result.summary_rows()
    buf = io.StringIO()
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(buf, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    if path:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(buf.getvalue())
    return buf.getvalue()


def from_dict(data: dict):
    """Rebuild a result from its JSON form (for `report` and the plots); the Inside views' kinds too."""
    kind = data["kind"]
    if kind in INSIDE_KINDS:
        from kvplay.lab.inside import from_dict as inside_from_dict  # torch: imported only when one is read

        return inside_from_dict(data)
    body = {k: v for k, v in data.items() if k != "kind"}
    body["env"] = Environment(**body["env"]) if "env" in body else None
    if kind == "compare":
        body["caches"] = [CacheRun(**c) for c in body["caches"]]
    elif kind in ("memory", "throughput"):
        body["caches"] = [SeriesResult(**c) for c in body["caches"]]
    elif kind == "ppl":
        body["caches"] = [PplRun(**c) for c in body["caches"]]
    elif kind == "capacity":
        body.pop("env", None)
        body["caches"] = [CapacityRow(**c) for c in body["caches"]]
    return RESULT_TYPES[kind](**body)

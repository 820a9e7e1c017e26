"""Compare's result: one prompt through the 16-bit cache and each spec (kvplay.lab.compare).

Each CacheRun carries its CacheLabel: what drawing it needs from its spec (its registered scheme and whether its
options differ from that scheme's preset, its name in the verdict, its method and engine, what its 16-bit window
keeps, the code that reproduces it), resolved once from the typed spec where the run is made (label_for), so the
pictures (kvplay.show.style's colours, dashes and markers) never parse or split a spec's text. Results saved before
labels existed get theirs when they are read back (their snippet then asks for as many tokens as the run made,
without the chat template), and labels saved before `scheme` existed get it then too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvplay.cache import CacheSpec, parse_spec
from kvplay.cache.evict import policy_of, policy_words
from kvplay.cache.methods.base import SNIPPET_CHAT_LOAD
from kvplay.errors import KvplayError
from kvplay.results.environment import Environment
from kvplay.results.profile import ModelProfile


@dataclass
class CacheLabel:
    """What the cards, the verdict and the report show of a cache, from its spec and method."""

    method: str = ""                   # the registered method ("kvplay", "quanto", "llama.cpp", "server")
    scheme: str = ""                   # its registered scheme ("kvplay-int2"; "" for a spec no method knows)
    variant: bool = False              # its options differ from the scheme's preset ("kvplay-int2:group=16")
    family: str = ""                   # where people meet it ("transformers", "llama.cpp / Ollama / LM Studio")
    engine: str = "transformers"       # where it ran: "transformers", "llama.cpp" or "server"
    name: str = ""                     # how the verdict names it: "llama.cpp q4_0, emulated (llamacpp-q4_0)"
    reference: bool = False            # a 16-bit reference the other rows are measured against
    window_reason: str = ""            # why a short run compresses less: what its 16-bit window keeps ("" none)
    snippet: str = ""                  # Python (or a request) that reproduces it
    keep: float | None = None          # the share of the prompt's tokens it keeps (None: it keeps every token)
    evicts: str = ""                   # its eviction policy and how it scores: "SnapKV, scored by the last 32 ..."


def label_for(spec: CacheSpec, max_new_tokens: int = 64, chat: bool = False) -> CacheLabel:
    """A spec's label, from its method's hooks (engine_name, window_reason, snippet)."""
    method = spec.method
    engine_name = method.engine_name(spec) if spec.is_quantized else None
    reference = spec.is_reference
    policy = policy_of(spec)
    return CacheLabel(method=method.name, scheme=spec.name, variant=str(spec) != spec.name, family=method.family,
                      engine=method.engine,
                      name=f"{engine_name} ({spec})" if engine_name else str(spec), reference=reference,
                      window_reason="" if reference or not spec.is_quantized else method.window_reason(spec),
                      snippet=method.snippet(spec, max_new_tokens, SNIPPET_CHAT_LOAD if chat else ""),
                      keep=spec.options.keep if policy else None,
                      evicts=policy_words(policy) if policy else "")


def _label_of_text(spec: str, max_new_tokens: int, chat: bool) -> CacheLabel:
    """The label of a stored result's spec string (a spec no registered method knows keeps its text as name)."""
    try:
        return label_for(parse_spec(spec), max_new_tokens, chat)
    except KvplayError:
        return CacheLabel(name=spec, reference=spec == "baseline")


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
    label: CacheLabel | None = None    # what drawing needs (label_for); filled on read for older results
    # The task's answer found in this cache's text and whether it is right (CompareResult.expected); None: no
    # answer to check, or decoding has not ended.
    answer: str | None = None
    answer_right: bool | None = None

    def __post_init__(self):
        if self.label is None:          # a result stored before labels: its spec's label, resolved once on read
            self.label = _label_of_text(self.spec, max(len(self.token_ids), 1), False)
        elif not self.label.scheme:     # a label stored before it carried its scheme: that part resolved on read
            known = _label_of_text(self.spec, 1, False)
            self.label.scheme, self.label.variant = known.scheme, known.variant


MIN_TIMED_STEPS = 8      # fewer timed decode steps than this: too short to quote a speed


def timed(run: CacheRun) -> bool:
    """Whether the run had enough timed decode steps for its speed to mean anything: the one rule the cards, the
    plots, the tables and the CSV all apply (a run with fewer gives its speed_reason, never a number)."""
    return run.decode_timed_steps >= MIN_TIMED_STEPS


def speed_reason(run: CacheRun) -> str:
    """Why a run has no speed, in the words the verdict, the cards, the chart and the table all use ("" if timed)."""
    if timed(run):
        return ""
    if run.partial:
        return "timed after decoding ends"
    return run.speed_note or f"too short to time (fewer than {MIN_TIMED_STEPS} decode steps)"


@dataclass
class CompareResult:
    kind: ClassVar[str] = "compare"
    title: ClassVar[str] = "Compare"

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
    check: str = "number"     # how the answer is found: kvplay.lab.grading.grade
    # Where and when its numbers were measured, in words, for a result shown later ("a 2-core CPU, 2026-12-01,
    # recorded"); "" for a live run, measured on this machine now.
    measured_on: str = ""
    # Caches this model's architecture refuses (kvplay.cache.runnable_specs): spec -> the refusal's one sentence,
    # shown as cards beside the caches that ran.
    refused: dict[str, str] = field(default_factory=dict)
    # Caches still calibrating on this model while the others decode (kvplay.lab.compare.iter_compare): spec -> what
    # it waits for, in words ("calibrating once for this model: about 40 s left"); empty once every cache has run.
    calibrating: dict[str, str] = field(default_factory=dict)
    # A model outside kvplay's catalogue: its attention's shape and key outlier channels (kvplay.lab.profile).
    profile: ModelProfile | None = None

    @property
    def where(self) -> str:
        """Where the speeds were measured, for the words beside them."""
        return f"on {self.measured_on}" if self.measured_on else "on this machine"

    def baseline(self) -> CacheRun:
        return self.caches[0]

    def summary_rows(self) -> list[dict]:
        return [{"spec": c.spec, "cache_bytes": c.cache_bytes, "allocated_bytes": c.allocated_bytes,
                 "compression": round(c.compression, 3),
                 "bits_per_element": round(c.bits_per_element, 3), "mean_kl": round(c.mean_kl, 5),
                 "max_kl": round(c.max_kl, 5), "top1_agreement": round(c.top1_agreement, 4),
                 "first_divergence": c.first_divergence, "match_fraction": round(c.match_fraction, 4),
                 "decode_tokens_per_s": (round(c.decode_tokens_per_s, 2) if timed(c)
                                         else f"not timed: {speed_reason(c)}"),
                 "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1)} for c in self.caches]

"""What should I deploy? (the Deploy tab, `python -m kvplay advise`): every KV-cache setting one engine can deploy,
measured on one model, what each buys in a memory budget, and the one that buys the most context within a quality
bar, with the line to paste; beside them, what kvplay's own presets would buy (never recommended: no engine runs
them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvplay.results.environment import Environment


@dataclass
class Measured:
    """One setting's quality on the model, as kvplay measures it (and keeps it on disk between questions)."""

    spec: str                       # kvplay's emulation of the setting (a canonical spec)
    mean_kl: float                  # nats, against the 16-bit cache, teacher-forced over the text
    top1: float                     # share of positions whose most likely next token is 16-bit's
    ppl_change_pct: float           # perplexity over the text against 16-bit's, in %
    answer: str | None              # what the pass-code task's answer gave (None: the task has no answer)
    answer_right: bool | None
    seconds: float                  # what measuring it took, where it was measured
    needle_tokens: int = 0          # the needle's prompt length (0: not measured)
    needle: str | None = None       # the needle's answer, stripped
    needle_found: bool | None = None
    source: str = "kvplay"          # what ran it: kvplay's emulation, or "llama.cpp" (the real engine on a GGUF)


@dataclass
class Caveat:
    """Something the engine does not print: what it is, and where it is written down."""

    key: str
    text: str
    source: str                     # a URL


@dataclass
class DeploySetting:
    """One row of the evidence: a setting the engine can deploy, its bytes in the budget and its quality."""

    spec: str                       # kvplay's emulation of it (a canonical spec): the row's identity
    label: str                      # the engine's words: "K q8_0 / V q4_0", "fp8_e4m3, unit scales"
    flag: str                       # what to paste into the engine
    status: str                     # measured | cached | pruned | refused
    deployable: bool = True         # False: kvplay's own preset, shown for what it would buy, never recommended
    bits: float | None = None       # bits per cached element at the served context (byte formulas)
    context_fits: int | None = None  # tokens one sequence can hold in the budget (cache-only bound, not capped)
    max_batch: int | None = None    # sequences at the served context
    mean_kl: float | None = None
    top1: float | None = None
    ppl_change_pct: float | None = None
    answer: str | None = None
    answer_right: bool | None = None
    needle: str | None = None       # the needle's answer at AdviseResult.needle_tokens (None: not measured)
    needle_found: bool | None = None
    source: str = "kvplay"          # kvplay's emulation, or "llama.cpp": the real engine's own run
    meets_bar: bool = False
    verdict: str = ""               # in words: "meets the bar", "KL 6.7 over 0.02, answer lost", why pruned or refused
    caveats: list[str] = field(default_factory=list)    # keys of AdviseResult.caveats


@dataclass
class AdviseResult:
    kind: ClassVar[str] = "advise"
    title: ClassVar[str] = "What should I deploy?"

    model: str                      # the model the quality was measured on
    engine: str                     # the engine's key: ollama, llama.cpp, lmstudio, vllm, sglang, transformers
    engine_name: str                # in words: "Ollama"
    arch: str                       # the architecture the bytes are counted for
    projected: bool                 # the bytes are a published architecture's, not the measured model's
    size: str                       # the measured model's size in words: "0.5B"
    budget_gib: float
    budget: str                     # in words: "a 24 GB GPU"
    weight_dtype: str
    weight_gib: float
    context: int                    # the context to serve, in tokens
    context_limit: int | None       # the architecture's trained context
    bar: str                        # the quality bar's name: strict, default, loose
    max_kl: float
    min_top1: float | None
    needs_answer: bool              # the bar asks for the answer kept (only where 16-bit answers it)
    text_name: str
    text_tokens: int
    chunk: int
    task: str                       # the pass-code task's title
    expected: str | None
    settings: list[DeploySetting]   # the engine's, then kvplay's own presets (deployable False)
    recommended: str                # the spec of the setting to deploy (the 16-bit one when nothing else meets the bar)
    paste: str                      # the line to paste for it
    caveats: list[Caveat]
    notes: list[str]                # the scope, the pruning, what is emulated
    env: Environment | None = None
    measured: str = ""              # where and when the measurements ran, in words
    recorded: str = ""              # "" for a live answer; where and when, for a recording
    cached: int = 0                 # settings read from the measurement store, not measured this time
    seconds: float = 0.0            # wall time of this answer
    needle_tokens: int = 0          # the needle's context (0: not measured)
    needs_needle: bool = False      # the bar asks for the needle found (only where 16-bit finds it)
    needle_note: str = ""           # why the needle was not measured, with what it would take

    def setting(self, spec: str) -> DeploySetting | None:
        return next((s for s in self.settings if s.spec == spec), None)

    @property
    def choice(self) -> DeploySetting:
        """The recommended row."""
        return self.setting(self.recommended) or self.settings[0]

    @property
    def deployable(self) -> list[DeploySetting]:
        """The engine's rows (kvplay's own presets left out)."""
        return [s for s in self.settings if s.deployable]

    @property
    def own(self) -> list[DeploySetting]:
        """kvplay's own presets: what they would buy, not deployable in the engine."""
        return [s for s in self.settings if not s.deployable]

    @property
    def reference(self) -> DeploySetting:
        """The engine's 16-bit setting (the first row)."""
        return self.settings[0]

    def summary_rows(self) -> list[dict]:
        return [{"setting": s.label, "spec": s.spec, "bits": s.bits, "context_fits": s.context_fits,
                 f"max_batch_at_{self.context}": s.max_batch, "mean_kl": s.mean_kl, "top1": s.top1,
                 "answer": s.answer, "answer_right": s.answer_right, "needle": s.needle,
                 "needle_found": s.needle_found, "deployable": s.deployable, "source": s.source,
                 "meets_bar": s.meets_bar,
                 "recommended": s.spec == self.recommended, "status": s.status, "verdict": s.verdict, "flag": s.flag}
                for s in self.settings]

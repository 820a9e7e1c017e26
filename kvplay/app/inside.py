"""The Inside views' commands: the outlier scan, find the number, error per head and the attention shift, each
checked once and run in the job envelope (kvplay.app.jobs), so each can be stopped like any other run."""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.app import prompts
from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings
from kvplay.cache import CacheSpec, calibrate, check_specs, runnable_specs
from kvplay.errors import KvplayError
from kvplay.lab.inside import (
    NEW_TOKENS,
    QUICK_LENGTHS,
    SCAN_TOKENS,
    attention_shift,
    head_errors,
    kept_run,
    needle_limit,
    needle_run,
    outlier_scan,
    scan_tokens,
)
from kvplay.results import AttentionShift, ErrorMaps, KeptResult, NeedleResult, OutliersResult

INSIDE_SPECS = ("quanto-int2", "kvplay-int4", "kvplay-int2")   # one that fails the needle, beside two that keep it
KEPT_SPECS = ("baseline:evict=snapkv,keep=0.25", "baseline:evict=streamingllm,keep=0.25")


@dataclass
class OutliersPlan(Plan):
    tokens: int

    def check(self, job: Job) -> None:
        job.need(self.tokens)

    def run(self, job: Job, checked, progress):
        yield outlier_scan(job.model, job.tokenizer, tokens=self.tokens, model_name=job.name, progress=progress)


def outliers(model_name=None, *, tokens: int = SCAN_TOKENS, device=None, dtype=None, weights=None, settings=None,
             progress=None, cancel=None) -> OutliersResult:
    """The outlier scan on the held-out play's first `tokens` tokens."""
    plan = OutliersPlan(check_int(tokens, "Tokens", 16, SCAN_TOKENS * 8))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


@dataclass
class NeedlePlan(Plan):
    specs: list[CacheSpec]
    quick: bool
    lengths: list | None
    depths: list | None
    seed: int

    def check(self, job: Job) -> bool:
        longest = max(self.lengths) if self.lengths else (max(QUICK_LENGTHS) if self.quick else
                                                          needle_limit(job.model.config))
        job.need(longest + NEW_TOKENS)
        return prompts.is_chat(job.name, job.tokenizer)

    def run(self, job: Job, chat: bool, progress):
        yield needle_run(job.model, job.tokenizer, self.specs, lengths=self.lengths, depths=self.depths,
                         quick=self.quick, seed=self.seed, chat=chat, model_name=job.name, progress=progress)


def needle(model_name=None, specs=INSIDE_SPECS, *, quick=True, lengths=None, depths=None, seed=0, device=None,
           dtype=None, weights=None, settings=None, progress=None, cancel=None) -> NeedleResult:
    """Find the number at context lengths x depths, through each cache."""
    settings = settings or Settings.from_env()
    plan = NeedlePlan(parse_specs(list(specs), settings), quick, lengths, depths, seed)
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


@dataclass
class ErrorMapsPlan(Plan):
    specs: list[CacheSpec]
    tokens: int

    def check(self, job: Job):
        if not any(s.is_quantized for s in self.specs):
            raise KvplayError("Pick at least one quantized cache to map its error.")
        runnable, refused = runnable_specs(self.specs, job.model.config, teacher_forced=True)
        quantized = [s for s in runnable if s.is_quantized]
        ids = scan_tokens(job.tokenizer, self.tokens)
        job.need(int(ids.shape[1]))
        return quantized, refused, ids

    def run(self, job: Job, checked, progress):
        quantized, refused, ids = checked
        calibrate(quantized, job.model, job.tokenizer, progress)
        out = []
        for i, spec in enumerate(quantized):
            progress(i / len(quantized), f"{spec}: per-head error")
            out.append(head_errors(job.model, ids, spec))
        progress(1.0, "done")
        yield ErrorMaps(model=job.name, tokens=int(ids.shape[1]), caches=out, refused=refused)


def error_maps(model_name=None, specs=INSIDE_SPECS, *, tokens: int = SCAN_TOKENS, device=None, dtype=None,
               weights=None, settings=None, progress=None, cancel=None) -> ErrorMaps:
    """head_errors for each quantized spec on the held-out play's first `tokens` tokens."""
    settings = settings or Settings.from_env()
    plan = ErrorMapsPlan(parse_specs(list(specs), settings), check_int(tokens, "Tokens", 64, SCAN_TOKENS * 8))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def attention_prompt(chat: bool) -> str:
    """The attention-shift view's default prompt: a pass code in filler for a chat model, the play otherwise."""
    return prompts.find_the_number(sentences=40) if chat else prompts.raw_default_prompt(1200)


@dataclass
class ShiftPlan(Plan):
    spec: CacheSpec
    prompt: str | None
    step: int
    layer: int
    head: int
    new_tokens: int

    def check(self, job: Job) -> list[int]:
        check_specs([self.spec], job.model.config, teacher_forced=True)
        chat = prompts.is_chat(job.name, job.tokenizer)
        ids = prompts.encode(job.tokenizer, attention_prompt(chat) if self.prompt is None else self.prompt, chat)
        job.need(len(ids) + self.new_tokens)
        return ids

    def run(self, job: Job, ids: list[int], progress):
        calibrate([self.spec], job.model, job.tokenizer, progress)
        result = attention_shift(job.model, job.tokenizer, ids, self.spec, step=self.step, layer=self.layer,
                                 head=self.head, new_tokens=self.new_tokens)
        result.model = job.name
        yield result


def shift(model_name, prompt: str | None, spec, *, step: int, layer: int, head: int, new_tokens: int = 32,
          device=None, dtype=None, weights=None, settings=None, progress=None, cancel=None) -> AttentionShift:
    """attention_shift behind the usual checks; the prompt (None: attention_prompt) goes through the chat
    template for chat models."""
    settings = settings or Settings.from_env()
    prompt = None if prompt is None else clean_text(prompt)
    spec = next((s for s in parse_specs([spec], settings) if s.is_quantized), None)
    if spec is None:
        raise KvplayError("Pick a quantized cache to compare its attention with the 16-bit cache's.")
    new_tokens = check_int(new_tokens, "New tokens", 2, 256)
    plan = ShiftPlan(spec, prompt, int(step), int(layer), int(head), new_tokens)
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


@dataclass
class KeptPlan(Plan):
    specs: list[CacheSpec]
    tokens: int
    depth: float
    seed: int

    def check(self, job: Job) -> bool:
        job.need(self.tokens + NEW_TOKENS)
        return prompts.is_chat(job.name, job.tokenizer)

    def run(self, job: Job, chat: bool, progress):
        yield kept_run(job.model, job.tokenizer, self.specs, tokens=self.tokens, depth=self.depth, seed=self.seed,
                       chat=chat, model_name=job.name, progress=progress)


def kept(model_name=None, specs=KEPT_SPECS, *, tokens: int = 1024, depth: float = 0.5, seed: int = 0, device=None,
         dtype=None, weights=None, settings=None, progress=None, cancel=None) -> KeptResult:
    """Which prompt positions each evicting cache kept, per layer, for one pass-code prompt."""
    settings = settings or Settings.from_env()
    if not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise KvplayError(f"The depth must be between 0 and 1, got {depth}.")
    plan = KeptPlan(parse_specs(list(specs), settings), check_int(tokens, "Tokens", 128, 8192), float(depth),
                    check_int(seed, "Seed", 0, 2**31 - 1))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)

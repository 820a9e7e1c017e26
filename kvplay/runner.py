"""Compare: one prompt through the 16-bit cache and each quantized cache, side by side.

Per spec, two passes:
  free-running   the spec generates on its own (greedy, or seeded sampling): text,
                 divergence from the baseline, exact bytes per step, timings;
  teacher-forced the baseline's tokens are fed through the spec's cache, decode-style,
                 so attention sees the quantized history; the spec's distribution at
                 each step is compared with the baseline's (KL, top-1, log-prob).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .arch import Arch
from .cache import CacheSpec, analytic_nbytes, build_cache, check_specs
from .generate import Sampler, generate
from .metrics import divergence, kl_per_step, token_logprob, top1_agree
from .results import CacheRun, CompareResult, Environment

Progress = Callable[[float, str], None]


def environment(model, model_name: str, weights: str | None = None) -> Environment:
    device = model.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return Environment(model=model_name, dtype=str(model.dtype).replace("torch.", ""), device=str(device), gpu=gpu,
                       weights=f"quanto {weights}" if weights else "16-bit")


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so highlighted pieces join back into the decoded text."""
    pieces, prev = [], ""
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        pieces.append(cur[len(prev):])
        prev = cur
    return pieces


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


LONG_CONTEXT = 8192       # "compression at long context" is quoted at this many tokens (or the model's limit)
TOP_K = 5


def speed_stats(decode_s: list[float], batch: int) -> tuple[float, list[float], int]:
    """(median tokens/s, [p25, p75] tokens/s, timed steps) over decode steps, the first discarded as warm-up."""
    steps = sorted(decode_s[1:])
    if not steps:
        return 0.0, [], 0

    def rate(q: float) -> float:
        return batch / max(steps[min(len(steps) - 1, int(q * (len(steps) - 1) + 0.5))], 1e-9)
    return rate(0.5), [round(rate(0.75), 2), round(rate(0.25), 2)], len(steps)


def long_context_compression(spec, arch: Arch, config) -> tuple[int | None, float | None]:
    """(tokens, baseline bytes / spec bytes) at a long context, from the byte formulas for this model's shape."""
    tokens = min(LONG_CONTEXT, int(getattr(config.get_text_config(decoder=True), "max_position_embeddings", 0)
                                   or LONG_CONTEXT))
    try:
        base = analytic_nbytes("baseline", arch, tokens).total
        return tokens, base / max(analytic_nbytes(spec, arch, tokens).total, 1)
    except Exception:  # a spec the formulas do not cover: the UI then quotes only the measured ratio
        return None, None


def top_k(logits: torch.Tensor, tokenizer, k: int = TOP_K) -> tuple[list, list, list]:
    """Per row of (N, V) logits: the k most likely ids, their probabilities and their text."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    ids_l = ids.tolist()
    return (ids_l, [[round(float(p), 4) for p in row] for row in probs],
            [[tokenizer.decode([t]) for t in row] for row in ids_l])


def warm_up(model, input_ids: torch.Tensor, specs) -> None:
    """Pay one-off costs (kernel builds such as quanto's, allocator growth) before timing."""
    for spec in specs:
        generate(model, input_ids[:, :8], build_cache(spec, model), 3, keep_logits=False)


@dataclass(frozen=True)
class CompareJob:
    """A validated compare run, as kvplay.service hands it over: specs parsed once, baseline first."""

    model: Any
    tokenizer: Any
    specs: tuple[CacheSpec, ...]
    prompt: str
    max_new_tokens: int
    model_name: str = ""
    batch_size: int = 1
    sampler: Sampler | None = None
    weights: str | None = None
    prompt_ids: list[int] | None = None
    chat: bool = False

    def stream(self, progress: Progress | None = None):
        """iter_compare on this job: the partial CompareResult after each spec."""
        return iter_compare(self.model, self.tokenizer, self.specs, self.prompt, self.max_new_tokens,
                            model_name=self.model_name, batch_size=self.batch_size, sampler=self.sampler,
                            weights=self.weights, prompt_ids=self.prompt_ids, chat=self.chat, progress=progress)

    def run(self, progress: Progress | None = None) -> CompareResult:
        result = None
        for partial in self.stream(progress):
            result = partial
        return result


def run_compare(model, tokenizer, specs, prompt: str, max_new_tokens: int, **kwargs) -> CompareResult:
    """Run the baseline and each spec on `prompt`; the baseline always comes first in the result."""
    result = None
    for partial in iter_compare(model, tokenizer, specs, prompt, max_new_tokens, **kwargs):
        result = partial
    return result


def iter_compare(model, tokenizer, specs, prompt: str, max_new_tokens: int, *, model_name: str = "",
                 batch_size: int = 1, sampler: Sampler | None = None, weights: str | None = None,
                 prompt_ids: list[int] | None = None, chat: bool = False, progress: Progress | None = None):
    """Like run_compare, but yields the partial CompareResult after each spec (for streaming UIs).

    prompt_ids: the prompt as the model reads it (kvplay.prompts.encode, chat template applied when `chat`);
    default: the raw prompt text tokenized.
    """
    specs = check_specs(specs, model.config)      # baseline first; each spec checked once per run
    sampler = sampler or Sampler()
    device = model.device
    if prompt_ids is None:
        prompt_ids = tokenizer(prompt).input_ids
    ids = torch.tensor([prompt_ids], device=device)                   # (1, T)
    ids = ids.expand(batch_size, -1).contiguous()                     # (B, T): the same prompt B times
    arch = Arch.from_config(model.config)
    progress = progress or (lambda frac, desc: None)
    progress(0.0, "warming up")
    warm_up(model, ids, specs)

    base_trace = None
    runs = []
    for i, spec in enumerate(specs):
        def step(j, n, i=i, spec=spec, phase="generating"):
            progress((i + 0.5 * j / max(n, 1)) / len(specs), f"{spec}: {phase}")
        t0 = time.perf_counter()
        _peak_reset(device)
        cache = build_cache(spec, model)
        free = generate(model, ids, cache, max_new_tokens, sampler=Sampler(sampler.temperature, sampler.top_p,
                                                                           sampler.seed),
                        stop_token=tokenizer.eos_token_id if chat else None, on_step=step)  # a chat answer ends
        peak = _peak(device)
        wall = time.perf_counter() - t0
        if base_trace is None:
            base_trace = free
            forced = free
        else:
            forced = generate(model, ids, build_cache(spec, model), 0, forced=base_trace.tokens,
                              on_step=lambda j, n, i=i, spec=spec: step(n + j, 2 * n, phase="teacher forcing"))
        p = torch.stack([lg[0] for lg in base_trace.logits])             # (N, V), row 0 of the batch
        q = torch.stack([lg[0] for lg in forced.logits])
        kl = kl_per_step(p, q)
        agree = top1_agree(p, q)
        logprob = token_logprob(q, base_trace.tokens[0])
        ref_ids = base_trace.tokens[0].tolist()
        own_ids = free.tokens[0].tolist()
        first, frac, spans = divergence(ref_ids, own_ids)
        top_ids, top_probs, top_text = top_k(q, tokenizer)
        speed, spread, timed = speed_stats(free.decode_s, ids.shape[0])
        long_tokens, long_ratio = long_context_compression(spec, arch, model.config)
        context = [ids.shape[1] + k for k in range(len(free.cache_bytes))]
        final = free.cache_bytes[-1]
        base_final = base_trace.cache_bytes[min(len(free.cache_bytes), len(base_trace.cache_bytes)) - 1]
        runs.append(CacheRun(
            spec=str(spec), text=tokenizer.decode(own_ids, skip_special_tokens=True), token_ids=own_ids,
            tokens=token_pieces(tokenizer, own_ids), first_divergence=first, match_fraction=frac,
            diff_spans=[list(s) for s in spans], kl=[round(float(x), 6) for x in kl],
            top1=[bool(x) for x in agree], baseline_logprob=[round(float(x), 5) for x in logprob],
            mean_kl=float(kl.mean()) if len(kl) else 0.0, max_kl=float(kl.max()) if len(kl) else 0.0,
            top1_agreement=float(agree.float().mean()) if len(agree) else 1.0,
            context_tokens=context, cache_bytes_per_step=free.cache_bytes, cache_bytes=final,
            allocated_bytes=free.allocated_bytes,
            baseline_bytes=base_final, compression=base_final / max(final, 1),
            bits_per_element=8 * final / (arch.elements_per_token * context[-1] * batch_size),
            prefill_s=free.prefill_s, prefill_tokens_per_s=free.prefill_tokens_per_s,
            decode_tokens_per_s=speed, wall_s=wall, peak_memory_bytes=peak,
            description=getattr(cache, "description", spec.scheme.summary), decode_timed_steps=timed,
            decode_spread=spread, long_context_tokens=long_tokens, long_context_compression=long_ratio,
            top5_ids=top_ids, top5_probs=top_probs, top5_tokens=top_text))
        progress((i + 1) / len(specs), f"{spec}: done")
        yield CompareResult(prompt=prompt, prompt_tokens=ids.shape[1], max_new_tokens=max_new_tokens,
                            batch_size=batch_size, sampling={"temperature": sampler.temperature,
                                                             "top_p": sampler.top_p, "seed": sampler.seed},
                            env=environment(model, model_name, weights), caches=list(runs), chat=chat)

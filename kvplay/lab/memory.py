"""Memory: a cache's exact bytes as the context grows (measured on the live cache, chunk by chunk), and the
bytes a published architecture's cache would take at longer contexts, from the measured bits per element.

Fed `chunk` tokens at a time, the first chunk is a prompt and every later one arrives as decode steps do (so
transformers' QuantizedCache, which re-quantizes when its residual fills, matches its formula with a prefill of one
chunk). A cache that evicts tokens is measured the way it holds memory when serving: a prompt of N tokens arrives in one
prefill and is evicted once, so each of its points is a fresh cache fed one prompt of that length (doubling from
the chunk up to the longest context). Fed chunk by chunk instead, only the first chunk would be a prompt, every
later one would be kept whole, and the sweep would show eviction saving almost nothing (15.8 bits per element where
the tasks view, which serves one prompt, reads 4.0)."""
from __future__ import annotations

import torch

from kvplay.cache import (
    analytic_nbytes,
    bits_per_element,
    build_cache,
    cache_nbytes,
    calibrate,
    evict,
    runnable_specs,
)
from kvplay.cache.arch import Arch, published_archs
from kvplay.lab.compare import environment
from kvplay.lab.generate import prefill
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import long_text_ids
from kvplay.results import MemoryResult, SeriesResult

PROJECTION_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def project(bits_per_element: float, arch: Arch, tokens: int) -> int:
    """Cache bytes of `arch` holding `tokens` tokens (batch 1) at `bits_per_element` bits each."""
    return int(round(bits_per_element / 8 * arch.elements(tokens)))


def _bpe_at(points: list[list[float]], arch: Arch, tokens: int) -> float:
    """Measured bits per element at the largest measured context <= tokens (the first point if none is)."""
    below = [p for p in points if p[0] <= tokens] or points[:1]
    ctx, nbytes = below[-1]
    return bits_per_element(int(nbytes), arch, ctx)


def projections(caches: list[SeriesResult], arch: Arch, tokens=PROJECTION_TOKENS) -> dict:
    """For each published architecture: spec -> [[tokens, bytes], ...] at the measured bits per element.

    `arch` is the measured model's architecture, which turns measured bytes into bits per element.
    """
    return {name: {c.spec: [[t, project(_bpe_at(c.points, arch, t), target, t)] for t in tokens] for c in caches}
            for name, target in published_archs().items()}


def prompt_lengths(max_context: int, chunk: int) -> list[int]:
    """The prompt lengths an evicting cache is measured at: chunk, 2 chunk, 4 chunk, ... and max_context."""
    lengths = [chunk]
    while lengths[-1] * 2 < max_context:
        lengths.append(lengths[-1] * 2)
    return [n for n in lengths if n < max_context] + [max_context]


def _chunk_by_chunk(model, spec, ids: torch.Tensor, chunk: int, tell):
    """One cache fed the text `chunk` tokens at a time: (the cache, [[context, bytes], ...] after every chunk)."""
    cache, points, total = build_cache(spec, model), [], ids.shape[1]
    starts = range(0, total, chunk)
    for j, start in enumerate(starts):
        end = min(start + chunk, total)
        mask = torch.ones(1, end, dtype=torch.long, device=model.device)   # (1, past + chunk)
        prefill(model, ids[:, start:end], mask, cache)
        points.append([end, cache_nbytes(cache).total])
        tell((j + 1) / len(starts), end)
    return cache, points


def _one_prompt_each(model, spec, ids: torch.Tensor, chunk: int, tell):
    """An evicting cache: for each prompt length, a fresh cache fed that prompt in one prefill, evicted once, as when
    serving. Returns (the longest prompt's cache, [[prompt tokens, bytes], ...])."""
    lengths = prompt_lengths(ids.shape[1], chunk)
    weight, points = sum(lengths), []
    for end in lengths:
        cache = build_cache(spec, model)
        prefill(model, ids[:, :end], torch.ones(1, end, dtype=torch.long, device=model.device), cache)
        points.append([end, cache_nbytes(cache).total])
        tell(sum(n for n in lengths if n <= end) / weight, end)
    return cache, points


def memory_sweep(model, tokenizer, specs, max_context: int, chunk: int = 32, *, model_name: str = "",
                 weights: str | None = None, progress: Progress | None = None) -> MemoryResult:
    """Feed the held-out play through each cache in chunks; measure its bytes after every chunk (an evicting cache:
    after one prompt of each length, see the module's docstring).

    points are [context_tokens, bytes]: kvplay's residual window shows as a sawtooth (a
    block leaving the 16-bit window costs less than it did), and transformers'
    QuantizedCache re-quantizes everything whenever its residual fills, which with
    chunks >= its residual is every chunk. The baseline always comes first.
    """
    specs, refused = runnable_specs(specs, model.config)
    progress = progress or no_progress
    calibrate(specs, model, tokenizer, progress)
    arch = Arch.from_config(model.config)
    ids = long_text_ids(tokenizer, max_context).to(model.device)            # (1, N)
    caches = []
    for i, spec in enumerate(specs):
        def tell(done: float, end: int, i=i, spec=spec) -> None:
            progress((i + done) / len(specs), f"{spec}: {end} tokens")
        feed = _chunk_by_chunk if evict.policy_of(spec) is None else _one_prompt_each
        cache, points = feed(model, spec, ids, chunk, tell)
        exact = spec.method.formula_any_arrival          # HF QuantizedCache's formula assumes prefill + decode
        caches.append(SeriesResult(spec=str(spec), points=points, extra={
            "bits_per_element": bits_per_element(cache_nbytes(cache), arch, max_context),
            "analytic_bytes": analytic_nbytes(spec, arch, max_context).total if exact else None,
            "description": getattr(cache, "description", spec.scheme.summary)}))
    progress(1.0, "done")
    return MemoryResult(max_context=max_context, chunk=chunk,
                        env=environment(model, model_name, weights), caches=caches,
                        projections=projections(caches, arch), refused=refused)

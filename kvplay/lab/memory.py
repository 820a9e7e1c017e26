"""Memory: a cache's exact bytes as the context grows (measured on the live cache, chunk by chunk), and the
bytes a published architecture's cache would take at longer contexts, from the measured bits per element."""
from __future__ import annotations

import torch

from kvplay.cache import analytic_nbytes, bits_per_element, build_cache, cache_nbytes, calibrate, runnable_specs
from kvplay.cache.arch import Arch, published_archs
from kvplay.lab.compare import environment, weights_label
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


def memory_sweep(model, tokenizer, specs, max_context: int, chunk: int = 32, *, model_name: str = "",
                 progress: Progress | None = None) -> MemoryResult:
    """Feed the held-out play through each cache in chunks; measure its bytes after every chunk.

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
    starts = range(0, max_context, chunk)
    caches = []
    for i, spec in enumerate(specs):
        cache = build_cache(spec, model)
        points = []
        for j, start in enumerate(starts):
            end = min(start + chunk, max_context)
            mask = torch.ones(1, end, dtype=torch.long, device=model.device)   # (1, past + chunk)
            prefill(model, ids[:, start:end], mask, cache)
            points.append([end, cache_nbytes(cache).total])
            progress((i + (j + 1) / len(starts)) / len(specs), f"{spec}: {end} tokens")
        exact = spec.method.formula_any_arrival          # HF QuantizedCache's formula assumes prefill + decode
        caches.append(SeriesResult(spec=str(spec), points=points, extra={
            "bits_per_element": bits_per_element(cache_nbytes(cache), arch, max_context),
            "analytic_bytes": analytic_nbytes(spec, arch, max_context).total if exact else None,
            "description": getattr(cache, "description", spec.scheme.summary)}))
    progress(1.0, "done")
    return MemoryResult(max_context=max_context, chunk=chunk,
                        env=environment(model, model_name, weights_label(model)), caches=caches,
                        projections=projections(caches, arch), refused=refused)

"""Throughput: decode tokens/s against batch size (at one context) and against context length (at batch 1),
one timed run per point (kvplay.lab.generate.speed_stats: the median step, the first discarded)."""
from __future__ import annotations

from kvplay.cache import build_cache, calibrate, runnable_specs
from kvplay.lab.compare import environment, warm_up
from kvplay.lab.generate import generate
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import long_text_ids
from kvplay.results import SeriesResult, ThroughputResult


def throughput_sweep(model, tokenizer, specs, batch_sizes=(1, 2, 4, 8), context: int = 512, new_tokens: int = 32,
                     contexts=(), *, model_name: str = "", weights: str | None = None,
                     progress: Progress | None = None) -> ThroughputResult:
    """Decode tokens/s (whole batch, first step discarded) per spec and batch size, after a `context` prompt.

    points are [[batch, tokens/s]]; with `contexts`, context_points are [[context, tokens/s]]
    at batch 1. Each spec gets one untimed warm-up generation first.
    """
    batch_sizes, contexts = list(batch_sizes), list(contexts)       # the result's JSON lists
    longest = max([context, *contexts])
    specs, refused = runnable_specs(specs, model.config)
    progress = progress or no_progress
    calibrate(specs, model, tokenizer, progress)
    ids = long_text_ids(tokenizer, longest).to(model.device)                # (1, N)
    runs_per_spec = len(batch_sizes) + len(contexts)
    caches = []
    for i, spec in enumerate(specs):
        progress(i / len(specs), f"{spec}: warming up")
        warm_up(model, ids, [spec])
        points, context_points, prefill_points = [], [], []
        for j, b in enumerate(batch_sizes):
            prompt = ids[:, :context].expand(b, -1).contiguous()             # (B, context)
            trace = generate(model, prompt, build_cache(spec, model), new_tokens, keep_logits=False)
            points.append([b, trace.decode_tokens_per_s])
            prefill_points.append([b, trace.prefill_tokens_per_s])
            progress((i + (j + 1) / runs_per_spec) / len(specs), f"{spec}: batch {b}")
        for j, n in enumerate(contexts):
            trace = generate(model, ids[:, :n], build_cache(spec, model), new_tokens, keep_logits=False)
            context_points.append([n, trace.decode_tokens_per_s])
            progress((i + (len(batch_sizes) + j + 1) / runs_per_spec) / len(specs), f"{spec}: context {n}")
        caches.append(SeriesResult(spec=str(spec), points=points, context_points=context_points,
                                   extra={"prefill_tokens_per_s": prefill_points}))
    progress(1.0, "done")
    return ThroughputResult(batch_sizes=batch_sizes, context=context, new_tokens=new_tokens,
                            env=environment(model, model_name, weights), caches=caches,
                            refused=refused)

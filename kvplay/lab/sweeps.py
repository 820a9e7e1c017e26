"""Sweeps: cache memory against context, tokens/s against batch size, and what fits on a GPU.

    memory_sweep(model, tok, ["kvplay-int4"], max_context=4096)      # measured bytes, chunk by chunk
    project(4.25, published_archs()["Llama-3-8B"], 32768)            # those bits on a real model
    capacity_for(["kvplay-int4"], "Llama-2-7B", gpu_gib=24)          # context and batch that fit
    throughput_sweep(model, tok, ["kvplay-int4"], batch_sizes=(1, 4))

Memory is measured on the live cache (cache_nbytes), never assumed; projections to
published architectures reuse the bits per element measured here.
"""
from __future__ import annotations

import math

import torch

from kvplay.cache import (
    analytic_nbytes,
    baseline_first,
    bits_per_element,
    build_cache,
    cache_nbytes,
    check_spec_for_model,
    check_specs,
    parse_spec,
)
from kvplay.cache.arch import Arch, published_archs
from kvplay.errors import KvplayError
from kvplay.lab.compare import environment, warm_up
from kvplay.lab.generate import generate, prefill
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.results import CapacityResult, CapacityRow, MemoryResult, SeriesResult, ThroughputResult

PROJECTION_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
REFERENCE_ARCH = "Llama-3-8B"          # default_bits: head_dim 128, as in most published models
WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}
CAPACITY_NOTE = "Cache-only bound: ignores activations, framework overhead and fragmentation."



def _max_positions(model) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2**31 - 1)


def _weights_label(model) -> str | None:
    """'int8' / 'int4' for models from models.quantize_weights, else None (16-bit weights)."""
    return getattr(model, "kvplay_weights", None)


def long_text_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """The held-out play's first `n_tokens` tokens (1, n), the play repeated as often as needed."""
    if n_tokens < 1:
        raise KvplayError(f"The text length must be at least 1 token, got {n_tokens}.")
    ids = tokenizer(HELD_OUT_TEXT.read_text(encoding="utf-8"), return_tensors="pt", verbose=False).input_ids[0]
    reps = -(-n_tokens // ids.shape[0])
    return ids.repeat(reps)[:n_tokens].unsqueeze(0)                        # (1, n)


# ---------------------------------------------------------------------------- memory

def project(bits_per_element: float, arch: Arch, tokens: int) -> int:
    """Cache bytes of `arch` holding `tokens` tokens (batch 1) at `bits_per_element` bits each."""
    return int(round(bits_per_element / 8 * arch.elements_per_token * tokens))


def _bpe_at(points: list[list[float]], arch: Arch, tokens: int) -> float:
    """Measured bits per element at the largest measured context <= tokens (the first point if none is)."""
    below = [p for p in points if p[0] <= tokens] or points[:1]
    ctx, nbytes = below[-1]
    return 8 * nbytes / (arch.elements_per_token * ctx)


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
    if chunk < 1:
        raise KvplayError(f"The chunk size must be at least 1 token, got {chunk}.")
    limit = _max_positions(model)
    if not 2 * chunk <= max_context <= limit:
        raise KvplayError(f"The sweep's context must be between {2 * chunk} (two chunks) and the model's "
                          f"{limit} positions, got {max_context}.")
    specs = check_specs(specs, model.config)
    progress = progress or no_progress
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
                        env=environment(model, model_name, _weights_label(model)), caches=caches,
                        projections=projections(caches, arch))


# ---------------------------------------------------------------------------- capacity

def capacity(specs_bits: dict[str, float], arch: Arch, gpu_gib: float, weight_dtype: str = "float16",
             context: int = 4096) -> CapacityResult:
    """How much cache fits beside the weights: longest context at batch 1, largest batch at `context`.

    specs_bits maps a spec's name to its bits per element (measured, or from default_bits).
    """
    if isinstance(gpu_gib, bool) or not isinstance(gpu_gib, (int, float)) or not gpu_gib > 0 \
            or not math.isfinite(gpu_gib):
        raise KvplayError("GPU memory must be a positive number of GiB.")
    if weight_dtype not in WEIGHT_BYTES:
        raise KvplayError(f"Unknown weight dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_BYTES)}.")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise KvplayError(f"The context must be a whole number of tokens, at least 1, got {context!r}.")
    weight_bytes = int(round(arch.params * WEIGHT_BYTES[weight_dtype]))
    free = gpu_gib * 2**30 - weight_bytes
    rows = []
    for spec, bits in specs_bits.items():
        if not bits > 0:
            raise KvplayError(f"{spec}: bits per element must be positive, got {bits}.")
        per_token = bits / 8 * arch.elements_per_token
        rows.append(CapacityRow(spec=spec, bits_per_element=float(bits), bytes_per_token=per_token,
                                max_context=math.floor(free / per_token) if free > 0 else 0,
                                max_batch=math.floor(free / (per_token * context)) if free > 0 else 0))
    return CapacityResult(arch=arch.name, gpu_gib=float(gpu_gib), weight_dtype=weight_dtype,
                          weight_bytes=weight_bytes, context=context, note=CAPACITY_NOTE, caches=rows)


def _arch_config(arch: Arch):
    """A minimal config with `arch`'s cache shape, so spec checks run without a model."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=arch.layers, num_attention_heads=arch.kv_heads,
                       num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                       hidden_size=arch.kv_heads * arch.head_dim)


def default_bits(spec, tokens: int = 8192) -> float:
    """Bits per element the formulas give for `spec` after `tokens` tokens on the reference architecture.

    No model runs: transformers' QuantizedCache is taken right after a prefill of all
    `tokens` (its residual empty); kvplay's window and sink are counted in 16-bit.
    """
    spec = parse_spec(spec)
    arch = published_archs()[REFERENCE_ARCH]
    check_spec_for_model(spec, _arch_config(arch))
    return bits_per_element(analytic_nbytes(spec, arch, tokens), arch, tokens)


def capacity_for(specs, arch_name: str, gpu_gib: float, weight_dtype: str = "float16",
                 context: int = 4096) -> CapacityResult:
    """capacity() for a published architecture, each spec at its default_bits; baseline first."""
    archs = published_archs()
    if arch_name not in archs:
        raise KvplayError(f"Unknown architecture {arch_name!r}; choose one of {', '.join(archs)}.")
    bits = {str(s): default_bits(s) for s in baseline_first(specs)}
    return capacity(bits, archs[arch_name], gpu_gib, weight_dtype, context)


# ---------------------------------------------------------------------------- throughput

def throughput_sweep(model, tokenizer, specs, batch_sizes=(1, 2, 4, 8), context: int = 512, new_tokens: int = 32,
                     contexts=(), *, model_name: str = "", progress: Progress | None = None) -> ThroughputResult:
    """Decode tokens/s (whole batch, first step discarded) per spec and batch size, after a `context` prompt.

    points are [[batch, tokens/s]]; with `contexts`, context_points are [[context, tokens/s]]
    at batch 1. Each spec gets one untimed warm-up generation first.
    """
    batch_sizes = [int(b) for b in batch_sizes]
    contexts = [int(c) for c in contexts]
    if not batch_sizes or min(batch_sizes) < 1:
        raise KvplayError("Batch sizes must be whole numbers of at least 1.")
    if new_tokens < 2:
        raise KvplayError(f"Throughput needs at least 2 new tokens (the first decode step is not timed), "
                          f"got {new_tokens}.")
    if min([context] + contexts) < 1:
        raise KvplayError("Context lengths must be at least 1 token.")
    limit = _max_positions(model)
    longest = max([context] + contexts)
    if longest + new_tokens > limit:
        raise KvplayError(f"Context plus new tokens ({longest} + {new_tokens}) exceed the model's {limit} positions.")
    specs = check_specs(specs, model.config)
    progress = progress or no_progress
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
                            env=environment(model, model_name, _weights_label(model)), caches=caches)

"""Quality of a quantized cache over a long text: perplexity, KL to the baseline, per-layer error.

    perplexity_run(model, tok, ["kvplay-int4", "kvplay-int2"])     # the held-out play, 2,048 tokens
    layer_errors(model, ids, "kvplay-int2")                         # relative K/V error per layer

Every position's logits are kept, so each spec is judged on the whole text against the
baseline's distributions at the same positions (teacher forcing by construction).
"""
from __future__ import annotations

import torch

from kvplay.cache import CacheSpec, build_cache, calibrate, dequantized_kv, parse_spec, runnable_specs
from kvplay.errors import KvplayError
from kvplay.lab.compare import environment
from kvplay.lab.generate import prefill
from kvplay.lab.metrics import (
    distribution_stats,
    kl_per_step,
    perplexity,
    relative_error,
    token_logprob,
    top1_agree,
)
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.results import PplResult, PplRun

MIN_TOKENS = 64          # fewer tokens make perplexity a coin toss
KL_WINDOW = 64           # tokens per point of kl_along_text
LAYER_ERROR_TOKENS = 1024



@torch.inference_mode()
def forward_logits(model, input_ids: torch.Tensor, past: int, cache) -> torch.Tensor:
    """Tokens (B, T) that follow `past` cached tokens -> logits of every position (B, T, V) float32."""
    batch, n = input_ids.shape
    mask = torch.ones(batch, past + n, dtype=torch.long, device=input_ids.device)           # (B, past + T)
    positions = torch.arange(past, past + n, device=input_ids.device).expand(batch, -1)     # (B, T)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True)
    return out.logits.float()


def chunked_logits(model, ids: torch.Tensor, cache, chunk: int, on_chunk=None) -> torch.Tensor:
    """Feed ids (1, N) through `cache` in chunks of `chunk` tokens -> logits (N, V) float32.

    on_chunk(done, total): progress callback after each chunk.
    """
    n, out = ids.shape[1], None
    for start in range(0, n, chunk):
        logits = forward_logits(model, ids[:, start:start + chunk], start, cache)[0]              # (c, V)
        if out is None:                     # filled in place: one (N, V) copy, not the chunks and their join
            out = logits.new_empty(n, logits.shape[-1])
        out[start:start + logits.shape[0]] = logits
        if on_chunk is not None:
            on_chunk(min(start + chunk, n), n)
    return out


def window_means(values: torch.Tensor, window: int) -> list[float]:
    """Mean of each run of `window` values (the last run may be shorter): (N,) -> list."""
    return [float(w.mean()) for w in values.split(window)]


def text_ids(tokenizer, text: str | None, max_tokens: int, chunk: int, device) -> tuple[torch.Tensor, str]:
    """(the first `max_tokens` token ids of the text (1, N) on `device`, the text's name): the held-out play when
    text is None; one sentence when too short for `chunk`."""
    name = ""
    if text is None:
        text, name = HELD_OUT_TEXT.read_text(encoding="utf-8"), HELD_OUT_TEXT.name
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[:, :max_tokens].to(device)     # (1, N)
    n, need = ids.shape[1], max(2 * chunk, MIN_TOKENS)
    if n < need:
        raise KvplayError(f"The text is too short to evaluate: {n} tokens, need at least {need}.")
    return ids, name


def cache_run(model, ids: torch.Tensor, spec: CacheSpec, chunk: int, base=None,
              progress: Progress | None = None) -> tuple[PplRun, torch.Tensor]:
    """One cache over ids (1, N), judged against the baseline's (logits (N, V), perplexity) `base` (None: this is
    the baseline, judged against itself): (its PplRun, its logits). progress(fraction, what) as its chunks go."""
    progress = progress or no_progress
    targets = ids[0, 1:]                                                                      # (N-1,)

    def on_chunk(done, total):
        progress(0.9 * done / total, f"{spec}: {done}/{total} tokens")
    logits = chunked_logits(model, ids, build_cache(spec, model), chunk, on_chunk)              # (N, V)
    ppl = perplexity(-token_logprob(logits[:-1], targets))
    base_logits, base_ppl = base if base is not None else (logits, ppl)
    kl = kl_per_step(base_logits, logits)                                                       # (N,)
    agree = top1_agree(base_logits, logits)
    progress(0.9, f"{spec}: per-layer error")
    if spec.is_quantized:
        key_err, value_err = layer_errors(model, ids[:, :LAYER_ERROR_TOKENS], spec)
    else:
        key_err = value_err = [0.0] * len(build_cache(spec, model).layers)
    run = PplRun(spec=str(spec), ppl=ppl, delta_ppl_pct=100 * (ppl / base_ppl - 1), mean_kl=float(kl.mean()),
                 top1_agreement=float(agree.float().mean()), kl_along_text=window_means(kl, KL_WINDOW),
                 layer_key_error=key_err, layer_value_error=value_err,
                 **distribution_stats(base_logits, logits, chunk, kl))
    return run, logits


def perplexity_run(model, tokenizer, specs, text: str | None = None, max_tokens: int = 2048, chunk: int = 16, *,
                   text_name: str = "", model_name: str = "", weights: str | None = None,
                   progress: Progress | None = None) -> PplResult:
    """Perplexity of each cache over a text, against the baseline's, with KL and top-1 agreement per position.

    Tokens go through the cache `chunk` at a time and every position's logits are kept.
    chunk=1 is exact decode semantics: each token attends to the quantized history.
    With chunk c, tokens inside a chunk see each other in full precision and only the
    history before the chunk as the cache stores it, so small chunks are stricter (and
    slower); the default 16 is a compromise. The text defaults to the held-out play;
    its first `max_tokens` tokens are used. The baseline always comes first. weights: the model's weight format
    when quantized ("int8"), for the environment. Each cache's
    figures are cache_run's, so a run spread cache by cache (kvplay.app.scale) gives the same.
    """
    specs, refused = runnable_specs(specs, model.config, teacher_forced=True)
    ids, name = text_ids(tokenizer, text, max_tokens, chunk, model.device)
    progress = progress or no_progress
    calibrate(specs, model, tokenizer, progress)

    runs, base = [], None
    for i, spec in enumerate(specs):
        run, logits = cache_run(model, ids, spec, chunk, base,
                                lambda f, what, i=i: progress((i + f) / len(specs), what))
        base = base or (logits, run.ppl)
        runs.append(run)
        del logits                          # at most two (N, V) copies at once: the baseline's and the next's
    progress(1.0, "done")
    return PplResult(text_name=text_name or name, tokens=ids.shape[1], chunk=chunk,
                     env=environment(model, model_name, weights), caches=runs,
                     refused=refused)


# ---------------------------------------------------------------------------- per-layer error
# dequantized_kv(layer): each cache method reads back its own layers (kvplay/cache/methods/).

def layer_errors(model, tokenizer_ids: torch.Tensor, spec: CacheSpec | str) -> tuple[list[float], list[float]]:
    """Relative Frobenius error of the keys and of the values each layer stores, for token ids (1, T).

    One prefill fills a DynamicCache (exact K, V) and one fills the spec's cache: in a
    single prefill the same keys and values enter both, so the difference is the
    storage alone. Returns (key errors, value errors), one per layer.
    """
    spec = parse_spec(spec)
    ids = tokenizer_ids.to(model.device)
    exact, stored = build_cache(CacheSpec("baseline"), model), build_cache(spec, model)
    mask = torch.ones_like(ids)                                                              # (1, T)
    prefill(model, ids, mask, exact)
    prefill(model, ids, mask, stored)
    key_err, value_err = [], []
    for ref, layer in zip(exact.layers, stored.layers):
        keys, values = dequantized_kv(layer)
        key_err.append(relative_error(keys, ref.keys))
        value_err.append(relative_error(values, ref.values))
    return key_err, value_err

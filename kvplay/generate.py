"""Generation as small free functions (after gpt-fast): prefill, decode_one_token, generate.

Driving the loop ourselves, rather than through model.generate, lets the runner
time prefill and decode separately, read the cache's exact bytes after every step
and feed a fixed token sequence (teacher forcing) through any cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import cache_nbytes


def sync(device) -> None:
    """Wait for queued GPU work so wall-clock timings mean something."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Sampler:
    """Greedy when temperature == 0; otherwise temperature + top-p sampling from a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    _gen: torch.Generator | None = field(default=None, repr=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) -> next tokens (B, 1)."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        if self._gen is None:
            self._gen = torch.Generator(device=logits.device).manual_seed(self.seed)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
        return torch.multinomial(probs, 1, generator=self._gen)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Left-padded attention mask (B, T) -> position ids (B, T), 0 at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """Run tokens (B, T) through the model, filling `cache`; return last-position logits (B, V).

    mask (B, past + T) covers the cache and the new tokens, so prefill also feeds a chunk.
    """
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=_positions(mask)[:, -input_ids.shape[1]:],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


@torch.inference_mode()
def decode_one_token(model, token: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """One decode step: token (B, 1), mask (B, T+1) covering the cache and the token -> logits (B, V)."""
    out = model(input_ids=token, attention_mask=mask, position_ids=_positions(mask)[:, -1:],
                past_key_values=cache, use_cache=True)
    return out.logits[:, -1].float()


@dataclass
class Trace:
    """What one generation did, step by step (tensors stay here; results keep plain numbers)."""

    tokens: torch.Tensor                 # (B, n) generated ids
    logits: list[torch.Tensor]           # n x (B, V) float32: the distribution each token was chosen from
    cache_bytes: list[int]               # in use: after prefill, then after each decode step
    prefill_s: float
    decode_s: list[float]                # per decode step
    prompt_tokens: int
    allocated_bytes: int = 0             # at the end: in use plus the buffers' spare capacity

    @property
    def decode_tokens_per_s(self) -> float:
        """Batch tokens per second over decode steps, discarding the first as warm-up."""
        steps = self.decode_s[1:] or self.decode_s
        return self.tokens.shape[0] * len(steps) / max(sum(steps), 1e-9)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.prompt_tokens / max(self.prefill_s, 1e-9)


def generate(model, input_ids: torch.Tensor, cache, max_new_tokens: int, *, mask: torch.Tensor | None = None,
             sampler: Sampler | None = None, forced: torch.Tensor | None = None, keep_logits: bool = True,
             stop_token: int | None = None, on_step=None) -> Trace:
    """Generate up to `max_new_tokens` tokens through `cache`.

    forced (B, n): teacher forcing; feed these tokens instead of the sampled ones,
    so the cache sees a fixed history and the logits are comparable across caches.
    on_step(i, n): progress callback; raising from it cancels the run.
    """
    sampler = sampler or Sampler()
    device = input_ids.device
    mask = torch.ones_like(input_ids) if mask is None else mask
    n_steps = forced.shape[1] if forced is not None else max_new_tokens
    sync(device)
    t0 = time.perf_counter()
    logits = prefill(model, input_ids, mask, cache)
    sync(device)
    prefill_s = time.perf_counter() - t0
    held = cache_nbytes(cache)                                   # the latest measurement (CacheBytes)
    tokens, all_logits, nbytes, decode_s = [], [], [held.total], []
    for i in range(n_steps):
        if keep_logits:
            all_logits.append(logits)
        token = forced[:, i:i + 1] if forced is not None else sampler(logits)
        tokens.append(token)
        if on_step is not None:
            on_step(i, n_steps)
        if i == n_steps - 1 or (stop_token is not None and forced is None and bool((token == stop_token).all())):
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        t0 = time.perf_counter()
        logits = decode_one_token(model, token, mask, cache)
        sync(device)
        decode_s.append(time.perf_counter() - t0)
        held = cache_nbytes(cache)
        nbytes.append(held.total)
    return Trace(tokens=torch.cat(tokens, dim=1), logits=all_logits, cache_bytes=nbytes, prefill_s=prefill_s,
                 decode_s=decode_s, prompt_tokens=input_ids.shape[1],
                 allocated_bytes=held.allocated_bytes)

"""Generation as small free functions (after gpt-fast): prefill, decode_one_token, generate, lockstep.

Driving the loop ourselves, rather than through model.generate, lets the runner
time prefill and decode separately, read the cache's exact bytes after every step
and feed a fixed token sequence (teacher forcing) through any cache.

lockstep() runs many caches as one batch (Compare): one prefill shared by every cache whose method
declares shares_prefill (the others get one each), then one forward pass per step for all of them
(kvplay.cache.rows.RowGroups). Rows are timed together, so lockstep records no per-cache speed;
time_alone() times caches one at a time, taking turns, after the run.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplay.cache import cache_nbytes
from kvplay.cache.rows import RowGroups, memoized


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
        """kvplay's one decode speed (speed_stats): batch tokens over the median step, the first discarded."""
        return speed_stats(self.decode_s, self.tokens.shape[0])[0]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.prompt_tokens / max(self.prefill_s, 1e-9)


def step_rate(steps: list[float], batch: int) -> float:
    """Tokens/s of timed decode steps (warm-up already left out): the batch over the median step, so one slow
    step (another process waking up) moves it less than a mean would."""
    return batch / max(statistics.median(steps), 1e-9) if steps else 0.0


def speed_stats(decode_s: list[float], batch: int) -> tuple[float, list[float], int]:
    """(tokens/s, [p25, p75] tokens/s, timed steps) over a run's decode steps, the first discarded as warm-up:
    the one definition of decode speed that Compare, Throughput, the benchmark and the cards quote."""
    steps = sorted(decode_s[1:])
    if not steps:
        return 0.0, [], 0

    def rate(q: float) -> float:
        return batch / max(steps[min(len(steps) - 1, int(q * (len(steps) - 1) + 0.5))], 1e-9)
    return step_rate(steps, batch), [round(rate(0.75), 2), round(rate(0.25), 2)], len(steps)


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


@dataclass
class Row:
    """One row group of a lockstep run: B rows through one cache, and what they did.

    sampler: the row chooses its own tokens (free-running); follow: the index of an earlier row whose
    tokens it is fed instead (teacher forcing: it ends when that row ends). shares_prefill: the cache's
    method declares it (CacheMethod.shares_prefill); rows that do not share it and have the same
    prefill_key (their spec) get one prefill of their own together.
    """

    cache: Any
    sampler: Sampler | None = None
    follow: int | None = None
    shares_prefill: bool = True
    prefill_key: str = ""
    name: str = ""
    keep_logits: bool = True
    measure_bytes: bool = True
    tokens: list = field(default_factory=list)         # n x (B, 1)
    logits: list = field(default_factory=list)         # n x (B, V) float32
    cache_bytes: list = field(default_factory=list)    # in use: after prefill, then after each step it was fed
    held: Any = None                                   # the latest CacheBytes
    prefill_s: float = 0.0
    done: bool = False
    next_logits: torch.Tensor | None = field(default=None, repr=False)   # (B, V): what it chooses from next

    def trace(self, prompt_tokens: int) -> Trace:
        """What the row did so far, as generate() reports it (no decode timings: rows are timed together)."""
        tokens = torch.cat(self.tokens, dim=1) if self.tokens else torch.zeros(0, 0, dtype=torch.long)
        return Trace(tokens=tokens, logits=list(self.logits), cache_bytes=list(self.cache_bytes),
                     prefill_s=self.prefill_s, decode_s=[], prompt_tokens=prompt_tokens,
                     allocated_bytes=self.held.allocated_bytes if self.held is not None else 0)


def _measure(row: Row) -> None:
    if row.measure_bytes:
        row.held = cache_nbytes(row.cache)
        row.cache_bytes.append(row.held.total)


def lockstep(model, input_ids: torch.Tensor, rows: list[Row], max_new_tokens: int, *, stop_token: int | None = None,
             on_prefill=None):
    """Step every row's cache together on input_ids (B, T); a generator yielding after each step i (0-based)
    the number of steps done, i + 1, once every row has chosen its token i (the first right after prefill).
    on_prefill(done, total) after each prefill (one shared by the rows that can, one per other spec); raising
    from it, as the app's cancel does, stops the run there.

    A free-running row ends at max_new_tokens or once all its B rows chose stop_token; a teacher-forced row
    when the row it follows ends. Ended rows leave the batch; the others go on.
    """
    with memoized([row.cache for row in rows]):                   # no row is timed here (rows.memoized)
        yield from _lockstep(model, input_ids, rows, max_new_tokens, stop_token, on_prefill)


def _lockstep(model, input_ids: torch.Tensor, rows: list[Row], max_new_tokens: int, stop_token: int | None,
              on_prefill=None):
    batch, prompt = input_ids.shape
    device = input_ids.device
    mask = torch.ones_like(input_ids)
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if row.follow is not None and row.follow >= i:
            raise ValueError("A teacher-forced row must follow an earlier row.")
        groups.setdefault("" if row.shares_prefill else f"own:{row.prefill_key or i}", []).append(i)
    for done, (key, members) in enumerate(groups.items(), 1):    # the shared prefill, then one per other spec
        fan = RowGroups([rows[i].cache for i in members], batch, model.config, names=[rows[i].name for i in members],
                        check_shared=key == "")
        sync(device)
        t0 = time.perf_counter()
        logits = prefill(model, input_ids, mask, fan)                            # (B, V)
        sync(device)
        for i in members:
            rows[i].next_logits, rows[i].prefill_s = logits, time.perf_counter() - t0
        if on_prefill is not None:
            on_prefill(done, len(groups))
    for row in rows:
        _measure(row)
    together = RowGroups([row.cache for row in rows], batch, model.config, names=[row.name for row in rows])
    together.split()
    for step in range(max_new_tokens):
        for g in together.active:
            row = rows[g]
            if row.keep_logits:
                row.logits.append(row.next_logits)
            token = row.sampler(row.next_logits) if row.follow is None else rows[row.follow].tokens[step]
            row.tokens.append(token)                                             # (B, 1)
            row.done = (step == max_new_tokens - 1 or (row.follow is not None and rows[row.follow].done) or
                        (row.follow is None and stop_token is not None and bool((token == stop_token).all())))
        yield step + 1
        for g in [g for g in together.active if rows[g].done]:
            together.drop(g)
        if not together.active:
            return
        tokens = torch.cat([rows[g].tokens[-1] for g in together.active])     # (G * B, 1)
        logits = decode_one_token(model, tokens, mask.new_ones(tokens.shape[0], prompt + step + 1), together)
        for n, g in enumerate(together.active):                               # (G * B, V) -> B rows each
            rows[g].next_logits = logits[n * batch:(n + 1) * batch]
            _measure(rows[g])


def time_alone(model, caches: list, tokens: list[torch.Tensor], *, rounds: int, steps: int,
               on_step=None) -> tuple[list[list[float]], list[int | None]]:
    """Decode steps through each cache alone, taking turns (0, 1, ..., then again) for `rounds` rounds.

    tokens: the (B, 1) token each cache is fed. Returns per cache the seconds of each step but the first
    of every round (the first step after another cache ran pays for the switch), and per cache the peak
    GPU memory over its turns (None off CUDA; every cache is held meanwhile). The caches grow.
    on_step(): called after every step (progress; raising from it cancels the run).
    """
    seconds: list[list[float]] = [[] for _ in caches]
    peaks: list[int | None] = [None] * len(caches)
    for _ in range(rounds):
        for c, (cache, token) in enumerate(zip(caches, tokens)):
            cuda = token.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(token.device)
            for s in range(steps):
                mask = token.new_ones(token.shape[0], cache.get_seq_length() + 1)
                sync(token.device)
                t0 = time.perf_counter()
                decode_one_token(model, token, mask, cache)
                sync(token.device)
                if s:
                    seconds[c].append(time.perf_counter() - t0)
                if on_step is not None:
                    on_step()
            if cuda:
                peaks[c] = max(peaks[c] or 0, int(torch.cuda.max_memory_allocated(token.device)))
    return seconds, peaks

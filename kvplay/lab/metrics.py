"""Pure metric functions: distributions and token sequences in, numbers out.

Functions of logits (N, V) work ROWS rows at a time, so that a long text's float32 copies of a large vocabulary
stay small: 2,048 positions of Gemma 3's 262,144-token vocabulary are 2.1 GB per copy, and a softmax makes two."""
from __future__ import annotations

import math

import torch

ROWS = 256


def _by_rows(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """fn over ROWS rows of each (N, ...) tensor at a time, the (N, ...) results joined."""
    n = tensors[0].shape[0]
    if n <= ROWS:
        return fn(*tensors)
    return torch.cat([fn(*(t[i:i + ROWS] for t in tensors)) for i in range(0, n, ROWS)])


def kl_per_step(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats for each row: logits (N, V) -> (N,). p is the reference (16-bit) run."""
    def kl(p, q):
        logp = torch.log_softmax(p.float(), dim=-1)
        logq = torch.log_softmax(q.float(), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1).clamp(min=0.0)
    return _by_rows(kl, p_logits, q_logits)


def top1_agree(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Whether both distributions put the same token first, per row: (N, V) -> (N,) bool."""
    return p_logits.argmax(-1) == q_logits.argmax(-1)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) per row: logits (N, V), tokens (N,) -> (N,)."""
    return _by_rows(lambda lg, t: torch.log_softmax(lg.float(), dim=-1).gather(-1, t[:, None]).squeeze(-1),
                    logits, tokens)


def divergence(reference: list[int], other: list[int]) -> tuple[int | None, float, list[tuple[int, int]]]:
    """Compare two generated token sequences position by position.

    Returns (index of the first differing token or None, fraction of positions equal,
    spans [start, end) of positions that differ). Positions past the shorter sequence differ.
    """
    n = max(len(reference), len(other))
    if n == 0:
        return None, 1.0, []
    same = [i < len(reference) and i < len(other) and reference[i] == other[i] for i in range(n)]
    spans, start = [], None
    for i, eq in enumerate(same + [True]):
        if not eq and start is None:
            start = i
        elif eq and start is not None:
            spans.append((start, i))
            start = None
    first = spans[0][0] if spans else None
    return first, sum(same) / n, spans


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean negative log-likelihood) over tokens."""
    return math.exp(float(nll.float().mean()))


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F."""
    exact = exact.float()
    return float((approx.float() - exact).norm() / exact.norm().clamp(min=1e-12))


def _sem(values: torch.Tensor, chunk: int) -> float:
    """Standard error of the mean of `values` (N,), from the spread of its chunk means (neighbouring positions are
    correlated, so the chunks, not the positions, are the independent samples)."""
    means = torch.stack([c.float().mean() for c in values.split(max(chunk, 1))])
    return float(means.std(unbiased=True) / math.sqrt(len(means))) if len(means) > 1 else 0.0


def distribution_stats(p_logits: torch.Tensor, q_logits: torch.Tensor, chunk: int, kl: torch.Tensor | None = None
                       ) -> dict:
    """What llama.cpp's `llama-perplexity --kl-divergence` reports, for reference logits p and a cache's q (N, V):
    KL mean with its standard error, median, 99th percentile and max (nats); the share of same top-1 with its
    standard error; and dp, the change in probability of the 16-bit model's top token (mean and root mean square,
    in percentage points). Standard errors come from the spread over `chunk`-token chunks. kl: kl_per_step(p, q)
    where the caller has it already (a pass over both (N, V) tensors)."""
    kl = kl_per_step(p_logits, q_logits) if kl is None else kl
    same = top1_agree(p_logits, q_logits).float()
    top = p_logits.argmax(-1, keepdim=True)
    prob = [_by_rows(lambda lg, t: torch.softmax(lg.float(), -1).gather(-1, t).squeeze(-1), logits, top)
            for logits in (p_logits, q_logits)]
    dp = 100 * (prob[1] - prob[0])
    return {"kl_sem": _sem(kl, chunk), "kl_median": float(kl.quantile(0.5)), "kl_p99": float(kl.quantile(0.99)),
            "kl_max": float(kl.max()), "top1_sem": _sem(same, chunk), "delta_p_mean": float(dp.mean()),
            "delta_p_rms": float(dp.pow(2).mean().sqrt())}

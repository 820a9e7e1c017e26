"""Pure metric functions: distributions and token sequences in, numbers out."""
from __future__ import annotations

import math

import torch


def kl_per_step(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats for each row: logits (N, V) -> (N,). p is the reference (16-bit) run."""
    logp = torch.log_softmax(p_logits.float(), dim=-1)
    logq = torch.log_softmax(q_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).clamp(min=0.0)


def top1_agree(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Whether both distributions put the same token first, per row: (N, V) -> (N,) bool."""
    return p_logits.argmax(-1) == q_logits.argmax(-1)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) per row: logits (N, V), tokens (N,) -> (N,)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


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


def distribution_stats(p_logits: torch.Tensor, q_logits: torch.Tensor, chunk: int) -> dict:
    """What llama.cpp's `llama-perplexity --kl-divergence` reports, for reference logits p and a cache's q (N, V):
    KL mean with its standard error, median, 99th percentile and max (nats); the share of same top-1 with its
    standard error; and dp, the change in probability of the 16-bit model's top token (mean and root mean square,
    in percentage points). Standard errors come from the spread over `chunk`-token chunks."""
    kl = kl_per_step(p_logits, q_logits)
    same = top1_agree(p_logits, q_logits).float()
    top = p_logits.argmax(-1, keepdim=True)
    prob = [torch.softmax(logits.float(), -1).gather(-1, top).squeeze(-1) for logits in (p_logits, q_logits)]
    dp = 100 * (prob[1] - prob[0])
    return {"kl_sem": _sem(kl, chunk), "kl_median": float(kl.quantile(0.5)), "kl_p99": float(kl.quantile(0.99)),
            "kl_max": float(kl.max()), "top1_sem": _sem(same, chunk), "delta_p_mean": float(dp.mean()),
            "delta_p_rms": float(dp.pow(2).mean().sqrt())}

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

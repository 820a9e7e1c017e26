"""StreamingLLM: keep the first tokens, which attention leans on whatever they say (attention sinks), and the
newest ones.

Xiao, Tian, Chen, Han and Lewis, "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453. As kvpress's StreamingLLMPress, it compresses the prompt once, after prefill; it needs no
scores from attention, so it knows nothing of the question: a needle outside its window is gone.
"""
from __future__ import annotations

import torch

from kvplay.cache.evict import Policy, register

SINKS = 4


class StreamingLLM(Policy):
    name = "streamingllm"
    title = "StreamingLLM"
    paper = "Xiao et al., 2024, Efficient Streaming Language Models with Attention Sinks (arXiv:2309.17453)"
    how = f"the first {SINKS} and the newest tokens"

    def scores(self, keys, query, scaling):
        b, h, t, _ = keys.shape
        position = torch.arange(t, device=keys.device, dtype=torch.float32)
        score = position.masked_fill(position < SINKS, float(t + 1))        # sinks first, then newest first
        return score.expand(b, h, t)


POLICY = register(StreamingLLM())

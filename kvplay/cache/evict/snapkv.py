"""SnapKV: keep the tokens the end of the prompt attends to, scored once per KV head after prefill.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis and Chen, "SnapKV: LLM Knows What You are Looking for
Before Generation", NeurIPS 2024, arXiv:2404.14469. The last WINDOW prompt tokens (the question, when it ends
the prompt) are an observation window: their attention over the whole prompt, averaged over the window and
over each KV head's query heads, then max-pooled over POOL neighbouring tokens so that the tokens around a hit
(the rest of a number, a name) survive with it, ranks the tokens; the window itself always stays.

The paper's and kvpress's defaults (a 64-token window, an average pool of 5) lost the pass code on SmolLM2-135M
keeping a quarter of a 1,024-token prompt at all 5 depths tried; a 32-token window, which holds the question
and little filler, with a max pool of 13 found it at all 5 (docs/eviction.md).
"""
from __future__ import annotations

import torch

from kvplay.cache.evict import Policy, attention_weights, register

WINDOW = 32
POOL = 13


class SnapKV(Policy):
    name = "snapkv"
    title = "SnapKV"
    paper = "Li et al., 2024, SnapKV: LLM Knows What You are Looking for Before Generation (arXiv:2404.14469)"
    needs_queries = True
    how = f"scored by the last {WINDOW} prompt tokens"

    def scores(self, keys, query, scaling):
        t = keys.shape[-2]
        window = min(WINDOW, t)
        weights = attention_weights(keys, query[:, :, -window:], scaling).mean(dim=2)      # (B, Hkv, T)
        b, h, _ = weights.shape
        pooled = torch.nn.functional.max_pool1d(weights.reshape(b * h, 1, t), POOL, stride=1,
                                                padding=POOL // 2).reshape(b, h, t)
        pooled[..., t - window:] = float("inf")            # the observation window stays
        return pooled


POLICY = register(SnapKV())

"""TOVA: keep the tokens the newest token attends to most, and evict on every step to hold the budget.

Oren, Hassid, Yarden, Adi and Schwartz, "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104.
After prefill, the last prompt token's attention (averaged over each KV head's query heads) ranks the prompt;
then each decode step adds a token and drops the one the new token attends to least, so the cache never holds
more than its budget. Only the 16-bit baseline runs it: dropping one token from kvplay's quantized blocks would
mean re-quantizing them.
"""
from __future__ import annotations

from kvplay.cache.evict import Policy, attention_weights, register


class TOVA(Policy):
    name = "tova"
    title = "TOVA"
    paper = "Oren et al., 2024, Transformers are Multi-State RNNs (arXiv:2401.06104)"
    needs_queries = True
    during_decode = True
    how = "scored by the newest token's attention"

    def scores(self, keys, query, scaling):
        return attention_weights(keys, query[:, :, -1:], scaling)[:, :, 0]      # (B, Hkv, T)


POLICY = register(TOVA())

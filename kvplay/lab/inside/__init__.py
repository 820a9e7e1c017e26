"""Inside the model: why a cache breaks, and whether it still finds a fact in a long context.

    scan = outlier_scan(model, tok)                          # key/value channel statistics per layer x head
    scan.verdict                                              # plain words, naming the schemes at risk
    grid = needle_run(model, tok, ["kvplay-int4"], quick=True)   # passkey retrieval, baseline first
    errs = head_errors(model, ids, "kvplay-int2")             # relative K/V error per layer x KV head
    shift = attention_shift(model, tok, prompt, "kvplay-int2", step=8, layer=3, head=0)
    kept = kept_run(model, tok, ["baseline:evict=snapkv,keep=0.25"])   # which positions eviction kept, per layer

One module per analysis (outliers, needle, errors, kept); the results are in kvplay.results.inside, the commands in
kvplay.app.inside, the figures in kvplay.show.inside.
"""
from kvplay.lab.inside.errors import attention_shift, head_errors
from kvplay.lab.inside.kept import kept_run, kept_shares
from kvplay.lab.inside.needle import (
    FULL_DEPTHS,
    NEW_TOKENS,
    QUESTION,
    QUICK_DEPTHS,
    QUICK_LENGTHS,
    NeedlePrompt,
    answer_correct,
    ask,
    full_lengths,
    needle_limit,
    needle_prompt,
    needle_run,
)
from kvplay.lab.inside.outliers import (
    OUTLIER_DEFINITION,
    OUTLIER_FACTOR,
    SCAN_TOKENS,
    capture_kv,
    channel_stats,
    head_stats,
    key_grouping,
    kurtosis,
    max_bits_at_risk,
    outlier_scan,
    scan_tokens,
    scheme_risk,
    verdict_text,
)

__all__ = ["attention_shift", "head_errors", "kept_run", "kept_shares",
           "FULL_DEPTHS", "NEW_TOKENS", "QUESTION", "QUICK_DEPTHS", "QUICK_LENGTHS",
           "NeedlePrompt", "answer_correct", "ask", "full_lengths", "needle_prompt", "needle_limit", "needle_run",
           "OUTLIER_DEFINITION", "OUTLIER_FACTOR", "SCAN_TOKENS", "capture_kv", "channel_stats", "head_stats",
           "key_grouping", "kurtosis", "max_bits_at_risk", "outlier_scan", "scan_tokens", "scheme_risk",
           "verdict_text"]

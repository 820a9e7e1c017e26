"""A model's profile for its KV cache, measured: the shape of its attention (from its config, through the same
Arch every byte formula uses) and, from one 16-bit pass over the held-out play, the layers whose keys carry outlier
channels (the Inside tab's outlier scan, summarised per layer), and the layers whose 4-bit keys move much of their
attention (kvplay.cache.outliers: the ones kvplay's adapting presets store at 8 bits). It is what a user bringing
a model kvplay has not seen needs before choosing a cache: per-token key groups suffer where a few channels are far
larger than the rest (quanto-int4 on Qwen2.5: +69% perplexity), and every cache keeps sliding layers in 16-bit.
"""
from __future__ import annotations

from kvplay.cache import key_outliers
from kvplay.cache.arch import Arch
from kvplay.lab.inside.outliers import OUTLIER_FACTOR, capture_kv, channel_stats, scan_tokens
from kvplay.results.profile import ModelProfile

PROFILE_TOKENS = 256          # one pass over this many tokens of the play: under a second for a 0.5B model on CPU


def model_profile(model, tokenizer, *, model_name: str = "", tokens: int = PROFILE_TOKENS,
                  factor: float = OUTLIER_FACTOR) -> ModelProfile:
    """The profile of a loaded model: its attention's shape and, per layer, its largest key channel over the median
    one (the worst KV head), from one 16-bit prefill of `tokens` tokens."""
    config = model.config.get_text_config(decoder=True)
    arch = Arch.from_config(model.config)
    ids = scan_tokens(tokenizer, tokens)
    ratios = [max(channel_stats(keys[h], factor)[0] for h in range(keys.shape[0]))
              for keys, _ in capture_kv(model, ids)]
    shifts = key_outliers(model, tokenizer) or []
    return ModelProfile(model=model_name or arch.name, family=config.model_type,
                        layers=config.num_hidden_layers, full_layers=arch.layers, sliding_layers=arch.sliding_layers,
                        sliding_window=arch.sliding_window, query_heads=config.num_attention_heads,
                        kv_heads=arch.kv_heads, head_dim=arch.head_dim, context=arch.context,
                        tokens=int(ids.shape[1]), factor=factor, key_ratio=[round(r, 1) for r in ratios],
                        outlier_layers=[i for i, r in enumerate(ratios) if r > factor],
                        key_shift=[[x.layer, round(x.shift, 3), round(x.shift8, 3)] for x in shifts])

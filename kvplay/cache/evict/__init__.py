"""Eviction: a cache that keeps only some of the prompt's tokens, the other lever beside fewer bits.

    parse_spec("baseline:evict=snapkv,keep=0.25")        # 16-bit, a quarter of the prompt's tokens
    parse_spec("kvplay-int4:evict=snapkv,keep=0.5")      # 4-bit, half of them: both levers at once

A policy is one small class with one hook, after kvpress's presses (NVIDIA/kvpress, Apache-2.0): scores()
ranks the prompt's tokens per KV head, and the cache keeps the `keep` share that scores highest. Each
policy is one module here that states its paper, and ends with register(...):

    streamingllm.py  StreamingLLM (Xiao et al., 2023): the first 4 tokens and the most recent ones
    snapkv.py        SnapKV (Li et al., 2024): scored once, by the attention of the prompt's last 32 tokens
    tova.py          TOVA (Oren et al., 2024): scored by the newest token's attention, evicting on every decode
                     step as well, so the cache never holds more than its budget

When: the prompt (a cache's first update of more than one token) is stored whole, attention runs over all
of it, as in a prefill without eviction, and then the cache keeps its budget: round(keep x prompt tokens)
per layer and KV head, ranked per head. A policy scored by attention reads the queries in kvplay's attention
implementation (attention.py), which runs every function the returned keys carry in `kvplay_after`
(AFTER) with that layer's queries; the model must therefore be loaded with attn_implementation="kvplay"
(as kvplay loads every model), and check_model refuses any other. Tokens generated afterwards are appended,
except under TOVA, which evicts one per step.

Positions go on: a cache that keeps 512 of 2,048 tokens still reports 2,048 tokens seen, so the next token
gets position 2,048 (get_seq_length), while the attention mask covers the 512 kept plus the new ones
(get_mask_sizes). Bytes count only what is stored, so bits per element (stored bytes over the tokens seen
times the elements per token) read 4.0 for a 16-bit cache keeping a quarter.

Only full-attention layers evict; sliding-window layers (Gemma 3's) are bounded by their window already.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
from typing import ClassVar

import torch

from kvplay.cache import attention
from kvplay.cache.attention import AFTER
from kvplay.errors import KvplayError

NONE = "none"


class Policy:
    """An eviction policy: which tokens of the prompt a cache keeps."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""                # as the paper names it: "SnapKV"
    paper: ClassVar[str] = ""                # authors, year, title and link
    needs_queries: ClassVar[bool] = False    # scored by attention: needs kvplay's attention implementation
    during_decode: ClassVar[bool] = False    # evicts on every decode step too (holds the budget)
    how: ClassVar[str] = ""                  # how it scores, for a card: "scored by the last 32 prompt tokens"

    def scores(self, keys: torch.Tensor, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """keys (B, Hkv, T, D), query (B, Hq, q, D) or None -> (B, Hkv, T) float: the higher, the more worth keeping."""
        raise NotImplementedError


POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    if not policy.name or policy.name in POLICIES or policy.name == NONE:
        raise ValueError(f"An eviction policy needs a new name; {policy.name!r} is taken or empty.")
    POLICIES[policy.name] = policy
    return policy


def policy_of(spec) -> Policy | None:
    """The spec's eviction policy, None when it keeps every token."""
    name = getattr(spec.options, "evict", NONE)
    return None if name in (None, NONE) else POLICIES[name]


def budget(keep: float, tokens: int) -> int:
    """Tokens a layer keeps of a `tokens`-token prompt: round(keep x tokens), at least 1."""
    return max(1, min(tokens, math.floor(keep * tokens + 0.5)))


def stored_tokens(spec, tokens: int, prefill: int | None = None) -> int:
    """Tokens a layer of this spec holds after `tokens` seen, `prefill` of them the prompt (None: all): what the
    byte formulas count."""
    policy = policy_of(spec)
    if policy is None:
        return tokens
    prompt = tokens if prefill is None else min(prefill, tokens)
    kept = budget(spec.options.keep, prompt) if prompt > 1 else prompt
    return kept if policy.during_decode else kept + tokens - prompt


def policy_words(policy: Policy) -> str:
    """A policy and how it scores, for a card: "SnapKV, scored by the last 32 prompt tokens"."""
    return f"{policy.title}, {policy.how}" + ("; evicts on each new token too" if policy.during_decode else "")


def kept_sentence(keep: float, how: str, prompt_tokens: int) -> str:
    """ "keeps 512 of 2,048 prompt tokens (how)": what a cache keeping `keep` holds of a prompt."""
    kept = budget(keep, prompt_tokens) if prompt_tokens > 1 else prompt_tokens
    return f"keeps {kept:,} of {prompt_tokens:,} prompt tokens ({how})"


def kept_words(spec, prompt_tokens: int) -> str:
    """What the cache keeps, in words: "keeps 512 of 2,048 prompt tokens (SnapKV, scored by the last 32 prompt
    tokens)"; "" without eviction."""
    policy = policy_of(spec)
    return "" if policy is None else kept_sentence(spec.options.keep, policy_words(policy), prompt_tokens)


def keep_top(scores: torch.Tensor, kept: int) -> torch.Tensor:
    """scores (B, Hkv, T) -> the indices (B, Hkv, kept) of the `kept` highest per head, in token order."""
    return scores.topk(kept, dim=-1).indices.sort(dim=-1).values


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D), index (B, H, k) -> (B, H, k, D): each head's own tokens."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def attention_weights(keys: torch.Tensor, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of the last q queries over all T keys, causal among themselves: query (B, Hq, q, D),
    keys (B, Hkv, T, D) -> (B, Hkv, q, T), averaged over each KV head's group of query heads (float32)."""
    b, hkv, t, d = keys.shape
    hq, q = query.shape[1], query.shape[2]
    group = hq // hkv
    k = keys.float().repeat_interleave(group, dim=1)                       # (B, Hq, T, D)
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling    # (B, Hq, q, T)
    future = torch.ones(q, q, dtype=torch.bool, device=keys.device).triu(1)
    logits[..., t - q:] = logits[..., t - q:].masked_fill(future, -math.inf)
    return logits.softmax(dim=-1).unflatten(1, (hkv, group)).mean(dim=2)


def unscored(spec) -> KvplayError:
    """The error of a cache whose prompt no attention scored: the model does not run kvplay's attention."""
    return KvplayError(f"{spec}: the prompt was never scored for eviction; the model must run kvplay's attention "
                       "implementation (attn_implementation='kvplay').")


def hooked(keys: torch.Tensor, after) -> torch.Tensor:
    """A view of keys (same values) that carries `after` for kvplay's attention to call with the queries."""
    view = keys.view_as(keys)
    setattr(view, AFTER, list(getattr(keys, AFTER, ())) + [after])
    return view


def check_model(spec, config, *, decode_ok: bool, where: str = "") -> None:
    """Refuse what eviction cannot do here: keep without evict, a policy scored by attention on a model that does
    not run kvplay's attention implementation, a policy that evicts during decode where the cache cannot."""
    policy = policy_of(spec)
    if policy is None:
        if spec.options.keep != 1.0:
            raise KvplayError(f"{spec}: keep applies with an eviction policy; add evict="
                              f"{' or evict='.join(POLICIES)}.")
        return
    loaded = getattr(config.get_text_config(decoder=True), "_attn_implementation", None)   # None: a shape only
    if loaded is not None and not attention.model_uses_it(config.get_text_config(decoder=True)):
        raise KvplayError(f"{spec}: eviction runs in kvplay's attention implementation, and this model was loaded "
                          f"with {config.get_text_config(decoder=True)._attn_implementation!r}; load it with "
                          "attn_implementation='kvplay', as kvplay's own loader does.")
    if policy.during_decode and not decode_ok:
        raise KvplayError(f"{spec}: {policy.title} evicts on every decode step, which {where} cannot do; use "
                          f"{' or '.join(p for p, pol in POLICIES.items() if not pol.during_decode)}.")


def describe(spec, layers: int) -> str:
    """For a cache's description: which policy, how much, where."""
    policy = policy_of(spec)
    if policy is None:
        return ""
    return (f"; keeps {spec.options.keep:.0%} of the prompt's tokens in each of its {layers} full-attention layers "
            f"({policy.title}, {policy.how})")


EVICT_HELP = ("which tokens of the prompt to keep: none keeps all; streamingllm the first 4 and the newest; snapkv "
               "those the prompt's last 32 tokens attend to most; tova those the newest token attends to most, "
               "evicting on every step (the 16-bit baseline only). Judged on tasks whose question ends the prompt "
               "(python -m kvplay tasks)")
KEEP_HELP = "the share of the prompt's tokens each layer keeps, per KV head (with an eviction policy)"


def _discover() -> None:
    """Import every module of this package, by name: each that calls register(...) adds its policy (found, not
    listed, as the cache methods are)."""
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{module.name}")


_discover()
EVICT = (NONE, *POLICIES)       # the `evict` option's choices

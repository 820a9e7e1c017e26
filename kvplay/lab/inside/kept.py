"""What eviction kept: for one prompt with a pass code hidden in filler, which positions each evicting cache kept in
each layer (the share of KV heads keeping each position), where the pass code sits, and whether it was found."""
from __future__ import annotations

import torch

from kvplay.cache import build_cache, check_specs
from kvplay.cache.evict import kept_words, policy_of
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate
from kvplay.lab.inside.needle import NEW_TOKENS, answer_correct, needle_prompt
from kvplay.lab.progress import Progress, no_progress
from kvplay.results import KeptCache, KeptResult


def kept_shares(cache, tokens: int) -> tuple[list[int], list[list[float]]]:
    """(the layers that evict, per such layer the share of its KV heads that kept each of the prompt's positions)."""
    layers, shares = [], []
    for i, layer in enumerate(cache.layers):
        index = getattr(layer, "kept_index", None)          # (B, H, kept), set once the prompt is scored
        if index is None:
            continue
        heads = index.shape[1]
        share = torch.zeros(tokens)
        share.index_add_(0, index[0].flatten().cpu(), torch.full((index[0].numel(),), 1.0 / heads))
        layers.append(i)
        shares.append([round(float(v), 3) for v in share])
    return layers, shares


def kept_run(model, tokenizer, specs, *, tokens: int = 1024, depth: float = 0.5, seed: int = 0, chat: bool = True,
             model_name: str = "", progress: Progress | None = None) -> KeptResult:
    """Each evicting cache in `specs` reads one pass-code prompt of about `tokens` tokens: what it kept, and its
    answer."""
    progress = progress or no_progress
    specs = [s for s in check_specs(specs, model.config) if policy_of(s) is not None]
    if not specs:
        raise KvplayError("Pick at least one cache that evicts tokens, such as baseline:evict=snapkv,keep=0.25.")
    p = needle_prompt(tokenizer, tokens, depth, seed=seed, chat=chat)
    ids = torch.tensor([p.ids], device=model.device)
    out = []
    for i, spec in enumerate(specs):
        progress(i / len(specs), f"{spec}: reading {len(p.ids):,} tokens")
        cache = build_cache(spec, model)           # the prompt, then the answer: what it kept is what it answered from
        trace = generate(model, ids, cache, NEW_TOKENS, keep_logits=False, stop_token=tokenizer.eos_token_id)
        answer = tokenizer.decode(trace.tokens[0], skip_special_tokens=True)
        layers, shares = kept_shares(cache, len(p.ids))
        out.append(KeptCache(spec=str(spec), kept=kept_words(spec, len(p.ids)), layers=layers, shares=shares,
                             answer=answer.strip(), found=answer_correct(answer, p.passkey)))
    progress(1.0, "done")
    return KeptResult(model=model_name, tokens=len(p.ids), depth=depth, seed=seed, passkey=p.passkey,
                      needle=[p.needle_token, p.needle_end], question_start=p.filler_end, caches=out)

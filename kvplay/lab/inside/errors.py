"""Error where it happens: each layer and KV head's key and value reconstruction error, and how one generated
token's attention over the context moves between the 16-bit cache and a quantized one.

Attention weights come from transformers' own output_attentions option with the eager attention implementation.
"""
from __future__ import annotations

import torch

from kvplay.cache import CacheSpec, build_cache, dequantized_kv, parse_spec
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate, prefill
from kvplay.results import AttentionShift, HeadErrors


def _rel(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error per head: (B, H, T, D) pairs -> (H,)."""
    exact = exact.float()
    return (approx.float() - exact).pow(2).sum((0, 2, 3)).sqrt() / exact.pow(2).sum((0, 2, 3)).sqrt().clamp(min=1e-12)


@torch.inference_mode()
def head_errors(model, ids: torch.Tensor, spec: CacheSpec | str) -> HeadErrors:
    """Relative key and value reconstruction error per layer and KV head, for token ids (1, T).

    As quality.layer_errors, per head: one prefill fills the exact cache and one the spec's;
    each method's dequantized_kv reads back what attention gets.
    """
    spec = parse_spec(spec)
    ids = ids.to(model.device)
    exact, stored = build_cache(CacheSpec("baseline"), model), build_cache(spec, model)
    mask = torch.ones_like(ids)
    prefill(model, ids, mask, exact)
    prefill(model, ids, mask, stored)
    keys, values = [], []
    for ref, layer in zip(exact.layers, stored.layers):
        k, v = dequantized_kv(layer)
        keys.append([float(e) for e in _rel(k, ref.keys)])
        values.append([float(e) for e in _rel(v, ref.values)])
    return HeadErrors(spec=str(spec), key_error=keys, value_error=values)


@torch.inference_mode()
def _attention_row(model, history: torch.Tensor, query: torch.Tensor, spec: CacheSpec, layer: int, head: int):
    """Attention of `query` (1, 1) over history (1, T) plus itself, through spec's cache: (T + 1,) float32."""
    cache = build_cache(spec, model)
    mask = torch.ones_like(history)
    prefill(model, history, mask, cache)
    mask = torch.ones(1, history.shape[1] + 1, dtype=torch.long, device=history.device)
    out = model(input_ids=query, attention_mask=mask, position_ids=torch.tensor([[history.shape[1]]],
                device=history.device), past_key_values=cache, use_cache=True, output_attentions=True)
    return out.attentions[layer][0, head, -1].float().cpu()


def attention_shift(model, tokenizer, ids: list[int], spec: CacheSpec | str, *, step: int, layer: int, head: int,
                    new_tokens: int = 32) -> AttentionShift:
    """For generated token `step` (>= 1; token 0 is predicted inside the prefill, in full precision), the
    16-bit attention weights of layer/head over the context, and the same query's through spec's cache.

    The history is the prompt plus the 16-bit run's tokens before the query (teacher forcing), so both
    rows attend over the same tokens. Weights come from output_attentions with eager attention, set for
    this call and restored after.
    """
    spec = parse_spec(spec)
    cfg = model.config.get_text_config(decoder=True)
    if not 0 <= layer < cfg.num_hidden_layers:
        raise KvplayError(f"The layer must be between 0 and {cfg.num_hidden_layers - 1}, got {layer}.")
    if not 0 <= head < cfg.num_attention_heads:
        raise KvplayError(f"The head must be between 0 and {cfg.num_attention_heads - 1}, got {head}.")
    x = torch.tensor([ids], device=model.device)
    base = generate(model, x, build_cache(CacheSpec("baseline"), model), new_tokens, keep_logits=False)
    generated = base.tokens[0]
    if not 1 <= step < generated.shape[0]:
        raise KvplayError(f"The token must be between 1 and {generated.shape[0] - 1} (token 0 is predicted in the "
                          f"prefill, where every cache is still exact), got {step}.")
    seq = torch.cat([x[0], generated[:step]])[None]                   # (1, P + step): history + query
    history, query = seq[:, :-1], seq[:, -1:]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        rows = [_attention_row(model, history, query, s, layer, head) for s in (CacheSpec("baseline"), spec)]
    finally:
        model.set_attn_implementation(previous)
    pieces = [tokenizer.decode([t]) for t in seq[0].tolist()]
    return AttentionShift(spec=str(spec), step=step, token=tokenizer.decode([int(generated[step])]), layer=layer,
                          head=head, context_tokens=int(seq.shape[1]), baseline=rows[0].tolist(),
                          quantized=rows[1].tolist(), sink=int(getattr(spec.options, "sink", 0) or 0),
                          window=int(getattr(spec.options, "residual", 0) or 0) if spec.is_quantized else seq.shape[1],
                          tokens=pieces)

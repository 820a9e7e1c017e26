"""What tests/test_attention.py (kvplay's engine) and tests/test_llamacpp_fused.py (llama.cpp's types) share: one
fused cache layer's decode step set against transformers' sdpa, each of attend.c's code paths in turn, and the tiny
GQA models, fused and plain, run teacher-forced."""
import pytest
import torch
from conftest import tiny_llama

from kvplay.cache import attention, build_cache
from kvplay.lab.generate import generate

needs_kernel = pytest.mark.skipif(not attention.available(), reason="no C compiler for kvplay's kernels")


class SdpaModule(torch.nn.Module):
    """The attention module's attributes transformers' sdpa_attention_forward reads."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def decode_step(layer, cached: int, batch: int, kv_heads: int, groups: int, head_dim: int, gen: torch.Generator):
    """A fused `layer` holding `cached` random tokens, after one decode update: (view, query, mask, module); rows
    after the first are left-padded."""
    def kv(n):
        return torch.randn(batch, kv_heads, n, head_dim, generator=gen).bfloat16()
    layer.update(kv(cached), kv(cached))
    keys, _ = layer.update(kv(1), kv(1))
    query = torch.randn(batch, kv_heads * groups, 1, head_dim, generator=gen).bfloat16()
    mask = torch.ones(batch, 1, 1, cached + 1, dtype=torch.bool)
    mask[1:, ..., :cached // 3] = False
    return keys.kvplay_view, query, mask if batch > 1 else None, SdpaModule(groups)


def pin_isa(request, monkeypatch, probe) -> str:
    """The `isa` fixtures' body: pin attend.c's code path request.param (portable C, AVX2, AVX-512), skipping a
    path this CPU lacks; probe() gives a (view, query) to try it on."""
    monkeypatch.setattr(attention, "ISA", request.param)
    view, query = probe()
    if view.attend(query, None, 0.125) is None:
        pytest.skip(f"this CPU has no {request.param} path")
    return request.param


def tiny_gqa_models():
    """A tiny GQA Llama (6 query heads, 2 KV heads, head_dim 64) with kvplay's attention, and the same with sdpa."""
    fused = tiny_llama(head_dim=64, num_attention_heads=6, num_key_value_heads=2, hidden_size=192)
    fused.set_attn_implementation("kvplay")
    plain = tiny_llama(head_dim=64, num_attention_heads=6, num_key_value_heads=2, hidden_size=192)
    return fused, plain


def teacher_forced(model, spec):
    """(cache, logits) of 200 prompt tokens in a batch of 2 (row 1 left-padded by 37) and 40 forced tokens, which
    cross a block flush at kvplay's residual of 124; the same seeded inputs every call."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (2, 200), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    forced = torch.randint(3, 96, (2, 40), generator=gen)
    cache = build_cache(spec, model)
    return cache, torch.stack(generate(model, ids, cache, 0, forced=forced, mask=mask).logits)

"""baseline:store=prealloc, the fastest 16-bit path: the same tokens in preallocated buffers (PreallocLayer).

Pinned to transformers' DynamicLayer (baseline, store=dynamic) on the bundled model: greedy tokens and every
step's logits, at batch 1 and in a left-padded batch of 3, with sdpa and with kvplay's fused kernel, while the
buffers grow past their first capacity; bytes in use and allocated; crop, the batch operations, reset and a
shared prefill in lockstep. Measured on this machine: every logit compared here was bit-identical (largest
difference 0.0), so the checks are exact.
"""
import pytest
import torch
from transformers.cache_utils import DynamicLayer

from kvplay.cache import analytic_nbytes, attention, build_cache, cache_nbytes, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.methods.dynamic import FusedDynamicLayer, PreallocLayer
from kvplay.lab.generate import Row, Sampler, decode_one_token, generate, lockstep, prefill

NEW = 40
TEXTS = ["ROMEO: But soft, what light", "JULIET:", "First Citizen: Before we proceed any further, hear me speak."]
needs_kernel = pytest.mark.skipif(not attention.available(), reason="no C compiler for kvplay's kernels")


@pytest.fixture(scope="module")
def batch(bundled):
    """Three prompts, left-padded to 16 tokens (6 and 12 pads in the first two rows): ids and mask (3, 16)."""
    enc = bundled[1](TEXTS, return_tensors="pt", padding=True, padding_side="left")
    assert enc.attention_mask.sum(-1).tolist() == [10, 4, 16]        # the padding really is there
    return enc.input_ids, enc.attention_mask


def _counted_attend(monkeypatch) -> list:
    """Count the fused kernel's calls (DecodeView.attend), keeping what it does."""
    calls, attend = [], attention.DecodeView.attend

    def counted(self, *args, **kwargs):
        calls.append(self.window_k.shape[-2])
        return attend(self, *args, **kwargs)
    monkeypatch.setattr(attention.DecodeView, "attend", counted)
    return calls


@pytest.mark.parametrize("rows", [1, 3], ids=["batch1", "left-padded-batch3"])
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("fused", marks=needs_kernel)])
def test_greedy_tokens_and_logits_equal_dynamic_caches_while_the_buffers_grow(bundled, batch, monkeypatch, rows,
                                                                               attn):
    model, _ = bundled
    ids, mask = batch[0][:rows], batch[1][:rows]
    if rows == 1:                                         # row 0 without its padding
        ids, mask = ids[:, 6:], None
    options = "" if attn == "sdpa" else ":attention=fused"
    reference = generate(model, ids, build_cache("baseline" + options, model), NEW, mask=mask)
    monkeypatch.setattr(PreallocLayer, "spare_tokens", 4)     # a few tokens of spare: it grows every few steps
    cache = build_cache("baseline:store=prealloc" + options.replace(":", ","), model)
    calls = _counted_attend(monkeypatch)
    capacity = []
    trace = generate(model, ids, cache, NEW, mask=mask,
                     on_step=lambda i, n: capacity.append(cache.layers[0].buffer_k.shape[-2]))
    assert all(type(layer) is PreallocLayer and layer.fused == (attn == "fused") for layer in cache.layers)
    assert torch.equal(trace.tokens, reference.tokens)
    assert all(torch.equal(a, b) for a, b in zip(trace.logits, reference.logits))
    prompt = ids.shape[1]
    assert cache.get_seq_length() == prompt + NEW - 1 > capacity[0] >= prompt + 4    # past the first capacity
    assert len(set(capacity)) >= 5                                                 # and grew again and again
    layers = model.config.num_hidden_layers
    assert len(calls) == (layers * (NEW - 1) if attn == "fused" else 0)            # decode steps only


def test_bytes_in_use_equal_dynamic_and_allocated_counts_the_buffers(bundled, batch):
    model, _ = bundled
    ids, mask = batch
    arch = Arch.from_config(model.config)
    dynamic, prealloc = build_cache("baseline", model), build_cache("baseline:store=prealloc", model)
    for cache in (dynamic, prealloc):
        prefill(model, ids, mask, cache)
        step_mask = torch.cat([mask, mask.new_ones(3, 1)], dim=-1)
        decode_one_token(model, ids[:, -1:], step_mask, cache)
    used, held = cache_nbytes(prealloc), cache_nbytes(dynamic)
    assert used == held == analytic_nbytes("baseline", arch, 17, batch=3)
    assert held.allocated is None                                # DynamicLayer concatenates to size
    # 16 prompt tokens and one step fit in the first buffers: 16 + 256 spare tokens of K and V, 2 bytes each
    row = 2 * arch.layers * 3 * arch.kv_heads * arch.head_dim * 2
    assert used.allocated == row * (16 + 256) and used.total == row * 17
    assert used.allocated == sum(layer.buffer_k.untyped_storage().nbytes() * 2 for layer in prealloc.layers)


def test_crop_drops_the_last_tokens_as_dynamic_layers_do_and_their_places_are_reused(bundled, batch):
    """Against a cropped DynamicCache (a fresh 13-token prefill is no reference: its keys from layer 1 on differ
    in the last bit from a 16-token prefill's, measured up to 0.0625 in the next logits, for DynamicCache too)."""
    model, _ = bundled
    ids = batch[0][2:]                                           # (1, 16), no padding
    cropped, upstream = build_cache("baseline:store=prealloc", model), build_cache("baseline", model)
    for cache in (cropped, upstream):
        prefill(model, ids, torch.ones(1, 16, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="positive value"):      # upstream's legacy form, refused as upstream does
        cropped.crop(5)
    cropped.crop(-3)
    upstream.crop(-3)
    cropped.crop(0)                                              # a no-op, as upstream
    assert cropped.get_seq_length() == upstream.get_seq_length() == 13
    layer = cropped.layers[0]
    for step in range(13, 16):                                   # the next tokens go where the cropped ones were
        mask = torch.ones(1, step + 1, dtype=torch.long)
        after = [decode_one_token(model, ids[:, step:step + 1], mask, c) for c in (cropped, upstream)]
        assert torch.equal(after[0], after[1])
    assert torch.equal(layer.keys, upstream.layers[0].keys) and layer.buffer_k.shape[-2] == 16 + 256
    cropped.reset()
    assert cropped.get_seq_length() == 0 and layer.buffer_k is None and cache_nbytes(cropped).allocated_bytes == 0


def test_batch_operations_move_the_buffers_as_dynamic_layers_move_their_tensors(bundled, batch):
    model, _ = bundled
    ids, mask = batch
    caches = [build_cache(s, model) for s in ("baseline", "baseline:store=prealloc")]
    for cache in caches:
        prefill(model, ids, mask, cache)
        cache.reorder_cache(torch.tensor([2, 0, 1]))
        cache.batch_select_indices(torch.tensor([0, 2]))
        cache.batch_repeat_interleave(2)                         # rows 2, 2, 1, 1 of the batch
    dynamic, prealloc = caches
    assert prealloc.layers[0].buffer_k.shape[0] == 4
    for a, b in zip(dynamic.layers, prealloc.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    rows = torch.tensor([2, 2, 1, 1])
    step_mask = torch.cat([mask[rows], mask.new_ones(4, 1)], dim=-1)
    out = [decode_one_token(model, ids[rows, -1:], step_mask, cache) for cache in caches]
    assert torch.equal(out[0], out[1])                           # the next step writes into the moved buffers


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_kernel)], ids=["sdpa", "fused"])
def test_it_shares_a_16_bit_prefill_in_lockstep(bundled, batch, fused):
    """shares_prefill: its prefill hands attention the 16-bit keys and values it was given (RowGroups checks
    each layer), and the shared run gives the tokens and logits of a run of its own."""
    model, _ = bundled
    ids = batch[0][2:]
    spec = parse_spec("baseline:store=prealloc" + (",attention=fused" if fused else ""))
    assert spec.method.shares_prefill
    rows = [Row(build_cache("baseline", model), Sampler(), name="baseline"),
            Row(build_cache(spec, model), Sampler(), name=str(spec))]
    for _ in lockstep(model, ids, rows, 8):
        pass
    alone = generate(model, ids, build_cache(spec, model), 8)
    assert torch.equal(torch.cat(rows[1].tokens, dim=1), alone.tokens)
    assert all(torch.equal(a, b) for a, b in zip(rows[1].logits, alone.logits))


def test_the_option_builds_the_layer_it_names(bundled):
    model, _ = bundled
    kinds = {s: {type(layer) for layer in build_cache(s, model).layers}
             for s in ("baseline", "baseline:attention=fused", "baseline:store=prealloc")}
    assert kinds == {"baseline": {DynamicLayer}, "baseline:attention=fused": {FusedDynamicLayer},
                     "baseline:store=prealloc": {PreallocLayer}}
    assert str(parse_spec("baseline:attention=fused,store=prealloc")) == "baseline:store=prealloc,attention=fused"
    assert "preallocated" in build_cache("baseline:store=prealloc", model).description


def test_the_kernel_reads_a_buffer_view_in_place_and_copies_anything_else():
    buffer = torch.zeros(2, 3, 40, 8, dtype=torch.bfloat16)
    view = buffer[:, :, :25]                                     # rows of D contiguous per (b, h)
    assert attention._rows(view) is view
    transposed = torch.zeros(2, 25, 3, 8).transpose(1, 2)        # rows 3 * 8 apart: attend.c cannot read it
    copy = attention._rows(transposed)
    assert copy is not transposed and copy.is_contiguous() and torch.equal(copy, transposed)

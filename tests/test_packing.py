"""Prepacked linear weights (kvplay.app.packing): the same products bit for bit, still an nn.Linear for every
path that needs one (weight quantization, copies), and on by default for CPU models; on CPUs without bfloat16
arithmetic, float32 products for long inputs."""
import copy

import pytest
import torch
from torch import nn

from kvplay.app import models
from kvplay.app.models import load_model, quantize_weights
from kvplay.app.packing import PACKED_ROWS, PackedLinear, pack_linears
from kvplay.app.settings import Settings
from kvplay.cache import build_cache
from tests.conftest import tiny_llama

needs_packing = pytest.mark.skipif(PackedLinear.of(nn.Linear(8, 8).to(torch.bfloat16)) is None,
                                reason="this torch build has no oneDNN weight packing")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (576, 192), (576, 49152), (64, 96)])
def test_packed_linear_equals_nn_linear_bit_for_bit(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.of(linear)
    assert packed.weight is linear.weight                              # shared, not copied
    with torch.no_grad():
        for rows in (1, 3, 9, 16, PACKED_ROWS, 64, 257):               # decode, lockstep, then nn.Linear's own path
            x = torch.randn(rows, shape[0]).to(torch.bfloat16)
            assert torch.equal(packed(x), linear(x)), rows
            x3 = torch.randn(2, max(1, rows // 2), shape[0]).to(torch.bfloat16)   # (B, T, in), as the model calls it
            assert torch.equal(packed(x3), linear(x3)), rows


@needs_packing
def test_the_packed_path_is_taken_for_few_rows_only():
    """Above PACKED_ROWS oneDNN's inner product may round differently from nn.Linear (seen at 64 and 257 rows on
    576 -> 1536: 7 and 29 elements one bfloat16 step apart), which is why those rows keep nn.Linear's path."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packed = PackedLinear.of(linear)
    packed.packed = PackedLinear.of(nn.Linear(576, 1536, bias=False).to(torch.bfloat16)).packed   # another weight
    few, many = torch.randn(PACKED_ROWS, 576).bfloat16(), torch.randn(PACKED_ROWS + 1, 576).bfloat16()
    with torch.no_grad():
        assert not torch.equal(packed(few), linear(few))               # the packed weight answered
        assert torch.equal(packed(many), linear(many))                 # the dense weight answered


def _logits(model, ids, spec="baseline", steps=4):
    """Prefill then `steps` greedy decode steps through a fresh cache: every step's logits, (steps + 1, B, V)."""
    cache, out = build_cache(spec, model), []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


@needs_packing
@pytest.mark.parametrize("spec", ["baseline", "kvplay-int2"])
def test_a_packed_model_computes_the_same_logits(spec):
    plain, packed = tiny_llama(), tiny_llama(tie_word_embeddings=False)
    packed.load_state_dict(plain.state_dict())
    assert pack_linears(packed) == 2 * 7 + 1                        # q, k, v, o, gate, up, down per layer; the head
    assert not any(type(m) is nn.Linear for m in packed.modules())
    ids = torch.randint(3, 96, (3, 40))
    assert torch.equal(_logits(plain, ids, spec), _logits(packed, ids, spec))


@needs_packing
def test_tied_weights_stay_tied_and_only_bfloat16_cpu_linears_are_packed():
    model = tiny_llama(tie_word_embeddings=True)
    pack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert pack_linears(tiny_llama().float()) == 0


@needs_packing
def test_deepcopy_and_weight_quantization_of_a_packed_model():
    plain, packed = tiny_llama(), tiny_llama()
    pack_linears(packed)
    ids = torch.randint(3, 96, (1, 12))
    twin = copy.deepcopy(packed)
    assert twin.model.layers[0].mlp.up_proj.packed is not packed.model.layers[0].mlp.up_proj.packed
    assert torch.equal(_logits(twin, ids), _logits(plain, ids))
    quantized = quantize_weights(packed, "int8")                       # quanto swaps the nn.Linear modules on a copy
    assert quantized.model.layers[0].mlp.up_proj.weight_qtype.name == "qint8"
    assert not isinstance(quantized.model.layers[0].mlp.up_proj, PackedLinear)   # quanto's own module now
    assert any(isinstance(m, PackedLinear) for m in packed.modules())  # the original stays packed
    assert torch.isfinite(_logits(quantized, ids, steps=1)).all()


@needs_packing
def test_load_model_packs_on_the_cpu_unless_told_not_to(bundled):
    model, _ = bundled                                                 # loaded with the default settings
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    plain, _ = load_model(device="cpu", settings=Settings(pack_weights=False))
    assert plain is not model and not any(isinstance(m, PackedLinear) for m in plain.modules())
    ids = torch.randint(3, 200, (1, 30))          # 30 rows: the packed path (longer inputs may be widened)
    assert torch.equal(_logits(model, ids, "kvplay-int2"), _logits(plain, ids, "kvplay-int2"))


@needs_packing
def test_a_weight_whose_packed_products_differ_stays_unpacked(monkeypatch):
    """Packing checks its products against nn.Linear's on this CPU first: a packed weight that answers differently
    (here another weight's, standing in for kernels that round differently) leaves the layer a plain nn.Linear."""
    from kvplay.app import packing

    other = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    monkeypatch.setattr(packing, "_pack", lambda weight: torch.ops.mkldnn._reorder_linear_weight(other.weight, 1))
    model = nn.Sequential(nn.Linear(64, 96, bias=False).to(torch.bfloat16))
    assert PackedLinear.of(model[0]) is None and pack_linears(model) == 0 and type(model[0]) is nn.Linear


def test_wide_products_are_float32_products_for_long_inputs_only():
    """wide: more than PACKED_ROWS rows multiply in float32 and round once; decode-sized inputs keep the bfloat16
    product (packed where oneDNN packs, else nn.Linear's own). Against a float64 product the float32 one is as
    close as torch's bfloat16 one (mean error 6.55e-4 both on a 2-core AVX2 EPYC; bound 1.02x)."""
    linear = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    wide = PackedLinear.of(linear, wide=True)
    assert wide is not None and wide.weight is linear.weight and "float32 products" in repr(wide)
    few, many = (torch.randn(n, 576, generator=torch.Generator().manual_seed(n)).bfloat16()
                 for n in (PACKED_ROWS, PACKED_ROWS + 1))
    with torch.no_grad():
        assert torch.equal(wide(few), linear(few))
        out = wide(many)
        assert out.dtype == torch.bfloat16
        wanted = nn.functional.linear(many.float(), linear.weight.float(), linear.bias.float()).bfloat16()
        assert torch.equal(out, wanted)
        exact = nn.functional.linear(many.double(), linear.weight.double(), linear.bias.double())
        err = lambda y: (y.double() - exact).abs().mean().item()            # noqa: E731
        assert err(out) <= 1.02 * err(linear(many))
    twin = copy.deepcopy(wide)
    assert twin.wide[0] is not wide.wide[0] and torch.equal(twin.wide[0], wide.wide[0])


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_without_bfloat16_arithmetic_gets_float32_products(monkeypatch, native):
    """pack_if_room widens the linears exactly where the CPU lacks bfloat16 arithmetic (and memory allows)."""
    monkeypatch.setattr(models, "BFLOAT16_ARITHMETIC", native)
    model = tiny_llama(tie_word_embeddings=False)
    ids = torch.randint(3, 96, (2, 40))                                   # 80 rows: the long-input path
    plain = _logits(model, ids, steps=2)
    models.pack_if_room(model)
    wide = [m for m in model.modules() if isinstance(m, PackedLinear) and m.wide is not None]
    assert len(wide) == (0 if native else 2 * 7 + 1)
    logits = _logits(model, ids, steps=2)
    # float32 products rounded to bfloat16 against oneDNN's bfloat16 ones: equal here (measured 2026-12-03, logits
    # up to 0.51); on the same model 4x wider, one bfloat16 step at most (4.9e-3, logits up to 1.2); bound 3x that.
    assert torch.equal(logits, plain) if native else torch.allclose(logits.float(), plain.float(), atol=0.016)

"""KVPlayLayer.crop behaves as transformers' DynamicLayer.crop: negative counts only, exact results."""
import pytest
import torch
from transformers import DynamicCache

from kvplay.cache import build_cache
from kvplay.errors import KvplayError


def _prefill(model, ids, spec):
    cache = build_cache(spec, model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def test_crop_refuses_the_legacy_positive_form_like_upstream(bundled):
    model, tokenizer = bundled
    ids = tokenizer("ROMEO: " * 10, return_tensors="pt").input_ids[:, :20]
    upstream = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=upstream)
    with pytest.raises(ValueError, match="positive value") as theirs:
        upstream.crop(15)
    ours = _prefill(model, ids, "kvplay-int4:residual=32")
    with pytest.raises(ValueError) as mine:
        ours.crop(15)
    assert str(mine.value) == str(theirs.value)
    assert ours.get_seq_length() == 20                        # nothing was cropped


def test_crop_drops_the_last_tokens_exactly(bundled):
    model, tokenizer = bundled
    ids = tokenizer("ROMEO: " * 20, return_tensors="pt").input_ids[:, :40]
    cropped = _prefill(model, ids[:, :40], "kvplay-int4:residual=32")
    fresh = _prefill(model, ids[:, :37], "kvplay-int4:residual=32")
    cropped.crop(-3)
    cropped.crop(0)                                           # a no-op, as upstream
    assert cropped.get_seq_length() == fresh.get_seq_length() == 37
    with torch.no_grad():
        after_crop = model(ids[:, 37:38], past_key_values=cropped).logits
        reference = model(ids[:, 37:38], past_key_values=fresh).logits
    assert torch.equal(after_crop, reference)
    long = _prefill(model, tokenizer("ROMEO: " * 60, return_tensors="pt").input_ids[:, :100],
                    "kvplay-int4:residual=32")
    window = long.layers[0].keys.shape[-2]
    assert window < 100                                       # the rest was quantized
    with pytest.raises(KvplayError, match="full-precision window"):
        long.crop(-(window + 1))
    assert long.get_seq_length() == 100

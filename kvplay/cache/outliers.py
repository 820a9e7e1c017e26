"""Outlier layers: the layers whose keys a 4-bit cache cannot hold, found in one 16-bit pass, once per model.

Some models carry a few key channels tens of times larger than the rest in a layer or two (Qwen2.5's layer 0). At
4 bits those layers' keys move much of their attention to other tokens, and the logits follow; the other layers'
keys barely move theirs. measure() finds them without a backward pass or a forward per layer:

  1. one 16-bit forward over TOKENS tokens of the calibration text (fragile.calibration_ids), in which kvplay's
     attention hands each full-attention layer's queries and keys to a probe (attention.py's kvplay_probe);
  2. for each layer, the share of its attention that moves to other tokens when its keys are read as REFERENCE
     stores them (sensitivity.shift, over QUERIES query positions past the 16-bit window), again with 8-bit scales
     and zeros (kvplay-3bit's and kvplay-2.5bit's), and its largest key channel against the median one (absolute
     maximum over the tokens, per KV head);
  3. an outlier layer is one whose keys move more than SHIFT of its attention, with either scales and zeros.

Shipped for the catalogue (512 tokens, the end of the play), 4-bit keys move this share of each layer's attention:
Qwen2.5-Coder-0.5B's layer 0 0.42, its other 23 layers 0.003-0.027; SmolLM2-135M's 30 layers 0.002-0.034; Gemma 3
270M's 3 global layers 0.026-0.061. The largest key channel does not tell them apart: Qwen2.5's layers 8 and 1 reach
44x and 38x the median channel and move 0.3% and 1.4% (per-channel blocks after a Hadamard rotation hold them),
its layer 0 15x. Layer 0 alone cost Qwen2.5 a mean KL of 0.0106 at 4 bits and 0.0008 at 8 (one layer's keys stored,
over 512 tokens), every other layer 0.0010 or less at 4 bits (docs/results.md, "Presets that adapt to the
model"). So SHIFT sits between: a quarter.

8-bit scales and zeros break a layer of their own. An 8-bit zero is an int8 in eighths of a step, so it reaches 16
steps from a block's minimum, and a key channel far from zero against its spread within a block (a k_proj bias)
clips. Qwen2.5-Coder-1.5B's layer 0 (outside the catalogue) moves 0.007 of its attention with 16-bit scales and 0.39
with 8-bit ones, and kvplay-3bit and kvplay-2.5bit lost +22.6% and +13.4% perplexity there on a held-out text
before this test caught it. No other layer of the four models moves over 0.06 with 8-bit scales, Qwen2.5-0.5B's layer
0 aside (0.71; 0.42 with 16-bit ones: an outlier layer either way).

kvplay's presets that adapt (their `adapt` option, methods/kvplay.py) store the outlier layers' keys at BITS with
META scales and zeros, as many of them as `adapt` more bits per element pays for. What is measured is kept with the
model's fragile-layer rankings (fragile.kept_value: in memory, on disk, and for the catalogue's models in
assets/fragile_rankings.json), and set on the model's text config (arch.KEY_OUTLIERS: the outlier layers, most
first), where Arch.from_config reads it, so every byte count taken from the config counts the outlier layers' keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvplay.cache import attention, fragile, sensitivity
from kvplay.cache.arch import KEY_OUTLIERS, Arch
from kvplay.cache.engine import KVPlayLayer
from kvplay.errors import KvplayError

REFERENCE = "kvplay-int4"    # the storage whose keys are tested: 4 bits per channel in blocks of 64, Hadamard-rotated
TOKENS = 512                 # calibration tokens in the pass (the end of the play)
SHIFT = 0.25                 # an outlier layer's 4-bit keys move more than this share of its attention
BITS, META = 8, "fp16"       # an outlier layer's keys under a preset that adapts: 8-bit codes, float16 scales and
                             # zeros (8-bit ones cannot reach a channel's offset: kvplay-3bit on Qwen2.5's GPL text,
                             # layer 0 at 8 bits with 8-bit scales +7.6% perplexity, with float16 ones +0.31%)
STORE_KEY = f"outliers:tokens={TOKENS},storage={REFERENCE},meta=fp16+8bit,queries={sensitivity.QUERIES}"


@dataclass(frozen=True)
class LayerKeys:
    """One full-attention layer's keys in the pass: the share of its attention its 4-bit keys move (with 16-bit
    scales and zeros, then with 8-bit ones), and its largest key channel's absolute maximum over the median
    channel's."""

    layer: int
    shift: float
    channel: float
    shift8: float = 0.0

    @property
    def moved(self) -> float:
        return max(self.shift, self.shift8)

    @property
    def outlier(self) -> bool:
        return self.moved > SHIFT


def full_attention(config) -> list[int]:
    """The indices of the model's full-attention layers (the ones a KVPlayCache quantizes)."""
    return [i for i, kind in enumerate(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])
            if kind == "full_attention"]


def measure(model, ids: torch.Tensor, reference) -> list[LayerKeys]:
    """Every full-attention layer's LayerKeys over ids (1, T): one 16-bit forward (kvplay attention), keys tested
    as `reference` (REFERENCE's CacheSpec) stores them."""
    config = model.config.get_text_config(decoder=True)
    if not attention.model_uses_it(config):
        raise KvplayError("Finding a model's outlier layers reads its queries and keys through kvplay's attention: "
                          "load the model with attn_implementation='kvplay' (kvplay's own loader does), or use "
                          "adapt=0.")
    layers, found = set(full_attention(config)), {}
    storages = [KVPlayLayer(reference), KVPlayLayer(reference, key_meta="8bit")]
    window = sensitivity.Window(storages[0].sink_len, storages[0].residual, storages[0].block)

    def probe(idx, q, k, v, scaling):
        if idx in layers:
            seen = sensitivity.Layer(q.detach(), k.detach(), v.detach(), scaling)
            positions = sensitivity.rows(k.shape[2]).to(k.device)
            peak = k.detach().float().abs().amax(dim=2)                                     # (B, Hkv, D)
            channel = (peak.amax(-1) / peak.median(-1).values.clamp_min(1e-6)).max().item()
            shifts = [sensitivity.shift(seen, [fragile.stored_states(s, k)], window, positions)[0] for s in storages]
            found[idx] = LayerKeys(idx, shifts[0], channel, shifts[1])
            if len(found) == len(layers):
                raise _Seen                                   # the layers after it and the logits: not needed
        return None                                                     # attention as usual

    with torch.no_grad():
        try:
            model(ids, use_cache=False, kvplay_probe=probe)
        except _Seen:
            pass
    return [found[i] for i in sorted(found)]


class _Seen(Exception):
    """Raised by measure()'s probe once every full-attention layer is measured: the forward stops there."""


def outlier_layers(found: list[LayerKeys]) -> tuple[int, ...]:
    """The outlier layers among `found`, the largest shift first."""
    return tuple(x.layer for x in sorted(found, key=lambda x: -x.moved) if x.outlier)


def kept(model) -> list[LayerKeys] | None:
    """What measure() found on this model, as kept (in memory, on disk or shipped), or None; a kept result is set on
    the model's config too."""
    rows = fragile.kept_value(model, STORE_KEY)
    if rows is None:
        return None
    found = [LayerKeys(int(i), float(s), float(c), float(s8)) for i, s, c, s8 in rows]
    _set(model, found)
    return found


def find(model, tokenizer, reference, progress=None) -> list[LayerKeys]:
    """The model's LayerKeys, kept() or measured now (one forward over the calibration text, keys stored as
    `reference`, REFERENCE's CacheSpec) and kept, and set on its config. progress(fraction, what) before a
    measurement."""
    found = kept(model)
    if found is not None:
        return found
    if tokenizer is None:
        raise KvplayError("Finding which layers' keys carry outliers reads a calibration text, so it needs the "
                          "tokenizer: build_cache(spec, model, tokenizer=tok), or use adapt=0.")
    if progress is not None:
        progress(0.0, "finding which layers' keys carry outliers (one 16-bit pass, once per model)")
    found = measure(model, fragile.calibration_ids(tokenizer, TOKENS).to(model.device), reference)
    fragile.keep_value(model, STORE_KEY, [[x.layer, round(x.shift, 4), round(x.channel, 2), round(x.shift8, 4)]
                                          for x in found])
    _set(model, found)
    return found


def layers(model, tokenizer, reference, progress=None) -> tuple[int, ...]:
    """The model's outlier layers, most first: as set on its config (by kvplay's loader, or a copy's original), else
    find()'s."""
    known = Arch.from_config(model.config).key_outliers
    return known if known is not None else outlier_layers(find(model, tokenizer, reference, progress))


def measurable(model) -> bool:
    """Whether the model runs kvplay's attention (the pass reads through it) and has full-attention layers."""
    return attention.model_uses_it(model.config.get_text_config(decoder=True)) and bool(full_attention(model.config))


def _set(model, found: list[LayerKeys]) -> None:
    setattr(model.config.get_text_config(decoder=True), KEY_OUTLIERS, outlier_layers(found))


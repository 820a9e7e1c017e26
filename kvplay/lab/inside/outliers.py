"""Outlier channels: per layer and KV head, how far the largest key (and value) dimension stands above the
median one, before and after a Hadamard rotation, and which schemes' key groups that breaks.

Keys are read as the cache receives them (after RoPE), from a DynamicCache filled by one prefill: nothing in
transformers is patched.
"""
from __future__ import annotations

import torch

from kvplay.cache import CacheSpec, build_cache, cache_schemes, parse_spec
from kvplay.cache.quant import hadamard, rotate
from kvplay.errors import KvplayError
from kvplay.lab.generate import prefill
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.results import HeadStats, LayerStats, OutliersResult, SchemeRisk

OUTLIER_FACTOR = 6.0          # a channel is an outlier when its max |x| exceeds this many times the median channel's


SCAN_TOKENS = 512             # tokens of the held-out play the scan reads


OUTLIER_DEFINITION = (f"An outlier channel is a key (or value) dimension whose largest |x| over the text exceeds "
                      f"{OUTLIER_FACTOR:g}x the median dimension's largest |x|, in one layer and KV head. Max ratio: "
                      "the largest dimension's max |x| over the median dimension's. Kurtosis: of all the head's "
                      "entries pooled (a normal distribution has 3; heavy tails, from a few large dimensions, "
                      "push it up).")


def kurtosis(x: torch.Tensor) -> float:
    """Pearson kurtosis of all entries (normal = 3)."""
    x = x.float().flatten()
    centred = x - x.mean()
    var = centred.pow(2).mean()
    return float(centred.pow(4).mean() / var.pow(2).clamp(min=1e-24))


def channel_stats(x: torch.Tensor, factor: float = OUTLIER_FACTOR) -> tuple[float, int, list[int]]:
    """x (T, D) -> (max ratio, outlier channel count, up to 3 largest channels): per-channel max |x| vs the median."""
    peak = x.float().abs().amax(dim=0)                                    # (D,)
    median = peak.median().clamp(min=1e-12)
    ratio = peak / median
    top = [int(i) for i in ratio.argsort(descending=True)[:3] if ratio[i] > factor]
    return float(ratio.max()), int((ratio > factor).sum()), top


@torch.inference_mode()
def capture_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One prefill of ids (1, T) into a DynamicCache -> per layer (keys, values), each (H, T, D), as stored."""
    cache = build_cache(CacheSpec("baseline"), model)
    prefill(model, ids.to(model.device), torch.ones_like(ids).to(model.device), cache)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def scan_tokens(tokenizer, n: int = SCAN_TOKENS) -> torch.Tensor:
    """The first n tokens of the held-out play's first scene: a real text, (1, n)."""
    text = HELD_OUT_TEXT.read_text(encoding="utf-8")
    text = text[max(text.find("ACT 1\nSCENE 1"), 0):]
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids[:, :n]


def head_stats(keys: torch.Tensor, values: torch.Tensor, factor: float = OUTLIER_FACTOR) -> HeadStats:
    """Statistics of one KV head: keys, values (T, D)."""
    rotated = rotate(keys.float(), hadamard(keys.shape[-1], keys.device))
    k_ratio, k_out, k_top = channel_stats(keys, factor)
    r_ratio, r_out, _ = channel_stats(rotated, factor)
    v_ratio, v_out, _ = channel_stats(values, factor)
    return HeadStats(head=0, key_kurtosis=kurtosis(keys), value_kurtosis=kurtosis(values), key_max_ratio=k_ratio,
                     key_outlier_channels=k_out, key_kurtosis_rotated=kurtosis(rotated), key_max_ratio_rotated=r_ratio,
                     key_outlier_channels_rotated=r_out, value_max_ratio=v_ratio, value_outlier_channels=v_out,
                     key_top_channels=k_top)


def key_grouping(spec: CacheSpec) -> tuple[str, int, bool]:
    """How a scheme quantizes keys: ("token" | "channel" | "float", bits, rotated), as its method declares
    (CacheMethod.key_grouping)."""
    return spec.method.key_grouping(spec)


def scheme_risk(spec: CacheSpec, layers: list[LayerStats]) -> SchemeRisk:
    """Whether a scheme's key groups lose the ordinary channels next to this model's outlier channels.

    A per-token int group spans the head's channels, so its step is range / (2^bits - 1), about
    2 x max|x| / (2^bits - 1). Once that step exceeds the median channel's magnitude, i.e. the max
    ratio exceeds (2^bits - 1) / 2 (int4: 7.5, int2: 1.5, int8: 127.5), ordinary channels round to a
    level or two. Per-channel groups give each channel its own scale; rotation spreads the outliers.
    """
    if not spec.is_quantized:
        return SchemeRisk(str(spec), False, "16-bit: nothing is quantized")
    grouping, bits, rotated = key_grouping(spec)
    stat = "key_max_ratio_rotated" if rotated else "key_max_ratio"
    worst_layer, worst = max(((lay.layer, h) for lay in layers for h in lay.heads), key=lambda p: getattr(p[1], stat))
    ratio = getattr(worst, stat)
    how = "after rotation, " if rotated else ""
    if grouping == "channel":
        return SchemeRisk(str(spec), False, "keys grouped per channel: each channel has its own scale, so outlier "
                                            "channels do not crush the others")
    if grouping == "float":
        return SchemeRisk(str(spec), False, f"{bits}-bit floating point keeps each value's relative precision "
                                            f"(worst ratio {ratio:.0f}x)")
    limit = (2 ** bits - 1) / 2
    if ratio > limit:
        return SchemeRisk(str(spec), True, f"keys grouped per token at {bits} bits: {how}layer {worst_layer} head "
                                           f"{worst.head} has a channel {ratio:.0f}x the median, above the "
                                           f"{limit:g}x at which the step of a group exceeds the median channel")
    close = " (close: a longer or different text may cross it)" if ratio > 0.75 * limit else ""
    return SchemeRisk(str(spec), False, f"keys grouped per token at {bits} bits, but {how}the worst ratio, "
                                        f"{ratio:.1f}x, is under {limit:g}x{close}")


def max_bits_at_risk(ratio: float) -> int:
    """The most bits at which a per-token int group loses the median channel next to a channel `ratio`x larger:
    the largest b with (2^b - 1) / 2 < ratio (0 when even 2 bits keep it)."""
    bits = 0
    while (2 ** (bits + 1) - 1) / 2 < ratio and bits < 16:
        bits += 1
    return bits if bits >= 2 else 0


def verdict_text(layers: list[LayerStats], risks: list[SchemeRisk], factor: float = OUTLIER_FACTOR) -> str:
    """A few plain sentences: the most fragile layers and heads, then the schemes at risk."""
    heads = sorted(((lay.layer, h) for lay in layers for h in lay.heads), key=lambda p: -p[1].key_max_ratio)
    fragile = [(n, h) for n, h in heads if h.key_outlier_channels > 0]
    total = sum(len(lay.heads) for lay in layers)
    if not fragile:
        lines = [f"No key channel exceeds {factor:g}x the median channel in any layer or head: the keys have no "
                 "outlier channels on this text."]
    else:
        lines = [f"{len(fragile)} of {total} layer-head pairs have key outlier channels (>{factor:g}x the median)."]
        for n, h in fragile[:3]:
            bits = max_bits_at_risk(h.key_max_ratio)
            lose = (f"Per-token groups of {bits} bits or fewer lose the small channels next to them" if bits
                    else "Even per-token 2-bit groups keep the ordinary channels")
            lines.append(f"Layer {n} keys, head {h.head}: {h.key_outlier_channels} channel"
                         f"{'s' if h.key_outlier_channels != 1 else ''} above {factor:g}x the median, the largest "
                         f"{h.key_max_ratio:.1f}x (channel {h.key_top_channels[0]}); after Hadamard rotation "
                         f"{h.key_max_ratio_rotated:.1f}x. {lose}, while per-channel grouping or rotation keeps "
                         "them.")
    values = [(n, h) for n, h in heads if h.value_outlier_channels > 0]
    if values:
        n, h = max(values, key=lambda p: p[1].value_max_ratio)
        lines.append(f"Values: {len(values)} layer-head pair{'s' if len(values) != 1 else ''} with outlier channels, "
                     f"the largest {h.value_max_ratio:.1f}x in layer {n} head {h.head} (values are grouped per "
                     "token by every registered scheme).")
    risky = [r.spec for r in risks if r.at_risk]
    safe = [r.spec for r in risks if not r.at_risk and r.spec != "baseline"]
    lines.append(f"At risk: {', '.join(risky)}." if risky else "No registered scheme is at risk from outlier channels.")
    if safe:
        lines.append(f"Not at risk from outlier channels: {', '.join(safe)}.")
    return "\n".join(lines)


def outlier_scan(model, tokenizer, *, ids: torch.Tensor | None = None, tokens: int = SCAN_TOKENS,
                 factor: float = OUTLIER_FACTOR, model_name: str = "", progress: Progress | None = None
                 ) -> OutliersResult:
    """Key and value channel statistics per layer and KV head, before and after Hadamard rotation, and a verdict."""
    progress = progress or no_progress
    ids = scan_tokens(tokenizer, tokens) if ids is None else ids
    if ids.shape[1] < 16:
        raise KvplayError(f"The outlier scan needs at least 16 tokens of text, got {ids.shape[1]}.")
    progress(0.1, "prefill")
    kv = capture_kv(model, ids)
    layers = []
    for n, (keys, values) in enumerate(kv):
        progress(0.1 + 0.8 * n / len(kv), f"layer {n}")
        heads = []
        for h in range(keys.shape[0]):
            stats = head_stats(keys[h], values[h], factor)
            stats.head = h
            heads.append(stats)
        layers.append(LayerStats(layer=n, heads=heads))
    risks = [scheme_risk(parse_spec(name), layers) for name in cache_schemes()]
    progress(1.0, "done")
    return OutliersResult(model=model_name, tokens=int(ids.shape[1]), outlier_factor=factor,
                          definition=OUTLIER_DEFINITION, layers=layers, schemes=risks,
                          verdict=verdict_text(layers, risks, factor))

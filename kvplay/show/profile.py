"""A model's profile in words (kvplay.results.profile): the card a brought model gets, for the page and the CLI."""
from __future__ import annotations

from kvplay.cache import adapting_presets
from kvplay.cache.outliers import SHIFT
from kvplay.results.profile import ModelProfile

STRONG = 2        # outliers at twice the outlier factor or more (12x by default) are worth a warning


def _layers(indices: list[int]) -> str:
    """[0, 1, 2, 8] -> "layers 0-2 and 8"; [5] -> "layer 5": runs of neighbours as ranges."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    if len(indices) == 1:
        return f"layer {parts[0]}"
    return "layers " + (", ".join(parts[:-1]) + " and " if len(parts) > 1 else "") + parts[-1]


def shape_text(p: ModelProfile) -> str:
    """"qwen2: 24 layers, 14 query heads sharing 2 KV heads of head_dim 64, all full attention, 32,768 positions"."""
    attention = ("all full attention" if not p.sliding_layers else
                 f"{p.full_layers} full-attention and {p.sliding_layers} sliding-window layers ({p.sliding_window:,} "
                 "tokens, kept 16-bit by kvplay's caches)")
    context = f", {p.context:,} positions" if p.context else ""
    kv = f"{p.kv_heads} KV head" + ("s" if p.kv_heads > 1 else "")
    return (f"{p.family}: {p.layers} layers, {p.query_heads} query heads sharing {kv} of head_dim "
            f"{p.head_dim}, {attention}{context}")


def outliers_text(p: ModelProfile) -> str:
    """The key outlier channels found, in one sentence, with where they were measured."""
    where = f"(one 16-bit pass over {p.tokens} tokens of the play)"
    if not p.outlier_layers:
        worst = max(p.key_ratio, default=0.0)
        return (f"No key outlier channels {where}: the largest key channel stays within {worst:.0f}x the median, "
                f"under {p.factor:g}x, in every layer.")
    worst = max(p.key_ratio[i] for i in p.outlier_layers)
    found = (f"in {_layers(p.outlier_layers)} of {len(p.key_ratio)} {where}: the largest key channel up to "
             f"{worst:.0f}x the median one")
    if worst < STRONG * p.factor:
        return f"Mild key outlier channels {found}."
    return (f"Key outlier channels {found}. Caches that group keys per token (quanto, HQQ, llama.cpp's types, fp8 "
            "with one scale) lose most there; per-channel keys or a rotation spread them.")


def adapt_text(p: ModelProfile) -> str:
    """What kvplay's adapting presets do on this model, from its layers' 4-bit key shift, with 16-bit scales and
    zeros, then 8-bit ones where measured ("" unmeasured)."""
    if not p.key_shift:
        return ""
    presets = " and ".join(", ".join(adapting_presets()).rsplit(", ", 1))
    rows = [(int(r[0]), r[1], r[2] if len(r) > 2 else 0.0) for r in p.key_shift]    # recorded cards: no 8-bit figure
    out = sorted((r for r in rows if max(r[1:]) > SHIFT), key=lambda r: -max(r[1:]))
    rest = max((max(r[1:]) for r in rows if max(r[1:]) <= SHIFT), default=0.0)
    if not out:
        return f"4-bit keys move at most {rest:.0%} of any layer's attention, so {presets} spend no extra bits on it."
    scales = [r for r in out if r[1] <= SHIFT]              # outlier layers only with 8-bit scales and zeros
    said = f"At 4 bits the keys of {_layers(sorted(r[0] for r in out))} move up to {max(out[0][1:]):.0%} of the " \
           f"attention (the other layers' at most {rest:.0%})"
    if scales:
        said += (f"; in {_layers(sorted(r[0] for r in scales))} only with the 8-bit scales and zeros kvplay-3bit and "
                 f"kvplay-2.5bit store ({max(r[1] for r in scales):.0%} with 16-bit ones)")
    return f"{said}, so {presets} store them at 8 bits, as many as 0.25 more bits per element pay for."


def profile_text(p: ModelProfile) -> str:
    return " ".join(x for x in (f"{p.model}. {shape_text(p)}. {outliers_text(p)}", adapt_text(p)) if x)

"""Inside the model: why a cache breaks, and whether it still finds a fact in a long context.

    scan = outlier_scan(model, tok)                          # key/value channel statistics per layer x head
    scan.verdict                                              # plain words, naming the schemes at risk
    grid = needle_run(model, tok, ["kvplay-int4"], quick=True)   # passkey retrieval, baseline first
    errs = head_errors(model, ids, "kvplay-int2")             # relative K/V error per layer x KV head
    shift = attention_shift(model, tok, prompt, "kvplay-int2", step=8, layer=3, head=0)

Keys are read as the cache receives them (after RoPE), from a DynamicCache filled by one
prefill: nothing in transformers is patched. Attention weights come from transformers' own
output_attentions option with the eager attention implementation.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvplay.app.catalogue import HELD_OUT_TEXT
from kvplay.app.prompts import FILLER, encode
from kvplay.cache import SCHEMES, CacheSpec, build_cache, check_specs, dequantized_kv, parse_spec
from kvplay.cache.quant import hadamard, rotate
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate, prefill

Progress = Callable[[float, str], None]

OUTLIER_FACTOR = 6.0          # a channel is an outlier when its max |x| exceeds this many times the median channel's
SCAN_TOKENS = 512             # tokens of the held-out play the scan reads
SHIFT_ROWS = 12               # context positions an attention shift's table lists (largest moves)
OUTLIER_DEFINITION = (f"An outlier channel is a key (or value) dimension whose largest |x| over the text exceeds "
                      f"{OUTLIER_FACTOR:g}x the median dimension's largest |x|, in one layer and KV head. Max ratio: "
                      "the largest dimension's max |x| over the median dimension's. Kurtosis: of all the head's "
                      "entries pooled (a normal distribution has 3; heavy tails, from a few large dimensions, "
                      "push it up).")


def _no_progress(fraction: float, description: str) -> None:
    pass


def _as_dict(obj) -> dict:
    return asdict(obj)


# ============================================================================ 1. fragility scan

@dataclass
class HeadStats:
    head: int
    key_kurtosis: float
    value_kurtosis: float
    key_max_ratio: float
    key_outlier_channels: int
    key_kurtosis_rotated: float
    key_max_ratio_rotated: float
    key_outlier_channels_rotated: int
    value_max_ratio: float
    value_outlier_channels: int
    key_top_channels: list[int] = field(default_factory=list)    # largest channels first (up to 3)


@dataclass
class LayerStats:
    layer: int
    heads: list[HeadStats]


@dataclass
class SchemeRisk:
    spec: str
    at_risk: bool
    reason: str


@dataclass
class OutliersResult:
    model: str
    tokens: int
    outlier_factor: float
    definition: str
    layers: list[LayerStats]
    schemes: list[SchemeRisk]
    verdict: str
    kind: str = "outliers"

    def to_dict(self) -> dict:
        return _as_dict(self)

    def summary_rows(self) -> list[dict]:
        return [{"layer": lay.layer, "head": h.head, "key_max_ratio": round(h.key_max_ratio, 1),
                 "key_outliers": h.key_outlier_channels, "key_kurtosis": round(h.key_kurtosis, 1),
                 "rotated_ratio": round(h.key_max_ratio_rotated, 1),
                 "rotated_kurtosis": round(h.key_kurtosis_rotated, 1),
                 "value_max_ratio": round(h.value_max_ratio, 1)} for lay in self.layers for h in lay.heads]

    def matrix(self, key: str) -> list[list[float]]:
        """One statistic as a layer x head matrix (for heatmaps)."""
        return [[float(getattr(h, key)) for h in lay.heads] for lay in self.layers]


def outliers_from_dict(data: dict) -> OutliersResult:
    """Rebuild a scan from its JSON (the verdict and risks are recomputed with this version's rules)."""
    layers = [LayerStats(layer=lay["layer"], heads=[HeadStats(**h) for h in lay["heads"]]) for lay in data["layers"]]
    risks = [scheme_risk(parse_spec(name), layers) for name in SCHEMES]
    factor = data.get("outlier_factor", OUTLIER_FACTOR)
    return OutliersResult(model=data.get("model", ""), tokens=data["tokens"], outlier_factor=factor,
                          definition=OUTLIER_DEFINITION, layers=layers, schemes=risks,
                          verdict=verdict_text(layers, risks, factor))


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
    """How a scheme quantizes keys: ("token" | "channel" | "float", bits, rotated).

    A method may declare it (method.key_grouping(spec)); otherwise it is read from the spec's
    options: kvplay's keys=, and the axis transformers' QuantizedCache backends group per token on.
    """
    declared = getattr(spec.method, "key_grouping", None)
    if callable(declared):
        return declared(spec)
    bits, rotated = int(spec.scheme.bits), spec.rotation == "hadamard"
    if spec.scheme.fmt != "int":
        return "float", bits, rotated
    if spec.keys is not None:
        return spec.keys, int(spec.kbits or bits), rotated
    per_token_axis = {"quanto": 0, "hqq": 1}.get(spec.backend)
    if spec.axis_key is not None and per_token_axis is not None:
        return ("token" if spec.axis_key == per_token_axis else "channel"), bits, rotated
    return "token", bits, rotated


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
    progress = progress or _no_progress
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
    risks = [scheme_risk(parse_spec(name), layers) for name in SCHEMES]
    progress(1.0, "done")
    return OutliersResult(model=model_name, tokens=int(ids.shape[1]), outlier_factor=factor,
                          definition=OUTLIER_DEFINITION, layers=layers, schemes=risks,
                          verdict=verdict_text(layers, risks, factor))


# ============================================================================ 2. retrieval test

QUICK_LENGTHS = (256, 512, 1024)
QUICK_DEPTHS = (0.1, 0.5, 0.9)
FULL_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
QUESTION = "What is the pass code for the archive room? Answer with the number only."
NEW_TOKENS = 24          # SmolLM2 writes one token per digit and often restates the question first


def full_lengths(limit: int) -> list[int]:
    """Context lengths doubling from 256 up to the model's limit (the limit itself last)."""
    out, n = [], 256
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


@dataclass
class NeedlePrompt:
    ids: list[int]
    passkey: str
    needle_token: int        # index in ids of the needle sentence's first token
    filler_start: int        # index of the first filler token
    filler_end: int          # index after the last filler token (the question follows)


def _filler_sentences(rng: random.Random, n: int) -> list[str]:
    """n seeded filler sentences, never the same sentence twice in a row."""
    out: list[str] = []
    for _ in range(n):
        choices = [s for s in FILLER if not out or s != out[-1]]
        out.append(rng.choice(choices))
    return out


def needle_prompt(tokenizer, context_tokens: int, depth: float, *, seed: int = 0, chat: bool = True) -> NeedlePrompt:
    """A seeded passkey sentence at `depth` (0 = start, 1 = end) of seeded filler, the whole prompt
    about `context_tokens` tokens, then the question (through the chat template when chat)."""
    if not 0.0 <= depth <= 1.0:
        raise KvplayError(f"The depth must be between 0 and 1, got {depth}.")
    rng = random.Random(f"{seed}:{context_tokens}:{depth}")
    passkey = str(rng.randrange(10_000, 100_000))
    needle = f"The pass code for the archive room is {passkey}."

    def build(sentences: list[str]) -> tuple[str, str]:
        at = round(depth * len(sentences))
        before, after = " ".join(sentences[:at]), " ".join(sentences[at:])
        return before, after

    def wrap(body: str) -> str:
        return body + "\n\n" + QUESTION if chat else body + "\n\nQuestion: " + QUESTION + "\nAnswer: The pass code is"

    per = max(len(tokenizer(s, verbose=False).input_ids) for s in FILLER)
    count = max(context_tokens // per, 2)
    sentences = _filler_sentences(rng, count)
    while True:     # grow the filler one sentence at a time until the prompt reaches the length
        before, after = build(sentences)
        ids = encode(tokenizer, wrap(" ".join(p for p in (before, needle, after) if p)), chat)
        if len(ids) >= context_tokens or len(sentences) > 4 * count:
            break
        sentences.append(rng.choice([s for s in FILLER if s != sentences[-1]]))
    if len(ids) > context_tokens and len(sentences) > 2:
        sentences.pop()
        before, after = build(sentences)
        ids = encode(tokenizer, wrap(" ".join(p for p in (before, needle, after) if p)), chat)
    prefix = encode(tokenizer, wrap(before + (" " if before else "") + "\x00"), chat)   # where the needle starts
    needle_at = next(i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b) if prefix != ids else len(ids)
    head = encode(tokenizer, wrap("\x00"), chat)
    filler_start = next(i for i, (a, b) in enumerate(zip(head, ids)) if a != b)
    tail = len(encode(tokenizer, wrap(""), chat)) - filler_start
    return NeedlePrompt(ids=ids, passkey=passkey, needle_token=needle_at, filler_start=filler_start,
                        filler_end=len(ids) - tail)


@dataclass
class NeedleCache:
    spec: str
    grid: list[list]                 # [context_tokens, depth_fraction, correct]; correct None where the baseline failed
    answers: list[str] = field(default_factory=list)   # the decoded answer per cell, grid order
    found: int = 0
    counted: int = 0                 # cells the baseline passed


@dataclass
class NeedleResult:
    model: str
    seed: int
    chat: bool
    lengths: list[int]
    depths: list[float]
    prompt_tokens: list[int]         # the real prompt length per cell, grid order
    caches: list[NeedleCache]
    kind: str = "needle"

    def to_dict(self) -> dict:
        return _as_dict(self)

    def summary_rows(self) -> list[dict]:
        rows = []
        for c in self.caches:
            row = {"spec": c.spec, "found": f"{c.found}/{c.counted}"}
            for n in self.lengths:
                cells = [g for g in c.grid if g[0] == n]
                row[f"{n} tok"] = "".join("-" if g[2] is None else ("Y" if g[2] else "n") for g in cells)
            rows.append(row)
        return rows


def answer_correct(text: str, passkey: str) -> bool:
    """The answer names the passkey (digits only, so '4 2 1 7 7' or '42,177' count too)."""
    digits = "".join(ch for ch in text if ch.isdigit() or ch.isspace())
    return passkey in text or passkey in digits.replace(" ", "")


def ask(model, tokenizer, ids: list[int], spec: CacheSpec, new_tokens: int = NEW_TOKENS) -> str:
    """Greedy answer to a prompt through `spec`'s cache, decoded."""
    x = torch.tensor([ids], device=model.device)
    trace = generate(model, x, build_cache(spec, model), new_tokens, keep_logits=False,
                     stop_token=tokenizer.eos_token_id)
    return tokenizer.decode(trace.tokens[0], skip_special_tokens=True)


def needle_run(model, tokenizer, specs, *, lengths=None, depths=None, quick: bool = True, seed: int = 0,
               chat: bool = True, model_name: str = "", new_tokens: int = NEW_TOKENS,
               progress: Progress | None = None) -> NeedleResult:
    """Passkey retrieval on a grid of context lengths x depths: the baseline first, then each cache on the
    cells the baseline passed (others are recorded as None: not counted against a cache)."""
    progress = progress or _no_progress
    limit = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 2048))
    if depths is not None and any(not 0 <= d <= 1 for d in depths):
        raise KvplayError("Depths must be fractions between 0 and 1.")
    lengths = list(lengths or (QUICK_LENGTHS if quick else full_lengths(limit - NEW_TOKENS)))
    depths = list(depths or (QUICK_DEPTHS if quick else FULL_DEPTHS))
    bad = [n for n in lengths if not 64 <= n <= limit - NEW_TOKENS]
    if bad:
        raise KvplayError(f"Context lengths must be between 64 and {limit - NEW_TOKENS} tokens for this model, "
                          f"got {bad[0]}.")
    specs = check_specs(specs, model.config)
    prompts = [(n, d, needle_prompt(tokenizer, n, d, seed=seed, chat=chat)) for n in lengths for d in depths]
    caches, base_ok = [], None
    total = len(specs) * len(prompts)
    for i, spec in enumerate(specs):
        grid, answers, oks = [], [], []
        for j, (n, d, p) in enumerate(prompts):
            progress((i * len(prompts) + j) / total, f"{spec}: {n} tokens at depth {d:g}")
            if base_ok is not None and not base_ok[j]:
                grid.append([n, d, None])
                answers.append("")
                continue
            text = ask(model, tokenizer, p.ids, spec, new_tokens)
            ok = answer_correct(text, p.passkey)
            grid.append([n, d, ok])
            answers.append(text.strip())
            oks.append(ok)
        if base_ok is None:
            base_ok = [bool(g[2]) for g in grid]
        caches.append(NeedleCache(spec=str(spec), grid=grid, answers=answers, found=sum(oks),
                                  counted=sum(base_ok)))
    progress(1.0, "done")
    return NeedleResult(model=model_name, seed=seed, chat=chat, lengths=lengths, depths=depths,
                        prompt_tokens=[len(p.ids) for _, _, p in prompts], caches=caches)


# ============================================================================ 3. error where it happens

@dataclass
class HeadErrors:
    spec: str
    key_error: list[list[float]]      # layer x KV head, relative Frobenius error
    value_error: list[list[float]]


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


@dataclass
class AttentionShift:
    spec: str
    step: int                        # the generated token whose attention is shown (its query is the token before)
    token: str
    layer: int
    head: int                        # query head
    context_tokens: int
    baseline: list[float]            # attention weights over the context, 16-bit cache
    quantized: list[float]           # the same query through the spec's cache
    sink: int                        # leading tokens kept in 16-bit
    window: int                      # trailing tokens kept in 16-bit (at most)
    tokens: list[str] = field(default_factory=list)
    model: str = ""
    kind: str = "attention_shift"

    @property
    def difference(self) -> list[float]:
        return [q - b for q, b in zip(self.quantized, self.baseline)]

    def to_dict(self) -> dict:
        return _as_dict(self)

    def summary_rows(self, top: int = SHIFT_ROWS) -> list[dict]:
        """The context positions whose attention weight moved most, largest move first."""
        where = sorted(range(len(self.baseline)), key=lambda i: -abs(self.quantized[i] - self.baseline[i]))[:top]
        start = self.context_tokens - self.window
        return [{"position": i, "token": self.tokens[i].replace("\n", "⏎") if i < len(self.tokens) else "",
                 "held_in": "sink (16-bit)" if i < self.sink else ("16-bit window" if i >= start else "quantized"),
                 "weight_16bit": round(self.baseline[i], 5), "weight_cache": round(self.quantized[i], 5),
                 "difference": round(self.quantized[i] - self.baseline[i], 5)} for i in where]


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
                          quantized=rows[1].tolist(), sink=int(spec.sink or 0),
                          window=int(spec.residual or 0) if spec.is_quantized else seq.shape[1], tokens=pieces)


# ============================================================================ service + CLI

def _run_model(args_model, settings, device=None, dtype=None, weights=None):
    from kvplay.app import commands

    return commands.get_run_model(args_model, settings, device, dtype, weights)


def outliers(model_name=None, *, tokens: int = SCAN_TOKENS, device=None, dtype=None, weights=None, settings=None,
             progress=None, cancel=None) -> OutliersResult:
    """The fragility scan behind the same checks as every command (model, one run per device)."""
    from kvplay.app import guard
    from kvplay.app.commands import check_int
    from kvplay.app.settings import Settings

    settings = settings or Settings.from_env()
    model, tok, name = _run_model(model_name, settings, device, dtype, weights)
    tokens = check_int(tokens, "Tokens", 16, SCAN_TOKENS * 8)
    with guard.exclusive(model.device):
        return outlier_scan(model, tok, tokens=tokens, model_name=name, progress=guard.watch(progress, cancel))


def needle(model_name=None, specs=("kvplay-int4", "kvplay-int2"), *, quick=True, lengths=None, depths=None, seed=0,
           device=None, dtype=None, weights=None, settings=None, progress=None, cancel=None) -> NeedleResult:
    """The retrieval test behind the same checks as every command."""
    from kvplay.app import guard
    from kvplay.app.commands import parse_specs
    from kvplay.app.prompts import is_chat
    from kvplay.app.settings import Settings

    settings = settings or Settings.from_env()
    specs = parse_specs(list(specs), settings)
    model, tok, name = _run_model(model_name, settings, device, dtype, weights)
    chat = is_chat(name, tok)
    limit = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 2048))
    longest = max(lengths) if lengths else (max(QUICK_LENGTHS) if quick else limit)
    guard.check_run(model, longest + NEW_TOKENS)
    with guard.exclusive(model.device):
        return needle_run(model, tok, specs, lengths=lengths, depths=depths, quick=quick, seed=seed, chat=chat,
                          model_name=name, progress=guard.watch(progress, cancel))


@dataclass
class ErrorMaps:
    model: str
    tokens: int
    caches: list[HeadErrors]
    kind: str = "head_errors"

    def to_dict(self) -> dict:
        return _as_dict(self)

    def summary_rows(self) -> list[dict]:
        """Per cache: the median and worst head's key and value error, in %, and where the worst key head is."""
        rows = []
        for c in self.caches:
            keys = [(e, n, h) for n, row in enumerate(c.key_error) for h, e in enumerate(row)]
            values = sorted(e for row in c.value_error for e in row)
            worst, layer, head = max(keys)
            key_median = _median(sorted(e for e, _, _ in keys))
            rows.append({"spec": c.spec, "key_error_median_pct": round(100 * key_median, 2),
                         "key_error_worst_pct": round(100 * worst, 2), "worst_key_head": f"L{layer}h{head}",
                         "value_error_median_pct": round(100 * _median(values), 2),
                         "value_error_worst_pct": round(100 * values[-1], 2)})
        return rows


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def error_maps(model_name=None, specs=("kvplay-int4", "kvplay-int2"), *, tokens: int = SCAN_TOKENS, device=None,
               dtype=None, weights=None, settings=None, progress=None, cancel=None) -> ErrorMaps:
    """head_errors for each quantized spec on the held-out play's first `tokens` tokens."""
    from kvplay.app import guard
    from kvplay.app.commands import check_int, parse_specs
    from kvplay.app.settings import Settings

    settings = settings or Settings.from_env()
    names = parse_specs(list(specs), settings)
    model, tok, name = _run_model(model_name, settings, device, dtype, weights)
    specs = [s for s in check_specs(names, model.config) if s.is_quantized]
    if not specs:
        raise KvplayError("Pick at least one quantized cache to map its error.")
    tokens = check_int(tokens, "Tokens", 64, SCAN_TOKENS * 8)
    ids = scan_tokens(tok, tokens)
    progress = guard.watch(progress or _no_progress, cancel)
    out = []
    with guard.exclusive(model.device):
        for i, spec in enumerate(specs):
            progress(i / len(specs), f"{spec}: per-head error")
            out.append(head_errors(model, ids, spec))
    progress(1.0, "done")
    return ErrorMaps(model=name, tokens=int(ids.shape[1]), caches=out)


def attention_prompt(chat: bool) -> str:
    """The attention-shift view's default prompt: a pass code in filler for a chat model, the play otherwise."""
    from kvplay.app.prompts import find_the_number, raw_default_prompt

    return find_the_number(sentences=40) if chat else raw_default_prompt(1200)


def shift(model_name, prompt: str | None, spec, *, step: int, layer: int, head: int, new_tokens: int = 32,
          device=None, dtype=None, weights=None, settings=None) -> AttentionShift:
    """attention_shift behind the usual checks; the prompt (None: attention_prompt) goes through the chat
    template for chat models."""
    from kvplay.app import guard
    from kvplay.app.commands import check_int, clean_text, parse_specs
    from kvplay.app.prompts import is_chat
    from kvplay.app.settings import Settings

    settings = settings or Settings.from_env()
    prompt = None if prompt is None else clean_text(prompt)
    spec = next((parse_spec(s) for s in parse_specs([spec], settings) if parse_spec(s).is_quantized), None)
    if spec is None:
        raise KvplayError("Pick a quantized cache to compare its attention with the 16-bit cache's.")
    new_tokens = check_int(new_tokens, "New tokens", 2, 256)
    model, tok, name = _run_model(model_name, settings, device, dtype, weights)
    check_specs([spec], model.config)
    chat = is_chat(name, tok)
    ids = encode(tok, attention_prompt(chat) if prompt is None else prompt, chat)
    guard.check_run(model, len(ids) + new_tokens)
    with guard.exclusive(model.device):
        result = attention_shift(model, tok, ids, spec, step=int(step), layer=int(layer), head=int(head),
                                 new_tokens=new_tokens)
    result.model = name
    return result


def add_parsers(sub, common) -> None:
    """The outliers, needle, errors and attention subcommands (kvplay/cli/main.py calls this)."""
    p = sub.add_parser("outliers", help="key/value outlier channels per layer and head, and the schemes at risk")
    common(p)
    p.add_argument("--tokens", type=int, default=SCAN_TOKENS, help="tokens of the held-out play to scan")
    p = sub.add_parser("needle", help="find a passkey hidden in filler, at context lengths x depths, per cache")
    common(p, caches=("kvplay-int4", "kvplay-int2", "quanto-int4"))
    p.add_argument("--quick", action="store_true", help=f"lengths {list(QUICK_LENGTHS)} x depths {list(QUICK_DEPTHS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths, fractions 0..1")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("errors", help="relative key and value reconstruction error per layer and KV head, per cache")
    common(p, caches=("quanto-int4", "kvplay-int4", "kvplay-int2"))
    p.add_argument("--tokens", type=int, default=SCAN_TOKENS, help="tokens of the held-out play to store")
    p = sub.add_parser("attention", help="one layer and head's attention over the context: 16-bit cache against one "
                                         "quantized cache, for one generated token")
    common(p, caches=("kvplay-int2",))
    p.add_argument("--prompt", default=None, help="prompt text (default: a pass code in filler for a chat model, "
                                                  "otherwise the held-out play's opening)")
    p.add_argument("--step", type=int, default=8, help="the generated token (1 = the second one)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--head", type=int, default=0, help="query head")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens the 16-bit cache generates first")


COMMANDS = ("outliers", "needle", "errors", "attention")


def run_cli(args, progress, settings) -> OutliersResult | NeedleResult | ErrorMaps | AttentionShift:
    common = dict(device=args.device, dtype=args.dtype, weights=args.weights, settings=settings, progress=progress)
    if args.command == "outliers":
        return outliers(args.model, tokens=args.tokens, **common)
    if args.command == "errors":
        return error_maps(args.model, args.caches, tokens=args.tokens, **common)
    if args.command == "attention":
        if len(args.caches) != 1:
            raise KvplayError(f"Give one cache to compare its attention with the 16-bit cache's, got "
                              f"{len(args.caches)}.")
        del common["progress"]
        return shift(args.model, args.prompt, args.caches[0], step=args.step, layer=args.layer, head=args.head,
                     new_tokens=args.new_tokens, **common)
    return needle(args.model, args.caches, quick=args.quick, lengths=args.lengths, depths=args.depths,
                  seed=args.seed, **common)


# ---------------------------------------------------------------------------- results as JSON (report --inputs)

RESULT_KINDS = {"outliers": OutliersResult, "needle": NeedleResult, "head_errors": ErrorMaps,
                "attention_shift": AttentionShift}
TITLES = {"outliers": "Inside: outlier channels per layer and KV head", "needle": "Inside: find the number",
          "head_errors": "Inside: reconstruction error per layer and KV head",
          "attention_shift": "Inside: attention shift"}


def is_result(obj) -> bool:
    return isinstance(obj, tuple(RESULT_KINDS.values()))


def from_dict(data: dict) -> OutliersResult | NeedleResult | ErrorMaps:
    """Rebuild an Inside result from its JSON (the CLI's --json, the tab's download)."""
    kind = data["kind"]
    if kind == "outliers":
        return outliers_from_dict(data)
    body = {k: v for k, v in data.items() if k != "kind"}
    if kind == "needle":
        return NeedleResult(**{**body, "caches": [NeedleCache(**c) for c in body["caches"]]})
    if kind == "head_errors":
        return ErrorMaps(**{**body, "caches": [HeadErrors(**c) for c in body["caches"]]})
    if kind == "attention_shift":
        return AttentionShift(**body)
    raise KeyError(kind)


def write_json(result, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=1)


def main_cli(args) -> int:
    """Run `outliers`, `needle`, `errors` or `attention`, print the table (and the verdict), write --json / --csv.
    KvplayError propagates to kvplay/cli/main.py's main, which prints the sentence and exits 2."""
    from kvplay.app.settings import Settings
    from kvplay.cli import main as cli
    from kvplay.results import to_csv

    settings = cli.cli_settings() if hasattr(cli, "cli_settings") else Settings.from_env()
    update, close = cli._progress()
    try:
        result = run_cli(args, update, settings)
    finally:
        close()
    cli._print_table(result.summary_rows())
    if isinstance(result, OutliersResult):
        print()
        print(result.verdict)
    if args.json:
        write_json(result, args.json)
    if args.csv:
        to_csv(result, args.csv)
    return 0

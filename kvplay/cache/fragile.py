"""Fragile layers: which layers' keys, and which layers' values, get more bits under kvplay's `fragile` options.

At 2 bits some layers' keys cost the logits far more than others'. `kvplay-int2:fragile=0.1,fragile_kbits=4`
stores the keys of the tenth of the layers (3 of SmolLM2's 30) that gain most from 4 bits at 4 bits, the
others' at 2. Values have their own share and bits (`vfragile`, `fragile_vbits`) and their own ranking: the
layers whose values need bits are not the ones whose keys do (on SmolLM2, values: 18, 24, 23, ...; keys at 3
against 4 bits: 8, 5, 3, ...). The rankings are measured once per model and storage format (under the preset's
own window: ranked_as), then kept (ranking() below: in memory, in ~/.cache/kvplay/fragile, and for the
catalogue's models shipped in assets/fragile_rankings.json). Two ways measure one:

The exhaustive ranking (rank_layers; what the shipped seeds are):
  1. CALIBRATION_TOKENS tokens from the end of The Tempest, or CALIBRATION_BLOCKS blocks where blocks are
     longer (kvplay ppl reads the play from its start, so the two overlap only past 29,000 tokens; SmolLM2
     tokenizes the play into 31,443);
  2. one 16-bit forward gives the reference logits; then, for each layer and each of the low and high bits,
     one forward in which that layer alone attends to its keys (or values) as the engine stores them
     (rotation, sink, blocks; kvplay_attention's kvplay_probe hook in attention.py swaps them in), the other
     part exact;
  3. a layer's gain is how much the mean KL divergence from the reference logits drops with the extra bits.
2 x layers + 1 forwards per ranking: 43 s for SmolLM2 over 512 tokens on 2 cores, about 300 s for a 1.5B model.

The Fisher ranking (rank_layers_fisher; the default where none is kept): one forward and one backward over the
same text (sensitivity.py) give every layer's keys' and values' Fisher information, and a layer's gain is its
stored error at the low bits less at the high bits, weighted by it (gains()); layers whose low-bit keys move half
their attention elsewhere, past where that second-order estimate holds, come first (broken()). One pass serves
keys and values and every storage and window of its length: 1,024 tokens for blocks of 32 (kvplay-int2), 2,048
for longer ones (fisher_tokens). On the three catalogue models, each preset's mean KL with it came within 10% of
the exhaustive ranking's (docs/benchmarks.md, "Calibrating a model kvplay has not seen").

The KL of the logits, not the layer's own attention error, because an early layer's error travels through
every layer after it: on the bundled model, 4-bit keys in layer 0 alone cut the KL by 33%, in layer 1 by
4%, while layer 1's own attention error gains more (both measured, docs/quality-ablation.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import torch

from kvplay.cache import attention, sensitivity
from kvplay.cache.engine import KVPlayLayer, rotations
from kvplay.errors import KvplayError
from kvplay.paths import assets

CALIBRATION_TOKENS = 512     # 16 blocks of 32 tokens; 2 x 30 + 1 forwards of SmolLM2 took 43 s on 2 cores
CALIBRATION_BLOCKS = 16      # longer blocks calibrate on more tokens: 16 of them (kvplay-3bit's 128: 2,048 tokens)
# The library's own data (kvplay.paths.assets: assets/ of a checkout, or the wheel's copy): the calibration text
# (the end of the play that kvplay ppl reads from its start) and the rankings measured for the catalogue's models.
CALIBRATION_TEXT = assets("texts", "tempest.txt")
SEEDS = assets("fragile_rankings.json")   # {fingerprint: {storage_key: ranking}} of the catalogue's models
_RANKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (fingerprint, {storage_key: ranking})


PARTS = ("keys", "values")
_OPTIONS = {"keys": ("fragile", "kbits", "fragile_kbits"),      # part -> (share, bits, fragile layers' bits)
            "values": ("vfragile", "vbits", "fragile_vbits")}


def fragile_bits(spec, part: str) -> tuple[float, int, int]:
    """(share, bits, fragile layers' bits) of `part` ("keys" or "values"); share 0 where the spec has none."""
    share, bits, more = (getattr(spec, name) for name in _OPTIONS[part])
    return share or 0.0, bits, more


def ranks(spec, part: str) -> bool:
    """Whether the spec gives `part` fragile layers: a share, and fragile bits above the others' (kvplay-int2:kbits=4
    keeps 4-bit keys everywhere, and ranks nothing)."""
    share, bits, more = fragile_bits(spec, part)
    return bool(share) and more > bits


def fragile_count(spec, layers: int, part: str = "keys") -> int:
    """How many of `layers` quantized layers are fragile for `part`: the spec's share, rounded half up (0 where
    the spec does not rank the part)."""
    return int(fragile_bits(spec, part)[0] * layers + 0.5) if ranks(spec, part) else 0


def calibration_ids(tokenizer, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """(1, tokens) token ids: the end of The Tempest."""
    ids = tokenizer(CALIBRATION_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    return ids[:, -tokens:]


def stored_states(layer, x: torch.Tensor, part: str = "keys") -> torch.Tensor:
    """keys or values x (B, H, T, D) as a KVPlayLayer hands them to attention once its blocks are stored: the
    sink and the tokens after the last whole block exact, the blocks through the layer's key (value) format and
    rotation (under rotation=calibrated, the layer's key_rotation for keys)."""
    fmt = layer.fmt(part)
    s, t = layer.sink_len, layer.block
    n = max(0, x.shape[2] - s) // t
    blocks = x[:, :, s:s + n * t].float()                                    # (B, H, n * T, D)
    rotation = rotations(layer.spec, x.shape[-1], x.device, layer.key_rotation)[PARTS.index(part)]
    if rotation is not None:
        blocks = blocks @ rotation
    decoded = torch.empty_like(blocks)
    fmt.decode(fmt.encode(blocks.unflatten(2, (n, t))), decoded)
    stored = x.clone()
    stored[:, :, s:s + n * t] = decoded @ rotation.mT if rotation is not None else decoded
    return stored


def stored_attention(layer, q, k, v, scaling: float, part: str = "keys") -> torch.Tensor:
    """Causal attention over a prompt as it runs token by token through `layer`'s storage, for one part (keys or
    values; the other is taken exact): query i sees token j's key (value) as stored (stored_states) once j's
    block has left the 16-bit window before i arrived, exact otherwise.

    q (B, Hq, T, D), k, v (B, Hkv, T, D) -> (B, T, Hq, D) in q's dtype.
    """
    g, t = q.shape[1] // k.shape[1], k.shape[2]
    rep = lambda x: x.float().repeat_interleave(g, 1)                                    # noqa: E731 (B, Hq, T, D)
    pos = torch.arange(t, device=k.device)
    i, j = pos.unsqueeze(1), pos.unsqueeze(0)                                            # (T, 1), (1, T)
    s, block = layer.sink_len, layer.block
    boundary = s + block * ((i - s - layer.residual).clamp(min=0) // block)              # (T, 1)
    use = (j >= s) & (j < boundary)                                                      # (T, T): j as stored
    qf = q.float() * scaling
    scores = qf @ rep(k).transpose(-1, -2)                                               # (B, Hq, T, T)
    if part == "keys":
        scores = torch.where(use, qf @ rep(stored_states(layer, k)).transpose(-1, -2), scores)
    p = scores.masked_fill(j > i, -torch.inf).softmax(-1)
    if part == "keys":
        out = p @ rep(v)
    else:
        out = (p * use) @ rep(stored_states(layer, v, "values")) + (p * ~use) @ rep(v)
    return out.transpose(1, 2).to(q.dtype)


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(reference || logits) over positions, logits (1, T, V)."""
    p, q = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def ranked_as(spec):
    """The spec whose storage a ranking measures: the same format under its preset's own window (residual and
    sink), and under rotation=calibrated, rotation=hadamard.

    The window: which layers need bits is a property of the layers' keys and values, and a window only changes how
    many tokens skip quantization. Over Trade-offs' window sweep on SmolLM2 (kvplay-int2, residual 0/32/128/512 x
    sink 0/4/16, 1,024 tokens), ranking each variant under the preset's window gave a mean KL of 0.0479 against
    0.0492 ranked under its own (lower in 9 of 12 cells; top-1 0.903 both), and one ranking instead of 12 (43 s
    each). A window as long as the calibration text leaves nothing quantized to rank by (residual=512: the layers
    came back in index order). docs/tradeoffs.md ("Window and sinks") has the figures.
    The rotation: the layers are ranked under the fixed rotation the calibrated ones start from: on SmolLM2,
    kvplay-2.5bit's 3-bit key layers ranked that way gave KL 0.0324 and top-1 0.902 on the play, ranked under the
    calibrated rotations 0.0418 and 0.896 (docs/quality-ablation.md, round 6), and the ranking is the Hadamard
    preset's, measured once."""
    preset = type(spec)(spec.name).options
    spec = spec.with_options(**{k: getattr(preset, k) for k in ("residual", "sink") if hasattr(preset, k)})
    return spec.with_options(rotation="hadamard") if spec.rotation == "calibrated" else spec


def exhaustive_tokens(spec) -> int:
    """The tokens rank_layers() reads for the spec: CALIBRATION_TOKENS, or CALIBRATION_BLOCKS of its blocks where
    they are longer."""
    return max(CALIBRATION_TOKENS, CALIBRATION_BLOCKS * KVPlayLayer(ranked_as(spec)).block)


def rank_layers(model, tokenizer, spec, layers: list[int], part: str = "keys", progress=None) -> list[int]:
    """`layers` ordered by how much the logits gain when that layer's keys (values) alone get the fragile bits
    (fragile_kbits, fragile_vbits) over the spec's (ranked_as(spec)'s). progress(fraction, what) before each of the
    2 x layers + 1 forwards (43 s for SmolLM2 over 512 tokens on 2 CPU cores, about 125 s over 2,048)."""
    spec = ranked_as(spec)
    _check_attention(model, spec, part)
    formats = {"low": KVPlayLayer(spec), "high": KVPlayLayer.with_bits(spec, part, fragile_bits(spec, part)[2])}
    ids = calibration_ids(tokenizer, exhaustive_tokens(spec)).to(model.device)

    def logits(probe=None):
        with torch.no_grad():
            return model(ids, use_cache=False, kvplay_probe=probe).logits

    progress = progress or (lambda fraction, what: None)
    what = (f"{spec}: measuring which layers' {part} need {fragile_bits(spec, part)[2]} bits (once per model and "
            "storage format, then kept on disk)")
    progress(0.0, what)
    reference = logits()
    kl = {}
    for n, i in enumerate(layers):
        progress(n / len(layers), f"{what}: layer {n + 1} of {len(layers)}")
        for name, layer in formats.items():
            kl[i, name] = mean_kl(reference, logits(lambda idx, q, k, v, scaling, i=i, layer=layer:
                                                    stored_attention(layer, q, k, v, scaling, part)
                                                    if idx == i else None))
    return sorted(layers, key=lambda i: kl[i, "high"] - kl[i, "low"])


FISHER_PASSES = (1024, 2048)  # the tokens a Fisher pass reads: a spec's is the first that holds FISHER_BLOCKS of its
FISHER_BLOCKS = 32            # blocks (fisher_tokens), twice the exhaustive ranking's CALIBRATION_BLOCKS
FISHER_TOKENS = FISHER_PASSES[-1]   # the long pass, whose queries and keys also serve the key-rotation fits
FISHER_SEED = 0              # the labels drawn from the model's own predictions (sensitivity.label_gradient)
RANKERS = ("fisher", "exhaustive")
_FISHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {(tokens, layers): fisher_pass()}


def ranker() -> str:
    """Which ranking ranking() measures where none is kept: $KVPLAY_RANKING, "fisher" (the default: one forward
    and one backward pass, shared by keys, values and every preset) or "exhaustive" (rank_layers: 2 x layers + 1
    forwards per ranking, what the shipped seeds are). Set, it also reads only rankings of its own kind."""
    name = os.environ.get("KVPLAY_RANKING", "") or "fisher"
    if name not in RANKERS:
        raise KvplayError(f"KVPLAY_RANKING={name!r}: choose {' or '.join(RANKERS)}.")
    return name


def fisher_tokens(spec) -> int:
    """The tokens the spec's Fisher pass reads: the first of FISHER_PASSES that holds FISHER_BLOCKS of its blocks,
    else the longest. kvplay-int2's blocks of 32 take the short pass, half the long one's work, so a Compare's
    kvplay-int2 calibrates in about half the time; kvplay-2.5bit and kvplay-3bit share the long pass, whose queries
    and keys their rotation fits read. Twice the exhaustive ranking's 16 blocks because the gradient is the noisier
    measure: over 512 tokens (16 blocks) every label seed ranked Qwen2.5-Coder-0.5B's layer 11 over layer 16 for
    kvplay-int2, 11% over the exhaustive ranking's KL, and over 1,024 none did (docs/benchmarks.md, "Calibrating a
    model kvplay has not seen")."""
    need = FISHER_BLOCKS * KVPlayLayer(ranked_as(spec)).block
    return next((tokens for tokens in FISHER_PASSES if tokens >= need), FISHER_PASSES[-1])


def window(spec) -> sensitivity.Window:
    """The 16-bit window ranked_as(spec) stores under: (sink, residual, tokens per block)."""
    layer = KVPlayLayer(ranked_as(spec))
    return sensitivity.Window(layer.sink_len, layer.residual, layer.block)


def windows(spec) -> list[sensitivity.Window]:
    """The spec's window, then every preset's of its method that ranks a part from a pass as long: one pass over
    each layer's attention serves them all (sensitivity.fisher)."""
    found = [window(spec)]
    for scheme in spec.method.schemes:
        preset = type(spec)(scheme.name)
        if (any(ranks(preset, part) for part in PARTS) and fisher_tokens(preset) == fisher_tokens(spec)
                and window(preset) not in found):
            found.append(window(preset))
    return found


def fisher_pass(model, tokenizer, spec, layers: list[int], progress=None) -> dict[int, sensitivity.Layer]:
    """sensitivity.measure() over fisher_tokens(spec) tokens of the calibration text, once per model, length and
    layers, kept in memory: every part, storage and window of that length is scored from it. progress(fraction,
    what) as it goes."""
    kept, tokens = _FISHERS.setdefault(model, {}), fisher_tokens(spec)
    if (tokens, tuple(layers)) not in kept:
        progress = progress or (lambda fraction, what: None)
        what = (f"{spec}: measuring which layers' keys and values need more bits (one forward and one backward "
                f"pass over {tokens:,} tokens, once per model, then kept on disk)")
        progress(0.0, what)
        ids = calibration_ids(tokenizer, tokens).to(model.device)
        kept[tokens, tuple(layers)] = sensitivity.measure(
            model, ids, layers, FISHER_SEED, lambda fraction, where: progress(fraction, f"{what}: {where}"))
    return kept[tokens, tuple(layers)]


def fisher_pass_kept(model, layers: list[int], tokens: int = FISHER_TOKENS) -> bool:
    """Whether fisher_pass() over these layers and tokens is kept in memory for this model (then a ranking from it
    needs no pass)."""
    return (tokens, tuple(layers)) in _FISHERS.get(model, {})


def queries_and_keys(model, tokens: int, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """{layer: (queries (Hq, N, D), keys (Hkv, N, D)) float32} of the last `tokens` calibration tokens, as a
    fisher_pass() over that many kept in memory saw them (rotations.queries_and_keys' without a forward), or None
    if none did."""
    for (length, kept), measured in _FISHERS.get(model, {}).items():
        if length == tokens and set(layers) <= set(kept):
            return {i: (measured[i].q[0].float(), measured[i].k[0].float()) for i in layers}
    return None


def gains(measured: dict[int, sensitivity.Layer], spec, layers: list[int], part: str = "keys") -> dict[int, float]:
    """{layer: 1/2 sum_i F_ii (d_low,i^2 - d_high,i^2) / tokens}: about the mean KL the fragile bits save in its
    `part`, d the error of the stored states (stored_states) at the spec's bits and at the fragile bits, F the
    Fisher diagonal under the spec's window (ranked_as(spec)'s storage; sensitivity.fisher)."""
    spec = ranked_as(spec)
    low, high = KVPlayLayer(spec), KVPlayLayer.with_bits(spec, part, fragile_bits(spec, part)[2])
    n, found = PARTS.index(part), {}
    for i in layers:
        layer = measured[i]
        sensitivity.fisher(layer, windows(spec))
        x = (layer.k, layer.v)[n]
        low_error, high_error = ((stored_states(fmt, x, part).float() - x.float()).pow_(2) for fmt in (low, high))
        found[i] = 0.5 * (layer.diagonal[window(spec)][n] * (low_error - high_error)).sum().item() / x.shape[2]
    return found


def broken(measured: dict[int, sensitivity.Layer], spec, layers: list[int]) -> dict[int, float]:
    """{layer: how much more of its attention the spec's bits move than the fragile bits (sensitivity.shift)} for the
    layers whose keys at the spec's bits move more than sensitivity.BROKEN of it, where second order fails."""
    spec = ranked_as(spec)
    low, high = KVPlayLayer(spec), KVPlayLayer.with_bits(spec, "keys", fragile_bits(spec, "keys")[2])
    found, reads = {}, window(spec)
    for i in layers:
        layer = measured[i]
        positions = sensitivity.rows(layer.k.shape[2]).to(layer.k.device)
        moved = sensitivity.shift(layer, [stored_states(low, layer.k)], reads, positions)[0]
        if moved > sensitivity.BROKEN:                                 # the fragile bits' shift: only where needed
            found[i] = moved - sensitivity.shift(layer, [stored_states(high, layer.k)], reads, positions)[0]
    return found


def rank_layers_fisher(model, tokenizer, spec, layers: list[int], part: str = "keys", progress=None) -> list[int]:
    """`layers` ordered by gains() (most first), from fisher_pass(): one forward and one backward over the
    calibration text, shared by keys and values and by every storage; for keys, the layers broken() by the spec's
    bits first, those the fragile bits mend most first. progress: fisher_pass'."""
    spec = ranked_as(spec)
    _check_attention(model, spec, part)
    measured = fisher_pass(model, tokenizer, spec, layers, progress)
    if progress is not None:
        progress(1.0, f"{spec}: weighing each layer's stored {part} by the pass's Fisher information")
    found = gains(measured, spec, layers, part)
    first = broken(measured, spec, layers) if part == "keys" else {}
    return sorted(first, key=lambda i: -first[i]) + sorted((i for i in layers if i not in first),
                                                           key=lambda i: -found[i])


def _check_attention(model, spec, part: str) -> None:
    if not attention.model_uses_it(model.config.get_text_config(decoder=True)):
        raise KvplayError(f"{spec} ranks layers through kvplay's attention: load the model with "
                          "attn_implementation='kvplay' (kvplay's own loader does), or use "
                          f"{_OPTIONS[part][0]}=0.")


def fingerprint(model) -> str:
    """A short hash naming a model's weights (names, dtypes, shapes and each tensor's first 64 KiB)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().reshape(-1)[:32768].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def storage_key(spec, layers: list[int], part: str = "keys", method: str = "exhaustive") -> str:
    """What a ranking depends on: how it was measured, the part's storage (bits, grouping, fit, rotation, window)
    and the layers ranked (ranked_as(spec)'s). Exhaustive keys' strings are the ones the seeds were first written
    with; values' start with "values:"; a Fisher ranking's start with "fisher,tokens=N,seed=S:"."""
    if method == "fisher":
        return (f"fisher,tokens={fisher_tokens(spec)},seed={FISHER_SEED},draw=cdf,queries={sensitivity.QUERIES},"
                f"broken={sensitivity.BROKEN}:{storage_key(spec, layers, part)}")
    spec = ranked_as(spec)
    if part == "values":
        return (f"values:vbits={spec.vbits},fragile_vbits={spec.fragile_vbits},group={spec.group},"
                f"vgroup={spec.vgroup},keys={spec.keys},values={spec.values},vfit={spec.vfit},"
                f"rotation={spec.rotation},sink={spec.sink},residual={spec.residual},vmeta={spec.vmeta},"
                f"layers={','.join(map(str, layers))}")
    return (f"kbits={spec.kbits},fragile_kbits={spec.fragile_kbits},group={spec.group},keys={spec.keys},"
            f"kfit={spec.kfit},rotation={spec.rotation},sink={spec.sink},residual={spec.residual},"
            f"layers={','.join(map(str, layers))}"
            + (f",kmeta={spec.kmeta}" if spec.kmeta not in (None, "fp16") else ""))   # new keys only when set


def ranking_dir() -> Path:
    """Where measured rankings are kept between runs: $KVPLAY_RANKING_DIR, else ~/.cache/kvplay/fragile."""
    return Path(os.environ.get("KVPLAY_RANKING_DIR") or Path.home() / ".cache" / "kvplay" / "fragile").expanduser()


def _stored(fp: str) -> dict[str, list[int]]:
    """Rankings of the model with fingerprint fp measured before: the bundled seeds (SEEDS), then this
    machine's cache."""
    found = dict(json.loads(SEEDS.read_text()).get(fp, {})) if SEEDS.exists() else {}
    try:
        found.update(json.loads((ranking_dir() / f"{fp}.json").read_text()))
    except (OSError, ValueError):
        pass
    return found


stored_rankings = _stored      # public: scripts/rank_fragile.py ships what this machine has measured

def _keep(fp: str, rankings: dict[str, list[int]]) -> None:
    try:
        ranking_dir().mkdir(parents=True, exist_ok=True)
        (ranking_dir() / f"{fp}.json").write_text(json.dumps(rankings, indent=1))
    except OSError:
        pass          # a cache: a read-only home only means measuring again next time


def _model_store(model) -> tuple[str, dict]:
    """(fingerprint, what is kept for it), read once per model object."""
    if model not in _RANKINGS:
        fp = fingerprint(model)
        _RANKINGS[model] = fp, _stored(fp)
    return _RANKINGS[model]


def kept_value(model, key: str):
    """Another measurement kept beside the model's rankings under `key` (outliers.py's), or None."""
    return _model_store(model)[1].get(key)


def keep_value(model, key: str, value) -> None:
    """Keep `value` under `key` beside the model's rankings: in memory and in ranking_dir()."""
    fp, found = _model_store(model)
    found[key] = value
    _keep(fp, found)


def kept_ranking(model, spec, layers: list[int], part: str = "keys") -> list[int] | None:
    """The layers ranked for `part` as kept for this model (in memory, in ranking_dir() or in SEEDS), or None
    when ranking() would have to measure them: a kept exhaustive ranking comes first, then a kept Fisher one
    (only the one KVPLAY_RANKING names, when it is set)."""
    rankings = _model_store(model)[1]
    for method in (ranker(),) if os.environ.get("KVPLAY_RANKING") else ("exhaustive", "fisher"):
        if storage_key(spec, layers, part, method) in rankings:
            return rankings[storage_key(spec, layers, part, method)]
    return None


def ranking(model, tokenizer, spec, layers: list[int], part: str = "keys", progress=None) -> list[int]:
    """The layers ranked for `part`, measured once per model and storage_key and kept: in memory, in
    ranking_dir() and, for the catalogue's models, shipped in SEEDS (exhaustive: scripts/rank_fragile.py).
    What kept_ranking() finds comes first; where nothing is kept, rank_layers_fisher() measures one
    (rank_layers() under KVPLAY_RANKING=exhaustive, which also ignores kept Fisher rankings, as
    KVPLAY_RANKING=fisher ignores kept exhaustive ones). progress: theirs."""
    kept = kept_ranking(model, spec, layers, part)
    if kept is not None:
        return kept
    if tokenizer is None:
        raise KvplayError(f"{spec} ranks the model's layers on a calibration text, so it needs the tokenizer: "
                          "build_cache(spec, model, tokenizer=tok).")
    (fp, rankings), chosen = _RANKINGS[model], ranker()
    measure = rank_layers_fisher if chosen == "fisher" else rank_layers
    key = storage_key(spec, layers, part, chosen)
    rankings[key] = measure(model, tokenizer, spec, layers, part, progress)
    _keep(fp, rankings)
    return rankings[key]


def layer_bits(model, tokenizer, spec, layers: list[int], progress=None,
               taken: dict[int, int] | None = None) -> dict[str, dict[int, int]]:
    """{part: {layer index: its bits}} for the fragile_count() layers (of `layers`) that gain most, per part
    ("keys", "values"), at the fragile bits; a part without fragile layers maps to {}. taken: layers whose keys
    already have their bits (an adapting preset's outlier layers, methods/kvplay.py): they keep them, and the
    fragile keys are the next most gaining layers, so the count at each bit width depends on the counts alone.
    progress: rank_layers', for a ranking not measured before."""
    taken, bits = taken or {}, {}
    for part in PARTS:
        count = fragile_count(spec, len(layers), part)
        more = fragile_bits(spec, part)[2]
        skip = taken if part == "keys" else {}
        order = [i for i in ranking(model, tokenizer, spec, layers, part, progress) if i not in skip] if count else []
        bits[part] = {i: more for i in order[:count]} | skip
    return bits

"""Fragile layers: which layers' keys, and which layers' values, get more bits under kvplay's `fragile` options.

At 2 bits some layers' keys cost the logits far more than others'. `kvplay-int2:fragile=0.1,fragile_kbits=4`
stores the keys of the tenth of the layers (3 of SmolLM2's 30) that gain most from 4 bits at 4 bits, the
others' at 2. Values have their own share and bits (`vfragile`, `fragile_vbits`) and their own ranking: the
layers whose values need bits are not the ones whose keys do (on SmolLM2, values: 18, 24, 23, ...; keys at 3
against 4 bits: 8, 5, 3, ...). The rankings are measured once per model and storage format (under the preset's
own window: ranked_as), then kept (ranking() below: in memory, in ~/.cache/kvplay/fragile, and for the
catalogue's models shipped in assets/fragile_rankings.json):

  1. CALIBRATION_TOKENS tokens from the end of The Tempest, or CALIBRATION_BLOCKS blocks where blocks are
     longer (kvplay ppl reads the play from its start, so the two overlap only past 29,000 tokens; SmolLM2
     tokenizes the play into 31,443);
  2. one 16-bit forward gives the reference logits; then, for each layer and each of the low and high bits,
     one forward in which that layer alone attends to its keys (or values) as the engine stores them
     (rotation, sink, blocks; kvplay_attention's kvplay_probe hook in attention.py swaps them in), the other
     part exact;
  3. a layer's gain is how much the mean KL divergence from the reference logits drops with the extra bits.

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

from kvplay.cache import attention
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


def rank_layers(model, tokenizer, spec, layers: list[int], part: str = "keys", progress=None) -> list[int]:
    """`layers` ordered by how much the logits gain when that layer's keys (values) alone get the fragile bits
    (fragile_kbits, fragile_vbits) over the spec's (ranked_as(spec)'s). progress(fraction, what) before each of the
    2 x layers + 1 forwards (43 s for SmolLM2 over 512 tokens on 2 CPU cores, about 125 s over 2,048)."""
    spec = ranked_as(spec)
    if not attention.model_uses_it(model.config.get_text_config(decoder=True)):
        raise KvplayError(f"{spec} ranks layers through kvplay's attention: load the model with "
                          "attn_implementation='kvplay' (kvplay's own loader does), or use "
                          f"{_OPTIONS[part][0]}=0.")
    formats = {"low": KVPlayLayer(spec), "high": KVPlayLayer.with_bits(spec, part, fragile_bits(spec, part)[2])}
    tokens = max(CALIBRATION_TOKENS, CALIBRATION_BLOCKS * formats["low"].block)
    ids = calibration_ids(tokenizer, tokens).to(model.device)

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


def fingerprint(model) -> str:
    """A short hash naming a model's weights (names, dtypes, shapes and each tensor's first 64 KiB)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().reshape(-1)[:32768].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def storage_key(spec, layers: list[int], part: str = "keys") -> str:
    """What a ranking depends on: the part's storage (bits, grouping, fit, rotation, window) and the layers
    ranked (ranked_as(spec)'s). Keys' strings are the ones the seeds were first written with; values' start with
    "values:"."""
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


def ranking(model, tokenizer, spec, layers: list[int], part: str = "keys", progress=None) -> list[int]:
    """rank_layers(), measured once per model and storage_key: kept in memory, in ranking_dir() and, for the
    catalogue's models, shipped in SEEDS (scripts/rank_fragile.py measures them). progress: rank_layers'."""
    if model not in _RANKINGS:
        fp = fingerprint(model)
        _RANKINGS[model] = fp, _stored(fp)
    (fp, rankings), key = _RANKINGS[model], storage_key(spec, layers, part)
    if key not in rankings:
        if tokenizer is None:
            raise KvplayError(f"{spec} ranks the model's layers on a calibration text, so it needs the tokenizer: "
                              "build_cache(spec, model, tokenizer=tok).")
        rankings[key] = rank_layers(model, tokenizer, spec, layers, part, progress)
        _keep(fp, rankings)
    return rankings[key]


def layer_bits(model, tokenizer, spec, layers: list[int], progress=None) -> dict[str, dict[int, int]]:
    """{part: {layer index: the fragile bits}} for the fragile_count() layers (of `layers`) that gain most, per
    part ("keys", "values"); a part without fragile layers maps to {}. progress: rank_layers', for a ranking
    not measured before."""
    bits = {}
    for part in PARTS:
        count = fragile_count(spec, len(layers), part)
        more = fragile_bits(spec, part)[2]
        bits[part] = ({i: more for i in ranking(model, tokenizer, spec, layers, part, progress)[:count]}
                      if count else {})
    return bits

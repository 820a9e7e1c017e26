"""kvplay's own engine (kvplay/cache/engine.py): append-only blocks, a 16-bit window and sink,
keys grouped per channel (KIVI) and values per token by default, optional Hadamard rotation, or key rotations
calibrated per layer and KV head (rotations.py).

To add an option: add a field to KvplayOptions with option(...) (its default, valid values and
help), read it as spec.<name> in engine.py, and, if it does not apply to kvplay-fp8, set it to
None in that scheme's preset. The parser, the canonical spec string, the UI's Advanced
controls, the CLI help, the docs table and the sweeps' grids pick it up from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.cache import calibration_time, evict, fragile, outliers, rotations
from kvplay.cache.arch import Arch
from kvplay.cache.engine import KVPlayCache, KVPlayLayer
from kvplay.cache.evict import EVICT, EVICT_HELP, KEEP_HELP
from kvplay.cache.fragile import PARTS, fragile_bits, fragile_count, kept_ranking, layer_bits
from kvplay.cache.methods.base import (
    ATTENTION,
    ATTENTION_HELP,
    CacheBytes,
    CacheMethod,
    Scheme,
    option,
    register,
    require_group_divides,
    tensor_nbytes,
)
from kvplay.cache.quant import FITS, INT_BITS, METAS, meta_nbytes, packed_len
from kvplay.cache.store import TensorFormat
from kvplay.errors import KvplayError


@dataclass(frozen=True)
class KvplayOptions:
    group: int | None = option(64, lo=1, hi=4096, grid=(32, 64, 128), label="group size",
                               help="elements per quantization group; with channel grouping, tokens per block")
    residual: int = option(128, lo=0, hi=65536, grid=(0, 32, 128, 512), label="residual window (tokens)",
                           help="most recent tokens kept in 16-bit")
    keys: str | None = option("channel", choices=("channel", "token"), label="keys grouped per",
                              help="channel: groups span the tokens of a block (KIVI); token: groups span head_dim")
    values: str | None = option("token", choices=("channel", "token"), label="values grouped per",
                                help="channel: groups span the tokens of a block; token: groups span head_dim")
    rotation: str = option("none", choices=("none", "hadamard", "calibrated"), label="rotation",
                           help="hadamard spreads outlier channels before quantizing (needs an even head_dim); "
                                "calibrated: keys rotated per layer and KV head by rotations fitted once per model "
                                "to its queries (about 2 min for SmolLM2 on 2 CPU cores), values by Hadamard")
    sink: int = option(0, lo=0, hi=65536, grid=(0, 4, 16), label="sink tokens",
                       help="first tokens kept in 16-bit (attention sinks)")
    kbits: int | None = option(4, choices=INT_BITS, label="key bits", help="bits per key code")
    vbits: int | None = option(4, choices=INT_BITS, label="value bits", help="bits per value code")
    kfit: str | None = option("minmax", choices=FITS, label="key scale fit",
                              help="minmax: each group's range; mse: scale and zero refitted by least squares "
                                   "(same bytes, may clip)")
    vfit: str | None = option("minmax", choices=FITS, label="value scale fit",
                              help="minmax: each group's range; mse: scale and zero refitted by least squares "
                                   "(same bytes, may clip)")
    fragile: float | None = option(0.0, lo=0, hi=1, grid=(0.0, 0.1, 0.2), label="fragile layers (share)",
                                   help="this share of the layers (rounded to whole layers), those where more key bits "
                                        "cut the logits' KL most (measured once per model on a calibration text), "
                                        "store keys at fragile_kbits (when that is more than kbits)")
    fragile_kbits: int | None = option(4, choices=INT_BITS, label="fragile layers' key bits",
                                       help="bits per key code in the fragile layers")
    vfragile: float | None = option(0.0, lo=0, hi=1, grid=(0.0, 0.1, 0.2), label="fragile layers for values (share)",
                                    help="this share of the layers, those where more value bits cut the logits' KL "
                                         "most (ranked on their own, as for keys), store values at fragile_vbits "
                                         "(when that is more than vbits)")
    fragile_vbits: int | None = option(4, choices=INT_BITS, label="fragile layers' value bits",
                                       help="bits per value code in the values' fragile layers")
    adapt: float | None = option(0.0, lo=0, hi=1, grid=(0.0, 0.25), label="bits spent where the model needs them",
                                 help="up to this many more bits per element (all-in at 8k tokens) for the outlier "
                                      "layers, whose 4-bit keys, with 16-bit or 8-bit scales and zeros, would move "
                                      "over a quarter of their attention (found once per model in one 16-bit pass): "
                                      "their keys at 8 bits with 16-bit scales and zeros, as many of them as these "
                                      "bits pay for")
    vgroup: int | None = option(0, lo=0, hi=4096, label="value group size",
                                help="elements per value group when values are grouped per token and keys per "
                                     "channel (0: the group size); lets key blocks be longer than a head")
    kmeta: str | None = option("fp16", choices=METAS, label="key scales and zeros",
                               help="each key group's scale and zero: fp16 (4 bytes) or 8bit (a log-domain scale "
                                    "code and a zero in eighth steps, 2 bytes; no fused kernel yet)")
    vmeta: str | None = option("fp16", choices=METAS, label="value scales and zeros",
                               help="each value group's scale and zero: fp16 (4 bytes) or 8bit (2 bytes; as kmeta)")
    attention: str = option("fused", choices=ATTENTION, label="decode attention", help=ATTENTION_HELP)
    evict: str = option("none", choices=EVICT, label="eviction", help=EVICT_HELP)
    keep: float = option(1.0, lo=0.01, hi=1.0, grid=(0.5, 0.25, 0.125), label="tokens kept (share)",
                         help=KEEP_HELP)


_FP8 = dict(group=None, vgroup=None, keys=None, values=None, kbits=None, vbits=None, kfit=None, vfit=None,  # one format
            fragile=None, fragile_kbits=None, vfragile=None, fragile_vbits=None, kmeta=None, vmeta=None, adapt=None)
ADAPT = "; 8-bit keys with 16-bit scales and zeros in the layers whose 4-bit keys, with 16-bit or 8-bit scales " \
        "and zeros, would move over a quarter of their attention (found once per model), as many as 0.25 more bits " \
        "per element pay for"


class Kvplay(CacheMethod):
    name = "kvplay"
    order = 40
    description = "kvplay's engine: quantized once per block, 16-bit window and sink, KIVI grouping"
    Options = KvplayOptions
    schemes = (
        Scheme("kvplay-int8", "int", 8, "kvplay's engine, 8-bit integers", dict(group=64, kbits=8, vbits=8)),
        Scheme("kvplay-int4", "int", 4, "kvplay's engine, 4-bit: Hadamard-rotated, keys per channel, values per "
               "token (KIVI), 4 sink tokens, fitted value scales" + ADAPT,
               dict(group=64, kbits=4, vbits=4, sink=4, residual=124, vfit="mse", rotation="hadamard", adapt=0.25)),
        Scheme("kvplay-int3", "int", 3, "kvplay's engine, 3-bit, bit-packed", dict(group=32, kbits=3, vbits=3)),
        Scheme("kvplay-int2", "int", 2, "kvplay's engine, 2-bit: Hadamard-rotated, keys per channel, values per "
               "token (KIVI), 4 sink tokens, fitted value scales, 4-bit keys in the tenth of the layers that "
               "need them most", dict(group=32, kbits=2, vbits=2, sink=4, residual=124, vfit="mse",
                                      rotation="hadamard", fragile=0.1)),
        Scheme("kvplay-3bit", "int", 3, "kvplay's engine at 3.5 bits per element all-in at 8k tokens, bits where "
               "each layer needs them: keys per channel in blocks of 128 at 4 bits in the 60% of the layers that "
               "need them most and 3 bits in the rest, values per token in groups of 64 at 4 bits in the fifth of "
               "the layers that need them most and 2 bits in the rest (both rankings measured once per model), "
               "8-bit scales and zeros, keys rotated per layer and KV head by rotations fitted once per model, "
               "values Hadamard-rotated, 4 sink tokens, fitted value scales" + ADAPT + "; fused decode",
               dict(group=128, vgroup=64, kbits=3, vbits=2, fragile=0.6, fragile_kbits=4, vfragile=0.2,
                    fragile_vbits=4, sink=4, residual=124, vfit="mse", rotation="calibrated", kmeta="8bit",
                    vmeta="8bit", adapt=0.25)),
        Scheme("kvplay-2.5bit", "int", 2, "kvplay's engine at quanto-int2's 2.5 bits per element all-in at 8k "
               "tokens: keys per channel in blocks of 64 at 3 bits in the quarter of the layers that need them most "
               "and 2 bits in the rest, 2-bit values per token in groups of 64, 8-bit scales and zeros, scales and "
               "zeros of keys and values fitted by least squares, keys rotated per layer and KV head by rotations "
               "fitted once per model, values Hadamard-rotated, 4 sink tokens and a 32-token window" + ADAPT +
               "; fused decode",
               dict(group=64, vgroup=64, kbits=2, vbits=2, fragile=0.25, fragile_kbits=3, sink=4, residual=32,
                    kfit="mse", vfit="mse", rotation="calibrated", kmeta="8bit", vmeta="8bit", adapt=0.25)),
        Scheme("kvplay-fp8", "fp8", 8, "kvplay's engine, float8 e4m3 with a per-token scale", _FP8),
    )
    layer_types = (KVPlayLayer,)
    shares_prefill = True          # an empty KVPlayLayer hands attention its window: the 16-bit states given
    colour_family, line_dash, marker = "purple", "solid", "circle"
    window = "slide"               # a token is quantized once, when it leaves the 16-bit window
    family = "kvplay's engine"

    def check_model(self, spec, config) -> None:
        super().check_model(spec, config)
        evict.check_model(spec, config, decode_ok=False, where="kvplay's quantized blocks (dropping one token would "
                                                               "mean re-quantizing its block)")

    def check(self, spec, arch) -> None:
        if spec.scheme.fmt == "int":
            if spec.vgroup and (spec.keys, spec.values) != ("channel", "token"):
                raise KvplayError(f"{spec}: vgroup applies when keys are grouped per channel and values per token.")
            for part, grouping, group in (("keys", spec.keys, spec.group),
                                          ("values", spec.values, spec.vgroup or spec.group)):
                if grouping == "token":
                    require_group_divides(spec, group, arch.head_dim, f"when {part} are grouped per token")
        if spec.rotation in ("hadamard", "calibrated") and arch.head_dim % 2:
            raise KvplayError(f"{spec}: {spec.rotation.capitalize()} rotation needs an even head_dim, and this "
                              f"model's is {arch.head_dim}.")
        if spec.rotation == "calibrated" and (spec.scheme.fmt != "int" or spec.keys != "channel"):
            raise KvplayError(f"{spec}: rotation=calibrated fits key rotations to blocks of keys grouped per channel; "
                              "use keys=channel, or rotation=hadamard.")

    def build(self, spec, model, tokenizer=None, progress=None):
        if evict.policy_of(spec) is not None:
            self.check_model(spec, model.config)         # a user's own build_cache too: no queries, no eviction
        config = model.config.get_text_config(decoder=True)
        layers = _full_attention(config)
        outlying = adapted_layers(spec, model, tokenizer, progress)
        bits = layer_bits(model, tokenizer, spec, layers, progress,     # first: its pass has the rotations' keys
                          {i: outliers.BITS for i in outlying})
        fits = rotations.key_rotations(model, tokenizer, spec, layers, progress) \
            if spec.rotation == "calibrated" else None
        return KVPlayCache(spec, config, bits["keys"], bits["values"], fits,
                           {i: outliers.META for i in outlying})

    def calibrate(self, spec, model, tokenizer=None, progress=None) -> None:
        """The outlier layers, the fragile layers' rankings (fragile.py) and the key rotations under
        rotation=calibrated (rotations.py), once per model and storage; the catalogue's models ship theirs."""
        self.build(spec, model, tokenizer, progress)

    def calibrated(self, spec, model) -> bool:
        layers = _full_attention(model.config.get_text_config(decoder=True))
        arch = Arch.from_config(model.config)
        if adapt_limit(spec, arch) and arch.key_outliers is None and outliers.kept(model) is None:
            return False                                  # the outlier layers: one 16-bit pass, not yet run
        return (all(kept_ranking(model, spec, layers, part) is not None for part in PARTS
                    if fragile_count(spec, len(layers), part))
                and (spec.rotation != "calibrated" or rotations.rotations_kept(model, spec, layers)))

    def calibration_parts(self, spec, model) -> dict[str, float]:
        config, parts, ct = model.config, {}, calibration_time
        layers = _full_attention(config.get_text_config(decoder=True))
        device, arch = model.device.type, Arch.from_config(config)
        if adapt_limit(spec, arch) and arch.key_outliers is None and outliers.kept(model) is None:
            parts["outlier pass"] = ct.seconds("pass", ct.pass_flops(config, outliers.TOKENS) / 3, device)
        ranked = [part for part in PARTS if fragile_count(spec, len(layers), part)
                  and kept_ranking(model, spec, layers, part) is None]
        ranker = fragile.ranker() if ranked else None
        tokens = fragile.fisher_tokens(spec)
        passing = ranker == "fisher" and not fragile.fisher_pass_kept(model, layers, tokens)
        if ranker == "exhaustive":
            for part in ranked:
                flops = (2 * len(layers) + 1) * ct.pass_flops(config, fragile.exhaustive_tokens(spec)) / 3
                parts[fragile.storage_key(spec, layers, part)] = ct.seconds("pass", flops, device)
        if passing:
            parts[f"Fisher pass over {tokens} tokens"] = ct.seconds("pass", ct.pass_flops(config, tokens), device) + \
                ct.seconds("logits", ct.logit_elements(config, tokens), device)
        if ranker == "fisher":
            weigh, rank = ct.rank_probe(spec, tuple(ranked), config, device)
            factor = ct.MINIATURE_FACTOR
            if passing:
                parts[f"Fisher weights over {tokens} tokens"] = factor["weigh"] * len(layers) * weigh
            parts[" + ".join(fragile.storage_key(spec, layers, part, "fisher") for part in ranked)] = \
                factor["rank"] * len(layers) * rank
        if spec.rotation == "calibrated" and not rotations.rotations_kept(model, spec, layers):
            fitter = rotations.chosen_fitter()
            key = rotations.storage_key(spec, layers, fitter)
            parts[key] = ct.rotation_seconds(config, len(layers), fitter.block(spec.group), spec.sink, fitter,
                                             device)
            if not (passing and tokens == fragile.FISHER_TOKENS) and not fragile.fisher_pass_kept(model, layers):
                # its queries need a forward of their own
                parts[f"forward for {key}"] = ct.seconds("pass", ct.pass_flops(config) / 3, device)
        return parts

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (pk, mk), (pv, mv) = layer.store_k.nbytes(), layer.store_v.nbytes()
        sixteen = (layer.sink_k, layer.sink_v, layer.keys, layer.values)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sixteen if t.numel()}
        return CacheBytes(pk + pv, mk + mv, tensor_nbytes(*sixteen),
                          allocated=layer.store_k.allocated() + layer.store_v.allocated() + sum(storages.values()))

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        streams = batch * arch.kv_heads                      # independent (sequence, head) streams of a layer
        layer = KVPlayLayer(spec)
        tokens = evict.stored_tokens(spec, tokens, prefill)          # an evicting cache holds only what it kept
        sink = min(tokens, spec.sink)
        quantized = layer.block * (max(0, tokens - sink - spec.residual) // layer.block)
        window = tokens - sink - quantized
        total = CacheBytes(full_precision=2 * arch.layers * streams * (sink + window) * arch.head_dim * dtype_bytes)
        # Keys and values add up layer by layer, so which layers are fragile does not change the bytes: only
        # how many are, per part and bit width (an adapting preset's outlier layers' keys at 8 bits, then the
        # fragile layers among the rest: fragile.layer_bits).
        for part in PARTS:
            outlying = adapted_count(spec, arch) if part == "keys" else 0
            fragile = min(fragile_count(spec, arch.layers, part), arch.layers - outlying)
            for layers, fmt in ((arch.layers - fragile - outlying, KVPlayLayer(spec).fmt(part)),
                                (fragile, KVPlayLayer.with_bits(spec, part, fragile_bits(spec, part)[2]).fmt(part)),
                                (outlying, outlier_keys(spec))):
                payload, meta = stored_bytes(fmt, quantized, arch.head_dim)
                total += CacheBytes(payload=layers * streams * payload, metadata=layers * streams * meta)
        return total

    def dequantized_kv(self, layer):
        return layer.assemble("keys"), layer.assemble("values")


def stored_bytes(fmt: TensorFormat, tokens: int, head_dim: int) -> tuple[int, int]:
    """(payload, metadata) for `tokens` quantized tokens of one head (tokens a multiple of the block)."""
    if fmt.fmt == "fp8":
        return tokens * head_dim, tokens * 2
    meta = meta_nbytes(fmt.meta)   # one group's scale and zero
    if fmt.grouping == "channel":  # codes packed along head_dim; one scale and zero per channel per block
        return tokens * packed_len(head_dim, fmt.bits), (tokens // fmt.group) * head_dim * meta
    groups = head_dim // fmt.group
    return tokens * groups * packed_len(fmt.group, fmt.bits), tokens * groups * meta


METHOD = register(Kvplay())

ADAPT_CONTEXT = 8192     # the context a preset's bits per element are quoted at ("all-in at 8k tokens")


def adapt_limit(spec, arch) -> int:
    """How many layers' keys an adapting spec may store at outliers.BITS: as many as `adapt` more bits per element
    pay for, all-in at ADAPT_CONTEXT tokens (0 without adapt: Qwen2.5's 24 layers at 4 bits: 3; Gemma 3's 3 global
    layers: 0)."""
    if not getattr(spec.options, "adapt", None) or spec.scheme.fmt != "int":
        return 0
    layer = KVPlayLayer(spec)
    quantized = layer.block * (max(0, ADAPT_CONTEXT - spec.sink - spec.residual) // layer.block)
    more = [sum(stored_bytes(fmt, quantized, arch.head_dim)) for fmt in (layer.key_fmt, outlier_keys(spec))]
    per_layer = 8 * arch.kv_heads * (more[1] - more[0]) / arch.elements(ADAPT_CONTEXT)
    return int(spec.adapt / per_layer + 1e-9) if per_layer > 0 else 0


def outlier_keys(spec) -> TensorFormat:
    """How an adapting spec stores an outlier layer's keys: outliers.BITS codes with outliers.META scales and zeros,
    grouped as the spec's other keys."""
    return KVPlayLayer(spec, key_bits=outliers.BITS, key_meta=outliers.META).key_fmt


def adapted_count(spec, arch) -> int:
    """How many layers' keys the spec stores at outliers.BITS on a model of this arch: its outlier layers
    (arch.key_outliers, as measured), up to adapt_limit(); 0 where they were not measured."""
    return min(len(arch.key_outliers or ()), adapt_limit(spec, arch))


def adapted_layers(spec, model, tokenizer=None, progress=None) -> list[int]:
    """The layers whose keys the spec stores at outliers.BITS on this model: the outlier layers found once per
    model (outliers.find), most outlying first, up to adapt_limit()."""
    limit = adapt_limit(spec, Arch.from_config(model.config))
    if not limit:
        return []
    return list(outliers.layers(model, tokenizer, type(spec)(outliers.REFERENCE), progress))[:limit]


def _full_attention(config) -> list[int]:
    """The indices of the model's full-attention layers (the ones a KVPlayCache quantizes)."""
    return outliers.full_attention(config)

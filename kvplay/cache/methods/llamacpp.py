"""llama.cpp's KV-cache types (`-ctk/-ctv`, Ollama, LM Studio), emulated exactly in kvplay's engine.

Each token's keys and values are quantized the moment they arrive, in ggml's 32-element blocks along
head_dim (kvplay/cache/ggml.py: layouts, reference quantizers, exact bytes); llama.cpp keeps no 16-bit
window and no sink, so prefill and every decode step attend to the quantized history, the new tokens
included. Keys and values take their own types (`ctk`, `ctv`), as in llama.cpp. `attn_rot=auto` is
llama.cpp's default since PR #21038: a quantized K (V) is Hadamard-rotated in chunks along head_dim before
it is stored when head_dim is a multiple of 64; `attn_rot=off` is LLAMA_ATTN_ROT_DISABLE=1.

`first_last=TYPE` (with `first_last_n=N`, 2 by default) stores the keys and values of the first N and the last N
layers as TYPE, ik_llama.cpp's mixed KV cache (ik_llama#1599: `-ctk-first TYPE,N -ctk-last TYPE,N -ctv-first
TYPE,N -ctv-last TYPE,N`); llama_kv_cache_init in ikawrakow/ik_llama.cpp src/llama.cpp @ 8337e4cd3861 gives layer
i the first type when i < N and the last type when i >= n_layer - N, counting every layer. Only the choice of
layers is ik_llama.cpp's: the types stay mainline llama.cpp's reference quantizers and rotation, whereas
ik_llama.cpp rotates only with -khad/-vhad and has its own q4_0 KV quantizer (ik_llama#1547), so no engine runs
exactly this spec. kvplay keeps sliding-window layers 16-bit and its byte formula cannot tell which of them sit at
the ends, so first_last runs on models without sliding-window layers only.

The blocks live in the engine's append-only BlockStore (one-token blocks). Decode attention, with
`attention=fused` (the default) on a model whose attention implementation is "kvplay" and quantized keys and
values (any of q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, rotated or not), runs kvplay's fused CPU kernel straight
on the ggml codes (attention.py, csrc/attend.c): the cache hands attention placeholders and no 16-bit copy of
the history is made. An f16 part, `attention=sdpa`, prefill and GPU steps dequantize the history, then run
sdpa; the cache's description says which path it takes. What is not emulated: llama.cpp's CPU flash
attention also quantizes the query to q8_0 for the K dot products, and accumulates in its own order (the
fused kernel accumulates in float32 in its own order too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvplay.cache import attention, ggml
from kvplay.cache.arch import Arch
from kvplay.cache.engine import CountingLayer
from kvplay.cache.methods.base import ATTENTION, ATTENTION_HELP, CacheBytes, CacheMethod, Scheme, option, register
from kvplay.cache.store import BlockStore
from kvplay.errors import KvplayError

_TYPE_HELP = "llama.cpp cache type (f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl): ggml's 32-element blocks per token"


@dataclass(frozen=True)
class LlamaCppOptions:
    ctk: str = option("q8_0", choices=ggml.TYPES, label="key type (-ctk)", help="keys: " + _TYPE_HELP)
    ctv: str = option("q8_0", choices=ggml.TYPES, label="value type (-ctv)", help="values: " + _TYPE_HELP)
    attn_rot: str = option("auto", choices=("auto", "off"), label="Hadamard rotation (attn_rot)",
                           help="auto: llama.cpp's default, a quantized K or V is Walsh-Hadamard-rotated when head_dim "
                                "is a multiple of 64 (K in the largest power-of-two chunks, V in 64s); off: "
                                "LLAMA_ATTN_ROT_DISABLE=1")
    attention: str = option("fused", choices=ATTENTION, label="decode attention", help=ATTENTION_HELP)
    first_last: str = option("none", choices=("none",) + ggml.TYPES, label="first/last layers' type (ik_llama.cpp)",
                             help="none, or the type of the keys and values of the first and last first_last_n "
                                  "layers: ik_llama.cpp's -ctk-first/-ctk-last/-ctv-first/-ctv-last TYPE,N (#1599)")
    first_last_n: int = option(2, lo=1, hi=64, grid=(1, 2, 4), label="first/last layers",
                               help="how many layers at each end take first_last (the N of TYPE,N)")


@dataclass(frozen=True)
class GgmlFormat:
    """One ggml cache type as a BlockStore format: encode (B, H, n, 1, D) float32 -> parts (B, H, n, 1, ...)."""

    kind: str

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ggml.quantize(x, self.kind)

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """stored parts of n one-token blocks -> out (B, H, n, D) in out's dtype."""
        out.copy_(ggml.dequantize(stored, self.kind).flatten(2, 3))


def part_rotation(spec, kind: str, head_dim: int, part: str, device) -> torch.Tensor | None:
    """The (D, D) rotation llama.cpp applies to this part ("k" or "v") before storing it, or None."""
    n = ggml.rotation_size(head_dim, part)
    if spec.attn_rot == "off" or not ggml.quantized(kind) or n is None:
        return None
    return ggml.rotation(head_dim, n, device)


def layer_type_pairs(spec) -> list[tuple[str, str]]:
    """The (K, V) types the spec's layers take: (ctk, ctv), and the edges' (first_last, first_last) if set."""
    return [(spec.ctk, spec.ctv)] + ([(spec.first_last,) * 2] if spec.first_last != "none" else [])


def edge_layers(spec, layers: int) -> set[int]:
    """The layers ik_llama.cpp gives the first/last type: i < N or i >= layers - N, of all `layers`."""
    if spec.first_last == "none":
        return set()
    n = spec.first_last_n
    return {i for i in range(layers) if i < n or i >= layers - n}


def fused_decode(spec, config) -> tuple[bool, str]:
    """Whether decode attention reads the ggml codes with kvplay's fused kernel for this spec and model, and if
    not, why."""
    config = config.get_text_config(decoder=True)
    if spec.attention != "fused":
        return False, "attention=sdpa"
    if not attention.model_uses_it(config):
        return False, f"the model's attention implementation is {config._attn_implementation!r}, not 'kvplay'"
    arch = Arch.from_config(config)
    if not all(attention.covers_ggml(k, v, arch.head_dim) for k, v in layer_type_pairs(spec)):
        return False, ("the fused kernel reads quantized ggml types only, not f16, at head_dim up to "
                       f"{attention.MAX_HEAD_DIM}")
    if config.num_attention_heads // arch.kv_heads > attention.MAX_GROUP:
        return False, f"the fused kernel serves at most {attention.MAX_GROUP} query heads per KV head"
    return True, ""


class LlamaCppLayer(CountingLayer):
    """One decoder layer: keys and values as ggml blocks, one BlockStore each, every token stored on arrival.

    fused (set by the cache, see fused_decode): a CPU decode step hands attention placeholders over the stores
    (attention.DecodeView: N one-token blocks, no sink, no window) instead of the dequantized history.
    """

    def __init__(self, spec, fused: bool = False, types: tuple[str, str] | None = None):
        super().__init__()
        self.spec = spec
        self.seen = 0
        self.fused = fused
        self.ctk, self.ctv = types or (spec.ctk, spec.ctv)           # this layer's (first_last: the edges' type)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        d = key_states.shape[-1]
        self.keys = self.values = key_states.new_empty(key_states.shape[:2] + (0, d))   # (B, H, 0, D): nothing 16-bit
        self.store_k = BlockStore(GgmlFormat(self.ctk), 1, d)
        self.store_v = BlockStore(GgmlFormat(self.ctv), 1, d)
        self.rot_k = part_rotation(self.spec, self.ctk, d, "k", self.device)
        self.rot_v = part_rotation(self.spec, self.ctv, d, "v", self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> every stored key and value, dequantized, (B, H, seen, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        for store, x, rot in ((self.store_k, key_states, self.rot_k), (self.store_v, value_states, self.rot_v)):
            x = x.float()
            if not torch.isfinite(x).all():
                raise KvplayError("The model produced NaN or inf keys/values; they cannot be quantized.")
            store.append((x if rot is None else x @ rot).unsqueeze(3))               # (B, H, T, 1, D)
        if self.fused and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            none = key_states[:, :, :0]                                               # (B, H, 0, D): no sink, no window
            return attention.DecodeView(none, none, none, none, self.store_k, self.store_v, self.store_k.n_blocks, 1,
                                        self.rot_k, (self.ctk, self.ctv), self.rot_v).placeholders()
        return self.read(self.store_k, self.rot_k), self.read(self.store_v, self.rot_v)

    def read(self, store: BlockStore, rot: torch.Tensor | None) -> torch.Tensor:
        """What attention gets: the stored history (B, H, seen, D) in the model's dtype, rotation undone."""
        if rot is None:
            return store.dequantize(self.dtype)
        return (store.dequantize(torch.float32) @ rot).to(self.dtype)                # R is its own inverse

    def crop(self, tokens_to_remove: int) -> None:
        raise KvplayError("llama.cpp's emulated cache stores every token quantized; it cannot be cropped.")

    def _select(self, fn) -> None:
        for store in (self.store_k, self.store_v):
            fn(store)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(lambda s: s.select_batch(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(lambda s: s.select_batch(torch.as_tensor(indices, device=self.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(lambda s: s.repeat_batch(repeats))


def _store_nbytes(store: BlockStore) -> tuple[int, int, int]:
    """(payload, metadata, full_precision) bytes in use of one store (f16 counts as 16-bit tokens)."""
    kind = store.fmt.kind
    sizes = {name: t.numel() * t.element_size() for name, t in zip(ggml.PARTS[kind], store.used())}
    if kind == "f16":
        return 0, 0, sizes.get("x", 0)
    meta = sum(v for k, v in sizes.items() if k in ggml.METADATA)
    return sum(sizes.values()) - meta, meta, 0


def _type_scheme(kind: str, bits: int) -> Scheme:
    return Scheme(f"llamacpp-{kind}", "ggml", bits,
                  f"llama.cpp's {kind} cache type ({ggml.bits_per_element(kind):g} bits), emulated: every token "
                  "in ggml's 32-element blocks as it arrives, Hadamard-rotated as llama.cpp does by default",
                  dict(ctk=kind, ctv=kind))


class LlamaCpp(CacheMethod):
    name = "llamacpp"
    order = 50
    family = "llama.cpp / Ollama / LM Studio"
    colour_family, line_dash, marker = "indigo", "dashdot", "star"
    description = ("llama.cpp's cache types (-ctk/-ctv), emulated exactly: ggml's blocks and reference rounding, "
                   "no 16-bit window, Hadamard rotation by default")
    Options = LlamaCppOptions
    schemes = tuple(_type_scheme(k, b) for k, b in
                    (("q8_0", 8), ("q5_1", 5), ("q5_0", 5), ("q4_1", 4), ("iq4_nl", 4), ("q4_0", 4)))
    layer_types = (LlamaCppLayer,)

    def check(self, spec, arch) -> None:
        for part, kind in (("key", spec.ctk), ("value", spec.ctv), ("first/last layers'", spec.first_last)):
            if kind != "none" and ggml.quantized(kind) and arch.head_dim % ggml.QK:
                raise KvplayError(f"{spec}: llama.cpp's {kind} {part} cache needs head_dim to be a multiple of "
                                  f"{ggml.QK}, and this model's is {arch.head_dim}.")
        if spec.first_last != "none" and arch.sliding_layers:
            raise KvplayError(f"{spec}: ik_llama.cpp picks its first and last {spec.first_last_n} layers among all "
                              f"{arch.layers + arch.sliding_layers}, sliding ones included, and kvplay keeps this "
                              f"model's {arch.sliding_layers} sliding-window layers 16-bit without a byte formula "
                              "that knows where they sit, so first_last runs only on models without them.")

    def build(self, spec, model, tokenizer=None):
        config = model.config.get_text_config(decoder=True)
        layers = []
        fused, why = fused_decode(spec, config)
        kinds, kwargs_list = get_layer_types_and_kwargs(config)
        edges = edge_layers(spec, len(kinds))
        for i, (kind, kwargs) in enumerate(zip(kinds, kwargs_list)):
            if kind == "full_attention":
                layers.append(LlamaCppLayer(spec, fused, (spec.first_last,) * 2 if i in edges else None))
            elif kind in ("sliding_attention", "chunked_attention") and kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))      # bounded: kept 16-bit
            else:
                raise KvplayError(f"{spec}: kvplay's llama.cpp emulation does not support {kind!r} layers.")
        cache = Cache(layers=layers)
        d = Arch.from_config(config).head_dim
        rot = [f"{p} in chunks of {ggml.rotation_size(d, p.lower())}" for p, kind in (("K", spec.ctk), ("V", spec.ctv))
               if spec.attn_rot == "auto" and ggml.quantized(kind) and ggml.rotation_size(d, p.lower())]
        split = Arch.from_config(config).layer_split()
        edge = (f" (layers {', '.join(map(str, sorted(edges)))}: K and V {spec.first_last}, as ik_llama.cpp's "
                "-ctk-first/-last and -ctv-first/-last)") if edges else ""
        cache.description = (f"{spec}: K {spec.ctk}, V {spec.ctv}{edge}, every token quantized on arrival"
                             + (f" ({split})" if split else "") + "; Hadamard "
                             f"rotation: {', '.join(rot) or 'none'}; decode attention: " + (
                                 "fused from the ggml codes (on CPU)" if fused else f"dequantize then attend ({why})"))
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        (pk, mk, fk), (pv, mv, fv) = _store_nbytes(layer.store_k), _store_nbytes(layer.store_v)
        return CacheBytes(pk + pv, mk + mv, fk + fv,
                          allocated=layer.store_k.allocated() + layer.store_v.allocated())

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        edges = len(edge_layers(spec, arch.layers))                           # no sliding layers with first_last
        total = CacheBytes()
        for layers, kinds in zip((arch.layers - edges, edges), layer_type_pairs(spec)):
            rows = layers * batch * arch.kv_heads * tokens                  # token rows of K (and of V)
            for kind in kinds:
                payload, meta = ggml.row_nbytes(kind, arch.head_dim)
                total += CacheBytes(0, 0, rows * payload) if kind == "f16" else CacheBytes(rows * payload, rows * meta)
        return total

    def dequantized_kv(self, layer):
        return layer.read(layer.store_k, layer.rot_k), layer.read(layer.store_v, layer.rot_v)

    def key_grouping(self, spec) -> tuple[str, int, bool]:
        """For the Inside tab's outlier risk (inside.key_grouping): keys in per-token blocks of 32 elements."""
        if spec.ctk == "f16":
            return "float", 16, False
        return "token", ggml.CODE_BITS[spec.ctk], spec.attn_rot == "auto"

    def engine_name(self, spec) -> str | None:
        types = spec.ctk if spec.ctk == spec.ctv else f"-ctk {spec.ctk} -ctv {spec.ctv}"
        edges = f", first and last {spec.first_last_n} layers {spec.first_last}" if spec.first_last != "none" else ""
        return f"llama.cpp {types}{edges}" + ("" if spec.attn_rot == "auto" else " unrotated") + ", emulated"

    def own_recipe(self, spec) -> tuple[str, str] | None:
        """llama.cpp's own flags: this spec is its cache types, emulated exactly (none with first_last, which only
        ik_llama.cpp offers, with its own rotation and q4_0 quantizer)."""
        if spec.first_last != "none":
            return None
        env = "LLAMA_ATTN_ROT_DISABLE=1 " if spec.attn_rot == "off" else ""
        return "llama.cpp", f"{env}llama-server -ctk {spec.ctk} -ctv {spec.ctv} -fa on"

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        if spec.first_last != "none":
            t, n = spec.first_last, spec.first_last_n
            return (super().snippet(spec, max_new_tokens, load) +
                    "# the nearest real engine, ik_llama.cpp (#1599): llama-server -m model.gguf -fa on "
                    f"-ctk {spec.ctk} -ctv {spec.ctv} -ctk-first {t},{n} -ctk-last {t},{n} "
                    f"-ctv-first {t},{n} -ctv-last {t},{n}\n"
                    "# (add -khad -vhad for its Hadamard rotation; its own rotation and q4_0 quantizer are not "
                    "kvplay's)\n")
        return (super().snippet(spec, max_new_tokens, load) +
                f"# the real engine: llama-cli -m model.gguf -fa on -ctk {spec.ctk} -ctv {spec.ctv}"
                + (" (with LLAMA_ATTN_ROT_DISABLE=1)" if spec.attn_rot == "off" else "") + "\n")


METHOD = register(LlamaCpp())

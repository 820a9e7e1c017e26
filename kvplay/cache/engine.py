"""kvplay's own quantized KV cache.

What it fixes in transformers' QuantizedCache (see docs/benchmark-analysis.md and README.md):
  1. the prompt is not quantized wholesale at prefill: the last `residual` tokens
     of any update, prefill included, stay in full precision;
  2. storage is append-only: a token is quantized once, in a block, when it leaves
     the full-precision window, and never again (no O(n) re-quantization per flush);
  3. keys are grouped per channel across the tokens of a block (KIVI), values per token.

Token layout of one layer, oldest first:

    [ sink (S tokens, 16-bit) | quantized blocks (n_blocks x block) | window (>= R tokens, 16-bit) ]

update() returns full-precision keys and values in that order, so every attention
implementation works unchanged, and only one layer's history is dequantized at a time.
On a CPU decode step of a model whose attention implementation is "kvplay" (attention.py),
it returns placeholders instead and attention reads the packed codes directly: no 16-bit
copy of the history is made (KVPlayCache.description says which path a cache takes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer, get_layer_types_and_kwargs

from kvplay.cache import attention, evict, quant
from kvplay.cache.arch import Arch
from kvplay.cache.store import BlockStore, TensorFormat, assemble
from kvplay.errors import KvplayError

if TYPE_CHECKING:
    from kvplay.cache.spec import CacheSpec


class CountingLayer(DynamicLayer):
    """A DynamicLayer that keeps its own stores and counts the tokens it has seen in `self.seen`: the
    bookkeeping generate() needs, shared by kvplay's engine and the emulated engine formats."""

    seen: int = 0

    def get_seq_length(self) -> int:
        return self.seen

    def stored(self) -> int:
        """Tokens held now: those seen, unless the layer evicts (kvplay.cache.evict)."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.seen = 0


class StoredLayer(CountingLayer):
    """A CountingLayer whose keys and values live in two BlockStores of one token per block (`store_k`, `store_v`,
    in the formats the subclass's `formats` names), nothing kept 16-bit, every token stored as it arrives and read
    back dequantized: the one update of the emulated engine formats that attend to the cache they have just
    written (vLLM's). `prepare` turns the states into what the stores' format encodes."""

    def formats(self) -> tuple[object, object]:
        """The keys' and values' BlockStore formats (self.device is set)."""
        raise NotImplementedError

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        d = key_states.shape[-1]
        self.keys = self.values = key_states.new_empty(key_states.shape[:2] + (0, d))   # nothing kept 16-bit
        key_fmt, value_fmt = self.formats()
        self.store_k, self.store_v = BlockStore(key_fmt, 1, d), BlockStore(value_fmt, 1, d)
        self.is_initialized = True

    def prepare(self, states: torch.Tensor) -> torch.Tensor:
        return states.float()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> every stored key and value, dequantized, (B, H, seen, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.store_k.append(self.prepare(key_states).unsqueeze(3))                   # (B, H, T, 1, D)
        self.store_v.append(self.prepare(value_states).unsqueeze(3))
        return self.store_k.dequantize(self.dtype), self.store_v.dequantize(self.dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for store in (self.store_k, self.store_v):
                store.select_batch(beam_idx)


def rotations(spec: CacheSpec, head_dim: int, device, key_rotation: torch.Tensor | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(keys' rotation, values' rotation) under spec.rotation, float32 on device: none, (None, None); hadamard, one
    (D, D) Hadamard matrix for both; calibrated, key_rotation (Hkv, D, D) for the keys, one per KV head, and the
    Hadamard matrix for the values."""
    if spec.rotation in (None, "none"):
        return None, None
    try:
        hadamard = quant.hadamard(head_dim, device=device)
    except ValueError as exc:
        raise KvplayError(str(exc)) from exc
    if spec.rotation != "calibrated":
        return hadamard, hadamard
    if key_rotation is None:
        raise KvplayError(f"{spec}: rotation=calibrated needs the model's calibrated key rotations: build the cache "
                          "with build_cache(spec, model, tokenizer), which measures them once per model.")
    return key_rotation.to(device=device, dtype=torch.float32).contiguous(), hadamard


class KVPlayLayer(CountingLayer):
    """One decoder layer's cache. Initialises lazily on the device and dtype of its first keys.

    The spec is taken as checked against the model (group sizes, rotation): build_cache and the runners
    check each spec once, at the edge (Kvplay.check in methods/kvplay.py). key_bits and value_bits override
    spec.kbits and spec.vbits (a fragile layer's keys or values, see fragile.py), key_meta spec.kmeta (an outlier
    layer's keys, outliers.py). key_rotation (Hkv, D, D): this
    layer's keys' rotations under rotation=calibrated, one per KV head (rotations.py); required there, unused
    otherwise.
    """

    def __init__(self, spec: CacheSpec, key_bits: int | None = None, value_bits: int | None = None,
                 key_rotation: torch.Tensor | None = None, key_meta: str | None = None):
        super().__init__()
        self.spec = spec
        self.key_rotation = key_rotation
        fp8 = spec.scheme.fmt == "fp8"
        self.key_fmt = TensorFormat("fp8", 8, "token", 1) if fp8 else \
            TensorFormat("int", key_bits or spec.kbits, spec.keys, spec.group, spec.kfit or "minmax",
                         key_meta or spec.kmeta or "fp16")
        self.value_fmt = TensorFormat("fp8", 8, "token", 1) if fp8 else \
            TensorFormat("int", value_bits or spec.vbits, spec.values, spec.vgroup or spec.group, spec.vfit or "minmax",
                         spec.vmeta or "fp16")
        # Tokens leave the window in blocks; channel grouping needs `group` tokens per block.
        self.block = spec.group if "channel" in (self.key_fmt.grouping, self.value_fmt.grouping) else 1
        self.residual = spec.residual
        self.sink_len = spec.sink
        self.rotation_k: torch.Tensor | None = None      # (D, D) or (Hkv, D, D), set at lazy_initialization
        self.rotation_v: torch.Tensor | None = None      # (D, D)
        self.seen = 0
        self.fused = False          # set by KVPlayCache: decode attention reads the codes (attention.py)
        self.policy = evict.policy_of(spec)     # keeps only some of the prompt's tokens (evict/), or None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None   # the prompt, until the policy has scored it
        self.kept_index: torch.Tensor | None = None                       # (B, H, kept) prompt positions it kept

    @classmethod
    def with_bits(cls, spec: CacheSpec, part: str, bits: int | None) -> KVPlayLayer:
        """A layer whose `part` ("keys" or "values") is stored at `bits` (None: the spec's)."""
        return cls(spec, key_bits=bits) if part == "keys" else cls(spec, value_bits=bits)

    def fmt(self, part: str) -> TensorFormat:
        """The TensorFormat of `part`: "keys" or "values"."""
        return self.key_fmt if part == "keys" else self.value_fmt

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        head_dim = key_states.shape[-1]
        self.rotation_k, self.rotation_v = rotations(self.spec, head_dim, self.device, self.key_rotation)
        empty = key_states.new_empty(key_states.shape[:2] + (0, head_dim))     # (B, H, 0, D), keeps nothing alive
        self.sink_k, self.sink_v = empty, empty
        self.keys, self.values = empty, empty                                 # the full-precision window
        self.store_k = BlockStore(self.key_fmt, self.block, head_dim)
        self.store_v = BlockStore(self.value_fmt, self.block, head_dim)
        self.is_initialized = True

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> all keys and values so far, 16-bit, (B, H, seen, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise evict.unscored(self.spec)
        prompt = self.policy is not None and self.seen == 0 and key_states.shape[-2] > 1
        self.seen += key_states.shape[-2]
        if prompt:                  # attention reads the whole prompt; the policy then keeps its share (evict/)
            self.pending = (key_states, value_states)
            return evict.hooked(key_states, self._evict_prompt), value_states
        # What attention sees: stored history, then the window and new tokens exactly as they are
        # now (tokens about to be quantized are still full precision at this moment).
        window_k = torch.cat([self.keys, key_states], dim=-2)
        window_v = torch.cat([self.values, value_states], dim=-2)
        if self.fused and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            view = attention.DecodeView(self.sink_k, self.sink_v, window_k, window_v, self.store_k, self.store_v,
                                        self.store_k.n_blocks, self.block, self.rotation_k,
                                        rotation_v=self.rotation_v)
            self._settle(window_k, window_v)      # append-only: the view's n_blocks stay as they are
            return view.placeholders()
        out_k = self.assemble("keys", window_k)
        out_v = self.assemble("values", window_v)
        self._settle(window_k, window_v)
        return out_k, out_v

    def _evict_prompt(self, query: torch.Tensor, scaling: float) -> None:
        """Store the prompt's tokens the policy keeps (each KV head its own), in token order, as if only they had
        arrived: the first become the sink, the rest blocks and window."""
        keys, values = self.pending
        self.pending = None
        kept = evict.budget(self.spec.keep, keys.shape[-2])
        index = torch.arange(keys.shape[-2], device=keys.device).expand(*keys.shape[:2], -1)
        if kept < keys.shape[-2]:
            index = evict.keep_top(self.policy.scores(keys, query, scaling), kept)
            keys, values = evict.gather(keys, index), evict.gather(values, index)
        self.kept_index = index             # (B, H, kept): the prompt positions kept, for the Inside view
        self._settle(keys, values)

    def stored(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_k.shape[-2] + self.store_k.n_blocks * self.block + self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self.pending = self.kept_index = None

    def assemble(self, part: str, window: torch.Tensor | None = None) -> torch.Tensor:
        """One (B, H, S + N + W, D) tensor of `part` ("keys" or "values"): sink, dequantized history (written in
        place), window (the layer's own where None)."""
        if part == "keys":
            return assemble(self.sink_k, self.store_k, self.keys if window is None else window, self.store_k.n_blocks,
                            self.rotation_k)
        return assemble(self.sink_v, self.store_v, self.values if window is None else window, self.store_v.n_blocks,
                        self.rotation_v)

    def _settle(self, window_k: torch.Tensor, window_v: torch.Tensor) -> None:
        """Fill the sink, then quantize whole blocks while more than `residual` tokens remain."""
        take = min(self.sink_len - self.sink_k.shape[-2], window_k.shape[-2])
        if take > 0:
            self.sink_k = torch.cat([self.sink_k, window_k[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, window_v[:, :, :take]], dim=-2)
            window_k, window_v = window_k[:, :, take:], window_v[:, :, take:]
        n_blocks = max(0, window_k.shape[-2] - self.residual) // self.block
        if n_blocks:
            n = n_blocks * self.block
            self.store_k.append(self._blocks(window_k[:, :, :n], n_blocks, self.rotation_k))
            self.store_v.append(self._blocks(window_v[:, :, :n], n_blocks, self.rotation_v))
            window_k, window_v = window_k[:, :, n:], window_v[:, :, n:]
        self.keys, self.values = window_k.contiguous(), window_v.contiguous()

    def _blocks(self, x: torch.Tensor, n_blocks: int, rotation: torch.Tensor | None) -> torch.Tensor:
        """(B, H, n*T, D) 16-bit -> (B, H, n, T, D) float32, rotated by rotation ((D, D) or (H, D, D)) if any."""
        x = x.float()
        if not torch.isfinite(x).all():   # checked here, once per block, not on every decode step
            raise KvplayError("The model produced NaN or inf keys/values; they cannot be quantized.")
        if rotation is not None:
            x = x @ rotation
        return x.unflatten(2, (n_blocks, self.block))


    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens; only those still in the full-precision window can go.

        As transformers' DynamicLayer.crop: a negative count, and the legacy positive form (the length
        to keep) refused with upstream's ValueError.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                             "Please use a negative integer to remove that number of tokens from the cache instead.")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.keys.shape[-2]:
            raise KvplayError("kvplay's cache can only crop tokens that are still in its full-precision window.")
        self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]
        self.seen -= n

    def _select(self, index: torch.Tensor) -> None:
        for name in ("sink_k", "sink_v", "keys", "values"):
            t = getattr(self, name)
            setattr(self, name, t.index_select(0, index.to(t.device)))
        self.store_k.select_batch(index)
        self.store_v.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.as_tensor(indices, device=self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        for name in ("sink_k", "sink_v", "keys", "values"):
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
        self.store_k.repeat_batch(repeats)
        self.store_v.repeat_batch(repeats)


def fused_decode(spec: CacheSpec, config, key_bits=(), value_bits=()) -> tuple[bool, str]:
    """Whether decode attention reads the packed codes for this spec and model (whose layers store keys at
    spec.kbits or at any of key_bits, values at spec.vbits or any of value_bits), and if not, why."""
    config = config.get_text_config(decoder=True)
    if spec.attention != "fused":
        return False, "attention=sdpa"
    if not attention.model_uses_it(config):
        return False, f"the model's attention implementation is {config._attn_implementation!r}, not 'kvplay'"
    arch = Arch.from_config(config)
    layers = [KVPlayLayer(spec, kb, vb) for kb in {spec.kbits, *key_bits} for vb in {spec.vbits, *value_bits}]
    if (not all(attention.covers(layer.key_fmt, layer.value_fmt, arch.head_dim) for layer in layers)
            or config.num_attention_heads // arch.kv_heads > attention.MAX_GROUP):
        return False, "the fused kernel covers int2/int3/int4/int8 with keys per channel and values per token"
    return True, ""


def _tiers(key_bits: dict, value_bits: dict, key_metas: dict, spec) -> dict[tuple[str, int, str], list[int]]:
    """{(part, bits, what else): layers} of the layers stored otherwise than the spec says, in bits order, for a
    cache's description; an outlier layer's keys (those with their own scales and zeros, key_metas) are a tier of
    their own: " with fp16 scales and zeros, where the keys' outliers are"."""
    found: dict[tuple[str, int, str], list[int]] = {}
    for part, chosen in (("keys", key_bits), ("values", value_bits)):
        for i, bits in sorted(chosen.items(), key=lambda item: (item[1], item[0])):
            meta = key_metas.get(i) if part == "keys" else None
            more = "" if meta is None else (f" with {meta} scales and zeros" if meta != spec.kmeta else "") + \
                ", where the keys' outliers are"
            found.setdefault((part, bits, more), []).append(i)
    return found


def _layers(indices: list[int]) -> str:
    """[3] -> "layer 3"; [0, 5] -> "layers 0, 5"."""
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(map(str, indices))


class KVPlayCache(Cache):
    """kvplay's cache for a whole model: a KVPlayLayer per full-attention layer.

    Sliding-window and chunked layers keep transformers' own sliding layers, in 16-bit (a sliding layer stops
    growing at its window, so its cache is bounded anyway); only full-attention layers are quantized: on Gemma 3,
    "3 global layers quantized, 15 sliding layers kept in 16-bit (512 tokens each)" (Arch.layer_split; a live
    cache's counts: kvplay.cache.accounting.layer_split). key_bits (value_bits) maps a layer's index to its key
    (value) bits where they differ from spec.kbits (spec.vbits): the fragile layers, fragile.py; key_metas a
    layer's keys' scales and zeros where they differ from spec.kmeta: an adapting preset's outlier layers,
    outliers.py.
    key_rotations maps a layer's index to its keys' rotations (Hkv, D, D) under rotation=calibrated (rotations.py).
    """

    def __init__(self, spec: CacheSpec, config, key_bits: dict[int, int] | None = None,
                 value_bits: dict[int, int] | None = None, key_rotations: dict[int, torch.Tensor] | None = None,
                 key_metas: dict[int, str] | None = None):
        config = config.get_text_config(decoder=True)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(config)
        key_bits, value_bits, key_rotations = key_bits or {}, value_bits or {}, key_rotations or {}
        key_metas = key_metas or {}
        layers = []
        for i, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs)):
            if layer_type == "full_attention":
                layers.append(KVPlayLayer(spec, key_bits.get(i), value_bits.get(i), key_rotations.get(i),
                                          key_metas.get(i)))
            elif layer_type in DYNAMIC_LAYER_TYPE_MAPPING and layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
            else:
                raise KvplayError(f"kvplay's cache does not support {layer_type!r} layers.")
        super().__init__(layers=layers)
        self.spec = spec
        fused, why = fused_decode(spec, config, set(key_bits.values()), set(value_bits.values()))
        for layer in layers:
            if isinstance(layer, KVPlayLayer):
                layer.fused = fused
        split = Arch.from_config(config).layer_split()
        self.description = f"{spec}: " + (split or f"{len(layers)} layers quantized") + (
            "".join(f"; {bits}-bit {part} in {_layers(layers)}{more}"
                    for (part, bits, more), layers in _tiers(key_bits, value_bits, key_metas, spec).items())) + (
            "; decode attention: fused from packed codes (on CPU)" if fused else f"; decode attention: dequantize "
            f"then attend ({why})") + evict.describe(spec, sum(isinstance(layer, KVPlayLayer) for layer in layers))

    def __repr__(self) -> str:
        return f"KVPlayCache({self.description})"

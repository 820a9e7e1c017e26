"""The 16-bit reference: transformers' DynamicCache in the model's own dtype, and the fastest 16-bit path.

`baseline:attention=fused` keeps the same cache but runs decode attention through kvplay's fused kernel
(attention.py) on the 16-bit keys and values, so the kernel's own speed can be told from the gain of
reading fewer bytes.

`baseline:store=prealloc` keeps the same 16-bit tokens in a preallocated (B, H, capacity, D) buffer per layer
and writes each step's tokens in place (PreallocLayer), where DynamicLayer concatenates the whole history
into a new tensor on every step. It is the 16-bit path a quantized cache has to beat on speed, with or
without `attention=fused`; the default stays `store=dynamic`, what transformers' users get.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvplay.cache import attention, evict
from kvplay.cache.evict import EVICT, EVICT_HELP, KEEP_HELP
from kvplay.cache.methods.base import (
    ATTENTION,
    ATTENTION_HELP,
    SNIPPET_HEAD,
    SNIPPET_LOAD,
    CacheBytes,
    CacheMethod,
    Scheme,
    option,
    register,
    tensor_nbytes,
)
from kvplay.errors import KvplayError

STORES = ("dynamic", "prealloc")
SPARE_TOKENS = 256      # a full PreallocLayer grows to its need plus this many tokens or an eighth of it, if more


@dataclass(frozen=True)
class DynamicOptions:
    store: str = option("dynamic", choices=STORES, label="16-bit store",
                        help="dynamic: transformers' DynamicCache, which concatenates the whole history into a new "
                             "tensor on every step (what transformers' users get); prealloc: a preallocated buffer "
                             f"per layer written in place, grown by an eighth (at least {SPARE_TOKENS} tokens) when "
                             "full: the fastest 16-bit path, for speed comparisons")
    attention: str = option("sdpa", choices=ATTENTION, label="decode attention", help=ATTENTION_HELP)
    evict: str = option("none", choices=EVICT, label="eviction", help=EVICT_HELP)
    keep: float = option(1.0, lo=0.01, hi=1.0, grid=(0.5, 0.25, 0.125), label="tokens kept (share)",
                         help=KEEP_HELP)


class FusedDynamicLayer(DynamicLayer):
    """transformers' DynamicLayer whose CPU decode steps hand attention placeholders (attention.DecodeView)."""

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> all keys and values so far, or placeholders when decoding."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] != 1 or key_states.device.type != "cpu":
            return keys, values
        return attention.DecodeView(keys[:, :, :0], values[:, :, :0], keys, values).placeholders()


class PreallocLayer(DynamicLayer):
    """transformers' DynamicLayer with its tokens in preallocated buffers: no concatenation per step.

    buffer_k, buffer_v (B, H, capacity, D) in the dtype of the first keys (the model's); `keys` and `values`
    are views of their first `length` tokens, which update() returns. When a step does not fit, both grow to
    the need plus max(spare_tokens, need // 8) tokens, one copy of the history: at 8k tokens that is one copy
    per 1,024 steps instead of one per step. fused: CPU decode steps hand attention placeholders
    (attention.DecodeView over the views, read in place). The views stay valid as long as nothing rewrites
    their positions: a crop followed by new tokens writes those tokens where the cropped ones were.
    """

    spare_tokens = SPARE_TOKENS

    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.length = 0
        self.buffer_k = self.buffer_v = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.buffer_k = key_states.new_empty(key_states.shape[:2] + (0, key_states.shape[-1]))
        self.buffer_v = value_states.new_empty(value_states.shape[:2] + (0, value_states.shape[-1]))
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self.buffer_k[:, :, :self.length], self.buffer_v[:, :, :self.length]

    def _grow(self, needed: int) -> None:
        """Reallocate both buffers to hold `needed` tokens plus the spare margin, copying the filled part."""
        capacity = needed + max(self.spare_tokens, needed // 8)
        for name in ("buffer_k", "buffer_v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:2] + (capacity, old.shape[-1]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> views of all keys and values so far, (B, H, length, D), or
        the fused kernel's placeholders on a CPU decode step."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.buffer_k.shape[-2]:
            self._grow(end)
        self.buffer_k[:, :, self.length:end] = key_states
        self.buffer_v[:, :, self.length:end] = value_states
        self.length = end
        self._views()
        if self.fused and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            return attention.DecodeView(self.keys[:, :, :0], self.values[:, :, :0], self.keys,
                                        self.values).placeholders()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self.buffer_k = self.buffer_v = None
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (upstream's checks and slicing); their places are reused."""
        super().crop(tokens_to_remove)
        if self.is_initialized:
            self.length = self.keys.shape[-2]

    def _batch(self, pick) -> None:
        if self.is_initialized:
            self.buffer_k, self.buffer_v = pick(self.buffer_k), pick(self.buffer_v)
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch(lambda b: b.index_select(0, beam_idx.to(b.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch(lambda b: b[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch(lambda b: b.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:
        self._batch(lambda b: b.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.buffer_k.device != self.device:
            self._batch(lambda b: b.to(self.device, non_blocking=True))


class EvictingLayer(DynamicLayer):
    """transformers' DynamicLayer that keeps only `keep` of the prompt's tokens, as its policy ranks them per KV
    head (kvplay.cache.evict), and counts every token seen, so positions go on. fused: CPU decode steps hand
    attention placeholders over what it keeps (attention.DecodeView)."""

    def __init__(self, spec, fused: bool = False):
        super().__init__()
        self.spec, self.policy, self.fused = spec, evict.policy_of(spec), fused
        self.seen, self.budget, self.pending = 0, None, False
        self.kept_index: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states (B, H, T, D) -> what it holds, the new tokens last; the keys carry the policy's
        scoring (evict.hooked) on the prompt, and under a policy that evicts as it decodes, on every step."""
        if self.pending:
            raise evict.unscored(self.spec)
        prompt = self.seen == 0 and key_states.shape[-2] > 1
        self.seen += key_states.shape[-2]
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if prompt:
            self.budget = evict.budget(self.spec.keep, key_states.shape[-2])
        if self.fused and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            keys, values = attention.DecodeView(keys[:, :, :0], values[:, :, :0], keys, values).placeholders()
        if prompt or (self.policy.during_decode and self.budget is not None and self.keys.shape[-2] > self.budget):
            self.pending = True
            return evict.hooked(keys, self._evict), values
        return keys, values

    def _evict(self, query, scaling) -> None:
        self.pending = False
        index = torch.arange(self.keys.shape[-2], device=self.keys.device).expand(*self.keys.shape[:2], -1)
        if self.keys.shape[-2] > self.budget:
            index = evict.keep_top(self.policy.scores(self.keys, query, scaling), self.budget)
            self.keys, self.values = evict.gather(self.keys, index), evict.gather(self.values, index)
        if self.kept_index is None:         # (B, H, kept): the prompt positions kept, for the Inside view
            self.kept_index = index

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.keys.shape[-2] if self.is_initialized else 0) + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise KvplayError(f"{self.spec}: an evicting cache cannot be cropped.")

    def reset(self) -> None:
        super().reset()
        self.seen, self.budget, self.pending, self.kept_index = 0, None, False, None


class Dynamic(CacheMethod):
    name = "dynamic"
    order = 0                       # its place in the registry: the UI's presets, the docs tables
    description = "transformers' DynamicCache: every token in the model's 16-bit dtype (the reference)"
    Options = DynamicOptions
    schemes = (Scheme("baseline", "bf16", 16, "transformers' DynamicCache in the model's 16-bit dtype: the reference"),)
    # DynamicSlidingWindowLayer also serves the 16-bit sliding-window layers other caches keep.
    layer_types = (DynamicLayer, DynamicSlidingWindowLayer, FusedDynamicLayer, PreallocLayer, EvictingLayer)
    quantized = False
    # DynamicLayer returns the keys and values it was given; an empty PreallocLayer returns its copy of them
    # (the same values, in the same dtype), and on a prefill it never returns placeholders.
    shares_prefill = True
    colour_family, line_dash, marker = "grey", "solid", "circle"     # the reference stays grey
    family = "16-bit reference"

    def is_reference(self, spec) -> bool:
        return evict.policy_of(spec) is None          # an evicting baseline is compressed: fewer tokens

    def check_model(self, spec, config) -> None:
        super().check_model(spec, config)
        if evict.policy_of(spec) is not None and spec.store == "prealloc":
            raise KvplayError(f"{spec}: eviction runs on store=dynamic; a preallocated store keeps every token.")
        evict.check_model(spec, config, decode_ok=True)

    def build(self, spec, model, tokenizer=None):
        config = model.config
        cache = DynamicCache(config=config)
        fused = spec.attention == "fused" and attention.model_uses_it(config.get_text_config(decoder=True))
        if evict.policy_of(spec) is not None:
            self.check_model(spec, config)               # a user's own build_cache too: no queries, no eviction
            cache.layers = [EvictingLayer(spec, fused) if type(layer) is DynamicLayer else layer
                            for layer in cache.layers]
            cache.description = f"{spec}: 16-bit" + evict.describe(spec, sum(
                isinstance(layer, EvictingLayer) for layer in cache.layers)) + "; decode attention: " + (
                "kvplay's fused kernel (on CPU)" if fused else "transformers' sdpa")
            return cache
        if spec.store == "prealloc":
            cache.layers = [PreallocLayer(fused) if type(layer) is DynamicLayer else layer for layer in cache.layers]
        elif fused:
            cache.layers = [FusedDynamicLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        cache.description = f"{spec}: 16-bit" + (
            ", preallocated and written in place" if spec.store == "prealloc" else "") + "; decode attention: " + (
            "kvplay's fused kernel on the 16-bit cache (on CPU)" if fused else "transformers' sdpa")
        return cache

    def layer_nbytes(self, layer) -> CacheBytes:
        if not layer.is_initialized:
            return CacheBytes()
        if isinstance(layer, PreallocLayer):          # in use: the filled views; allocated: the whole buffers
            return CacheBytes(full_precision=tensor_nbytes(layer.keys, layer.values),
                              allocated=tensor_nbytes(layer.buffer_k, layer.buffer_v))
        return CacheBytes(full_precision=tensor_nbytes(layer.keys, layer.values))

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None) -> CacheBytes:
        tokens = evict.stored_tokens(spec, tokens, prefill)          # an evicting cache holds only what it kept
        return CacheBytes(full_precision=2 * arch.layers * batch * arch.kv_heads * tokens * arch.head_dim * dtype_bytes)

    def dequantized_kv(self, layer):
        return layer.keys, layer.values

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        if spec.attention == "fused" or spec.store == "prealloc":
            return super().snippet(spec, max_new_tokens, load)
        return (SNIPPET_HEAD + (load or SNIPPET_LOAD) +
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False)\n")


METHOD = register(Dynamic())

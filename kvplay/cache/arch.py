"""Architecture numbers that decide KV-cache size, from a live config or a published table.

    arch = Arch.from_config(gemma3_config)   # layers=3 (global), sliding_layers=15, sliding_window=512
    arch.elements(8192)                      # K and V elements held at 8,192 tokens: a sliding layer holds at most
                                             # sliding_window - 1 tokens between steps, as transformers' does
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

from kvplay.paths import assets

ARCHS_FILE = assets("architectures.json")
KEY_OUTLIERS = "kvplay_key_outliers"     # the text config's attribute where outliers.py sets what it measured


@dataclass(frozen=True)
class Arch:
    name: str
    layers: int        # decoder layers that keep a full-attention KV cache
    kv_heads: int
    head_dim: int
    params: int = 0    # parameter count, for weight memory in capacity estimates
    sliding_layers: int = 0    # sliding-window (or chunked) layers: every cache keeps them 16-bit, bounded
    sliding_window: int = 0    # their window in tokens (config.sliding_window)
    context: int = 0           # the positions it was trained for (0: not known)
    key_outliers: tuple[int, ...] | None = None   # layers whose keys 4 bits cannot hold, measured (outliers.py);
                                                  # None: not measured (a published table's, a config alone)

    @property
    def elements_per_token(self) -> int:
        """K and V elements one token adds across the full-attention layers (batch 1): what grows with context."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def sliding_tokens(self, tokens: int) -> int:
        """Tokens one sliding-window layer holds after `tokens` tokens: transformers' DynamicSlidingWindowLayer
        keeps the last sliding_window - 1 (the next token's attention adds itself)."""
        return min(tokens, max(self.sliding_window - 1, 0))

    def elements(self, tokens: int, batch: int = 1) -> int:
        """K and V elements every layer holds after `tokens` tokens: full-attention layers all of them, sliding
        layers their window; the denominator of bits per element (a 16-bit cache is exactly 16 bits)."""
        held = self.layers * tokens + self.sliding_layers * self.sliding_tokens(tokens)
        return 2 * held * self.kv_heads * self.head_dim * batch

    def sliding_nbytes(self, tokens: int, batch: int = 1, dtype_bytes: int = 2) -> int:
        """Bytes of the sliding layers' 16-bit keys and values after `tokens` tokens (0 without any)."""
        return 2 * self.sliding_layers * self.sliding_tokens(tokens) * self.kv_heads * self.head_dim * batch * \
            dtype_bytes

    def layer_split(self) -> str:
        """The cards' words for a hybrid model, e.g. "3 global layers quantized, 15 sliding layers kept in 16-bit
        (512 tokens each)"; "" for a model whose layers all attend to the whole history."""
        if not self.sliding_layers:
            return ""
        return split_words(self.layers, self.sliding_layers, self.sliding_window)

    @classmethod
    def from_config(cls, config, name: str = "", params: int = 0) -> Arch:
        c = config.get_text_config(decoder=True)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads

        layer_types, kwargs = get_layer_types_and_kwargs(c)  # the same source the caches use
        windows = [kw["sliding_window"] for t, kw in zip(layer_types, kwargs)
                   if t in ("sliding_attention", "chunked_attention") and kw.get("sliding_window")]
        return cls(name=name or getattr(c, "_name_or_path", "") or c.model_type,
                   layers=sum(t == "full_attention" for t in layer_types),
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, params=params, sliding_layers=len(windows),
                   sliding_window=max(windows, default=0), context=context_limit(config) or 0,
                   key_outliers=getattr(c, KEY_OUTLIERS, None))


def split_words(quantized: int, sliding: int, window: int) -> str:
    """ "3 global layers quantized, 15 sliding layers kept in 16-bit (512 tokens each)", in the right numbers."""
    def n(count: int, noun: str) -> str:
        return f"{count} {noun}" + ("" if count == 1 else "s")
    return (f"{n(quantized, 'global layer')} quantized, {n(sliding, 'sliding layer')} kept in 16-bit "
            f"({window} tokens each)")


def published_archs() -> dict[str, Arch]:
    """Published configurations of real models, from assets/architectures.json."""
    rows = json.loads(ARCHS_FILE.read_text())
    return {r["name"]: Arch(**{k: r[k] for k in ("name", "layers", "kv_heads", "head_dim", "params", "context")})
            for r in rows}


def context_limit(config) -> int | None:
    """The positions the model was trained for (its text config's max_position_embeddings), None where it does not
    say: the one place kvplay reads a model's context limit."""
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(limit) if limit else None

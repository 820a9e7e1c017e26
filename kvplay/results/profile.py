"""A model's profile for its KV cache (kvplay.lab.profile): its attention's shape and its key outlier channels."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class ModelProfile:
    kind: ClassVar[str] = "profile"
    title: ClassVar[str] = "Your model: what matters for its KV cache"

    model: str
    family: str                    # the config's model_type: "llama", "qwen2", "gemma3_text", ...
    layers: int                    # decoder layers
    full_layers: int               # of them, full attention: the layers a cache quantizes
    sliding_layers: int            # sliding-window (or chunked) layers, which every cache keeps 16-bit
    sliding_window: int            # their window in tokens (0: none)
    query_heads: int
    kv_heads: int
    head_dim: int
    context: int                   # positions it was trained for (0: not known)
    tokens: int                    # tokens of the held-out play the 16-bit pass read
    factor: float                  # a key channel is an outlier above this many times the median channel
    key_ratio: list[float]         # per layer: the largest key channel's max |x| over the median channel's, worst head
    outlier_layers: list[int]      # the layers whose worst ratio exceeds `factor`
    key_shift: list[list] = field(default_factory=list)   # [layer, share of its attention its 4-bit keys move with
                                                          # 16-bit scales and zeros, with 8-bit ones] per full-
                                                          # attention layer (kvplay.cache.outliers; [] unmeasured)

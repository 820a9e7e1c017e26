"""Architecture numbers that decide KV-cache size, from a live config or a published table."""
from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

from kvplay.paths import assets

ARCHS_FILE = assets("architectures.json")


@dataclass(frozen=True)
class Arch:
    name: str
    layers: int        # decoder layers that keep a full-attention KV cache
    kv_heads: int
    head_dim: int
    params: int = 0    # parameter count, for weight memory in capacity estimates

    @property
    def elements_per_token(self) -> int:
        """K and V elements one token adds across all layers (batch 1)."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config, name: str = "", params: int = 0) -> Arch:
        c = config.get_text_config(decoder=True)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads

        layer_types, _ = get_layer_types_and_kwargs(c)  # the same source the caches use
        return cls(name=name or getattr(c, "_name_or_path", "") or c.model_type,
                   layers=sum(t == "full_attention" for t in layer_types),
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, params=params)


def published_archs() -> dict[str, Arch]:
    """Published configurations of real models, from assets/architectures.json."""
    rows = json.loads(ARCHS_FILE.read_text())
    return {r["name"]: Arch(**{k: r[k] for k in ("name", "layers", "kv_heads", "head_dim", "params")}) for r in rows}


def context_limit(config) -> int | None:
    """The positions the model was trained for (its text config's max_position_embeddings), None where it does not
    say: the one place kvplay reads a model's context limit."""
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(limit) if limit else None

"""Many caches in one batch: RowGroups, a transformers Cache whose batch is split into row groups.

    caches = [build_cache(spec, model) for spec in specs]          # each built by its own method
    rows = RowGroups(caches, rows=B, config=model.config)
    prefill(model, ids, mask, rows)          # fan-out: ids (B, T) once; every cache stores the same 16-bit K, V
    rows.split()                             # from now on the batch is (len(caches) * B, ...), group g's rows
    decode_one_token(model, tokens, mask, rows)   # tokens (G * B, 1): one forward pass steps every cache

Each cache keeps its own layers (exactly the objects its method's build() made, so cache_nbytes(caches[g])
counts group g's bytes); RowGroupLayer only hands each sub-layer its slice of the batch and collects
what it returns.

Fan-out (prefill): every sub-layer's update() gets the same (B, H, T, D) keys and values, as it would in
a prefill of its own, and attention gets what the first one returned. That is only right for methods
whose prefill hands attention the 16-bit states it was given (CacheMethod.shares_prefill); update()
checks it and raises a KvplayError naming the cache otherwise.

Split (decode): group g's rows are g * B ... (g + 1) * B - 1. With the "kvplay" attention implementation
(attention.py) the layer returns stride-0 placeholders carrying `kvplay_rows`, every group's own
(keys, values) (real tensors or the fused path's placeholders), and kvplay_attention attends per group:
each group's history stays in its own format, fused or sdpa as it would alone, and at its own length (a
cache that evicts holds fewer tokens, kvplay.cache.evict). With any other attention implementation the
groups' keys and values are concatenated along the batch (their lengths agree: every row has read the
same prompt and the same number of steps, and eviction needs kvplay's attention).

An evicting cache scores its tokens by the queries after attention (kvplay.cache.evict): in fan-out, the keys
handed to attention carry every group's scoring functions.

Rows stepping together are never timed one by one, so `memoized(caches)` lets layers that declare a
`memoize` switch (transformers' quantized layers, methods/hf.MemoizedDequantize) skip work whose result
they already hold: the same tensors, less time. Compare times each cache alone afterwards, switch off.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvplay.cache import attention
from kvplay.errors import KvplayError


class RowGroupLayer(CacheLayerMixin):
    """One decoder layer of RowGroups: the same layer of every group's cache."""

    is_compileable = False

    def __init__(self, owner: RowGroups, index: int):
        super().__init__()
        self.owner, self.index = owner, index

    @property
    def layers(self) -> list:
        """This layer of each active group's cache, in group order."""
        return [self.owner.caches[g].layers[self.index] for g in self.owner.active]

    @property
    def is_sliding(self) -> bool:
        return bool(getattr(self.layers[0], "is_sliding", False))

    @property
    def is_initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    @is_initialized.setter
    def is_initialized(self, value) -> None:        # CacheLayerMixin.__init__ sets it; the sub-layers own it
        pass

    def lazy_initialization(self, key_states, value_states) -> None:   # the sub-layers initialise themselves
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Fan-out: key_states, value_states (B, H, T, D) to every group; split: (G * B, H, T, D), B rows each."""
        owner = self.owner
        if owner.fan_out:
            outs = [layer.update(key_states, value_states, *args, **kwargs) for layer in self.layers]
            if owner.check_shared:
                for g, (k, v) in zip(owner.active, outs):
                    same = k.shape == key_states.shape and torch.equal(k, key_states) and torch.equal(v, value_states)
                    if not same:
                        raise KvplayError(f"{owner.names[g]}: its prefill hands attention other keys or values than "
                                          "the 16-bit ones it was given, so it cannot share a prefill; its method "
                                          "must not declare shares_prefill.")
            after = [f for k, _ in outs for f in getattr(k, attention.AFTER, ())]     # every evicting cache scores
            if not after:                                                            # by the shared queries
                return outs[0]
            keys = outs[0][0].view_as(outs[0][0])
            setattr(keys, attention.AFTER, after)
            return keys, outs[0][1]
        b = owner.rows
        parts = [layer.update(key_states[i * b:(i + 1) * b], value_states[i * b:(i + 1) * b], *args, **kwargs)
                 for i, layer in enumerate(self.layers)]                     # each (B, H, L, D)
        lengths = {k.shape[-2] for k, _ in parts}
        if len(lengths) != 1 and not owner.per_group_attention:      # per group, each attends over its own length
            raise KvplayError(f"Caches stepping together disagree on their length at layer {self.index} "
                              f"({sorted(lengths)}); run them one at a time.")
        if not owner.per_group_attention:
            return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])   # (G * B, H, L, D)
        k0 = parts[0][0]
        zero = k0.new_zeros(())
        shape = (b * len(parts),) + tuple(k0.shape[1:])
        keys, values = zero.expand(shape), zero.expand(shape)     # (G * B, H, L, D), no memory of their own
        keys.kvplay_rows = values.kvplay_rows = RowsView(b, parts)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def get_max_length(self) -> int:
        return self.layers[0].get_max_length()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


class RowsView:
    """What one layer hands attention in a split step: B rows per group, each group's (keys, values)."""

    def __init__(self, rows: int, parts: list[tuple[torch.Tensor, torch.Tensor]]):
        self.rows, self.parts = rows, parts


class RowGroups(Cache):
    """caches: one transformers Cache per row group (each from its method's build()); rows: batch rows per group.

    names: a label per group for error messages. check_shared: in fan-out, verify that every group's
    prefill handed attention the 16-bit states (see the module docstring).
    """

    def __init__(self, caches: list, rows: int, config, *, names: list[str] | None = None, check_shared: bool = True):
        n_layers = {len(c.layers) for c in caches}
        if len(n_layers) != 1:
            raise KvplayError(f"Caches stepping together must have as many layers each; they have {sorted(n_layers)}.")
        self.caches, self.rows = list(caches), rows
        self.active = list(range(len(caches)))           # the groups still stepping, in batch order
        self.names = names or [str(i) for i in range(len(caches))]
        self.fan_out, self.check_shared = True, check_shared
        self.per_group_attention = attention.model_uses_it(config.get_text_config(decoder=True))
        super().__init__(layers=[RowGroupLayer(self, i) for i in range(n_layers.pop())])

    def split(self) -> None:
        """From the next forward pass on, the batch holds every active group's rows, group after group."""
        self.fan_out = False

    def drop(self, group: int) -> None:
        """Stop stepping `group` (its cache keeps what it holds); later batches leave its rows out."""
        self.active.remove(group)

    @property
    def batch_rows(self) -> int:
        return self.rows * (1 if self.fan_out else len(self.active))


@contextmanager
def memoized(caches):
    """Within the block, every layer of `caches` with a `memoize` switch has it on (the same results, computed
    once where a layer can); afterwards off again, its memory released."""
    layers = [layer for cache in caches for layer in cache.layers if hasattr(layer, "memoize")]
    for layer in layers:
        layer.memoize = True
    try:
        yield
    finally:
        for layer in layers:
            layer.memoize = False
            layer.__dict__.pop("_dequantized", None)

"""Time one layer's decode step (cache update + attention) at a long context, path against path.

    PYTHONPATH=. python scripts/attend_profile.py --tokens 8000 --batch 1 --repeats 5

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, bfloat16) on random keys and
values: only the time matters here. Each path is a cache layer filled with `tokens` tokens, then timed
over `steps` decode steps (update() with one new token, then transformers' attention function); the paths
run interleaved, `repeats` times, and the medians are printed as milliseconds and as ratios to the
first path: the fastest 16-bit path (preallocated store, fused kernel) unless --paths says otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicLayer

from kvplay.cache import parse_spec
from kvplay.cache.attention import kvplay_attention
from kvplay.cache.engine import KVPlayLayer
from kvplay.cache.methods.dynamic import FusedDynamicLayer, PreallocLayer

PATHS = {   # name: (layer factory, what it is)
    "baseline, preallocated (fused kernel)": lambda: PreallocLayer(fused=True),     # the fastest 16-bit path
    "baseline (sdpa)": lambda: DynamicLayer(),
    "baseline (fused kernel)": lambda: FusedDynamicLayer(),
    "kvplay-int4 (dequantize, sdpa)": lambda: _kvplay("kvplay-int4:attention=sdpa"),
    "kvplay-int4 (fused)": lambda: _kvplay("kvplay-int4"),                 # the presets rotate (Hadamard)
    "kvplay-int4:rotation=none (fused)": lambda: _kvplay("kvplay-int4:rotation=none"),
    "kvplay-int2 (dequantize, sdpa)": lambda: _kvplay("kvplay-int2:attention=sdpa"),
    "kvplay-int2 (fused)": lambda: _kvplay("kvplay-int2"),
    "kvplay-int2:rotation=none (fused)": lambda: _kvplay("kvplay-int2:rotation=none"),
    # issue 27's presets: 8-bit scales and zeros (attend_t.kmeta8, vmeta8)
    "kvplay-2.5bit (dequantize, sdpa)": lambda: _kvplay("kvplay-2.5bit:attention=sdpa"),
    "kvplay-2.5bit (fused)": lambda: _kvplay("kvplay-2.5bit"),
    "kvplay-3bit (dequantize, sdpa)": lambda: _kvplay("kvplay-3bit:attention=sdpa"),
    "kvplay-3bit (fused)": lambda: _kvplay("kvplay-3bit"),
    # their fragile layers' formats (each preset mixes layers of its base and fragile bits)
    "kvplay-3bit:kbits=4 (fused)": lambda: _kvplay("kvplay-3bit:kbits=4"),
    "kvplay-3bit:kbits=4,vbits=4 (fused)": lambda: _kvplay("kvplay-3bit:kbits=4,vbits=4"),
    "kvplay-2.5bit:kbits=3 (fused)": lambda: _kvplay("kvplay-2.5bit:kbits=3"),
}


def _kvplay(text: str) -> KVPlayLayer:
    layer = KVPlayLayer(parse_spec(text))
    layer.fused = parse_spec(text).attention == "fused"
    return layer


class _Module(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from the attention module."""

    num_key_value_groups = 3
    is_causal = True


@torch.inference_mode()
def time_path(make, tokens: int, batch: int, steps: int, heads=(9, 3), head_dim: int = 64) -> float:
    """Median ms per decode step (update + attention) of one layer after `tokens` tokens."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv = heads
    layer = make()
    for start in range(0, tokens, 1024):                   # the prompt arrives in chunks, as in the bench
        n = min(1024, tokens - start)
        layer.update(torch.randn(batch, hkv, n, head_dim, generator=gen).bfloat16(),
                     torch.randn(batch, hkv, n, head_dim, generator=gen).bfloat16())
    module, times = _Module(), []
    for _ in range(steps + 1):
        q = torch.randn(batch, hq, 1, head_dim, generator=gen).bfloat16()
        k, v = (torch.randn(batch, hkv, 1, head_dim, generator=gen).bfloat16() for _ in range(2))
        t0 = time.perf_counter()
        keys, values = layer.update(k, v)
        kvplay_attention(module, q, keys, values, None, scaling=head_dim ** -0.5)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="*", default=list(PATHS), help="a subset of the path names")
    args = ap.parse_args()
    ms = {name: [] for name in args.paths}
    for _ in range(args.repeats):                            # interleaved: every path sees the same machine state
        for name in args.paths:
            ms[name].append(time_path(PATHS[name], args.tokens, args.batch, args.steps))
    base = statistics.median(ms[args.paths[0]])
    print(f"{args.tokens} tokens, batch {args.batch}, {torch.get_num_threads()} threads, medians of "
          f"{args.repeats} x {args.steps} steps (ms per layer per decode step; speed ratio to {args.paths[0]})")
    for name, values in ms.items():
        m = statistics.median(values)
        print(f"  {name:40s} {m:8.3f} ms   {base / m:6.2f}x")


if __name__ == "__main__":
    main()

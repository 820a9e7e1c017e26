"""Screen kvplay cache specs in seconds: a one-pass simulation of `kvplay ppl`'s chunked run, with bits per element.

    PYTHONPATH=. python scripts/screen_bits.py kvplay-2.5bit 'kvplay-int2:meta=8bit,group=64,vgroup=64'
    PYTHONPATH=. python scripts/screen_bits.py --tokens 2048 --text assets/texts/python-reference.txt kvplay-3bit

`python -m kvplay ppl --chunk 16` feeds the text 16 tokens at a time through a real cache: 128 forwards at 2,048
tokens, minutes per spec on 2 cores. Here one forward does the same job. With chunk c, sink S, residual R and
blocks of T, a query in the chunk starting at token s sees token j as stored (quantized, then dequantized) iff
S <= j < S + T * floor(max(0, s - S - R) / T), and exact otherwise: that is what KVPlayLayer holds when the
chunk arrives, and a block's stored form depends on that block alone. So each layer's attention (swapped in
through kvplay_attention's `kvplay_probe` hook, as kvplay/cache/fragile.py does for keys) mixes exact and stored
keys and values per (query, key) pair. Keys and values go through the layer's own TensorFormat.encode/decode
(rotation, fit, metadata, fragile layers' key bits), so every format the engine stores is screened as stored.

Attention runs in float32 from bfloat16 keys and values (kvplay ppl's sdpa runs in bfloat16), and the reference is
the same float32 attention without quantization; docs/quality-ablation.md gives the screen beside real runs.

Prints one line per spec: bits per element all-in at 8,192 tokens and averaged over lengths 8,192-8,447 (every phase
of a block of up to 256 tokens), delta perplexity, mean KL and top-1 agreement against the reference;
--json appends the same as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvplay.app.models import load_model
from kvplay.cache import analytic_nbytes, bits_per_element, build_cache, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.engine import KVPlayLayer
from kvplay.cache.fragile import mean_kl
from kvplay.lab.metrics import perplexity, token_logprob
from kvplay.lab.texts import HELD_OUT_TEXT

LENGTHS = range(8192, 8192 + 256)      # bits averaged over every phase of a block of up to 256 tokens


ROPE: dict = {}          # --keys-before-rope: {"cos", "sin"} (1, 1, N, D) of the text's positions
KEY_ROTATIONS: dict = {}  # id(layer) -> (Hkv, D, D) key rotations replacing the layer's (scripts/screen_rotation.py)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrope(k: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys (B, H, N, D) turned back to their pre-RoPE values: each channel pair rotated by -angle."""
    return k * ROPE["cos"] - _rotate_half(k) * ROPE["sin"]


def rope(k: torch.Tensor) -> torch.Tensor:
    return k * ROPE["cos"] + _rotate_half(k) * ROPE["sin"]


def stored(layer: KVPlayLayer, x: torch.Tensor, fmt, before_rope: bool = False, rotation=None) -> torch.Tensor:
    """x (B, H, N, D) as `layer` hands it to attention once its blocks are stored: the sink and the tokens past
    the last whole block exact, every block through fmt (rotated first if the layer rotates), float32.
    before_rope: quantize the keys as they were before RoPE and apply RoPE to the decoded ones (a simulation of
    KVQuant's pre-RoPE keys; the engine and its kernel do not store keys this way). rotation: (D, D) or one per
    head (H, D, D) in place of the layer's."""
    if before_rope:
        return rope(stored(layer, unrope(x.float()), fmt, rotation=rotation))
    s, t = layer.sink_len, layer.block
    n = max(0, x.shape[2] - s) // t
    out = x.float().clone()
    if n == 0:
        return out
    blocks = out[:, :, s:s + n * t]                                           # (B, H, n * T, D)
    rotation = layer.rotation if rotation is None else rotation
    if rotation is not None:
        blocks = blocks @ rotation
    decoded = torch.empty_like(blocks)
    fmt.decode(fmt.encode(blocks.unflatten(2, (n, t))), decoded)
    out[:, :, s:s + n * t] = decoded @ rotation.mT if rotation is not None else decoded
    return out


def simulated_attention(layer: KVPlayLayer | None, q, k, v, scaling: float, chunk: int) -> torch.Tensor:
    """Causal attention of a chunked run through `layer` (None: exact): q (B, Hq, N, D), k, v (B, Hkv, N, D)
    -> (B, N, Hq, D) in q's dtype."""
    g, n = q.shape[1] // k.shape[1], k.shape[2]
    qf = q.float() * scaling
    rep = lambda x: x.repeat_interleave(g, 1)                                 # noqa: E731  (B, Hq, N, D)
    pos = torch.arange(n, device=k.device)
    i, j = pos.unsqueeze(1), pos.unsqueeze(0)                                 # (N, 1), (1, N)
    scores = qf @ rep(k.float()).transpose(-1, -2)                            # (B, Hq, N, N)
    if layer is None:
        return (scores.masked_fill(j > i, -torch.inf).softmax(-1) @ rep(v.float())).transpose(1, 2).to(q.dtype)
    if layer.rotation is None and layer.spec.rotation == "hadamard":
        layer.lazy_initialization(k, v)
    s, t = layer.sink_len, layer.block
    start = (i // chunk) * chunk                                              # (N, 1): the query's chunk
    boundary = s + t * ((start - s - layer.residual).clamp(min=0) // t)
    use = (j >= s) & (j < boundary)                                           # (N, N): key j as stored
    k_st = stored(layer, k, layer.key_fmt, before_rope=bool(ROPE), rotation=KEY_ROTATIONS.get(id(layer)))
    v_st = stored(layer, v, layer.value_fmt)
    scores = torch.where(use, qf @ rep(k_st).transpose(-1, -2), scores).masked_fill(j > i, -torch.inf)
    p = scores.softmax(-1)
    out = (p * use) @ rep(v_st) + (p * ~use) @ rep(v.float())
    return out.transpose(1, 2).to(q.dtype)


def run(model, ids: torch.Tensor, layers, chunk: int) -> torch.Tensor:
    """Logits (N, V) float32 of one forward whose attention simulates the chunked run through `layers`
    (a list indexed by layer; None: exact)."""
    def probe(idx, q, k, v, scaling):
        return simulated_attention(layers[idx], q, k, v, scaling, chunk)
    with torch.no_grad():
        return model(ids, use_cache=False, kvplay_probe=probe).logits[0].float()


def bits(spec, arch: Arch) -> tuple[float, float]:
    """Bits per element all-in at 8,192 tokens, and averaged over LENGTHS."""
    at = [bits_per_element(analytic_nbytes(spec, arch, n), arch, n) for n in (8192, *LENGTHS)]
    return at[0], sum(at[1:]) / len(LENGTHS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--text", type=Path, default=HELD_OUT_TEXT, help="default: the held-out play")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--json", type=Path, help="append one JSON line per spec")
    parser.add_argument("--keys-before-rope", action="store_true",
                        help="simulate keys quantized before RoPE (an experiment: the engine does not store this)")
    args = parser.parse_args()

    model, tok = load_model(args.model)
    arch = Arch.from_config(model.config)
    ids = tok(args.text.read_text(encoding="utf-8"), return_tensors="pt", verbose=False).input_ids[:, :args.tokens]
    if args.keys_before_rope:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)    # (1, N, D)
        ROPE.update(cos=cos.float()[:, None], sin=sin.float()[:, None])
    targets = ids[0, 1:]
    reference = run(model, ids, [None] * arch.layers, args.chunk)
    base_ppl = perplexity(-token_logprob(reference[:-1], targets))
    print(f"{args.text.name}, {ids.shape[1]} tokens, chunk {args.chunk}: reference perplexity {base_ppl:.3f}")
    for name in args.specs:
        began = time.time()
        spec = parse_spec(name)
        layers = build_cache(name, model, tok).layers
        logits = run(model, ids, layers, args.chunk)
        ppl = perplexity(-token_logprob(logits[:-1], targets))
        row = dict(spec=str(spec) + (" (keys before RoPE, simulated)" if ROPE else ""), text=args.text.name,
                   tokens=ids.shape[1], chunk=args.chunk,
                   bits_8k=bits(spec, arch)[0], bits_mean=bits(spec, arch)[1],
                   delta_ppl_pct=100 * (ppl / base_ppl - 1), mean_kl=mean_kl(reference[None], logits[None]),
                   top1=float((reference.argmax(-1) == logits.argmax(-1)).float().mean()))
        print(f"{row['bits_8k']:.3f} bits at 8k ({row['bits_mean']:.3f} mean)  dPPL {row['delta_ppl_pct']:+.2f}%  "
              f"KL {row['mean_kl']:.4f}  top-1 {row['top1']:.3f}  {row['spec']}  ({time.time() - began:.0f} s)",
              flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""How much each layer's stored keys and values cost the logits, from one forward and one backward pass (Fisher
information, as KVQuant weighs its quantization error): fragile.py's fast ranking.

An error d in a layer's keys (values) raises the KL divergence of the logits from the 16-bit model's by about
1/2 d^T F d, F their Fisher information; with errors independent between elements, 1/2 sum_i F_ii d_i^2.

  1. measure(): one forward over the calibration tokens in which each ranked layer's attention output gets a
     zero tensor added (a leaf the backward reaches), its queries, keys and values kept; labels y_t drawn from the
     16-bit model's own next-token distribution at each position; one backward of -sum_t log p(y_t) to the
     leaves: g, the gradient at each layer's attention output. With labels drawn from the model itself each
     position's gradient has mean zero, so the square of a gradient summed over positions estimates the Fisher of
     every position's KL without bias (the text's own tokens, the empirical Fisher, would not).
  2. fisher(): from g, the gradient of each layer's keys and values through the queries that read them as
     stored only: a query reads a token exact until its block has left the 16-bit window (Window; fragile's
     stored_attention). Squared, that is F's diagonal, per window.
  3. fragile.gains() weighs each storage's squared error by it.

The window matters: SmolLM2's kvplay-2.5bit keys (32-token window) ranked with the gradient through every query
shared 3 of the 8 layers the exhaustive ranking picks, through the far queries 6 (rank correlation with the
exhaustive forwards' gains 0.42 and 0.92). So does the softmax: second order holds while a layer's stored keys
move its scores by about 1. On Qwen2.5-Coder-0.5B, 2-bit keys move layer 0's by 10 (std; other layers 0.7-1.9)
and half its attention or more to other tokens (shift(): 0.80; other layers 0.26 at most). Its Fisher estimate
was 0.005, the exhaustive forwards measured 0.52 (mean KL over 512 tokens; next layers 0.009, 0.007), so
fragile.rank_layers_fisher ranks first the layers whose keys shift more than BROKEN of their attention.
docs/benchmarks.md ("Calibrating a model kvplay has not seen") has the figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

CHUNK = 256                  # queries at a time in fisher() (a (B, Hq, 256, T) float32 block: 29 MB for Qwen2.5-0.5B)
QUERIES = 512                # query positions shift() reads, evenly spaced over the calibration tokens
SHIFT_CHUNK = 64             # of them at a time: each chunk's queries against the keys up to its last position
BROKEN = 0.5                 # the share of a layer's attention its stored keys move past which second order fails


@dataclass(frozen=True)
class Window:
    """Which tokens a query reads exact: the first `sink`, and those whose block of `block` tokens has not left the
    `residual`-token window (KVPlayLayer's layout; fragile.stored_attention's rule)."""

    sink: int
    residual: int
    block: int

    def boundary(self, i: torch.Tensor) -> torch.Tensor:
        """Query positions i -> the first key position each reads exact again after the stored blocks."""
        return self.sink + self.block * ((i - self.sink - self.residual).clamp(min=0) // self.block)

    def stored(self, i: torch.Tensor, t: int) -> torch.Tensor:
        """Query positions i (n,) -> (n, t): whether each reads each of t keys as stored."""
        j = torch.arange(t, device=i.device)
        return (j >= self.sink) & (j < self.boundary(i)[:, None])


@dataclass
class Layer:
    """One ranked layer in the pass: q (B, Hq, T, D), k, v (B, Hkv, T, D) as its attention saw them, its scaling,
    g (B, Hq, T, D) float32, the gradient of the loss at its attention output, and fisher() per window."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    g: torch.Tensor | None = None
    diagonal: dict[Window, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def draw(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One label per row of p (r, V), drawn from it by its inverse distribution function: the first index whose
    cumulative probability exceeds a uniform draw, (r, 1). 5x faster than torch.multinomial on Qwen2.5's 151,936
    tokens (0.17 s against 0.84 s for 256 rows on 2 cores), which took 6.7 s of its 28 s pass."""
    u = torch.rand(p.shape[0], 1, generator=generator, device=p.device, dtype=p.dtype)
    cdf = p.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=p.shape[-1] - 1)


def label_gradient(logits: torch.Tensor, generator: torch.Generator, rows: int = 256) -> torch.Tensor:
    """d(-sum_t log p(y_t)) / d logits for labels y_t drawn from softmax(logits[t]): softmax - onehot(y), in the
    logits' dtype, computed `rows` positions at a time (a 2,048 x 151,936 float32 block is 1.2 GB)."""
    flat = logits.detach().flatten(0, -2)                                                # (N, V)
    grad = torch.empty_like(flat)
    for a in range(0, flat.shape[0], rows):
        p = flat[a:a + rows].float().softmax(-1)
        y = draw(p, generator)                                                           # (r, 1)
        grad[a:a + rows] = p.scatter_add_(-1, y, -torch.ones_like(y, dtype=p.dtype))
    return grad.view_as(logits)


def measure(model, ids: torch.Tensor, layers: list[int], seed: int = 0, progress=None) -> dict[int, Layer]:
    """{layer: Layer} for each of `layers` over ids (1, T): one forward and one backward of the model (kvplay
    attention: its kvplay_probe hook computes the ranked layers' attention here). progress(fraction, where) after
    each ranked layer's forward and backward ("forward, layer 1 of 30"); an exception it raises stops the pass."""
    progress = progress or (lambda fraction, where: None)
    seen, leaves, ranked = {}, {}, set(layers)
    done = [0]

    def step(*_):
        done[0] += 1
        n, total = done[0], len(layers)
        progress(n / (2 * total), f"forward, layer {n} of {total}" if n <= total
                 else f"backward, layer {n - total} of {total}")

    def probe(idx, q, k, v, scaling):
        if idx not in ranked:
            return None                                                   # another layer: attention as usual
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        seen[idx] = Layer(q.detach(), k.detach(), v.detach(), scaling)
        leaves[idx] = torch.zeros(out.shape, device=out.device, requires_grad=True)
        leaves[idx].register_hook(step)                                   # the backward reached this layer
        step()
        return (out + leaves[idx]).transpose(1, 2).to(q.dtype)            # (B, T, Hq, D)

    with torch.enable_grad():
        logits = model(ids, use_cache=False, kvplay_probe=probe).logits
        grad = label_gradient(logits, torch.Generator(device=logits.device).manual_seed(seed))
        found = torch.autograd.grad(logits, [leaves[i] for i in layers], grad)
    for i, g in zip(layers, found):
        seen[i].g = g
    return seen


def fisher(layer: Layer, windows: list[Window]) -> None:
    """Fill layer.diagonal[w] = (keys' F, values' F), (B, Hkv, T, D) float32, for each window w it lacks: the
    squared gradient of the loss with respect to each key (value) through the queries that read it as stored.
    The gradient through every query, less the band each window's queries read exact; CHUNK queries at a time."""
    windows = [w for w in windows if w not in layer.diagonal]
    if not windows:
        return
    (b, hkv, t, _), scaling = layer.k.shape, layer.scaling
    group = lambda x: x.float().unflatten(1, (hkv, -1))                                 # noqa: E731 (B,Hkv,g,T,D)
    q, g = group(layer.q) * scaling, group(layer.g)
    k, v = layer.k.float(), layer.v.float()
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    near = torch.zeros((len(windows), 2) + k.shape, device=k.device)   # through the queries that read them exact
    pos = torch.arange(t, device=k.device)
    for a in range(0, t, CHUNK):
        e = min(a + CHUNK, t)
        i, j = pos[a:e, None], pos[None, :e]                                             # (c, 1), (1, e)
        qc, gc = q[:, :, :, a:e].flatten(2, 3), g[:, :, :, a:e].flatten(2, 3)            # (B, Hkv, g c, D)
        p = qc @ k[:, :, :e].mT                                                          # (B, Hkv, g c, e)
        p.view(b, hkv, -1, e - a, e)[..., a:].masked_fill_(j[:, a:] > i, -torch.inf)     # the chunk's own keys
        p = p.softmax(-1)
        ds = gc @ v[:, :, :e].mT                                                         # d p
        ds.sub_((ds * p).sum(-1, keepdim=True)).mul_(p)                                  # d scores
        dk[:, :, :e] += ds.mT @ qc
        dv[:, :, :e] += p.mT @ gc
        for w, window in enumerate(windows):
            lo = int(window.boundary(pos[a]))                                            # the band's first key
            if lo < e:
                exact = (j[:, lo:] < window.boundary(i)) | (j[:, lo:] > i)               # (c, e - lo): outside it
                for n, (x, y) in enumerate(((ds, qc), (p, gc))):
                    x = x[..., lo:].unflatten(2, (-1, e - a)).masked_fill(exact, 0).flatten(2, 3)
                    near[w, n, :, :, lo:e] += x.mT @ y
    for w, window in enumerate(windows):
        far = (torch.stack([dk, dv]) - near[w]).pow_(2)
        far[..., :window.sink, :] = 0                                                    # the sink: read exact
        layer.diagonal[window] = far[0], far[1]


def rows(t: int, count: int = QUERIES) -> torch.Tensor:
    """`count` query positions evenly spaced over t tokens, the last included (all of them when t <= count)."""
    return torch.arange(t - 1, -1, -max(1, t // count)).flip(0)


def shift(layer: Layer, keys: list[torch.Tensor], window: Window, positions: torch.Tensor) -> list[float]:
    """For each of `keys` (B, Hkv, T, D), the layer's keys as stored: the share of attention that moves to other
    tokens (total variation, averaged over heads and `positions` (increasing), those past the window) when the
    queries read them so. SHIFT_CHUNK positions at a time, each chunk reading the keys up to its last position only
    (the causal half: 3.1x faster a call on Qwen2.5-Coder-0.5B's layers than every query against every key, the
    same shares to 1e-7)."""
    hkv = layer.k.shape[1]
    q = layer.q[:, :, positions].float().unflatten(1, (hkv, -1)) * layer.scaling        # (B, Hkv, g, n, D)
    reads = window.stored(positions, int(positions[-1]) + 1).any(-1)                     # positions past the window
    if not reads.any():
        return [0.0] * len(keys)
    moved = [0.0] * len(keys)
    for a in range(0, len(positions), SHIFT_CHUNK):
        at, qc = positions[a:a + SHIFT_CHUNK], q[..., a:a + SHIFT_CHUNK, :]
        if not reads[a:a + SHIFT_CHUNK].any():
            continue
        t = int(at[-1]) + 1
        later = torch.arange(t, device=q.device) > at[:, None]                           # (c, t)
        use = window.stored(at, t)
        scores = qc @ layer.k[:, :, :t].float().unsqueeze(2).mT                          # (B, Hkv, g, c, t)
        p = scores.masked_fill(later, -torch.inf).softmax(-1)
        for n, x in enumerate(keys):
            other = torch.where(use, qc @ x[:, :, :t].float().unsqueeze(2).mT, scores).masked_fill_(later, -torch.inf)
            tv = 0.5 * (other.softmax(-1) - p).abs().sum(-1)                             # (B, Hkv, g, c)
            moved[n] += tv[..., reads[a:a + SHIFT_CHUNK]].sum().item()
    return [m / (q.shape[0] * q.shape[1] * q.shape[2] * int(reads.sum())) for m in moved]

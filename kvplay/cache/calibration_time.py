"""About how long a calibration will take on this machine, said before it starts (issue 49: "the page says before
it starts how long it will take").

A calibration's parts are estimated two ways:
  - the Fisher pass (fragile.py), one forward and one backward of the whole model: its floating-point operations,
    counted from the config, over the rate this machine multiplies large float32 matrices at (probed once a
    process, PROBE: a few milliseconds), times a factor measured on the catalogue's models (SECONDS_PER_PROBED_FLOP).
    The count is approximate on purpose: the factor absorbs what it leaves out, so only its growth with the shape
    matters;
  - the rankings' Fisher weights and gains (rank_probe) and the key-rotation fits (fit_probe): many small products
    whose speed no large product predicts (SmolLM2's fit took 15.4 s on 2 Intel Xeon cores and 16.1 s on 2 AMD EPYC
    cores, whose large products ran 1.8x slower), so each is timed here on a miniature of the real code at the
    model's shape (a layer or four of random tensors, a fraction of a second), scaled to the model's layers and
    steps, times a factor near 1 (MINIATURE_FACTOR).
docs/benchmarks.md ("Calibrating a model kvplay has not seen") sets the estimates against measured times.

Each part is named by what it serves, so that parts several specs share are counted once (estimate()): one model's
Fisher pass of a length serves every ranking of that length (fragile.fisher_tokens), one fit every spec with the same
key blocks.
"""
from __future__ import annotations

import functools
import time

import torch

from kvplay.cache import fragile, quant, rotations, sensitivity
from kvplay.cache.engine import KVPlayLayer

PROBE = 1024                      # a (PROBE, 2 PROBE) @ (2 PROBE, 2 PROBE) product: 8.6 GFLOP, about 0.05 s on 2 cores
# Measured seconds over (operations / probed float32 rate), fitted to the three catalogue models' first calibrations
# on 2 AMD EPYC cores, then checked on 2 Intel Xeon cores
SECONDS_PER_PROBED_FLOP = {"pass": 0.502, "logits": 2_840}
# Measured seconds over the miniature's, on the four models' calibrations on 2 Intel Xeon cores (2026-12-06)
MINIATURE_FACTOR = {"weigh": 1.0, "rank": 1.1, "rotations": 0.88}
FIT_PROBE_LAYERS, FIT_PROBE_STEPS = 4, 2   # fit_probe's miniature of a rotation fit: layers, timed steps
PROBE_RUNS = 2                             # runs of a miniature's first part, the fastest kept


@functools.cache
def probed_rate(dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """Floating-point operations per second of a PROBE x 2 PROBE x 2 PROBE matrix product in `dtype`, the best of
    3 after one warm-up: this machine's speed, as the calibration's own products see it."""
    a = torch.randn(PROBE, 2 * PROBE, dtype=dtype, device=device)
    b = torch.randn(2 * PROBE, 2 * PROBE, dtype=dtype, device=device)
    best = float("inf")
    for n in range(4):
        start = time.perf_counter()
        (a @ b).sum().item()                              # .item(): the product is done on any device
        if n:
            best = min(best, time.perf_counter() - start)
    return 2 * PROBE * (2 * PROBE) ** 2 / best


def _shape(config) -> dict[str, int]:
    c = config.get_text_config(decoder=True)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden, layers = c.hidden_size, c.num_hidden_layers
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * c.intermediate_size
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                weights=layers * per_layer + c.vocab_size * hidden)


def pass_flops(config, tokens: int = fragile.FISHER_TOKENS) -> float:
    """One forward and one backward of the whole model over `tokens` (the Fisher pass): three forwards' worth."""
    s = _shape(config)
    return 3 * (2 * s["weights"] * tokens + 2 * s["layers"] * s["heads"] * s["head_dim"] * tokens ** 2)


def logit_elements(config, tokens: int = fragile.FISHER_TOKENS) -> float:
    """The logits a pass draws its labels from (sensitivity.label_gradient: a softmax and a draw over the whole
    vocabulary at every position), which no matrix product's count covers: Gemma 3's 262,144-entry vocabulary
    makes its pass 1.8 times what its products alone predict (2.7 times before the faster label draw)."""
    return tokens * config.get_text_config(decoder=True).vocab_size


_WEIGHS: dict[tuple, float] = {}
_RANKS: dict[tuple, float] = {}


def rank_probe(spec, parts: tuple[str, ...], config, device: str = "cpu") -> tuple[float, float]:
    """(weigh, rank) seconds per layer of the spec's Fisher ranking of `parts`, timed here on a miniature of it: one
    layer of random queries, keys, values and gradients over the spec's pass (fragile.fisher_tokens); its Fisher
    weights for every window that pass serves (sensitivity.fisher; timed once per pass and shape, as the pass's
    weights are computed once), then fragile.gains() of each part and, for keys, the attention shift that tells a
    broken layer (sensitivity.shift; once per spec, parts and shape)."""
    s, t, windows = _shape(config), fragile.fisher_tokens(spec), fragile.windows(spec)
    shape = (s["heads"], s["kv_heads"], s["head_dim"], t, device)
    weighed, ranked = (frozenset(windows), *shape), (str(spec), parts, *shape)
    if weighed not in _WEIGHS or ranked not in _RANKS:
        g = torch.Generator(device=device).manual_seed(0)
        x = lambda heads: torch.randn(1, heads, t, s["head_dim"], generator=g, device=device)   # noqa: E731
        times = []
        for _ in range(PROBE_RUNS):                   # the fastest: the first run also pays for warming up
            layer = sensitivity.Layer(x(s["heads"]), x(s["kv_heads"]), x(s["kv_heads"]), s["head_dim"] ** -0.5,
                                      x(s["heads"]))
            start = time.perf_counter()
            sensitivity.fisher(layer, windows)
            weigh = _done(layer.diagonal[windows[0]][0], start)
            start = time.perf_counter()
            for part in parts:
                fragile.gains({0: layer}, spec, [0], part)
            if "keys" in parts:
                low = fragile.stored_states(KVPlayLayer(fragile.ranked_as(spec)), layer.k)
                sensitivity.shift(layer, [low], windows[0], sensitivity.rows(t).to(device))
            times.append((weigh, time.perf_counter() - start))
        _WEIGHS.setdefault(weighed, min(w for w, _ in times))
        _RANKS.setdefault(ranked, min(r for _, r in times))
    return _WEIGHS[weighed], _RANKS[ranked]


@functools.cache
def fit_probe(heads: int, kv_heads: int, head_dim: int, block: int, sink: int, fitter: rotations.Fitter,
              device: str = "cpu") -> tuple[float, float]:
    """(setup, step) seconds per layer of rotations.fit_layers at this shape, timed here on a miniature of it:
    FIT_PROBE_LAYERS layers of random queries and keys over rotations.CALIBRATION_TOKENS tokens, their inputs
    (rotations.fit_inputs), then FIT_PROBE_STEPS timed steps of the loss and its gradient after one untimed (at the
    start, where a step costs what every step does; no optimizer step, so nothing can diverge)."""
    g = torch.Generator(device=device).manual_seed(0)
    n = rotations.CALIBRATION_TOKENS
    q = torch.randn(heads, n, head_dim, generator=g, device=device)
    k = torch.randn(kv_heads, n, head_dim, generator=g, device=device)
    setups = []
    for _ in range(PROBE_RUNS):                       # the fastest: the first run also pays for warming up
        start = time.perf_counter()
        m, keys = rotations.fit_inputs([(q, k)] * FIT_PROBE_LAYERS, block, sink, fitter)
        setups.append(_done(m, start))
    setup = min(setups)
    rotation = quant.hadamard(head_dim, device=device).expand(keys.shape[0], head_dim, head_dim)
    a = torch.zeros_like(rotation, requires_grad=True)
    with torch.enable_grad():
        for n_step in range(FIT_PROBE_STEPS + 1):
            if n_step == 1:
                start = time.perf_counter()
            rotations.fit_loss(fitter, rotation, a, m, keys, block, sink, FIT_PROBE_LAYERS).backward()
    step = _done(a.grad, start) / FIT_PROBE_STEPS
    return setup / FIT_PROBE_LAYERS, step / FIT_PROBE_LAYERS


def _done(x: torch.Tensor, start: float) -> float:
    """Seconds since start once x is computed (.item(): on any device)."""
    x.sum().item()
    return time.perf_counter() - start


def rotation_seconds(config, layers: int, block: int, sink: int, fitter: rotations.Fitter,
                     device: str = "cpu") -> float:
    """rotations.fit_layers of `layers` layers for blocks of `block` tokens, from fit_probe(): the setup, then
    fitter.steps steps, per layer, times the measured factor."""
    s = _shape(config)
    setup, step = fit_probe(s["heads"], s["kv_heads"], s["head_dim"], block, sink, fitter, device)
    return MINIATURE_FACTOR["rotations"] * layers * (setup + fitter.steps * step)


def seconds(part: str, flops: float, device: str = "cpu") -> float:
    """`part`'s estimated seconds here: flops (for "logits", elements) over the probed float32 rate, times the
    part's measured factor. float32 for a bfloat16 model's pass too: where the CPU has bfloat16 matrix units (an
    Intel Xeon with AMX) the bfloat16 probe ran 5.7x the float32 one (1,952 against 343 GFLOP/s) and 4.7x an AMD
    EPYC's bfloat16 probe, but the four models' passes only 1.05-2.0x as fast as on that EPYC: estimated from the
    bfloat16 probe, Qwen2.5-1.5B's shape's 26 s pass read 12 s; from the float32 one, 32 s (docs/benchmarks.md)."""
    return SECONDS_PER_PROBED_FLOP[part] * flops / probed_rate(torch.float32, device)


def estimate(parts: list[dict[str, float]]) -> float:
    """Seconds for every part of several specs' calibrations ({name: seconds} each), a part they share once."""
    return sum({name: s for each in parts for name, s in each.items()}.values())


def words(total: float) -> str:
    """'about 40 s' or 'about 3 min', for a card or a progress line."""
    return f"about {max(1, round(total)):,} s" if total < 120 else f"about {round(total / 60):,} min"

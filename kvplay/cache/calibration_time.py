"""About how long a calibration will take on this machine, said before it starts (issue 49: "the page says before
it starts how long it will take").

A calibration's parts (fragile.py's Fisher pass and rankings, rotations.py's key-rotation fits) are dense tensor
products of shapes the model's config gives, so each part is estimated as its floating-point operations over the
rate this machine multiplies matrices at (probed once a process, PROBE: a few milliseconds), times a factor per part
measured on the catalogue's models (SECONDS_PER_PROBED_FLOP; docs/benchmarks.md sets the estimates against measured
times). The operation counts are approximate on purpose: each factor absorbs what a count leaves out (softmaxes,
copies, the backward's share of the forward), so only their growth with the model's shape matters.

Each part is named by what it serves, so that parts several specs share are counted once (estimate()): one model's
Fisher pass of a length serves every ranking of that length (fragile.fisher_tokens), one fit every spec with the same
key blocks.
"""
from __future__ import annotations

import functools
import time

import torch

from kvplay.cache import fragile, rotations, sensitivity

PROBE = 1024                      # a (PROBE, 2 PROBE) @ (2 PROBE, 2 PROBE) product: 8.6 GFLOP, about 0.05 s on 2 cores
# Measured seconds over (operations / probed float32 rate), per part, fitted to the three catalogue models' first
# calibrations on 2 AMD EPYC cores and, for "rank" and "rotations", to a model of Qwen2.5-1.5B's shape, then checked
# on 2 Intel Xeon cores (docs/benchmarks.md, "Calibrating a model kvplay has not seen")
SECONDS_PER_PROBED_FLOP = {"pass": 0.502, "logits": 2_840, "weigh": 0.89, "rank": 4.3, "rotations": 2.25}
WIDE = 128                        # a rotation fit's (D, D) products run at one rate up to this head_dim; at 256 twice
                                  # as fast per operation (Gemma 3's fits, against Qwen2.5's at 64 and 128)


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


def weigh_flops(config, layers: int, windows: int, tokens: int = fragile.FISHER_TOKENS) -> float:
    """sensitivity.fisher() of `layers` layers for `windows` windows: the gradient through every query, per window."""
    s = _shape(config)
    return 4 * layers * s["heads"] * s["head_dim"] * tokens ** 2 * (1 + windows)


def rank_flops(config, layers: int, tokens: int = fragile.FISHER_TOKENS) -> float:
    """One spec's rankings (fragile.gains and sensitivity.shift over QUERIES query positions) of `layers` layers:
    its keys' alone took as long as its keys' and values' together (3.3-3.7 s on Qwen2.5-Coder-0.5B)."""
    s = _shape(config)
    return 4 * layers * s["heads"] * s["head_dim"] * tokens * sensitivity.QUERIES


def rotation_flops(config, layers: int, block: int, sink: int, fitter: rotations.Fitter) -> float:
    """rotations.fit_layers of `layers` layers for blocks of `block` tokens: the block weights, the queries'
    moments, then fitter.steps steps of the loss and its gradient (three products' worth), counted at the rate of
    products up to WIDE wide."""
    s, n_tok = _shape(config), rotations.CALIBRATION_TOKENS
    d, queries, blocks = s["head_dim"], n_tok // fitter.query_stride, (n_tok - sink) // block
    setup = layers * s["heads"] * queries * d * (2 * n_tok + 2 * blocks * d)
    step = 3 * layers * s["kv_heads"] * (2 * n_tok * d ** 2 + 2 * blocks * d ** 3)
    return (setup + fitter.steps * step) * min(1.0, WIDE / d)


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

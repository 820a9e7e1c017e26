"""Calibrated key rotations: kvplay's `rotation=calibrated`, one orthogonal matrix per layer and KV head.

`rotation=hadamard` multiplies every key and value by one fixed Hadamard matrix H before quantizing them, so that
no channel's outliers set a whole block's scale. `rotation=calibrated` keeps H for the values and gives each layer's
KV heads keys rotations of their own, fitted once per model to what its queries read (docs/quality-ablation.md,
rounds 5 and 6: on SmolLM2, kvplay-2.5bit's mean KL falls 11-21% on three texts, kvplay-3bit's 6-9%):

  1. one 16-bit forward over CALIBRATION_TOKENS tokens from the end of The Tempest (fragile.py's calibration text,
     which `kvplay ppl` reaches only past 29,000 tokens) records each layer's queries and keys after RoPE, as
     attention sees them (kvplay_attention's kvplay_probe hook);
  2. a key channel c stored per block of T tokens carries rounding noise of variance scale_c^2 / 12 (scale_c: the
     channel's range over the block over the 2^b - 1 steps), and a query q turns it into score noise
     sum_c (q R)_c^2 scale_c^2 / 12. Summed over the calibration queries, each block weighted by the attention
     mass the query puts on it (a block no query reads costs nothing), that is the loss;
  3. R = H expm(A - A^T) (or H cay(A - A^T), the Cayley map (I - S)^-1 (I + S)), orthogonal for any A, starts at H
     (A = 0) and takes Adam steps on A.

Two fitters (FITTERS; formats as data): "thorough", what the catalogue's shipped fits are (300 steps through the
matrix exponential, every calibration query weighing the blocks), and "fast", what a model nothing is kept for gets by
default (150 steps at twice the rate through the Cayley map, whose backward is a solve rather than a 2D x 2D matrix
exponential, and every 4th query). On Qwen2.5-Coder-0.5B's 24 layers the fast fit leaves 3% more score noise
than the thorough one and takes a third of the time; each preset's KL with it is in docs/benchmarks.md. A kept
thorough fit comes first, then a kept fast one; $KVPLAY_ROTATIONS picks the fitter, and then reads only its own.

The bits only scale the loss, so one fit serves every key bit width of a block size (a fragile layer's 3-bit
keys use the same R as the 2-bit ones). The fast fitter goes further: its one fit for 64-token blocks serves every
larger block (Fitter.shared_block), so kvplay-3bit and kvplay-2.5bit calibrate one fit between them.
Every layer is fitted in one batch (fit_layers); all of Qwen2.5-Coder-0.5B's 24 layers took 45-48 s per block
size on 2 shared CPU cores (thorough) before that batching (docs/benchmarks.md).
The fragile layers (fragile.py) are ranked under the Hadamard matrix the fits start from (fragile.ranked_as says why).
The fits are kept like the fragile rankings: in memory, in ~/.cache/kvplay/rotations and, for the catalogue's
models, shipped in assets/key_rotations/ (float16, made exactly orthogonal again on loading; scripts/rank_fragile.py
writes them).
They belong to the model, not to the cache: 30 layers x 3 heads x 64 x 64 float16 is 0.74 MB for SmolLM2, counted
nowhere in the cache's bytes, as the Hadamard matrix is not.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvplay.cache import attention, fragile, quant
from kvplay.cache.fragile import calibration_ids, fingerprint
from kvplay.errors import KvplayError
from kvplay.paths import assets

CALIBRATION_TOKENS = 2048    # 16-32 blocks of the presets' 128 or 64 tokens per layer and head; 1,024 left 38% more
                             # score noise on Qwen2.5-Coder-0.5B's 2,048


@dataclass(frozen=True)
class Fitter:
    """How a model's key rotations are fitted: Adam's steps and rate, which calibration queries weigh the blocks
    (every query_stride-th), and the map from a skew-symmetric S to a rotation (Cayley's, or the exponential)."""
    name: str
    steps: int
    lr: float = 5e-3
    query_stride: int = 1
    cayley: bool = False
    shared_block: int | None = None      # blocks of this many tokens or more share one fit, made at this size

    def block(self, group: int) -> int:
        """The block size the keys of a spec stored in blocks of `group` tokens are fitted for."""
        return min(group, self.shared_block) if self.shared_block else group

    @property
    def key(self) -> str:
        """Its part of a fit's storage key: the steps, and whatever differs from the defaults (the shipped fits'
        keys predate the fitters and name only their steps)."""
        extra = [f"lr={self.lr:g}"] if self.lr != Fitter.lr else []
        extra += [f"queries=1/{self.query_stride}"] if self.query_stride != Fitter.query_stride else []
        extra += ["map=cayley"] if self.cayley else []
        return ",".join([f"steps={self.steps}", *extra])

    def rotation(self, start: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """start @ the rotation of S = a - a^T: orthogonal for any a, start itself at a = 0."""
        s = a - a.mT
        if not self.cayley:
            return start @ torch.linalg.matrix_exp(s)
        eye = torch.eye(s.shape[-1], device=s.device)
        return start @ torch.linalg.solve(eye - s, eye + s)


# "thorough": round 5's screened setting (docs/quality-ablation.md). "fast": Qwen2.5-Coder-0.5B's 24 layers, blocks
# of 64, screened on the score noise left (thorough's 0.256 of the Hadamard matrix's): the Cayley map at 300 steps
# 0.254, with every 4th query 0.255; then 150 steps at 1e-2 0.262 (100 at 1.5e-2: 0.272; a cosine decay: worse).
# Its one fit at 64-token blocks serves kvplay-3bit's 128 too: kvplay-3bit's KL with it against its own fit, +4.7%,
# -5.4% and +1.0% on SmolLM2, Qwen2.5 and Gemma 3 (docs/benchmarks.md, "Since the faster attention shift").
FITTERS = {"thorough": Fitter("thorough", 300),
           "fast": Fitter("fast", 150, 1e-2, query_stride=4, cayley=True, shared_block=64)}
STEPS, LR = FITTERS["thorough"].steps, FITTERS["thorough"].lr


def chosen_fitter() -> Fitter:
    """Which fitter key_rotations() uses where nothing is kept: $KVPLAY_ROTATIONS, "fast" (the default) or
    "thorough" (what the shipped fits are). Set, it also reads only fits of its own kind."""
    name = os.environ.get("KVPLAY_ROTATIONS", "") or "fast"
    if name not in FITTERS:
        raise KvplayError(f"KVPLAY_ROTATIONS={name!r}: choose {' or '.join(FITTERS)}.")
    return FITTERS[name]


# {fingerprint}.pt: {storage_key: (layers, Hkv, D, D) float16}, the catalogue's models' fits
SEEDS = assets("key_rotations")
_FITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> _Fits


def queries_and_keys(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (queries (Hq, N, D), keys (Hkv, N, D))}, float32, of one 16-bit forward over ids (1, N)."""
    seen = {}

    def grab(idx, q, k, v, scaling):
        seen[idx] = (q[0].float(), k[0].float())
        return None                                   # attention runs as usual
    with torch.no_grad():
        model(ids, use_cache=False, kvplay_probe=grab)
    return seen


def block_mass(q: torch.Tensor, k: torch.Tensor, block: int, sink: int, stride: int = 1) -> torch.Tensor:
    """q (Hkv, g N', D) a KV head's g query heads at every stride-th of the N positions, k (Hkv, N, D) ->
    (Hkv, g N', n): each query's causal attention mass on each of the n whole blocks of keys after the sink."""
    n_tok, n = k.shape[1], (k.shape[1] - sink) // block
    at = torch.arange(0, n_tok, stride, device=k.device)                                 # the queries' positions
    scores = (q.unflatten(1, (-1, len(at))) * k.shape[-1] ** -0.5) @ k.unsqueeze(1).mT   # (Hkv, g, N', N)
    i = torch.arange(n_tok, device=k.device)
    p = scores.masked_fill(i[None, :] > at[:, None], -torch.inf).softmax(-1)
    return p[..., sink:sink + n * block].unflatten(-1, (n, block)).sum(-1).flatten(1, 2)


def score_noise(R: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, block: int, sink: int,
                bits: int = 1) -> torch.Tensor:
    """Expected squared score error, averaged over KV heads, of keys k (Hkv, N, D) rotated by R (Hkv, D, D) and
    stored per channel in blocks at `bits`, read by queries q (Hkv, M, D) with block weights w (Hkv, M, n), or
    every block alike (w None)."""
    kr = (k @ R)[:, sink:sink + block * ((k.shape[1] - sink) // block)].unflatten(1, (-1, block))  # (Hkv, n, T, D)
    scale2 = ((kr.amax(2) - kr.amin(2)) / (2 ** bits - 1)).pow(2)                                   # (Hkv, n, D)
    if w is None:
        return ((q @ R).pow(2).mean(1) * scale2.mean(1)).sum(-1).mean() / 12
    return ((w.mT @ (q @ R).pow(2) / q.shape[1]) * scale2).sum((-1, -2)).mean() / 12


def moments(q: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """q (Hkv, M, D), block weights w (Hkv, M, n) or None -> (Hkv, n, D, D), each block's weighted second moment of
    the queries sum_i w_ib q_i q_i^T / M ((Hkv, 1, D, D), their mean, where w is None): score_noise()'s
    sum_i w_ib (q_i R)_c^2 / M is then (R^T M_b R)_cc, whatever R."""
    if w is None:
        return (q.mT @ q / q.shape[1]).unsqueeze(1)
    return torch.stack([(q * w[..., b:b + 1]).mT @ q for b in range(w.shape[-1])], 1) / q.shape[1]


def moment_noise(R: torch.Tensor, m: torch.Tensor, k: torch.Tensor, block: int, sink: int) -> torch.Tensor:
    """score_noise() at 1 bit from the queries' moments m (Hkv, n or 1, D, D) (moments()): the same number with a
    (D, D) product per block in place of one per query, 2.5x faster a step on Qwen2.5-Coder-0.5B's queries."""
    n = (k.shape[1] - sink) // block
    kr = (k[:, sink:sink + block * n] @ R).unflatten(1, (n, block))                  # (Hkv, n, T, D)
    scale2 = (kr.max(2).values - kr.min(2).values).pow(2)                            # (Hkv, n, D)
    read = ((m @ R.unsqueeze(1)) * R.unsqueeze(1)).sum(-2)                           # (Hkv, n or 1, D)
    return (read * (scale2 if m.shape[1] == n else scale2.mean(1, keepdim=True))).sum((-1, -2)).mean() / 12


def fit(q: torch.Tensor, k: torch.Tensor, block: int, sink: int, steps: int | None = None, weighted: bool = True,
        fitter: Fitter = FITTERS["thorough"]) -> tuple[torch.Tensor, float, float]:
    """One layer's key rotations: q (Hq, N, D), k (Hkv, N, D) -> ((Hkv, D, D) float32, score noise with the Hadamard
    matrix, score noise with the fit)."""
    return fit_layers([(q, k)], block, sink, steps, weighted, fitter=fitter)[0]


def fit_inputs(seen: list[tuple[torch.Tensor, torch.Tensor]], block: int, sink: int, fitter: Fitter,
               weighted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fit of the layers in `seen` reads at every step: their query moments per block (moments(), the blocks
    weighed by every fitter.query_stride-th query) and their keys, each layer's KV heads stacked."""
    ms, ks = [], []
    for q, k in seen:
        q = q.unflatten(0, (k.shape[0], -1))                                # (Hkv, g, N, D): a KV head's queries
        some = q[:, :, ::fitter.query_stride].flatten(1, 2)
        ms.append(moments(some, block_mass(some, k, block, sink, fitter.query_stride) if weighted else None))
        ks.append(k)
    return torch.cat(ms), torch.cat(ks)


def fit_loss(fitter: Fitter, start: torch.Tensor, a: torch.Tensor, m: torch.Tensor, k: torch.Tensor, block: int,
             sink: int, layers: int) -> torch.Tensor:
    """One step's loss: the summed layers' score noise (moment_noise) under the rotations start @ map(a)."""
    return moment_noise(fitter.rotation(start, a), m, k, block, sink) * layers


def fit_layers(seen: list[tuple[torch.Tensor, torch.Tensor]], block: int, sink: int, steps: int | None = None,
               weighted: bool = True, on_step=None, fitter: Fitter = FITTERS["thorough"]
               ) -> list[tuple[torch.Tensor, float, float]]:
    """fit() of every layer in `seen` at once: their heads stacked into one batch of Adam steps, the loss the sum
    of the layers' own, so each layer's gradient, and Adam's per-parameter steps, are those of its own fit (the
    same matrices, bit for bit; 22% faster than one fit per layer on Qwen2.5-Coder-0.5B). steps: the fitter's
    unless given. on_step(n) after step n. The score noises returned are read by the queries the fit weighs
    (every fitter.query_stride-th)."""
    steps = fitter.steps if steps is None else steps
    m, k = fit_inputs(seen, block, sink, fitter, weighted)
    hkv, d, layers = k.shape[0], k.shape[-1], len(seen)
    start = quant.hadamard(d, device=k.device).expand(hkv, d, d)
    a = torch.zeros(hkv, d, d, device=k.device, requires_grad=True)
    opt = torch.optim.Adam([a], lr=fitter.lr)
    with torch.enable_grad():
        for n in range(steps):
            loss = fit_loss(fitter, start, a, m, k, block, sink, layers)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if on_step is not None:
                on_step(n + 1)
    with torch.no_grad():
        rotation = fitter.rotation(start, a)
        out, at = [], 0
        for _, k_layer in seen:
            h = k_layer.shape[0]
            part = slice(at, at + h)
            out.append((rotation[part].contiguous(),
                        moment_noise(start[part], m[part], k[part], block, sink).item(),
                        moment_noise(rotation[part], m[part], k[part], block, sink).item()))
            at += h
        return out


def calibrate(model, tokenizer, spec, layers: list[int], progress=None, fitter: Fitter | None = None
              ) -> dict[int, torch.Tensor]:
    """{layer: (Hkv, D, D) float32 on the CPU}: each of `layers`' key rotations, fitted for blocks of
    fitter.block(spec.group) tokens after spec.sink tokens, every layer at once (fit_layers), by `fitter` (default:
    chosen_fitter()). progress(fraction, what) every few steps."""
    if not attention.model_uses_it(model.config.get_text_config(decoder=True)):
        raise KvplayError(f"{spec} fits its key rotations through kvplay's attention: load the model with "
                          "attn_implementation='kvplay' (kvplay's own loader does), or use rotation=hadamard.")
    fitter = fitter or chosen_fitter()
    progress = progress or (lambda fraction, what: None)
    what = f"{spec}: fitting each layer's key rotations (once per model and storage settings, then kept on disk)"
    progress(0.0, what)
    seen = fragile.queries_and_keys(model, CALIBRATION_TOKENS, layers)        # the ranking's pass already saw them
    if seen is None:
        seen = queries_and_keys(model, calibration_ids(tokenizer, CALIBRATION_TOKENS).to(model.device))

    def stepped(n):                                  # about 30 reports, at a step's end (a Stop acts there)
        if n % max(1, fitter.steps // 30) == 0:
            progress(n / fitter.steps, f"{what}: step {n} of {fitter.steps}")
    fits = fit_layers([seen[i] for i in layers], fitter.block(spec.group), spec.sink, on_step=stepped, fitter=fitter)
    return {i: fitted[0].cpu() for i, fitted in zip(layers, fits, strict=True)}


def storage_key(spec, layers: list[int], fitter: Fitter = FITTERS["thorough"]) -> str:
    """What a fit depends on: the key blocks (tokens per block, sink), how it was fitted and the layers fitted."""
    return (f"group={fitter.block(spec.group)},sink={spec.sink},tokens={CALIBRATION_TOKENS},{fitter.key},"
            f"layers={','.join(map(str, layers))}")


def _readable() -> tuple[Fitter, ...]:
    """The fitters whose kept fits key_rotations() reads, best first: thorough then fast, or $KVPLAY_ROTATIONS's."""
    return (chosen_fitter(),) if os.environ.get("KVPLAY_ROTATIONS") else (FITTERS["thorough"], FITTERS["fast"])


def rotation_dir() -> Path:
    """Where fitted rotations are kept between runs: $KVPLAY_ROTATION_DIR, else ~/.cache/kvplay/rotations."""
    return Path(os.environ.get("KVPLAY_ROTATION_DIR") or Path.home() / ".cache" / "kvplay" / "rotations").expanduser()


def orthogonal(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrices nearest m (..., D, D) (polar decomposition), float32: a float16 copy made exact."""
    u, _, vh = torch.linalg.svd(m.double())
    return (u @ vh).float().contiguous()


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return {}


def pack(fits: dict[int, torch.Tensor], layers: list[int]) -> torch.Tensor:
    """{layer: (Hkv, D, D)} -> (layers, Hkv, D, D) float16, as stored."""
    return torch.stack([fits[i] for i in layers]).half()


def _keep(fp: str, stored: dict[str, torch.Tensor]) -> None:
    try:
        rotation_dir().mkdir(parents=True, exist_ok=True)
        torch.save(stored, rotation_dir() / f"{fp}.pt")
    except OSError:
        pass          # a cache: a read-only home only means fitting again next time


@dataclass
class _Fits:
    """One model's fits: as stored (float16, the seeds' and this machine's), and made exact on first use."""
    fingerprint: str
    seeded: dict[str, torch.Tensor]
    measured: dict[str, torch.Tensor]               # rotation_dir()'s, and fits made in this process
    exact: dict[str, torch.Tensor] = field(default_factory=dict)


def _fits(model) -> _Fits:
    if model not in _FITTED:
        fp = fingerprint(model)
        _FITTED[model] = _Fits(fp, _load(SEEDS / f"{fp}.pt"), _load(rotation_dir() / f"{fp}.pt"))
    return _FITTED[model]


def _kept_key(model, spec, layers: list[int]) -> str | None:
    fits = _fits(model)
    for each in _readable():
        key = storage_key(spec, layers, each)
        if key in fits.exact or key in fits.measured or key in fits.seeded:
            return key
    return None


def rotations_kept(model, spec, layers: list[int]) -> bool:
    """Whether key_rotations() finds spec's fits kept for this model (in memory, rotation_dir() or SEEDS)."""
    return _kept_key(model, spec, layers) is not None


def key_rotations(model, tokenizer, spec, layers: list[int], progress=None) -> dict[int, torch.Tensor]:
    """{layer: (Hkv, D, D)} float32 key rotations for a rotation=calibrated spec, fitted once per model and
    storage_key (calibrate(), by chosen_fitter()) and kept: in memory, in rotation_dir() and, for the catalogue's
    models, in SEEDS (thorough fits). A kept thorough fit comes first, then a kept fast one (_readable)."""
    fits, key = _fits(model), _kept_key(model, spec, layers)
    if key is None:
        if tokenizer is None:
            raise KvplayError(f"{spec} fits its key rotations on a calibration text, so it needs the tokenizer: "
                              "build_cache(spec, model, tokenizer=tok).")
        chosen = chosen_fitter()
        key = storage_key(spec, layers, chosen)
        fits.measured[key] = pack(calibrate(model, tokenizer, spec, layers, progress, chosen), layers)
        _keep(fits.fingerprint, fits.measured)
    if key not in fits.exact:
        fits.exact[key] = orthogonal(fits.measured.get(key, fits.seeded.get(key)))   # float16 made exact, once
    return {i: fits.exact[key][n] for n, i in enumerate(layers)}

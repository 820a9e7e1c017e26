"""The real llama.cpp on the same GGUF, through llama-cpp-python (optional: pip install -r requirements-llamacpp.txt).

    spec = parse_real_spec("llama.cpp:q4_0")               # -ctk q4_0 -ctv q4_0, rotated (llama.cpp's default)
    parse_real_spec("llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off")  # LLAMA_ATTN_ROT_DISABLE=1 for this context
    runs = compare_runs("smollm2-135m-instruct", prompt_ids, 64, [spec], tokenizer)   # CacheRun rows
    runs = ppl_runs("smollm2-135m-instruct", ids, [spec], chunk=16)                   # PplRun rows

Spec syntax follows kvplay's `name:key=value` grammar with one name, `llama.cpp`: options ctk and ctv (the
cache types of -ctk/-ctv, default f16 each as in llama.cpp), attn_rot (auto: llama.cpp's Hadamard rotation of
quantized caches, its default; off: LLAMA_ATTN_ROT_DISABLE=1), and the shorthand `llama.cpp:TYPE` for
ctk=ctv=TYPE. The names match the emulation's (kvplay/cache/methods/llamacpp.py, `llamacpp-q4_0`).
These specs are not transformers caches, so they are not in kvplay's cache registry: kvplay.app.commands splits them
off (split_specs) and appends their rows to the same CompareResult / PplResult.

Every context is created with flash attention on (llama.cpp needs it for a quantized V) and logits for every
token. Each quantized row is measured against llama.cpp's own f16 cache on the same GGUF: KL and top-1 are
teacher-forced (the f16 run's tokens evaluated through the quantized cache n_batch tokens per llama_decode call;
keys and values are written before attention reads them, so every token reads the cache as llama.cpp stores
it). Bytes are computed from ggml's block sizes (GGML_TYPES) for the cells in use, layers x KV heads x (K row +
V row); tests/test_llamacpp.py checks them against the growth of llama.cpp's own llama_state_seq_get_size.
Without llama_cpp importable a spec gets one sentence (require()). The spec functions import no torch, so
kvplay.show.cards can ask is_real_spec cheaply.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvplay.errors import KvplayError
from kvplay.lab.compare import token_pieces, top_k
from kvplay.lab.generate import speed_stats
from kvplay.lab.metrics import divergence, kl_per_step, perplexity, token_logprob, top1_agree
from kvplay.results import CacheRun, PplRun

PREFIX = "llama.cpp"
INSTALL = "pip install -r requirements-llamacpp.txt"
# ggml type -> (elements per block, bytes per block), from ggml's type traits (ggml/src/ggml.c).
GGML_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
              "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}
REFERENCE = "f16"
KL_WINDOW = 64            # tokens per point of PplRun.kl_along_text, as kvplay.lab.quality


@dataclass(frozen=True)
class RealSpec:
    """One llama.cpp context: the K and V cache types and whether quantized caches are rotated."""

    ctk: str = REFERENCE
    ctv: str = REFERENCE
    rot: bool = True

    @property
    def is_reference(self) -> bool:
        return self.ctk == REFERENCE and self.ctv == REFERENCE

    @property
    def bits(self) -> float:
        """Bits per cached element, K and V averaged (q4_0: 4.5, q8_0: 8.5)."""
        return sum(8 * GGML_TYPES[t][1] / GGML_TYPES[t][0] for t in (self.ctk, self.ctv)) / 2

    def __str__(self) -> str:
        types = self.ctk if self.ctk == self.ctv else f"ctk={self.ctk},ctv={self.ctv}"
        return f"{PREFIX}:{types}" + ("" if self.rot else ",attn_rot=off")


def is_real_spec(text) -> bool:
    """Whether a spec string names the real llama.cpp engine (`llama.cpp` or `llama.cpp:...`)."""
    return isinstance(text, (str, RealSpec)) and (isinstance(text, RealSpec) or
                                                  text.strip().lower().split(":", 1)[0].strip() == PREFIX)


def _type(value: str, text: str) -> str:
    value = value.strip().lower()
    if value not in GGML_TYPES or value == "f32":
        offered = ", ".join(t for t in GGML_TYPES if t != "f32")
        raise KvplayError(f"Unknown llama.cpp cache type {value!r} in {text!r}; choose one of {offered}.")
    return value


def parse_real_spec(text: str | RealSpec) -> RealSpec:
    """'llama.cpp', 'llama.cpp:q4_0' or 'llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off' -> RealSpec, or one sentence."""
    if isinstance(text, RealSpec):
        return text
    name, _, opts = text.strip().partition(":")
    if name.strip().lower() != PREFIX:
        raise KvplayError(f"{text!r} is not a llama.cpp spec; those look like 'llama.cpp:q4_0'.")
    given: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in opts.split(","))):
        key, eq, raw = (p.strip().lower() for p in item.partition("="))
        if not eq:                                   # the shorthand llama.cpp:q4_0 sets both types
            key, raw = "type", key
        if not raw:
            raise KvplayError(f"Option {item!r} in {text!r} must look like key=value.")
        if key not in ("type", "ctk", "ctv", "attn_rot"):
            raise KvplayError(f"Unknown option {key!r} for llama.cpp; valid options: ctk, ctv and attn_rot, "
                              "or llama.cpp:TYPE for both types.")
        sets = {"type": {"ctk", "ctv"}}.get(key, {key})            # the keys of `given` this item sets
        if sets & set(given) or (key == "attn_rot" and "rot" in given):
            raise KvplayError(f"{text!r} sets {key!r} twice.")
        if key == "attn_rot":
            if raw not in ("auto", "off"):
                raise KvplayError(f"attn_rot must be auto or off in {text!r}, not {raw!r}.")
            given["rot"] = raw == "auto"
        else:
            given.update(dict.fromkeys(sets, _type(raw, text)))
    if opts.strip() and not given:
        raise KvplayError(f"Spec {text!r} has a colon but no options.")
    return RealSpec(**given)


def split_specs(specs) -> tuple[list, list[RealSpec]]:
    """(kvplay's own specs, as given; the real llama.cpp specs, parsed and de-duplicated)."""
    if isinstance(specs, str):
        specs = specs.split()
    specs = list(specs or [])
    real = [parse_real_spec(s) for s in specs if is_real_spec(s)]
    return [s for s in specs if not is_real_spec(s)], list(dict.fromkeys(real))


def require():
    """The llama_cpp module, or one sentence saying how to install it."""
    try:
        import llama_cpp  # llama-cpp-python: optional (requirements-llamacpp.txt), loaded only for the real llama.cpp
    except ImportError:
        raise KvplayError(f"The real llama.cpp engine needs llama-cpp-python, which is not installed: {INSTALL}.") \
            from None
    return llama_cpp


def available() -> bool:
    try:
        require()
    except KvplayError:
        return False
    return True


def row_nbytes(ggml_type: str, elements: int) -> int:
    """Bytes of one row of `elements` values in a ggml type (ggml_row_size)."""
    block, size = GGML_TYPES[ggml_type]
    if elements % block:
        raise KvplayError(f"llama.cpp's {ggml_type} needs rows of a multiple of {block} elements, not {elements}.")
    return elements // block * size


@dataclass(frozen=True)
class GgufShape:
    layers: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int

    @property
    def elements_per_token(self) -> int:
        return self.layers * self.kv_heads * (self.head_dim_k + self.head_dim_v)


def kv_nbytes(spec: RealSpec, shape: GgufShape, tokens: int) -> int:
    """Bytes llama.cpp's cache holds for `tokens` cells: every layer's K and V rows in their ggml types."""
    per_token = shape.kv_heads * (row_nbytes(spec.ctk, shape.head_dim_k) + row_nbytes(spec.ctv, shape.head_dim_v))
    return shape.layers * per_token * tokens


def gguf_shape(llm) -> GgufShape:
    """Layers, KV heads and head sizes from the GGUF's metadata."""
    meta = llm.metadata
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    return GgufShape(layers=int(meta[f"{arch}.block_count"]),
                     kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
                     head_dim_k=int(meta.get(f"{arch}.attention.key_length", head_dim)),
                     head_dim_v=int(meta.get(f"{arch}.attention.value_length", head_dim)))


def threads() -> int:
    return max(1, torch.get_num_threads())


@contextmanager
def context(path: Path, spec: RealSpec, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512):
    """A llama.cpp context on `path` for `spec` (flash attention, logits for every token), closed afterwards."""
    llama_cpp = require()
    saved = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if spec.rot else "1"      # read once, when the cache is created
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch),
                              n_threads=threads(), n_threads_batch=threads(), n_gpu_layers=0, flash_attn=True,
                              logits_all=True, type_k=getattr(llama_cpp, f"GGML_TYPE_{spec.ctk.upper()}"),
                              type_v=getattr(llama_cpp, f"GGML_TYPE_{spec.ctv.upper()}"), verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise KvplayError(f"llama.cpp could not open {path.name} with {spec}: {exc}.") from None
    finally:
        if saved is None:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        else:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = saved
    try:
        yield llm
    finally:
        llm.close()


def eval_logits(llm, ids: list[int]) -> np.ndarray:
    """Teacher-forced: `ids` through a fresh cache -> logits of every position (N, V) float32 (a copy)."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def state_nbytes(llm) -> int:
    """llama.cpp's own serialised size of sequence 0: its KV cells plus a small header (llama_state_seq_get_size)."""
    llama_cpp = require()
    return int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))


@dataclass
class Greedy:
    tokens: list[int]
    prefill_s: float
    decode_s: list[float]


def greedy(llm, prompt_ids: list[int], max_new_tokens: int, stop_token: int | None = None) -> Greedy:
    """Greedy decode (argmax of llama.cpp's logits), timing the prefill and each decode step."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    prefill_s, tokens, steps = time.perf_counter() - t0, [], []
    while True:
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(tok)
        if len(tokens) >= max_new_tokens or tok == stop_token:
            return Greedy(tokens, prefill_s, steps)
        t0 = time.perf_counter()
        llm.eval([tok])
        steps.append(time.perf_counter() - t0)


def _n_ctx(tokens: int) -> int:
    return -(-tokens // 256) * 256            # llama.cpp pads its cells to 256 anyway


def _scored(llm, ids: list[int], first: int):
    return torch.from_numpy(eval_logits(llm, ids)[first:])                                  # (N - first, V)


def compare_runs(gguf: Path, prompt_ids: list[int], max_new_tokens: int, specs, tokenizer, *,
                 base_tokens: list[int] | None = None, chat: bool = False, progress=None) -> list[CacheRun]:
    """CacheRun rows for llama.cpp's f16 cache (the reference, always first) and each spec, on one prompt.

    Each quantized row generates greedily on its own, then reads the f16 row's tokens teacher-forced; KL, top-1
    and text divergence are against the f16 row. The f16 row's text is compared with `base_tokens` (transformers'
    16-bit run) when given; its KL is 0 by definition.
    """

    specs = [RealSpec()] + [s for s in (parse_real_spec(s) for s in specs) if not s.is_reference]
    path, progress = Path(gguf), progress or (lambda f, d: None)
    stop = tokenizer.eos_token_id if chat else None
    n_ctx = _n_ctx(len(prompt_ids) + max_new_tokens + 1)
    runs, ref, p = [], None, None
    for i, spec in enumerate(specs):
        progress(i / len(specs), f"{spec}: generating")
        t0 = time.perf_counter()
        with context(path, spec, n_ctx) as llm:
            shape = gguf_shape(llm)
            free = greedy(llm, prompt_ids, max_new_tokens, stop)
            if ref is None:
                ref = free.tokens
            progress((i + 0.5) / len(specs), f"{spec}: teacher forcing")
            q = _scored(llm, prompt_ids + ref[:-1], len(prompt_ids) - 1)                    # (N, V)
            allocated = kv_nbytes(spec, shape, llm.n_ctx())
        p = q if p is None else p
        kl, agree = kl_per_step(p, q), top1_agree(p, q)
        logprob = token_logprob(q, torch.tensor(ref))
        against = (base_tokens if base_tokens is not None else ref) if spec.is_reference else ref
        first, frac, spans = divergence(against, free.tokens)
        top_ids, top_probs, top_text = top_k(q, tokenizer)
        speed, spread, timed = speed_stats(free.decode_s, 1)
        context_tokens = [len(prompt_ids) + k for k in range(len(free.tokens))]
        per_step = [kv_nbytes(spec, shape, n) for n in context_tokens]
        final, base_final = per_step[-1], kv_nbytes(RealSpec(), shape, context_tokens[-1])
        what = ("llama.cpp's own f16 cache on the same GGUF: the reference of the llama.cpp rows (its text is "
                "compared with transformers' 16-bit run)" if spec.is_reference else
                f"the real llama.cpp, -ctk {spec.ctk} -ctv {spec.ctv}{'' if spec.rot else ' unrotated'}, flash "
                "attention; KL, top-1 and text against llama.cpp's own f16 cache")
        runs.append(CacheRun(
            spec=str(spec), text=tokenizer.decode(free.tokens, skip_special_tokens=True), token_ids=free.tokens,
            tokens=token_pieces(tokenizer, free.tokens), first_divergence=first, match_fraction=frac,
            diff_spans=[list(s) for s in spans], kl=[round(float(x), 6) for x in kl], top1=[bool(x) for x in agree],
            baseline_logprob=[round(float(x), 5) for x in logprob], mean_kl=float(kl.mean()),
            max_kl=float(kl.max()), top1_agreement=float(agree.float().mean()), context_tokens=context_tokens,
            cache_bytes_per_step=per_step, cache_bytes=final, baseline_bytes=base_final,
            compression=base_final / final,
            bits_per_element=8 * final / (shape.elements_per_token * context_tokens[-1]),
            prefill_s=free.prefill_s, prefill_tokens_per_s=len(prompt_ids) / max(free.prefill_s, 1e-9),
            decode_tokens_per_s=speed, wall_s=time.perf_counter() - t0, description=what, allocated_bytes=allocated,
            decode_timed_steps=timed, decode_spread=spread, top5_ids=top_ids, top5_probs=top_probs,
            top5_tokens=top_text))
    progress(1.0, "llama.cpp: done")
    return runs


def ppl_runs(gguf: Path, ids: list[int], specs, *, chunk: int = 512, score_from: int = 0,
             progress=None) -> list[PplRun]:
    """PplRun rows for llama.cpp's f16 cache (first) and each spec over token ids, `chunk` tokens per decode call.

    Every token reads the cache as llama.cpp stores it, its own chunk included (keys and values are written
    before attention reads them). Positions from `score_from` on are scored: KL, top-1 and perplexity against
    the f16 row; llama-perplexity's protocol is chunk = len(ids), score_from = len(ids) // 2.
    """

    specs = [RealSpec()] + [s for s in (parse_real_spec(s) for s in specs) if not s.is_reference]
    path, progress = Path(gguf), progress or (lambda f, d: None)
    targets = torch.tensor(ids[score_from + 1:])                                            # (M - 1,)
    runs, p, base_ppl = [], None, None
    for i, spec in enumerate(specs):
        progress(i / len(specs), f"{spec}: {len(ids)} tokens")
        with context(path, spec, _n_ctx(len(ids)), n_batch=chunk, n_ubatch=min(chunk, 512)) as llm:
            q = _scored(llm, ids, score_from)                                               # (M, V)
        ppl = perplexity(-token_logprob(q[:-1], targets))
        p, base_ppl = (q, ppl) if p is None else (p, base_ppl)
        kl = kl_per_step(p, q)
        runs.append(PplRun(spec=str(spec), ppl=ppl, delta_ppl_pct=100 * (ppl / base_ppl - 1), mean_kl=float(kl.mean()),
                           top1_agreement=float(top1_agree(p, q).float().mean()),
                           kl_along_text=[float(w.mean()) for w in kl.split(KL_WINDOW)],
                           layer_key_error=[], layer_value_error=[]))   # llama.cpp does not hand its K/V back
        del q
    progress(1.0, "llama.cpp: done")
    return runs


def snippet(spec: str | RealSpec, max_new_tokens: int = 64) -> str:
    """llama-cpp-python code that runs this cache on the GGUF (render.snippet's answer for a llama.cpp spec)."""
    spec = parse_real_spec(spec)
    env = "" if spec.rot else 'os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"   # before the context is created\n'
    return ("import os\nimport llama_cpp  # pip install -r requirements-llamacpp.txt\n" + env +
            f"llm = llama_cpp.Llama(model_path=GGUF, n_ctx=4096, flash_attn=True, "
            f"type_k=llama_cpp.GGML_TYPE_{spec.ctk.upper()},\n"
            f"                      type_v=llama_cpp.GGML_TYPE_{spec.ctv.upper()})\n"
            f"out = llm(PROMPT, max_tokens={max_new_tokens}, temperature=0.0)\n"
            f"# the same in llama.cpp's CLI: llama-cli -m GGUF -fa on -ctk {spec.ctk} -ctv {spec.ctv}\n")


def tokenize(gguf: Path, text: str) -> list[int]:
    """`text` as llama.cpp's own tokenizer of the GGUF reads it (no BOS added): for a GGUF kvplay cannot load."""
    llama_cpp = require()
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    finally:
        llm.close()

"""The real llama.cpp on the same GGUF, through llama-cpp-python (optional: pip install -r requirements-llamacpp.txt).

    spec = parse_spec("llama.cpp:q4_0")                  # kvplay/cache/methods/llamacpp_real.py: the spec's method
    runs = compare_runs(gguf, prompt_ids, 64, [spec], tokenizer)       # CacheRun rows
    runs = ppl_runs(gguf, ids, [spec], chunk=16)                       # PplRun rows

The specs are registered cache methods like every other (engine "llama.cpp": one parser, check, byte formula and
snippet, in kvplay/cache/methods/llamacpp_real.py); this module runs them. That method names this module as its
runner, and RUNNER (kvplay.lab.engines.EngineRunner) is the hook a model's Compare and perplexity run call: they
append its rows to the same CompareResult / PplResult, knowing nothing of llama.cpp.

Every context is created with flash attention on (llama.cpp needs it for a quantized V) and logits for every
token. Each quantized row is measured against llama.cpp's own f16 cache on the same GGUF: KL and top-1 are
teacher-forced (the f16 run's tokens evaluated through the quantized cache n_batch tokens per llama_decode call;
keys and values are written before attention reads them, so every token reads the cache as llama.cpp stores
it). Bytes come from the method's formula (ggml's block sizes) for the cells in use, layers x KV heads x (K row +
V row); tests/test_llamacpp.py checks them against the growth of llama.cpp's own llama_state_seq_get_size.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvplay.cache import CacheSpec, bits_per_element, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.methods import llamacpp_real
from kvplay.cache.methods.llamacpp_real import available, require  # noqa: F401  (the commands' and tests' too)
from kvplay.errors import KvplayError
from kvplay.lab.compare import Task, token_pieces, top_k
from kvplay.lab.engines import EngineRunner
from kvplay.lab.generate import speed_stats
from kvplay.lab.grading import grade
from kvplay.lab.metrics import distribution_stats, divergence, kl_per_step, perplexity, token_logprob, top1_agree
from kvplay.results import CacheRun, PplRun
from kvplay.results.compare import label_for

ENGINE = llamacpp_real.RealLlamaCpp.engine
INSTALL = llamacpp_real.INSTALL
REFERENCE = parse_spec("llama.cpp")      # llama.cpp's own f16 cache: every llama.cpp row is measured against it
KL_WINDOW = 64            # tokens per point of PplRun.kl_along_text, as kvplay.lab.quality


@dataclass(frozen=True)
class GgufShape:
    """A GGUF's cache shape. Kept beside kvplay.cache.arch.Arch because a GGUF may give keys and values different
    widths (key_length, value_length: DeepSeek's MLA stores 192 and 128), which Arch's one head_dim cannot."""

    layers: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int

    @property
    def elements_per_token(self) -> int:
        return self.layers * self.kv_heads * (self.head_dim_k + self.head_dim_v)

    def elements(self, tokens: int, batch: int = 1) -> int:
        """K and V elements llama.cpp's cells hold after `tokens` tokens: the denominator of bits per element."""
        return self.elements_per_token * tokens * batch


def kv_nbytes(spec: CacheSpec, shape: GgufShape, tokens: int) -> int:
    """Bytes llama.cpp's cache holds for `tokens` cells: the spec's method's formula (every layer's K and V rows
    in their ggml types)."""
    arch = Arch("gguf", layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim_k)
    return spec.method.analytic_nbytes(spec, arch, tokens, head_dim_v=shape.head_dim_v).total


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
def context(path: Path, spec: CacheSpec, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512):
    """A llama.cpp context on `path` for `spec` (flash attention, logits for every token), closed afterwards."""
    llama_cpp = require()
    saved = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if spec.attn_rot == "auto" else "1"   # read once, at the cache's making
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


def _with_reference(specs) -> list[CacheSpec]:
    """llama.cpp's f16 cache first, then each other spec once."""
    return [REFERENCE] + [s for s in dict.fromkeys(parse_spec(s) for s in specs) if not s.is_reference]


def compare_runs(gguf: Path, prompt_ids: list[int], max_new_tokens: int, specs, tokenizer, *,
                 base_tokens: list[int] | None = None, chat: bool = False, task: Task | None = None,
                 progress=None) -> list[CacheRun]:
    """CacheRun rows for llama.cpp's f16 cache (the reference, always first) and each spec, on one prompt.

    Each quantized row generates greedily on its own, then reads the f16 row's tokens teacher-forced; KL, top-1
    and text divergence are against the f16 row. The f16 row's text is compared with `base_tokens` (transformers'
    16-bit run) when given; its KL is 0 by definition.
    """

    specs = _with_reference(specs)
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
        final, base_final = per_step[-1], kv_nbytes(REFERENCE, shape, context_tokens[-1])
        text = tokenizer.decode(free.tokens, skip_special_tokens=True)
        graded = grade(text, task.expected, task.check) if task else None
        runs.append(CacheRun(
            spec=str(spec), text=text, token_ids=free.tokens,
            tokens=token_pieces(tokenizer, free.tokens), first_divergence=first, match_fraction=frac,
            diff_spans=[list(s) for s in spans], kl=[round(float(x), 6) for x in kl], top1=[bool(x) for x in agree],
            baseline_logprob=[round(float(x), 5) for x in logprob], mean_kl=float(kl.mean()),
            max_kl=float(kl.max()), top1_agreement=float(agree.float().mean()), context_tokens=context_tokens,
            cache_bytes_per_step=per_step, cache_bytes=final, baseline_bytes=base_final,
            compression=base_final / final,
            bits_per_element=bits_per_element(final, shape, context_tokens[-1]),
            prefill_s=free.prefill_s, prefill_tokens_per_s=len(prompt_ids) / max(free.prefill_s, 1e-9),
            decode_tokens_per_s=speed, wall_s=time.perf_counter() - t0, description=spec.method.description_of(spec),
            allocated_bytes=allocated, decode_timed_steps=timed, decode_spread=spread, top5_ids=top_ids,
            top5_probs=top_probs, top5_tokens=top_text, label=label_for(spec, max_new_tokens, chat),
            answer=graded[0] if graded else None, answer_right=graded[1] if graded else None))
    progress(1.0, "llama.cpp: done")
    return runs


def ppl_runs(gguf: Path, ids: list[int], specs, *, chunk: int = 512, score_from: int = 0,
             progress=None) -> list[PplRun]:
    """PplRun rows for llama.cpp's f16 cache (first) and each spec over token ids, `chunk` tokens per decode call.

    Every token reads the cache as llama.cpp stores it, its own chunk included (keys and values are written
    before attention reads them). Positions from `score_from` on are scored: KL, top-1 and perplexity against
    the f16 row; llama-perplexity's protocol is chunk = len(ids), score_from = len(ids) // 2.
    """

    specs = _with_reference(specs)
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
                           layer_key_error=[], layer_value_error=[],    # llama.cpp does not hand its K/V back
                           **distribution_stats(p, q, chunk, kl)))
        del q
    progress(1.0, "llama.cpp: done")
    return runs


def tokenize(gguf: Path, text: str) -> list[int]:
    """`text` as llama.cpp's own tokenizer of the GGUF reads it (no BOS added): for a GGUF kvplay cannot load."""
    llama_cpp = require()
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    finally:
        llm.close()


def _measured(specs) -> bool:
    """Whether any spec asks for a quantized row: llama.cpp's own f16 cache alone adds no row (it is every row's
    reference, run first whenever another runs)."""
    return any(not parse_spec(s).is_reference for s in specs)


class LlamaCppRunner(EngineRunner):
    """The real llama.cpp's hook (kvplay.lab.engines): its rows beside a model's Compare and perplexity runs, on the
    model's GGUF (model_file(".gguf"))."""

    def check(self, specs, *, batch_size, temperature):
        if _measured(specs) and (batch_size != 1 or temperature > 0):
            raise KvplayError("The real llama.cpp runs greedy at batch size 1; set the batch size to 1 and the "
                              "temperature to 0.")

    def compare_runs(self, specs, job, base_tokens, model_file, progress):
        if not _measured(specs):
            return []
        return compare_runs(model_file(".gguf"), list(job.prompt_ids), job.max_new_tokens, specs, job.tokenizer,
                            base_tokens=base_tokens, chat=job.chat, task=job.task, progress=progress)

    def ppl_runs(self, specs, ids, chunk, model_file, progress):
        if not _measured(specs):
            return []
        return ppl_runs(model_file(".gguf"), ids, specs, chunk=chunk, progress=progress)


RUNNER = LlamaCppRunner()

"""What should I deploy? Every KV-cache setting an engine can deploy, as data; each measured on the loaded model
(KL and top-1 over a text, teacher-forced, and the pass-code answer); what each fits in a memory budget
(kvplay.lab.capacity); and the rule that picks one.

    ENGINES["ollama"].settings            # f16, q8_0, q4_0 with the line to paste for each
    search(ENGINES["llama.cpp"], get, passes)   # llama.cpp's K/V pairs, measured fewest bits first, pruned
    recommend(rows)                       # among rows meeting the bar, the most context (ties: the lowest KL)

The rule: among the settings that meet the quality bar, the one whose cache lets one sequence hold the most tokens
in the budget; ties (the same bytes) go to the lowest KL. The 16-bit setting always meets it, so there is always an
answer. Every row is kvplay's emulation of the engine's setting (kvplay/cache/methods), run on this machine; the
speed caveats the engines do not print are data here (CAVEATS), each with its source.

llama.cpp and LM Studio take a key type and a value type apart (-ctk/-ctv): 49 pairs of f16, q8_0, q5_1, q5_0,
q4_1, iq4_nl and q4_0. The search measures 16-bit and the six one-type settings first, then, fewest bits first, the
pairs no measurement settles, assuming a pair whose K and V are each at least as precise as another's is at least
as good (PRECISER: f16 > q8_0 > q5_1 > q5_0, q4_1 > q4_0; q5_0 > iq4_nl), and that a pair of two types that each
miss the bar alone misses it too (its KL sits between theirs when K's and V's errors add up and the types rank the
same for keys as for values). A pair as precise as one that meets the bar, on both sides, costs at least its bytes
and buys no context: pruned. A pair no more precise than one that fails, on both sides, or of two failing types, is
taken to fail: pruned. A pair with more bits than the best one found cannot win: pruned.

Beside the engine's settings, kvplay's own presets (OWN) are measured the same way, to show what they would buy;
no engine deploys them, so the rule never picks them. Where the needle is measured (a pass code in filler at a
long context, kvplay.lab.inside.needle), a setting that loses it where 16-bit finds it misses the bar.

With the real llama.cpp installed (llama-cpp-python) and a GGUF of the model, real_measure runs the llama.cpp
family's K/V pairs through llama.cpp itself on that file (real_spec: kvplay's pair as a `llama.cpp:` spec), the
same text, chunk and task, KL and top-1 against llama.cpp's own f16 cache; those rows say so (source "llama.cpp").
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvplay.cache import CacheSpec, analytic_nbytes, bits_per_element, build_cache, ggml, parse_spec
from kvplay.cache.arch import Arch
from kvplay.lab import llamacpp
from kvplay.lab.capacity import capacity
from kvplay.lab.generate import generate
from kvplay.lab.grading import grade
from kvplay.lab.metrics import kl_per_step, perplexity, token_logprob, top1_agree
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.quality import chunked_logits
from kvplay.results import Caveat, DeploySetting, Measured

# ---------------------------------------------------------------------------- the quality bar and the budget


@dataclass(frozen=True)
class Bar:
    name: str
    max_kl: float                 # mean KL to 16-bit over the text, nats
    min_top1: float | None        # share of positions agreeing with 16-bit's top token
    words: str


BARS = {"strict": Bar("strict", 0.005, 0.98, "answer kept, mean KL at most 0.005 and top-1 at least 98%"),
        "default": Bar("default", 0.02, None, "answer kept and mean KL at most 0.02"),
        "loose": Bar("loose", 0.1, None, "answer kept and mean KL at most 0.1")}

# GPU presets in GiB: the sizes sold as 24, 48 and 80 GB, and what nvidia-smi reports for the H100 80GB (81,559 MiB)
# and the H200 (143,771 MiB).
GPUS = {"24": (24.0, "a 24 GB GPU"), "48": (48.0, "a 48 GB GPU"), "80": (80.0, "an 80 GB GPU"),
        "h100": (81559 / 1024, "an H100 80GB"), "h200": (143771 / 1024, "an H200 141GB")}

# ---------------------------------------------------------------------------- what the engines do not print

_VLLM_DOCS = "https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html"
CAVEATS = {c.key: c for c in (
    Caveat("ollama-fa", "Ollama quantizes the cache only with flash attention on (OLLAMA_FLASH_ATTENTION=1); without "
           "it OLLAMA_KV_CACHE_TYPE is ignored and the cache stays f16. It takes one type for keys and values: f16 "
           "(the default), q8_0 or q4_0.",
           "https://github.com/ollama/ollama/blob/main/docs/faq.md#how-can-i-set-the-quantization-type-for-the-kv-cache"),
    Caveat("llama-fa", "A quantized V cache needs flash attention: llama.cpp refuses to start without -fa on.",
           "https://github.com/ggml-org/llama.cpp/issues/28524"),
    Caveat("cuda-fa-types", "On llama.cpp's default CUDA build, flash attention has kernels only for f16, q8_0 and "
           "q4_0 with K and V of one type: q5_0, q5_1, q4_1, iq4_nl or mixed K/V types run attention on the CPU, "
           "without a word (prefill 1,511 to 197 t/s on an RTX 4080); a build with -DGGML_CUDA_FA_ALL_QUANTS=ON "
           "keeps it on the GPU.", "https://github.com/ggml-org/llama.cpp/issues/28455"),
    Caveat("lmstudio-mixed", "LM Studio's CUDA runtime: K q8_0 / V q4_0 decoded at 18 tok/s against 121 for q4_0 / "
           "q4_0 on an RTX 3090 (mixed types leave flash attention).",
           "https://github.com/lmstudio-ai/lmstudio-bug-tracker/issues/2246"),
    Caveat("vllm-unit-scales", "vLLM's fp8 cache divides by scales of 1.0 unless told otherwise "
           "(--calculate-kv-scales, or a checkpoint calibrated by llm-compressor).", _VLLM_DOCS),
    Caveat("vllm-calibrated", "Needs a checkpoint whose k/v scales llm-compressor calibrated; vLLM reads them from it "
           "(per-head scales with the FlashAttention backend only).", _VLLM_DOCS),
    Caveat("vllm-sliding", "vLLM quantizes sliding-window layers too unless told --kv-cache-dtype-skip-layers "
           "sliding_window; kvplay's rows keep them 16-bit, as that flag does.", _VLLM_DOCS),
    Caveat("fp8-long-context", "fp8 decode can be slower than 16-bit at long context: 9.9 against 15.9 tok/s at 32k "
           "tokens on Intel Arc Pro B50 (llm-scaler's vLLM).", "https://github.com/intel/llm-scaler/issues/666"),
    Caveat("sglang-fp8-decode", "SGLang quantizes fp8 K and V in separate unfused steps: decode ran slower than with "
           "the BF16 cache at small batches on an H200.", "https://github.com/sgl-project/sglang/issues/30815"),
    Caveat("vllm-pth", "vLLM's per-token-head caches run only in its Triton attention backend (head_dim 32 or more; "
           "int4 needs a power-of-two head_dim).", "https://github.com/vllm-project/vllm/pull/38378"),
    Caveat("nvfp4-blackwell", "vLLM's nvfp4 cache runs only on Blackwell (SM100) GPUs.", _VLLM_DOCS),
    Caveat("sglang-fp4", "SGLang's fp4 cache (fp4_mx_block16, named fp4_e2m1 before) runs with the triton, "
           "torch_native, flex_attention and trtllm_mha attention backends.",
           "https://docs.sglang.io/docs/advanced_features/quantized_kv_cache.md"),
)}

# ---------------------------------------------------------------------------- the engines, as data

OWN = ("kvplay-int4", "kvplay-3bit")            # kvplay's presets, measured beside: what they would buy

LLAMA_TYPES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")
ONE_KERNEL = ("f16", "q8_0", "q4_0")           # the types llama.cpp's default CUDA build has flash attention for
PRECISER = {"f16": ("q8_0",), "q8_0": ("q5_1",), "q5_1": ("q5_0", "q4_1"), "q5_0": ("q4_0", "iq4_nl"),
            "q4_1": ("q4_0",)}


@dataclass(frozen=True)
class Deployable:
    """One setting an engine can deploy: kvplay's emulation of it, its name in the engine, the line to paste."""

    spec: str
    label: str
    flag: str
    caveats: tuple[str, ...] = ()


@dataclass(frozen=True)
class Engine:
    key: str
    name: str
    weights: str                  # the weights' dtype it usually serves (capacity.WEIGHT_BYTES), the default
    settings: tuple[Deployable, ...]
    pairs: bool = False           # K and V types apart: the settings are llama.cpp's pairs, searched (search())


def canonical(spec: str) -> str:
    return str(parse_spec(spec))


def pair_spec(k: str, v: str) -> str:
    """kvplay's spec for llama.cpp's -ctk k -ctv v (baseline for f16 / f16)."""
    if k == v == "f16":
        return "baseline"
    if k == "f16":
        return canonical(f"llamacpp-{v}:ctk=f16")
    return canonical(f"llamacpp-{k}" + (f":ctv={v}" if v != k else ""))


def _pair_label(k: str, v: str) -> str:
    return (f"{k} (the default)" if k == "f16" else k) if k == v else f"K {k} / V {v}"


def _pair(engine: str, k: str, v: str) -> Deployable:
    spec = pair_spec(k, v)
    mixed_or_slow = (k, v) not in ((t, t) for t in ONE_KERNEL)
    if engine == "lmstudio":
        flag = ("K/V cache quantization off (f16, the default)" if k == v == "f16" else
                f"Flash Attention on, K Cache Quantization Type {k}, V Cache Quantization Type {v}")
        caveats = ("cuda-fa-types",) * mixed_or_slow + ("lmstudio-mixed",) * (k != v)
    else:
        recipe = parse_spec(spec).method.own_recipe(parse_spec(spec)) if spec != "baseline" else None
        flag = "llama-server -m model.gguf" if recipe is None else recipe[1].replace(
            "llama-server ", "llama-server -m model.gguf ")
        caveats = ("llama-fa",) * (v != "f16") + ("cuda-fa-types",) * mixed_or_slow
    return Deployable(spec, _pair_label(k, v), flag, caveats)


def pair_settings(engine: str) -> tuple[Deployable, ...]:
    """Every K/V pair, 16-bit first, then the one-type settings, then the mixed pairs."""
    pairs = [("f16", "f16")] + [(t, t) for t in LLAMA_TYPES[1:]] + [(k, v) for k in LLAMA_TYPES for v in LLAMA_TYPES
                                                                      if k != v]
    return tuple(_pair(engine, k, v) for k, v in pairs)


def _recipe(spec: str) -> str:
    return parse_spec(spec).method.own_recipe(parse_spec(spec))[1]


VLLM, SGLANG = "vllm serve MODEL", "python -m sglang.launch_server --model-path MODEL"
_GENERATE = "model.generate(**inputs, {})"
ENGINES = {e.key: e for e in (
    Engine("ollama", "Ollama", "int4", (
        Deployable("baseline", "f16 (the default)", "OLLAMA_KV_CACHE_TYPE=f16 ollama serve"),
        *(Deployable(f"llamacpp-{t}", t, f"OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE={t} ollama serve",
                     ("ollama-fa",)) for t in ("q8_0", "q4_0")))),
    Engine("llama.cpp", "llama.cpp", "int4", pair_settings("llama.cpp"), pairs=True),
    Engine("lmstudio", "LM Studio", "int4", pair_settings("lmstudio"), pairs=True),
    Engine("vllm", "vLLM", "bfloat16", (
        Deployable("baseline", "auto (16-bit, the default)", VLLM),
        Deployable("vllm-fp8", "fp8_e4m3, unit scales (the default)", f"{VLLM} --kv-cache-dtype fp8_e4m3",
                   ("vllm-unit-scales", "fp8-long-context")),
        Deployable(canonical("vllm-fp8:scales=prompt"), "fp8_e4m3, --calculate-kv-scales",
                   f"{VLLM} --kv-cache-dtype fp8_e4m3 --calculate-kv-scales", ("fp8-long-context",)),
        Deployable(canonical("vllm-fp8:scales=tensor"), "fp8_e4m3, per-tensor calibrated scales",
                   "vllm serve CALIBRATED_MODEL --kv-cache-dtype fp8_e4m3", ("vllm-calibrated", "fp8-long-context")),
        Deployable(canonical("vllm-fp8:scales=head"), "fp8_e4m3, per-head calibrated scales",
                   "vllm serve CALIBRATED_MODEL --kv-cache-dtype fp8_e4m3 --attention-backend FLASH_ATTN",
                   ("vllm-calibrated", "fp8-long-context")),
        Deployable("vllm-int8-pth", "int8_per_token_head", f"{VLLM} {_recipe('vllm-int8-pth')}", ("vllm-pth",)),
        Deployable("vllm-fp8-pth", "fp8_per_token_head", f"{VLLM} {_recipe('vllm-fp8-pth')}", ("vllm-pth",)),
        Deployable("vllm-int4-pth", "int4_per_token_head", f"{VLLM} {_recipe('vllm-int4-pth')}", ("vllm-pth",)),
        Deployable("vllm-nvfp4", "nvfp4 (Blackwell)", f"{VLLM} --kv-cache-dtype nvfp4", ("nvfp4-blackwell",)))),
    Engine("sglang", "SGLang", "bfloat16", (
        Deployable("baseline", "auto (16-bit, the default)", SGLANG),
        Deployable("vllm-fp8", "fp8_e4m3 (unit scales)", f"{SGLANG} --kv-cache-dtype fp8_e4m3",
                   ("sglang-fp8-decode", "fp8-long-context")),
        Deployable("sglang-fp4", "fp4_mx_block16 (fp4_e2m1)",
                   f"{SGLANG} --kv-cache-dtype fp4_mx_block16 --attention-backend triton", ("sglang-fp4",)))),
    Engine("transformers", "transformers", "bfloat16", (
        Deployable("baseline", "DynamicCache (16-bit, the default)", "model.generate(**inputs)"),
        *(Deployable(name, name, _GENERATE.format(_recipe(name)))
          for name in ("hqq-int8", "quanto-int4", "hqq-int4", "quanto-int2", "hqq-int2")),
        Deployable("hf-fp8", "hf-fp8 (QuantizedCache, fp8)",
                   _GENERATE.format('cache_implementation="quantized", cache_config={"backend": "fp8"}')))),
)}


def own_setting(spec: str, engine: Engine) -> Deployable:
    """A row for one of kvplay's own presets: what it would buy, said plainly to be no setting of `engine`."""
    return Deployable(canonical(spec), f"{spec} (kvplay's own, not in {engine.name})",
                      f"not deployable in {engine.name}: kvplay's own cache, a transformers Cache that needs the "
                      f"kvplay package (kvplay.cache.build_cache(\"{spec}\", model))")


def sliding_flag(setting: Deployable, engine: str) -> Deployable:
    """On a model with sliding-window layers, vLLM's fp8 and nvfp4 lines get the flag that keeps those layers 16-bit
    (the per-token-head recipes carry it already)."""
    if engine != "vllm" or setting.spec == "baseline" or "skip-layers" in setting.flag:
        return setting
    return Deployable(setting.spec, setting.label, setting.flag + " --kv-cache-dtype-skip-layers sliding_window",
                      setting.caveats + ("vllm-sliding",))


# ---------------------------------------------------------------------------- the pruned search


def at_least(a: str, b: str) -> bool:
    """Whether ggml type a is taken to be at least as precise as b (PRECISER's order)."""
    return a == b or any(at_least(c, b) for c in PRECISER.get(a, ()))


def _covers(p: tuple[str, str], q: tuple[str, str]) -> bool:
    return at_least(p[0], q[0]) and at_least(p[1], q[1])


def pair_bits(k: str, v: str) -> float:
    return (ggml.bits_per_element(k) + ggml.bits_per_element(v)) / 2


def search(get: Callable[[tuple[str, str]], bool | None], types=LLAMA_TYPES) -> dict[tuple[str, str], str]:
    """llama.cpp's K/V pairs, measured as few as the rule needs. get(pair) measures a pair and says whether it meets
    the bar (None: the model refuses it, taken as failing). Returns why each pair left unmeasured was pruned."""
    known: dict[tuple[str, str], bool] = {}
    for t in types:
        known[(t, t)] = bool(get((t, t)))
    pairs = [(k, v) for k in types for v in types]
    while True:
        best = min(pair_bits(*p) for p, ok in known.items() if ok)
        open_ = [p for p in pairs if p not in known and pair_bits(*p) <= best and _why(p, known) is None]
        if not open_:
            break
        p = min(open_, key=lambda p: (pair_bits(*p), -len([t for t in types if at_least(p[0], t)]), p))
        known[p] = bool(get(p))
    best = min(pair_bits(*p) for p, ok in known.items() if ok)
    return {p: _why(p, known) or f"{pair_bits(*p):g} bits, more than the {best:g} of a setting that meets the bar"
            for p in pairs if p not in known}


def _why(p: tuple[str, str], known: dict[tuple[str, str], bool]) -> str | None:
    k, v = p
    if known.get((k, k)) is False and known.get((v, v)) is False:
        return f"its K type and its V type each miss the bar alone ({k}, {v})"
    for q, ok in known.items():
        if ok and _covers(p, q):
            return f"at least {_pair_label(*q)}'s bytes, which meets the bar"
        if not ok and _covers(q, p):
            return f"no more precise than {_pair_label(*q)}, which misses the bar"
    return None


# ---------------------------------------------------------------------------- one setting, measured


@dataclass(frozen=True)
class Probe:
    """What every setting is measured on: the text's token ids (1, N), the task's prompt ids (1, P), its answer."""

    text_ids: torch.Tensor
    chunk: int
    prompt_ids: torch.Tensor
    expected: str | None
    check: str
    max_new_tokens: int
    stop_token: int | None


def text_logits(model, tokenizer, spec: CacheSpec, probe: Probe, progress: Progress = no_progress):
    """(logits (N, V) float32, perplexity) over the text through `spec`'s cache, `chunk` tokens a forward."""
    logits = chunked_logits(model, probe.text_ids, build_cache(spec, model, tokenizer), probe.chunk,
                            lambda done, total: progress(done / total, f"{spec}: {done}/{total} tokens"))
    return logits, perplexity(-token_logprob(logits[:-1], probe.text_ids[0, 1:]))


@torch.inference_mode()
def measure(model, tokenizer, spec: CacheSpec, probe: Probe, base=None, progress: Progress = no_progress):
    """KL, top-1 and perplexity over the text through `spec`'s cache (teacher-forced) against `base` (16-bit's
    text_logits; None: this is 16-bit), then the task answered greedily through a fresh cache:
    (the Measured, this spec's text_logits)."""
    t0 = time.perf_counter()
    mine = text_logits(model, tokenizer, spec, probe, lambda f, what: progress(0.6 * f, what))
    (logits, ppl), (base_logits, base_ppl) = mine, base if base is not None else mine
    kl, agree = kl_per_step(base_logits, logits), top1_agree(base_logits, logits)
    answer = right = None
    if probe.expected is not None:
        trace = generate(model, probe.prompt_ids, build_cache(spec, model, tokenizer), probe.max_new_tokens,
                         keep_logits=False, stop_token=probe.stop_token,
                         on_step=lambda i, total: progress(0.6 + 0.4 * i / total, f"{spec}: answering"))
        answer, right = grade(tokenizer.decode(trace.tokens[0], skip_special_tokens=True), probe.expected,
                              probe.check)
    progress(1.0, f"{spec}: done")
    return Measured(spec=str(spec), mean_kl=float(kl.mean()), top1=float(agree.float().mean()),
                    ppl_change_pct=100 * (ppl / base_ppl - 1), answer=answer, answer_right=right,
                    seconds=round(time.perf_counter() - t0, 2)), mine


def collect(engine: Engine, lookup: Callable[[str], Measured | str], bar: Bar, own=OWN):
    """Every setting of `engine` that the rule needs, 16-bit first, then kvplay's `own` presets: lookup(spec) measures
    it (or reads it) and returns its Measured, or the sentence with which the model refuses it. Returns (spec ->
    Measured or refusal, spec -> why it was pruned, whether the bar asks for the answer: only where 16-bit answers
    right, whether it asks for the needle: only where 16-bit finds it)."""
    got: dict[str, Measured | str] = {"baseline": lookup("baseline")}
    needs_answer, needs_needle = bool(got["baseline"].answer_right), bool(got["baseline"].needle_found)

    def passes(spec: str) -> bool | None:
        got[spec] = got.get(spec) or lookup(spec)
        return None if isinstance(got[spec], str) else judge(got[spec], bar, needs_answer, needs_needle)[0]
    pruned = {}
    if not engine.pairs:
        for setting in engine.settings[1:]:
            passes(setting.spec)
    else:
        pruned = {pair_spec(*p): why for p, why in search(lambda p: passes(pair_spec(*p))).items()}
    for spec in own:
        got[canonical(spec)] = got.get(canonical(spec)) or lookup(canonical(spec))
    return got, pruned, needs_answer, needs_needle


LLAMA_FAMILY = ("ollama", "llama.cpp", "lmstudio")   # the engines whose rows the real llama.cpp can measure


def real_engine_measures(engine: Engine) -> bool:
    """Whether the engine itself measures this engine's rows here: the llama.cpp family's, where llama-cpp-python
    is installed (then on the model's GGUF, real_measure); else kvplay's emulation measures them."""
    return engine.key in LLAMA_FAMILY and llamacpp.available()


def by_real_engine(row: DeploySetting) -> bool:
    """Whether a row was measured by the engine itself (real_measure), not by kvplay's emulation."""
    return row.source == llamacpp.ENGINE


def real_spec(spec: str) -> CacheSpec | None:
    """The real llama.cpp's spec for one of the llama.cpp family's rows (baseline: its f16), None for any other."""
    parsed = parse_spec(spec)
    if spec == "baseline":
        return parse_spec("llama.cpp")
    if not hasattr(parsed, "ctk") or parsed.method.engine == llamacpp.ENGINE:
        return None
    return parse_spec(f"llama.cpp:ctk={parsed.ctk},ctv={parsed.ctv}")


def real_measure(gguf, spec: str, probe: Probe, tokenizer, reference=None, progress: Progress = no_progress):
    """One row of the llama.cpp family measured by the real llama.cpp on `gguf`: the text teacher-forced `chunk`
    tokens a decode call, KL and top-1 against `reference` (llama.cpp's own f16: (logits, perplexity); None: this
    is f16), then the task answered greedily in the same context. (the Measured, this run's (logits, perplexity))."""
    t0, real = time.perf_counter(), real_spec(spec)
    ids, prompt = probe.text_ids[0].tolist(), probe.prompt_ids[0].tolist()
    n_ctx = llamacpp._n_ctx(max(len(ids), len(prompt) + probe.max_new_tokens) + 1)
    progress(0.1, f"{real}: {len(ids)} tokens through llama.cpp")
    with llamacpp.context(gguf, real, n_ctx, n_batch=probe.chunk, n_ubatch=probe.chunk) as llm:
        logits = torch.from_numpy(llamacpp.eval_logits(llm, ids)).float()                        # (N, V)
        answer = right = None
        if probe.expected is not None:
            progress(0.6, f"{real}: answering")
            out = llamacpp.greedy(llm, prompt, probe.max_new_tokens, probe.stop_token)
            answer, right = grade(tokenizer.decode(out.tokens, skip_special_tokens=True), probe.expected, probe.check)
    mine = (logits, perplexity(-token_logprob(logits[:-1], probe.text_ids[0, 1:].cpu())))
    (base, base_ppl) = reference if reference is not None else mine
    progress(1.0, f"{real}: done")
    return Measured(spec=spec, mean_kl=float(kl_per_step(base, logits).mean()),
                    top1=float(top1_agree(base, logits).float().mean()), ppl_change_pct=100 * (mine[1] / base_ppl - 1),
                    answer=answer, answer_right=right, seconds=round(time.perf_counter() - t0, 2),
                    source=llamacpp.ENGINE), mine


# ---------------------------------------------------------------------------- the answer


def judge(m: Measured, bar: Bar, needs_answer: bool, needs_needle: bool = False) -> tuple[bool, str]:
    """(meets the bar, in words why not)."""
    misses = []
    if needs_answer and not m.answer_right:
        misses.append("answer lost")
    if needs_needle and not m.needle_found:
        misses.append(f"needle lost at {m.needle_tokens:,} tokens")
    if m.mean_kl > bar.max_kl:
        misses.append(f"KL {m.mean_kl:.3g} over {bar.max_kl:g}")
    if bar.min_top1 is not None and m.top1 < bar.min_top1:
        misses.append(f"top-1 {100 * m.top1:.0f}% under {100 * bar.min_top1:.0f}%")
    return not misses, ", ".join(misses) or "meets the bar"


def bits_at(spec: str, arch: Arch, tokens: int) -> float:
    """Bits per cached element after `tokens` tokens on `arch`, from the spec's byte formula."""
    return bits_per_element(analytic_nbytes(parse_spec(spec), arch, tokens), arch, tokens)


def fit(rows: list[DeploySetting], arch: Arch, gib: float, weights: str, context: int):
    """Fill each row's bits, the context one sequence fits in `gib` and the batch at `context` (capacity()), in
    place; the CapacityResult."""
    live = [r for r in rows if r.status != "refused"]
    for r in live:
        r.bits = round(bits_at(r.spec, arch, context), 4)
    result = capacity({r.spec: r.bits for r in live}, arch, gib, weights, context)
    for r, c in zip(live, result.caches):
        r.context_fits = c.cache_fits if c.cache_fits is not None else c.max_context
        r.max_batch = c.max_batch
    return result


def recommend(rows: list[DeploySetting]) -> DeploySetting:
    """Among the engine's rows that meet the bar, the one that fits the most context; ties: the lowest KL, then the
    fewest bits, then the engine's order. kvplay's own presets (not deployable) are never picked."""
    ok = [(i, r) for i, r in enumerate(rows) if r.meets_bar and r.context_fits is not None and r.deployable]
    return min(ok, key=lambda ir: (-ir[1].context_fits, ir[1].mean_kl or 0.0, ir[1].bits, ir[0]))[1]

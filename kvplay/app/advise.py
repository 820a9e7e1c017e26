"""What should I deploy? The `advise` command (the Deploy tab, `python -m kvplay advise`): for a model, an engine,
a context and a memory budget, the KV-cache setting to deploy, what it buys, what it risks, and the evidence.

    advise("qwen2.5-coder-0.5b-instruct", "ollama", gpu="24", context=32768)   # an AdviseResult

Each setting's measurement (kvplay.lab.advise.measure: KL and top-1 over a text, the pass-code answer) is kept on
disk (kvplay.app.advise_store), in $KVPLAY_ADVISE_DIR or ~/.cache/kvplay/advise, one folder per model file (named
by its pinned SHA-256, or its files' sizes and times) and one JSON file per setting, named by the spec, the text,
the task and the run's settings (tokens, chunk, device, dtype) and the source of the spec's method: asking again,
with any budget,
context or bar, reads them and loads no model. A question that needs a setting not measured yet loads the model in
the one job envelope (kvplay.app.jobs) and measures only what is missing.

The needle (a pass code in filler, kvplay.lab.inside.needle, depth 0.5) is measured at the longest context the
machine affords: on a GPU, the model's limit (or the settings' cap); on a CPU not at all unless asked (`needle`),
since one needle at 2,048 tokens alone takes longer than the whole first answer's budget there (docs/deploy.md).
Each setting's needle is kept in its own file, so the text's measurements serve a question with or without it.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvplay.app import catalogue, guard, models, prompts
from kvplay.app.advise_store import Store, model_key, setting_name, sha, store_dir
from kvplay.app.checks import check_int
from kvplay.app.fetch import gguf_path
from kvplay.app.jobs import Job, Plan, chosen_model, run_plan
from kvplay.app.settings import Settings
from kvplay.cache import calibrate, check_spec_for_model, parse_spec
from kvplay.cache.arch import Arch, published_archs
from kvplay.errors import KvplayError
from kvplay.lab import advise as lab
from kvplay.lab.bench import cpu_name
from kvplay.lab.capacity import WEIGHT_BYTES
from kvplay.lab.compare import environment
from kvplay.lab.inside.needle import NEW_TOKENS, needle_answer, needle_prompt
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.paths import assets
from kvplay.results import AdviseResult, DeploySetting, Environment, Measured, from_dict, to_dict

TOKENS, CHUNK = 512, 16          # the text's default length and tokens a forward: a first answer within minutes
MIN_TOKENS = 64
NEEDLE_MIN = 256                 # the needle's filler needs a few sentences around the pass code
NEEDLE_DEPTH = 0.5
NEEDLE_CPU_SECONDS = 12.7       # measured: Qwen2.5-Coder-0.5B, 2,048 tokens, one torch thread on the 2-core EPYC
NEEDLE_CPU_NOTE = ("Needle not measured: on a CPU one needle costs a prefill of its whole context per setting "
                   "(Qwen2.5-0.5B at 2,048 tokens: {seconds} s a setting on one core), past a first answer's few "
                   "minutes; ask for it with --needle TOKENS (the Needle box), or run on a GPU, where it runs at the "
                   "model's limit.")
RECORDED = assets("recorded", "deploy")


# ---------------------------------------------------------------------------- the inputs, checked without a model

@dataclass(frozen=True)
class AdviseInputs:
    engine: lab.Engine
    gib: float
    budget: str                   # in words: "a 24 GB GPU"
    weights: str
    context: int | None           # None: the model's limit, capped at what the budget fits
    bar: lab.Bar
    arch: Arch | None             # a published architecture to count the bytes for; None: the model's own
    tokens: int
    chunk: int
    needle: int | None = None     # the needle's prompt tokens; 0: not measured; None: the longest the machine affords


def parse_gpu(gpu) -> tuple[float, str]:
    """(GiB, in words) from a preset (24, 48, 80, h100, h200) or a number of GiB."""
    key = str(gpu).strip().lower().removesuffix("gb").removesuffix("gib").strip()
    if key in lab.GPUS:
        return lab.GPUS[key]
    try:
        gib = float(key)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and 0 < gib <= 100_000):
        raise KvplayError(f"Unknown GPU {str(gpu)[:40]!r}; choose {', '.join(lab.GPUS)} or type its memory in GiB.")
    return gib, f"{gib:g} GiB"


def check_inputs(engine, gpu="24", context=None, weights=None, bar="default", arch=None, tokens=TOKENS,
                 chunk=CHUNK, needle=None) -> AdviseInputs:
    """Every input that needs no model, checked once: one sentence naming the valid choices when it is wrong."""
    key = str(engine or "").strip().lower().replace(" ", "")
    key = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "lm-studio": "lmstudio"}.get(key, key)
    if key not in lab.ENGINES:
        raise KvplayError(f"Unknown engine {str(engine)[:40]!r}; choose one of {', '.join(lab.ENGINES)}.")
    found = lab.ENGINES[key]
    gib, words = parse_gpu(gpu)
    weights = weights or found.weights
    if weights not in WEIGHT_BYTES:
        raise KvplayError(f"Unknown weight dtype {str(weights)[:40]!r}; choose one of {', '.join(WEIGHT_BYTES)}.")
    if bar not in lab.BARS:
        raise KvplayError(f"Unknown quality bar {str(bar)[:40]!r}; choose one of {', '.join(lab.BARS)}.")
    archs = published_archs()
    if arch not in (None, "") and arch not in archs:
        raise KvplayError(f"Unknown architecture {str(arch)[:40]!r}; choose one of {', '.join(archs)}.")
    context = None if context in (None, "", 0) else check_int(context, "Context", 1, 10_000_000)
    tokens = check_int(tokens, "Tokens", MIN_TOKENS, 100_000)
    needle = None if needle in (None, "", "auto") else check_int(needle, "Needle", 0, 10_000_000)
    if needle and needle < NEEDLE_MIN:
        raise KvplayError(f"Needle must be 0 (not measured) or at least {NEEDLE_MIN} tokens, got {needle}.")
    return AdviseInputs(found, gib, words, weights, context, lab.BARS[bar], archs[arch] if arch else None, tokens,
                        check_int(chunk, "Chunk", 1, tokens // 2), needle)


def needle_tokens(needle: int | None, device: str, limit: int) -> int:
    """The needle's context: as asked, capped at `limit` (the model's and the settings'); asked for none (None), the
    longest the machine affords: `limit` on a GPU, none on a CPU (NEEDLE_CPU_NOTE says why)."""
    if needle is None:
        return 0 if str(device).startswith("cpu") else limit
    if needle > limit:
        raise KvplayError(f"Needle must be at most {limit:,} tokens for this model, got {needle:,}.")
    return needle


def _task(name: str) -> prompts.Task:
    return prompts.tasks(name)[0]


def probe_key(name: str, inputs: AdviseInputs, device: str, dtype) -> str:
    task, text = _task(name), HELD_OUT_TEXT.read_text(encoding="utf-8")
    return sha(json.dumps([sha(text), inputs.tokens, inputs.chunk, sha(task.prompt), task.expected,
                            task.max_new_tokens, device, str(dtype or "default")]))[:24]


class Missing(LookupError):
    """A setting not in the store: the model must load."""


def _record(data: dict) -> Measured | str:
    return data["refused"] if "refused" in data else Measured(**data["measured"])


def _with_needle(m: Measured, data: dict) -> Measured:
    n = data["needle"]
    return dataclasses.replace(m, needle_tokens=n["tokens"], needle=n["answer"], needle_found=n["found"])


# ---------------------------------------------------------------------------- measuring what is missing

@dataclass
class AdvisePlan(Plan):
    load_progress = True
    inputs: AdviseInputs
    store: Store
    probe: str                    # probe_key: what every setting is measured on
    needle: int = 0               # the needle's tokens, set by check (needle_tokens with the loaded model's limit)
    gguf: Path | None = None      # the real llama.cpp measures the llama.cpp family's rows on it (real_gguf)

    def check(self, job: Job) -> lab.Probe:
        tokens = check_int(self.inputs.tokens, "Tokens", MIN_TOKENS, job.limit)
        task = _task(job.name)
        chat = prompts.is_chat(job.name, job.tokenizer)
        ids = job.tokenizer(HELD_OUT_TEXT.read_text(encoding="utf-8"), return_tensors="pt",
                            verbose=False).input_ids[:, :tokens].to(job.device)                     # (1, N)
        prompt = prompts.encode(job.tokenizer, task.prompt, chat)
        vocab = int(job.model.config.get_text_config(decoder=True).vocab_size)
        self.needle = needle_tokens(self.inputs.needle, job.device, job.limit - NEW_TOKENS)
        job.need(max(tokens, len(prompt) + task.max_new_tokens, self.needle + NEW_TOKENS),
                 extra=2 * tokens * vocab * 4)
        arch = Arch.from_config(job.model.config, name=job.name,
                                params=sum(p.numel() for p in job.model.parameters()))
        self.store.write("model", {"arch": dataclasses.asdict(arch), "env": dataclasses.asdict(
            environment(job.model, job.name)), "measured": f"{cpu_name()}, {datetime.date.today()}",
            "text_name": HELD_OUT_TEXT.name, "task": task.title})
        self.haystack = needle_prompt(job.tokenizer, self.needle, NEEDLE_DEPTH, chat=chat) if self.needle else None
        return lab.Probe(ids, self.inputs.chunk, torch.tensor([prompt], device=job.device),
                         task.expected, task.check, task.max_new_tokens,
                         job.tokenizer.eos_token_id if chat else None)

    def run(self, job: Job, probe: lab.Probe, progress):
        base, real_base, done = [None], [None], [0]
        total = (len(self.inputs.engine.settings) if not self.inputs.engine.pairs else 11) + len(lab.OWN)

        def lookup(spec: str) -> Measured | str:
            got = measured(spec)
            if isinstance(got, str) or not self.needle:
                return got
            name = setting_name(spec, f"{self.probe}|needle:{self.needle}")
            kept = self.store.read(name)
            if kept is None:
                progress(min(done[0] / total, 0.99), f"{spec}: the needle at {self.needle:,} tokens")
                t0 = time.perf_counter()
                answer, found = needle_answer(job.model, job.tokenizer, parse_spec(spec), self.haystack)
                kept = {"needle": {"tokens": self.needle, "answer": answer[:80], "found": found,
                                   "seconds": round(time.perf_counter() - t0, 2)}}
                self.store.write(name, kept)
            return _with_needle(got, kept)

        def measured(spec: str) -> Measured | str:
            key = stored_spec(spec, self.gguf)
            name = setting_name(key, self.probe)
            kept = self.store.read(name)
            if kept is not None:
                return _record(kept)
            parsed = parse_spec(key)
            try:                        # the real llama.cpp's own refusals come when it opens the GGUF
                if key == spec:
                    check_spec_for_model(parsed, job.model.config)
            except KvplayError as exc:
                self.store.write(name, {"refused": str(exc)})
                return str(exc)
            part = lambda f, what: progress(min((done[0] + f) / max(total, done[0] + 1), 0.99), what)  # noqa: E731
            if key != spec:             # the real llama.cpp on the GGUF, against its own f16 cache
                if spec != "baseline" and real_base[0] is None:
                    real_base[0] = lab.real_measure(self.gguf, "baseline", probe, job.tokenizer, None, part)[1]
                measured, mine = lab.real_measure(self.gguf, spec, probe, job.tokenizer, real_base[0], part)
                real_base[0] = real_base[0] or mine
                done[0] += 1
                self.store.write(name, {"measured": dataclasses.asdict(measured)})
                return measured
            if spec != "baseline" and base[0] is None:      # 16-bit kept from before: its logits again, no answer
                base[0] = lab.text_logits(job.model, job.tokenizer, parse_spec("baseline"), probe, part)
            calibrate([parsed], job.model, job.tokenizer, part)
            measured, logits = lab.measure(job.model, job.tokenizer, parsed, probe, base[0], part)
            base[0] = base[0] or logits
            done[0] += 1
            self.store.write(name, {"measured": dataclasses.asdict(measured)})
            return measured
        yield lab.collect(self.inputs.engine, lookup, self.inputs.bar)


def stored_spec(spec: str, gguf: Path | None) -> str:
    """What a row's measurement is kept under: the real llama.cpp's spec where it measures the row, else the row's."""
    real = lab.real_spec(spec) if gguf is not None else None
    return str(real) if real is not None else spec


def real_gguf(name: str, engine: lab.Engine) -> Path | None:
    """The GGUF on which the real llama.cpp measures the llama.cpp family's rows (Ollama, llama.cpp, LM Studio): where
    llama-cpp-python is installed and the model is, or has, a GGUF file; else None (kvplay's emulation measures)."""
    if not lab.real_engine_measures(engine):
        return None
    try:
        return Path(gguf_path(name))
    except KvplayError:
        return None


def advise(model_name, engine, *, gpu="24", context=None, weights=None, bar="default", arch=None, tokens=TOKENS,
           chunk=CHUNK, needle=None, device=None, dtype=None, settings: Settings | None = None, progress=None,
           cancel: guard.CancelToken | None = None, measure: bool = True) -> AdviseResult | None:
    """The setting to deploy on `engine` for `model_name` in a `gpu` budget (kvplay.lab.advise): from the measurement
    store when every setting the answer needs is kept there (no model loads), else measured now (what is missing);
    measure=False: None instead of measuring (a share link's answer, shown only where it costs nothing)."""
    t0 = time.perf_counter()
    settings = settings or Settings.from_env()
    inputs = check_inputs(engine, gpu, context, weights, bar, arch, tokens, chunk, needle)
    name = chosen_model(model_name, settings)
    models.check_allowed(name, settings)
    device = device or models.default_device()
    store = Store(store_dir() / model_key(name))
    probe = probe_key(name, inputs, device, dtype)

    info = store.read("model")
    n = [0]

    gguf = real_gguf(name, inputs.engine)

    def kept(spec: str) -> Measured | str:
        data = store.read(setting_name(stored_spec(spec, gguf), probe))
        if data is None:
            raise Missing(spec)
        got = _record(data)
        if not n[0] or isinstance(got, str):
            return got
        data = store.read(setting_name(spec, f"{probe}|needle:{n[0]}"))
        if data is None:
            raise Missing(spec)
        return _with_needle(got, data)
    try:
        if info is None:
            raise Missing("model")
        limit = min(settings.max_context, info["arch"]["context"] or settings.max_context) - NEW_TOKENS
        n[0] = needle_tokens(inputs.needle, device, limit)
        collected = lab.collect(inputs.engine, kept, inputs.bar)
        cached = True
    except Missing:
        if not measure:
            return None
        plan = AdvisePlan(inputs, store, probe, gguf=gguf)
        collected = run_plan(name, plan, settings=settings, device=device, dtype=dtype, progress=progress,
                             cancel=cancel)
        info, cached, n[0] = store.read("model"), False, plan.needle
    note = NEEDLE_CPU_NOTE.format(seconds=NEEDLE_CPU_SECONDS) if not n[0] and inputs.needle is None else ""
    return compose(name, inputs, info, *collected, cached=cached, seconds=time.perf_counter() - t0,
                   needle=n[0], needle_note=note)


# ---------------------------------------------------------------------------- the answer, put together

def size_words(params: int, name: str = "") -> str:
    """The model's size as its makers give it ("0.5B", the catalogue's), else from its loaded parameters (a GGUF's
    untied output layer counts twice: Qwen2.5-Coder-0.5B loads with 630M)."""
    given = (catalogue.entry(name).size.split() or [""])[0] if catalogue.entry(name) else ""
    if re.fullmatch(r"[\d.]+[MB]", given):
        return given
    return f"{params / 1e9:.1f}B" if params >= 3e8 else f"{params / 1e6:.0f}M"


def compose(name: str, inputs: AdviseInputs, info: dict, got: dict, pruned: dict, needs_answer: bool,
            needs_needle: bool = False, *, cached: bool = False, seconds: float = 0.0, needle: int = 0,
            needle_note: str = "") -> AdviseResult:
    """The AdviseResult from the measurements: each row's bytes in the budget, the bar, the rule's choice."""
    engine, bar = inputs.engine, inputs.bar
    own = Arch(**info["arch"])
    arch = inputs.arch or own
    rows = []
    mine = tuple(lab.own_setting(spec, engine) for spec in lab.OWN)
    for setting in engine.settings + mine:
        d = lab.sliding_flag(setting, engine.key) if own.sliding_layers and setting not in mine else setting
        m = got.get(d.spec)
        row = DeploySetting(spec=d.spec, label=d.label, flag=d.flag, status="pruned", caveats=list(d.caveats),
                            deployable=setting not in mine)
        if d.spec in pruned:
            row.verdict = f"not measured: {pruned[d.spec]}"
        elif isinstance(m, str):
            row.status, row.verdict = "refused", m
        elif m is not None:
            row.status = "cached" if cached else "measured"
            row.mean_kl, row.top1, row.ppl_change_pct = m.mean_kl, m.top1, m.ppl_change_pct
            row.answer, row.answer_right = m.answer, m.answer_right
            row.needle, row.needle_found, row.source = m.needle, m.needle_found, m.source
            row.meets_bar, row.verdict = lab.judge(m, bar, needs_answer, needs_needle)
            if setting in mine:
                row.verdict = f"{row.verdict}; not deployable in {engine.name}"
        else:
            continue
        rows.append(row)
    context = inputs.context or arch.context or 4096
    lab.fit(rows, arch, inputs.gib, inputs.weights, context)
    if inputs.context is None:              # the model's limit, capped at what the budget lets any setting hold
        most = max((r.context_fits for r in rows if r.context_fits), default=0)
        if 0 < most < context:
            context = most
            lab.fit(rows, arch, inputs.gib, inputs.weights, context)
    rows = rows[:1] + sorted(rows[1:], key=lambda r: (not r.deployable, r.status == "pruned", r.status == "refused",
                                                      -(r.bits or 0)))
    choice = lab.recommend(rows)
    keys = list(dict.fromkeys(k for r in rows if r.status != "pruned" for k in r.caveats))
    size = size_words(own.params, name)
    measured = sum(r.status in ("measured", "cached") for r in rows)
    real = [r.label for r in rows if lab.by_real_engine(r)]
    notes = [f"Quality measured on {name} ({size}) with kvplay's emulation of each setting (kvplay/cache/methods), "
             f"{'except the rows marked [the real llama.cpp]' if real else 'not the engine itself'}: KL and top-1 over "
             f"the first {inputs.tokens:,} tokens of {info['text_name']} ({inputs.chunk} tokens a forward, "
             f"teacher-forced), and the answer to \"{info['task']}\"; {measured} settings measured."]
    if real:
        notes.append(f"{len(real)} rows (marked [the real llama.cpp]) were measured by llama.cpp itself on the "
                     "model's GGUF, KL and top-1 against its own f16 cache; the needle, where measured, is kvplay's "
                     "emulation's.")
    if inputs.arch is not None:
        notes.append(f"Bytes counted for {arch.name} (its published architecture); the quality is measured on the "
                     f"{size} sibling, {name}, not on {arch.name}.")
    notes.append(f"Context that fits is a cache-only bound: {inputs.budget} ({inputs.gib:g} GiB) less the weights "
                 f"({inputs.weights}), over the cache's bytes per token; activations, the engine's buffers and "
                 "fragmentation are not counted.")
    if pruned:
        notes.append(f"{len(pruned)} of {len(engine.settings)} K/V pairs were not measured: the measured ones settle "
                     "them (each row says how).")
    if own.sliding_layers and engine.key in ("ollama", "llama.cpp", "lmstudio"):
        notes.append(f"This model has {own.sliding_layers} sliding-window layers: kvplay keeps them 16-bit in every "
                     "row, where llama.cpp quantizes them too; their bytes are bounded by the window.")
    weight_gib = own.params * WEIGHT_BYTES[inputs.weights] / 2**30 if inputs.arch is None else \
        arch.params * WEIGHT_BYTES[inputs.weights] / 2**30
    return AdviseResult(
        model=name, engine=engine.key, engine_name=engine.name, arch=arch.name, projected=inputs.arch is not None,
        size=size, budget_gib=inputs.gib, budget=inputs.budget, weight_dtype=inputs.weights, weight_gib=weight_gib,
        context=context, context_limit=arch.context or None, bar=bar.name, max_kl=bar.max_kl,
        min_top1=bar.min_top1, needs_answer=needs_answer, text_name=info["text_name"],
        text_tokens=inputs.tokens, chunk=inputs.chunk, task=info["task"],
        expected=_task(name).expected, settings=rows, recommended=choice.spec, paste=choice.flag,
        caveats=[lab.CAVEATS[k] for k in keys], notes=notes, env=Environment(**info["env"]),
        measured=f"on {info['measured']}", cached=sum(r.status == "cached" for r in rows),
        seconds=round(seconds, 2), needle_tokens=needle, needs_needle=needs_needle and bool(needle),
        needle_note=needle_note)


# ---------------------------------------------------------------------------- recorded answers

def recording_path(model: str, engine: str, folder: Path = RECORDED) -> Path:
    return folder / model.strip().lower() / f"{engine}.json"


def save_recording(result: AdviseResult, where: str, folder: Path = RECORDED) -> Path:
    """Keep an answer for the Deploy tab to open on: {"kind": "recording", "where": ..., "result": ...}."""
    out = recording_path(result.model, result.engine, folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"kind": "recording", "where": where, "date": str(datetime.date.today()), "result": to_dict(result)}
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def recorded(model: str | None, engine: str, folder: Path = RECORDED) -> AdviseResult | None:
    """The recorded answer for this model and engine, labelled with where and when it was measured; None if none."""
    path = recording_path(str(model or ""), str(engine or ""), folder)
    if not model or not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    result = from_dict(data["result"])
    result.recorded = f"{data['where']}, {data['date']}"
    return result

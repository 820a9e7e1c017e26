"""Compare: one prompt through the 16-bit cache and each quantized cache, side by side.

Per spec, two passes:
  free-running   the spec generates on its own (greedy, or seeded sampling): text,
                 divergence from the baseline, exact bytes per step;
  teacher-forced the baseline's tokens are fed through the spec's cache, decode-style,
                 so attention sees the quantized history; the spec's distribution at
                 each step is compared with the baseline's (KL, top-1, log-prob).

All of them run together (generate.lockstep): one 16-bit prefill fills every cache whose method
declares shares_prefill (the others get their own), then each step is one forward pass over the
baseline's rows, every spec's free-running rows and every spec's teacher-forced rows (the
teacher-forced rows are fed the baseline rows' token of the step before, from the same batch).
iter_compare yields every cache's numbers so far right after prefill and every YIELD_EVERY steps.
Rows stepping together cannot be timed one by one, so afterwards each free-running cache decodes
alone for a few steps, taking turns with the baseline, at the context the run reached
(generate.time_alone): that is its tokens/s (the median step), recorded with the context it was timed at.
Rounds go on, up to MORE_ROUNDS more, until every cache's median step is known within SETTLED of itself
(noise widens the spread of the steps, and more steps narrow the median's); a run shorter than
MIN_TIMED_STEPS, or whose medians are still that uncertain after every round, is "not timed".
wall_s and prefill_s are then the run's (every cache's prefill_s is the shared prefill's, unless its
method has its own). tests/test_lockstep.py keeps the path before, one cache at a time with two passes and a
prefill each, and pins the lockstep to it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplay.cache import (
    CacheSpec,
    analytic_nbytes,
    bits_per_element,
    build_cache,
    calibrate,
    calibration_seconds,
    calibration_time,
    runnable_specs,
)
from kvplay.cache.arch import Arch, context_limit
from kvplay.lab.generate import Row, Sampler, generate, lockstep, speed_stats, time_alone
from kvplay.lab.grading import grade
from kvplay.lab.metrics import divergence, kl_per_step, token_logprob, top1_agree
from kvplay.lab.progress import Progress, last, time_left
from kvplay.results import MIN_TIMED_STEPS, CacheRun, CompareResult, Environment
from kvplay.results.compare import label_for


def environment(model, model_name: str, weights: str | None = None) -> Environment:
    device = model.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    outlying = Arch.from_config(model.config).key_outliers
    return Environment(model=model_name, dtype=str(model.dtype).replace("torch.", ""), device=str(device), gpu=gpu,
                       weights=f"quanto {weights}" if weights else "16-bit",
                       key_outliers=None if outlying is None else list(outlying))


def token_pieces(tokenizer, ids: list[int], known: list[str] = ()) -> list[str]:
    """The text each token adds, so highlighted pieces join back into the decoded text. A token that ends inside a
    character (one byte of an emoji or of Arabic script) adds nothing: the token that completes the character
    shows it whole, never as "\ufffd".

    known: the pieces of a prefix of ids already worked out (each piece depends only on the ids up to it)."""
    pieces, prev = list(known), "".join(known)
    for i in range(len(pieces), len(ids)):
        cur = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        if cur.endswith("\ufffd") and i + 1 < len(ids):        # a character split across tokens: wait for the rest
            pieces.append("")
            continue
        pieces.append(cur[len(prev):])
        prev = cur
    return pieces


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


LONG_CONTEXT = 8192       # "compression at long context" is quoted at this many tokens (or the model's limit)
TOP_K = 5


def long_context_compression(spec, arch: Arch, config) -> tuple[int | None, float | None]:
    """(tokens, baseline bytes / spec bytes) at a long context, from the byte formulas for this model's shape."""
    tokens = min(LONG_CONTEXT, context_limit(config) or LONG_CONTEXT)
    try:
        base = analytic_nbytes(CacheSpec("baseline"), arch, tokens).total
        return tokens, base / max(analytic_nbytes(spec, arch, tokens).total, 1)
    except Exception:  # a spec the formulas do not cover: the UI then quotes only the measured ratio
        return None, None


def top_k(logits: torch.Tensor, tokenizer, k: int = TOP_K) -> tuple[list, list, list]:
    """Per row of (N, V) logits: the k most likely ids, their probabilities and their text."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    ids_l = ids.tolist()
    return (ids_l, [[round(float(p), 4) for p in row] for row in probs],
            [[tokenizer.decode([t]) for t in row] for row in ids_l])


def warm_up(model, input_ids: torch.Tensor, specs) -> None:
    """Pay one-off costs (kernel builds such as quanto's, allocator growth) before timing."""
    for spec in specs:
        generate(model, input_ids[:, :8], build_cache(spec, model), 3, keep_logits=False)


@dataclass(frozen=True)
class Task:
    """The task a prompt asks, as a Compare grades it: its title, the answer and how to find it (lab.grading)."""

    title: str
    expected: str | None
    check: str = "number"


@dataclass(frozen=True)
class CompareJob:
    """A validated compare run, as kvplay.app.compare hands it over: specs parsed once, baseline first."""

    model: Any
    tokenizer: Any
    specs: tuple[CacheSpec, ...]
    prompt: str
    max_new_tokens: int
    model_name: str = ""
    batch_size: int = 1
    sampler: Sampler | None = None
    weights: str | None = None
    prompt_ids: list[int] | None = None
    chat: bool = False
    task: Task | None = None

    def stream(self, progress: Progress | None = None):
        """iter_compare on this job: partial CompareResults as the caches step, then the finished one."""
        return iter_compare(self.model, self.tokenizer, self.specs, self.prompt, self.max_new_tokens,
                            model_name=self.model_name, batch_size=self.batch_size, sampler=self.sampler,
                            weights=self.weights, prompt_ids=self.prompt_ids, chat=self.chat, task=self.task,
                            progress=progress)


def run_compare(model, tokenizer, specs, prompt: str, max_new_tokens: int, **kwargs) -> CompareResult:
    """Run the baseline and each spec on `prompt` to the end (the baseline first): the last of iter_compare."""
    return last(iter_compare(model, tokenizer, specs, prompt, max_new_tokens, **kwargs))


YIELD_EVERY = 8                  # steps between the partial results iter_compare yields
TIME_ROUNDS, TIME_STEPS = 4, 3   # timing: turns per cache, steps per turn (each turn's first discarded): 8 timed
MORE_ROUNDS = 8                  # at most this many more turns each while a cache's median step is unsettled
SETTLED = 0.1                    # a median step known within this share of itself (its standard error) is quoted


@dataclass
class _Run:
    """What every CacheRun of one compare shares."""

    model: Any
    tokenizer: Any
    specs: list
    ids: torch.Tensor                  # (B, T)
    prompt: str
    max_new_tokens: int
    sampler: Sampler
    model_name: str
    weights: str | None
    chat: bool
    task: Task | None = None
    refused: dict = field(default_factory=dict)  # spec -> why this model cannot run it (CompareResult.refused)
    seen: dict = field(default_factory=dict)   # per spec: (ids, pieces, top-5 lists) worked out for a partial result

    def result(self, runs: list[CacheRun]) -> CompareResult:
        s, task = self.sampler, self.task
        return CompareResult(prompt=self.prompt, prompt_tokens=self.ids.shape[1], max_new_tokens=self.max_new_tokens,
                             batch_size=self.ids.shape[0],
                             sampling={"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
                             env=environment(self.model, self.model_name, self.weights), caches=list(runs),
                             chat=self.chat, task=task.title if task else "",
                             expected=task.expected if task else None, check=task.check if task else "number",
                             refused=dict(self.refused))

    def cache_run(self, spec, free, forced, base_trace, *, wall: float, peak, description: str, speed,
                  partial: bool = False, decoded: bool = True) -> CacheRun:
        """One spec's CacheRun from its free-running and teacher-forced traces and the baseline's.

        speed: (tokens/s, [p25, p75], timed steps, context it was timed at or None, why not timed or "").
        decoded: its text is complete, so the task's answer is graded (before speeds are timed)."""
        tokenizer, batch = self.tokenizer, self.ids.shape[0]
        arch = Arch.from_config(self.model.config)
        n = min(len(base_trace.logits), len(forced.logits))
        p = torch.stack([lg[0] for lg in base_trace.logits[:n]]) if n else torch.zeros(0, 1)    # (N, V), row 0
        q = torch.stack([lg[0] for lg in forced.logits[:n]]) if n else torch.zeros(0, 1)
        kl, agree = kl_per_step(p, q), top1_agree(p, q)
        logprob = token_logprob(q, base_trace.tokens[0, :n]) if n else torch.zeros(0)
        own_ids = free.tokens[0].tolist() if free.tokens.numel() else []
        first, frac, spans = divergence(base_trace.tokens[0].tolist() if base_trace.tokens.numel() else [], own_ids)
        ids_before, pieces_before, top_before = self.seen.get(str(spec), ([], [], ([], [], [])))
        done = min(len(top_before[0]), n)            # steps whose top-5 are known: their logits stay as they were
        top_new = top_k(q[done:], tokenizer) if n > done else ([], [], [])
        top_ids, top_probs, top_text = (a[:done] + b for a, b in zip(top_before, top_new))
        pieces = token_pieces(tokenizer, own_ids, pieces_before if own_ids[:len(ids_before)] == ids_before else ())
        self.seen[str(spec)] = (own_ids, pieces, (top_ids, top_probs, top_text))
        tokens_per_s, spread, timed, context_timed, note = speed
        long_tokens, long_ratio = long_context_compression(spec, arch, self.model.config)
        context = [self.ids.shape[1] + k for k in range(len(free.cache_bytes))]
        final = free.cache_bytes[-1]
        base_final = base_trace.cache_bytes[min(len(free.cache_bytes), len(base_trace.cache_bytes)) - 1]
        text = tokenizer.decode(own_ids, skip_special_tokens=True)
        graded = grade(text, self.task.expected, self.task.check) if decoded and self.task else None
        return CacheRun(
            spec=str(spec), text=text, token_ids=own_ids,
            tokens=pieces, first_divergence=first, match_fraction=frac,
            diff_spans=[list(s) for s in spans], kl=[round(float(x), 6) for x in kl],
            top1=[bool(x) for x in agree], baseline_logprob=[round(float(x), 5) for x in logprob],
            mean_kl=float(kl.mean()) if len(kl) else 0.0, max_kl=float(kl.max()) if len(kl) else 0.0,
            top1_agreement=float(agree.float().mean()) if len(agree) else 1.0,
            context_tokens=context, cache_bytes_per_step=free.cache_bytes, cache_bytes=final,
            allocated_bytes=free.allocated_bytes,
            baseline_bytes=base_final, compression=base_final / max(final, 1),
            bits_per_element=bits_per_element(final, arch, context[-1], batch),
            prefill_s=free.prefill_s, prefill_tokens_per_s=free.prefill_tokens_per_s,
            decode_tokens_per_s=tokens_per_s, wall_s=wall, peak_memory_bytes=peak,
            description=description or spec.scheme.summary, decode_timed_steps=timed,
            decode_spread=spread, long_context_tokens=long_tokens, long_context_compression=long_ratio,
            top5_ids=top_ids, top5_probs=top_probs, top5_tokens=top_text,
            decode_context_tokens=context_timed, speed_note=note, partial=partial,
            label=label_for(spec, self.max_new_tokens, self.chat),
            answer=graded[0] if graded else None, answer_right=graded[1] if graded else None)


def _prepare(model, tokenizer, specs, prompt, max_new_tokens, *, model_name, batch_size, sampler, weights,
             prompt_ids, chat, task=None, progress=None) -> _Run:
    specs, refused = runnable_specs(specs, model.config)   # baseline first; each spec checked once per run
    if prompt_ids is None:
        prompt_ids = tokenizer(prompt).input_ids
    ids = torch.tensor([prompt_ids], device=model.device)               # (1, T)
    ids = ids.expand(batch_size, -1).contiguous()                       # (B, T): the same prompt B times
    return _Run(model, tokenizer, specs, ids, prompt, max_new_tokens, sampler or Sampler(), model_name, weights, chat,
                task, refused)


@dataclass
class _Group:
    """Caches decoded together in one lockstep: the baseline's rows first, then each spec's free-running and
    teacher-forced rows."""

    specs: list
    rows: list[Row]
    wall: float = 0.0

    @property
    def free(self) -> list[Row]:
        return [self.rows[0], *self.rows[1::2]]

    @property
    def forced(self) -> list[Row]:
        return [self.rows[0], *self.rows[2::2]]


def _group(model, specs, sampler: Sampler) -> _Group:
    rows = []
    for spec in specs:
        shared = dict(shares_prefill=spec.method.shares_prefill, prefill_key=str(spec), name=str(spec))
        rows.append(Row(build_cache(spec, model), Sampler(sampler.temperature, sampler.top_p, sampler.seed),
                        keep_logits=not rows, **shared))                 # free-running; the baseline's logits kept
        if len(rows) > 1:                                                 # teacher-forced on the baseline's tokens
            rows.append(Row(build_cache(spec, model), follow=0, measure_bytes=False, **shared))
    return _Group(list(specs), rows)


def iter_compare(model, tokenizer, specs, prompt: str, max_new_tokens: int, *, model_name: str = "",
                 batch_size: int = 1, sampler: Sampler | None = None, weights: str | None = None,
                 prompt_ids: list[int] | None = None, chat: bool = False, task: Task | None = None,
                 progress: Progress | None = None):
    """Like run_compare, but yields partial CompareResults as the caches step (for streaming UIs): every cache's
    numbers so far (CacheRun.partial) right after prefill and every YIELD_EVERY steps, the last step's, and
    the finished result once more with the speeds.

    A cache whose method still has to calibrate on this model (Method.calibrated false: kvplay's rankings and
    key rotations, for a model nothing is kept for) does not hold the others up: they decode first, with it
    named in CompareResult.calibrating (a partial result says so as soon as they have decoded); then it
    calibrates (the progress says how long is left), decodes beside a second 16-bit run and joins. Greedy and
    seeded decoding give the 16-bit run the same tokens both times, so its figures are measured against the same
    reference.

    prompt_ids: the prompt as the model reads it (kvplay.app.prompts.encode, chat template applied when `chat`);
    default: the raw prompt text tokenized. progress(fraction, "step 12 of 64") at every step. task: the answer
    every cache's text is graded against, as soon as decoding ends (before the speeds are timed).
    """
    run = _prepare(model, tokenizer, specs, prompt, max_new_tokens, model_name=model_name, batch_size=batch_size,
                   sampler=sampler, weights=weights, prompt_ids=prompt_ids, chat=chat, task=task, progress=progress)
    specs, ids, sampler = run.specs, run.ids, run.sampler
    base, *others = specs
    later = [s for s in others if not s.method.calibrated(s, model)]
    progress = progress or (lambda frac, desc: None)
    rounds = TIME_ROUNDS + MORE_ROUNDS
    timing = rounds * TIME_STEPS * len(specs) if max_new_tokens >= MIN_TIMED_STEPS else 0
    # progress counts steps (timing's too, at most that many): a first decode, then where a cache calibrates, the
    # calibration (counted as one decode) and a second decode
    decoding = max_new_tokens * (3 if later else 1)
    total = decoding + timing
    estimate = calibration_time.words(calibration_seconds(later, model))
    waiting = {str(s): f"calibrating once for this model ({estimate} on this machine, estimated), then decoding"
               for s in later}
    groups: list[_Group] = []
    t0 = time.perf_counter()

    def result(speeds=None, peaks=None, decoded=False, partial_group=None):
        partial, n, runs = speeds is None, ids.shape[1], {}
        for g, group in enumerate(groups):
            for c, spec in enumerate(group.specs):
                if g and not c:
                    continue                          # the second 16-bit run only serves as its group's reference
                at = c if not g else len(groups[0].specs) + c - 1
                runs[str(spec)] = run.cache_run(
                    spec, group.free[c].trace(n), group.forced[c].trace(n), group.free[0].trace(n),
                    wall=group.wall or time.perf_counter() - t0, peak=peaks[at] if peaks else None,
                    description=getattr(group.free[c].cache, "description", ""),
                    speed=speeds[at] if speeds else (0.0, [], 0, None, ""), partial=partial,
                    decoded=decoded or (group is not partial_group and group.wall > 0))
        ordered = [runs[str(s)] for s in specs if str(s) in runs]
        return dataclasses.replace(run.result(ordered), calibrating=dict(waiting))

    def decode(group: _Group, done_before: int, what: str):
        def prefilled(done, of):
            progress(done_before / total, f"{what}prefill ({ids.shape[1]:,} tokens): {done} of {of} done")
        start = time.perf_counter()
        progress(done_before / total, f"{what}prefill ({ids.shape[1]:,} tokens)")
        for steps in lockstep(model, ids, group.rows, max_new_tokens,
                              stop_token=tokenizer.eos_token_id if chat else None, on_prefill=prefilled):
            progress((done_before + steps) / total, f"{what}step {steps} of {max_new_tokens}")
            if steps == 1 or steps % YIELD_EVERY == 0:
                yield result(partial_group=group)
        group.wall = time.perf_counter() - start

    groups.append(_group(model, [base, *[s for s in others if s not in later]], sampler))
    yield from decode(groups[0], 0, "")
    yield result(decoded=True) if not later else result(partial_group=None)
    if later:
        names = ", ".join(map(str, later))
        start = time.perf_counter()

        def calibrating(fraction, what):             # in this thread, so the device stays held and Stop acts
            left = time_left(start, fraction)
            progress((max_new_tokens + fraction * max_new_tokens) / total, what + (f" ({left})" if left else ""))
        calibrate(later, model, tokenizer, calibrating)
        waiting.clear()
        groups.append(_group(model, [base, *later], sampler))
        yield from decode(groups[1], 2 * max_new_tokens, f"{names}: ")
        yield result(decoded=True)
    progress(decoding / total, "timing each cache alone")
    done = iter(range(decoding + 1, total + 1))

    def step(round_):
        progress(next(done) / total, f"timing each cache alone (round {round_} of at most {rounds})")
    free = groups[0].free + [row for g in groups[1:] for row in g.free[1:]]
    speeds = _time_speeds(model, free, max_new_tokens, step)
    progress(1.0, "timed")                            # a quiet machine settles before the last round
    yield result(*speeds, decoded=True)


def _time_speeds(model, rows: list[Row], max_new_tokens: int, on_step=None):
    """Per free-running row: (tokens/s, [p25, p75], timed steps, context, note), each cache alone, in turns of
    TIME_ROUNDS rounds, then one round at a time while any cache's median step is unsettled (uncertainty() above
    SETTLED), up to MORE_ROUNDS more; and per row the peak GPU memory over its turns (None off CUDA).
    on_step(round): after every step."""
    caches = [row.cache for row in rows]
    contexts = [cache.get_seq_length() for cache in caches]
    room = context_limit(model.config) or 1 << 30
    if max_new_tokens < MIN_TIMED_STEPS:
        return [(0.0, [], 0, None, "")] * len(rows), None       # render: "too short to time"
    if max(contexts) + (TIME_ROUNDS + MORE_ROUNDS) * TIME_STEPS > room:
        return [(0.0, [], 0, None, "no room left in the model's context")] * len(rows), None
    seconds: list[list[float]] = [[] for _ in rows]
    peaks: list[int | None] = [None] * len(rows)
    tokens = [row.tokens[-1] for row in rows]
    done, taken = 0, iter(range(1 << 30))

    def stepped():
        if on_step is not None:
            on_step(next(taken) // (TIME_STEPS * len(rows)) + 1)
    while done < TIME_ROUNDS or (done < TIME_ROUNDS + MORE_ROUNDS and
                                 max(uncertainty(s) for s in seconds) > SETTLED):
        turns = TIME_ROUNDS if done == 0 else 1
        more, peak = time_alone(model, caches, tokens, rounds=turns, steps=TIME_STEPS, on_step=stepped)
        seconds = [s + m for s, m in zip(seconds, more)]
        peaks = [p if q is None else max(p or 0, q) for p, q in zip(peaks, peak)]
        done += turns
    batch = tokens[0].shape[0]
    out = []
    for c, steps in enumerate(seconds):
        speed, quartiles, timed = speed_stats([0.0, *steps], batch)        # speed_stats drops the first step
        unsure = max(uncertainty(steps), uncertainty(seconds[0]))           # a ratio to 16-bit needs both
        if unsure > SETTLED:
            out.append((0.0, [], 0, contexts[c], f"the machine is busy (after {done} rounds its median step time "
                                                     f"was still uncertain by ±{100 * unsure:.0f}%)"))
        else:
            out.append((speed, quartiles, timed, contexts[c], ""))
    return out, peaks


def uncertainty(seconds: list[float]) -> float:
    """The standard error of the median step time, as a share of it: 1.25 sigma / sqrt(n), sigma estimated from the
    middle half of the steps (robust to the odd slow step), so more steps settle a noisy median; inf without steps."""
    if len(seconds) < 2:
        return float("inf")
    return 1.2533 * (_spread(seconds) / 1.349) / math.sqrt(len(seconds))


def _spread(seconds: list[float]) -> float:
    """Width of the middle half of step times, as a share of their median."""
    s = sorted(seconds)
    if not s:
        return 0.0
    def at(f: float) -> float:
        return s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]
    return (at(0.75) - at(0.25)) / max(at(0.5), 1e-9)



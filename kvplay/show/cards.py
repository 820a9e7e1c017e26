"""HTML and code snippets for the UI and the report: results in, strings out (no model runs).

The verdict comes first: one plain line per cache, coloured by VERDICT_THRESHOLDS, and one
sentence comparing caches of similar size. Cards follow, with every generated token shaded by
that step's KL and a hover card listing the 16-bit model's top-5 next tokens beside this cache's.
"""
from __future__ import annotations

import html
import math

from kvplay.cache.evict import kept_sentence
from kvplay.results import CacheRun, CompareResult, speed_reason, timed
from kvplay.show.profile import profile_text
from kvplay.show.style import colour_for

# Verdict colours, from the teacher-forced metrics (every cache reads the 16-bit text, so every step counts):
#   green "close to 16-bit"   mean KL <= 0.02 nats and top-1 agreement >= 95%
#   red   "far from 16-bit"   mean KL > 0.5 nats or top-1 agreement < 60%
#   amber "drifts"            anything between
# Issue 11's SmolLM2 figures land as: kvplay-int4 (0.007, 96%) green, quanto-int4 (0.017, 92%) amber,
# kvplay-int2 (0.17, 77%) amber, quanto-int2 (1.98, 33%) red.
VERDICT_THRESHOLDS = {"green": {"max_kl": 0.02, "min_top1": 0.95}, "red": {"kl_above": 0.5, "top1_below": 0.6}}
MIN_VERDICT_TOKENS = 8  # mid-run, no cache is called close to or far from 16-bit on fewer tokens: it reads "pending"
TONE_WORDS = {"green": "close to 16-bit", "amber": "drifts from 16-bit", "red": "far from 16-bit",
              "pending": "pending"}
TONE_VERBS = {"green": "stays close to 16-bit", "amber": "drifts from 16-bit", "red": "ends far from 16-bit",
              "pending": "has too few tokens to judge"}
TONE_ORDER = {"green": 0, "amber": 1, "red": 2, "pending": 3}     # best first, for ranking


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def fmt_kl(kl: float) -> str:
    """KL in nats for reading: two significant digits, no exponents."""
    if kl < 0.001:
        return "0" if kl == 0 else "<0.001"
    return f"{kl:.2g}" if kl < 10 else f"{kl:.0f}"


def tone_of(mean_kl: float, top1_agreement: float) -> str:
    """green, amber or red from a mean KL (nats) and a top-1 agreement (0-1), teacher-forced."""
    g, r = VERDICT_THRESHOLDS["green"], VERDICT_THRESHOLDS["red"]
    if mean_kl > r["kl_above"] or top1_agreement < r["top1_below"]:
        return "red"
    if mean_kl <= g["max_kl"] and top1_agreement >= g["min_top1"]:
        return "green"
    return "amber"


def tone(run: CacheRun) -> str:
    """green, amber or red from the teacher-forced figures; "pending" while a run still decoding has fewer than
    MIN_VERDICT_TOKENS steps (a finished short answer is judged on what it has), or one that decoded none."""
    if not run.kl or (run.partial and len(run.kl) < MIN_VERDICT_TOKENS):
        return "pending"
    return tone_of(run.mean_kl, run.top1_agreement)


def speed_text(run: CacheRun) -> str:
    if not timed(run):
        return f"speed not timed: {speed_reason(run)}"
    lo, hi = (run.decode_spread or [run.decode_tokens_per_s] * 2)
    at = f" at {run.decode_context_tokens:,} tokens" if run.decode_context_tokens else ""
    if f"{lo:{_rate(lo)}}" == f"{hi:{_rate(hi)}}":
        return f"{run.decode_tokens_per_s:{_rate(run.decode_tokens_per_s)}} tok/s{at}"
    return (f"{run.decode_tokens_per_s:{_rate(run.decode_tokens_per_s)}} tok/s{at} (half the steps ran at "
            f"{lo:{_rate(lo)}}-{hi:{_rate(hi)}} tok/s)")


def speed_clause(run: CacheRun, base: CacheRun) -> str:
    """The verdict's speed against 16-bit, with the context it was timed at; "not timed" and why, never a number."""
    if timed(run) and timed(base) and base.decode_tokens_per_s > 0:
        ratio = f"{run.decode_tokens_per_s / base.decode_tokens_per_s:.1f}x"
        if not run.decode_context_tokens:                    # results saved before speeds said their context
            return f"{ratio} the speed"
        return f"at {run.decode_context_tokens:,} tokens: {ratio} the 16-bit speed; at 8k: see the Throughput tab"
    return f"speed not timed: {speed_reason(run) if not timed(run) else speed_reason(base)}"


def _rate(tok_s: float) -> str:
    """A format for tokens/s: one decimal under 10 tok/s, whole numbers above."""
    return ".1f" if tok_s < 10 else ".0f"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def fmt_bits(bits: float) -> str:
    """Bits per element for reading: at most two decimals (2.48, 3.3, 16)."""
    return f"{bits:.2f}".rstrip("0").rstrip(".")


def bits_text(run: CacheRun, badge: bool = False) -> str:
    """All-in bits per element now (measured) and at the long context (16 bits / the formulas' ratio):
    '3.9 and 3.3 bits per element' for the verdict, '3.9 now, 3.3 at 8k' for a card's badge."""
    now = fmt_bits(run.bits_per_element)
    if not run.long_context_compression or run.label.reference:
        return now if badge else f"{now} bits per element"
    long = fmt_bits(16 / run.long_context_compression)
    return f"{now} now, {long} at {_k(run.long_context_tokens)}" if badge else f"{now} and {long} bits per element"


def compression_text(run: CacheRun) -> str:
    """'2.3x now, 3.4x at 8k tokens: the newest 128 tokens stay 16-bit' (or just the ratio now)."""
    now = f"{run.compression:.1f}x now"
    if run.long_context_compression is None or run.label.reference:
        return now
    long = f"{run.long_context_compression:.1f}x at {_k(run.long_context_tokens)} tokens"
    reason = run.label.window_reason
    return f"{now}, {long}" + (f": {reason}" if reason else "")


def _text_match(run: CacheRun, n: int) -> str:
    if run.first_divergence is None:
        return f"same text for all {n} tokens"
    if run.first_divergence == 0:
        return f"different text from the first token (of {n})"
    return f"same text for the first {run.first_divergence} of {n} tokens"


def verdict_line(run: CacheRun, base: CacheRun) -> tuple[str, str]:
    """(tone, plain words) for one quantized cache; pending, with the count so far, until it can be judged."""
    n = len(run.token_ids)
    t = tone(run)
    if t == "pending":
        if not run.partial:
            return t, f"{run.label.name}: not judged · no token decoded · {run.compression:.1f}x smaller now"
        return t, (f"{run.label.name}: pending · {len(run.kl)} tokens so far (a verdict needs "
                   f"{MIN_VERDICT_TOKENS}) · {run.compression:.1f}x smaller now")
    size = f"{run.compression:.1f}x smaller now"
    if run.long_context_compression is not None:
        size += f", {run.long_context_compression:.1f}x at {_k(run.long_context_tokens)} tokens"
    size += f" ({bits_text(run)})"
    parts = [size, _text_match(run, n), f"picks 16-bit's next token {100 * run.top1_agreement:.0f}% of the time",
             _kl_words(run)]
    parts.append(speed_clause(run, base))
    return t, f"{run.label.name}: {TONE_WORDS[t]} · " + " · ".join(parts)


def _size(run: CacheRun) -> float:
    return run.long_context_compression or run.compression


def size_words(run: CacheRun) -> str:
    """A cache's size as the headline gives it, always with when: "6.4x smaller at 8k" (the byte formulas at long
    context) or "2.8x smaller now" (measured, where no long-context figure exists)."""
    if run.long_context_compression and not run.label.reference:
        at = _k(run.long_context_tokens) if run.long_context_tokens else "long context"
        return f"{run.long_context_compression:.1f}x smaller at {at}"
    return f"{run.compression:.1f}x smaller now"


def _kl_words(run: CacheRun) -> str:
    """"KL 0.012", or "KL <0.001 over 6 tokens" for an answer shorter than a mid-run verdict waits for."""
    n = len(run.kl)
    return f"KL {fmt_kl(run.mean_kl)}" + (f" over {n} tokens" if n < MIN_VERDICT_TOKENS else "")


def _closeness(run: CacheRun) -> tuple[int, float]:
    return TONE_ORDER[tone(run)], run.mean_kl


def _names(runs: list[CacheRun]) -> str:
    """"hqq-int2 (6.4x smaller at 8k)", "a and b (6.4x smaller at 8k each)", "a (…) and b (…)", or "a (…), b (…)
    and 2 others": every size says whose it is."""
    sizes = {size_words(r) for r in runs}
    if len(sizes) == 1 and len(runs) <= 3:
        names = [r.spec for r in runs]
        each = " each" if len(runs) > 1 else ""
        return (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + f"{names[-1]} ({sizes.pop()}{each})"
    named = [f"{r.spec} ({size_words(r)})" for r in runs[:3]]
    if len(runs) > 3:
        return f"{named[0]}, {named[1]} and {len(runs) - 2} others"
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + f" and {named[-1]}"


def lead(runs: list[CacheRun]) -> CacheRun:
    """The cache the headline leads with. Where some cache kept the task's answer: one that did, in the best
    verdict colour among them, the smallest of those (closest to 16-bit on a tie). Where none was graded: the same
    without answers. Where every cache lost the answer: the one that drifts least."""
    if all(r.answer_right is False for r in runs):
        return min(runs, key=_closeness)
    pool = [r for r in runs if r.answer_right is not False]
    best = min(TONE_ORDER[tone(r)] for r in pool)
    return max((r for r in pool if TONE_ORDER[tone(r)] == best), key=lambda r: (_size(r), -r.mean_kl))


def _contrast(best: CacheRun, runs: list[CacheRun]) -> str:
    """At most one clause after the lead, the most telling first: the caches that lost the answer; else a smaller
    cache and how it fares; else a larger cache closer to 16-bit."""
    lost = sorted((r for r in runs if r.answer_right is False), key=_size, reverse=True)
    if lost:
        return f"{_names(lost)} lost it"
    smaller = [r for r in runs if r is not best and _size(r) > _size(best)]
    if smaller:
        s = max(smaller, key=_size)
        return f"the smallest, {s.spec} ({size_words(s)}), {TONE_VERBS[tone(s)]} ({_kl_words(s)})"
    closer = [r for r in runs if r is not best and _closeness(r) < _closeness(best)]
    if closer:
        c = min(closer, key=_closeness)
        return f"{c.spec} ({size_words(c)}) is closer still ({_kl_words(c)})"
    return ""


def _judged_sentence(runs: list[CacheRun]) -> str:
    """The finding, led by a cache that kept the answer whenever one did (each size with whose it is and when)."""
    best = lead(runs)
    named = f"{best.spec} ({size_words(best)})"
    if best.answer_right is False:
        if len(runs) == 1:
            return f"{named} lost the answer ({_kl_words(best)})"
        return f"No cache kept the answer; {named} drifts least ({_kl_words(best)})"
    kept = " kept the answer and" if best.answer_right else ""
    contrast = _contrast(best, runs)
    return f"{named}{kept} {TONE_VERBS[tone(best)]} ({_kl_words(best)})" + (f"; {contrast}" if contrast else "")


def overall_sentence(result: CompareResult) -> str:
    """One sentence on the caches, led by one that kept the task's answer; labelled as partial while they decode,
    and pending while any has fewer than MIN_VERDICT_TOKENS tokens and is still decoding. A finished short answer
    is judged on the tokens it has, and says how many. Caches still calibrating are named first, as joining."""
    runs, waiting = result.caches[1:], " and ".join(result.calibrating)
    joins = f"{waiting} join{'s' * (len(result.calibrating) == 1)} once calibrated for this model. " if waiting else ""
    if not runs:
        return joins + ("16-bit has decoded." if waiting else "Only the 16-bit baseline ran: pick a quantized cache.")
    done, partial = min(len(r.kl) for r in runs), any(r.partial for r in runs)
    if any(tone(r) == "pending" for r in runs):
        if partial:
            return joins + (f"Decoding: {done} of {result.max_new_tokens} tokens so far; the verdict comes at "
                            f"{MIN_VERDICT_TOKENS}.")
        return "No token was decoded, so there is nothing to judge: ask for at least one new token."
    sentence = _judged_sentence(runs) + "."
    if partial:
        graded = (" (answers are checked when decoding ends)"
                  if result.expected is not None and any(r.answer_right is None for r in runs) else "")
        sentence = f"So far, {done} of {result.max_new_tokens} tokens{graded}: " + sentence[0].lower() + sentence[1:]
    return joins + sentence


def headline(result: CompareResult) -> tuple[str, list[tuple[str, str]]]:
    """(overall sentence, [(tone, line), ...]) shared by the UI and the HTML report."""
    base = result.caches[0]
    lines = [verdict_line(r, base) for r in result.caches[1:]]
    answers = [task_line(r, result) for r in result.caches[1:]]
    lines = [(t, f"{text} · {a[0]}" if a else text) for (t, text), a in zip(lines, answers)]   # the task's answer
    lines += [("refused", f"Not run: {line}") for line in refusals(result.refused)]   # the model's refusals, said
    lines += [("pending", f"{spec}: {what}") for spec, what in result.calibrating.items()]   # joins when ready
    return overall_sentence(result), lines


def refusals(refused: dict[str, str]) -> list[str]:
    """The refusals, one line per reason: caches refused for the same reason ("quanto-int4: transformers' ...")
    share one line that names them all."""
    by_reason: dict[str, list[str]] = {}
    for spec, why in refused.items():
        reason = why[len(spec) + 2:] if why.startswith(f"{spec}: ") else why
        by_reason.setdefault(reason, []).append(spec)
    return [f"{' and '.join(specs)}: {reason}" for reason, specs in by_reason.items()]


VERDICT_FOOTNOTE = ("Green: mean KL at most 0.02 nats and top-1 agreement at least 95%. Red: mean KL above 0.5 or "
                    "top-1 agreement under 60%. Amber: between. KL and top-1 are teacher-forced (every cache reads "
                    "the 16-bit text); \"same text\" compares each cache's own greedy text, which stops matching "
                    "after the first different token even when later steps agree. Speeds: after the run each cache "
                    "decodes alone for a few steps, taking turns with the 16-bit cache, at the context the run "
                    "reached (the median step, {where}); longer contexts: the Throughput tab. While decoding, a cache "
                    "is judged once it has 8 tokens; an answer that ended sooner is judged on the tokens it has.")


def reference_line(result: CompareResult) -> str:
    """The 16-bit baseline's line under the verdict: its bytes, speed and answer."""
    base = result.caches[0]
    ref = (f"16-bit baseline: {mib(base.cache_bytes)} of cache after {base.context_tokens[-1]:,} tokens · "
           f"{speed_text(base)}" + (f", measured {result.where}" if timed(base) else ""))
    answer = task_line(base, result)
    return ref + (f" · {answer[0]}" if answer else "")


def verdict_text(result: CompareResult) -> str:
    """The verdict as plain lines, for a terminal: the sentence, a line per cache, the 16-bit reference's."""
    sentence, lines = headline(result)
    return "\n".join([sentence, *(f"  {text}" for _, text in lines), f"  {reference_line(result)}"])


def verdict_html(result: CompareResult) -> str:
    sentence, lines = headline(result)
    items = "".join(f"<li class='kv-verdict-line {t}'>{html.escape(text)}</li>" for t, text in lines)
    ref = reference_line(result)
    card = f"<p class='kv-profile'>{html.escape(profile_text(result.profile))}</p>" if result.profile else ""
    return (f"<div class='kv-verdict'><p class='kv-overall'>{html.escape(sentence)}</p><ul>{items}"
            f"<li class='kv-verdict-line ref'>{html.escape(ref)}</li></ul>{card}"
            f"<p class='kv-foot'>{html.escape(VERDICT_FOOTNOTE.format(where=result.where))}</p></div>")


# ---------------------------------------------------------------------------- cards

def _badge(label: str, value: str, tone_: str = "", tip: str = "") -> str:
    title = f" title='{html.escape(tip, quote=True)}'" if tip else ""
    return f"<span class='kv-badge {tone_}'{title}><b>{html.escape(value)}</b> {html.escape(label)}</span>"


def _shade(kl: float) -> str:
    """Background for a token whose step had this KL: none below 0.001 nats, darker up to 1 nat."""
    if kl < 1e-3:
        return ""

    strength = min(1.0, math.log10(1 + 1000 * kl) / 3)          # 0.001 -> 0.1, 0.01 -> 0.35, 0.1 -> 0.67, 1 -> 1
    return f" style='background: rgba(255, 140, 0, {0.08 + 0.55 * strength:.2f})'"


def _show(piece: str) -> str:
    return piece.replace("\n", "↵").replace(" ", "·") or "∅"


def _top_list(cls: str, title: str, tokens: list[str], probs: list[float], chosen: str | None) -> str:
    items = "".join(f"<li{' class=chosen' if t == chosen else ''}><code>{html.escape(_show(t))}</code> "
                    f"{100 * p:.1f}%</li>" for t, p in zip(tokens, probs))
    return f"<div class='{cls}'><b>{html.escape(title)}</b><ol>{items}</ol></div>"


def _tip(run: CacheRun, base: CacheRun, i: int) -> str:
    if i >= len(base.top5_tokens):
        return ""
    chosen = base.tokens[i] if i < len(base.tokens) else None
    lists = _top_list("kv-top-base", "16-bit top-5", base.top5_tokens[i], base.top5_probs[i], chosen)
    head = f"step {i}"
    if run is not base and i < len(run.top5_tokens):
        lists += _top_list("kv-top-cache", f"{run.spec} top-5", run.top5_tokens[i], run.top5_probs[i], chosen)
        head += f" · KL {fmt_kl(run.kl[i])} nats" if i < len(run.kl) else ""
    note = ""
    if run.first_divergence is not None and i > run.first_divergence:
        note = (f"<p>Both read the 16-bit text up to here; this card's own text departed at token "
                f"{run.first_divergence}.</p>")
    return f"<span class='kv-tip'><b>{html.escape(head)}</b>{note}<span class='kv-lists'>{lists}</span></span>"


def _tokens_html(run: CacheRun, base: CacheRun) -> str:
    differs = set()
    for a, b in run.diff_spans:
        differs.update(range(a, b))
    out = []
    for i, t in enumerate(run.tokens):
        cls = "kv-tok diff" if i in differs else "kv-tok"
        shade = _shade(run.kl[i]) if run is not base and i < len(run.kl) else ""
        out.append(f"<span class='{cls}' tabindex='0'{shade}>{html.escape(t)}{_tip(run, base, i)}</span>")
    return "".join(out)


def task_line(run: CacheRun, result: CompareResult) -> tuple[str, bool] | None:
    """("answer: 27611 ✓" or "answer: 2761 ✗ (expected 27611)", right?) when the task has an answer to check: the
    lab grades each cache as soon as its decoding ends."""
    if result.expected is None:
        return None
    if run.answer is None:
        return "answer: checked when decoding ends", False
    if run.answer_right:
        return f"answer: {run.answer} ✓", True
    return f"answer: {run.answer} ✗ (expected {result.expected})", False


def task_html(run: CacheRun, result: CompareResult) -> str:
    line = task_line(run, result)
    if line is None:
        return ""
    cls = "waiting" if run.answer is None else "right" if line[1] else "wrong"
    return f"\n<div class='kv-task {cls}'>{html.escape(line[0])}</div>"


def kept_text(run: CacheRun, prompt_tokens: int) -> str:
    """What an evicting cache kept of the prompt: "keeps 256 of 1,024 prompt tokens (SnapKV, scored by ...)"."""
    return "" if run.label.keep is None else kept_sentence(run.label.keep, run.label.evicts, prompt_tokens)


def card(run: CacheRun, result: CompareResult) -> str:
    base_run = result.caches[0]
    base = run is base_run
    reason = run.label.window_reason if not base else ""
    size = f"{run.compression:.1f}x smaller now"
    if run.long_context_compression is not None and not base:
        size += f", {run.long_context_compression:.1f}x at {_k(run.long_context_tokens)} tokens"
        size += "*" if reason else ""
    spare = (run.allocated_bytes or run.cache_bytes) - run.cache_bytes
    badges = [_badge("cache", mib(run.cache_bytes),
                     tip="Bytes in use: codes, scales and zero points, and every 16-bit token. Allocated, with the "
                         f"buffers' spare capacity: {mib(run.cache_bytes + spare)}."),
              _badge("", size,
                     tip="16-bit bytes / this cache's bytes, measured now; the long-context figure is from the byte "
                         f"formulas for this model. {reason}. The 16-bit window is a fixed cost long contexts dilute."),
              _badge("bits per element", bits_text(run, badge=True),
                     tip="Stored bits per key or value number, all-in: codes, scales, zero points and every 16-bit "
                         "token; now (measured), then at long context (the byte formulas)."),
              _badge("", speed_text(run), tip="Decode speed: this cache alone, the median of its decode steps after "
                                              f"the run, at the context shown, {result.where}.")]
    if base:
        del badges[1]            # the reference is not smaller than itself
    if not base:
        t = tone(run)
        badges = [_badge("", TONE_WORDS[t], t)] + badges + [
            _badge("", _text_match(run, len(run.token_ids))),
            _badge("top-1 agreement", f"{100 * run.top1_agreement:.0f}%",
                   tip="Teacher-forced: share of steps where this cache's most likely token is 16-bit's."),
            _badge("mean KL", fmt_kl(run.mean_kl), tip="Teacher-forced KL(16-bit || this cache), nats per step.")]
    kept = kept_text(run, result.prompt_tokens)
    kept = f"<div class='kv-kept'>{html.escape(kept)}</div>" if kept else ""
    tail = result.prompt[-160:]
    foot = f"<br>* {html.escape(reason)}, so a short run compresses less." if reason else ""
    # The prompt's tail and the answer in two labelled blocks, a rule between (no newline: kv-text keeps spaces).
    prompt = f"<div class='kv-prompt'><span class='kv-label'>prompt</span>…{html.escape(tail)}</div>"
    answer = f"<div class='kv-answer'><span class='kv-label'>answer</span>{_tokens_html(run, base_run)}</div>"
    return f"""<div class='kv-card' style='border-top: 4px solid {colour_for(run)}'>
<div class='kv-title'>{html.escape(run.spec)}{' <small>(16-bit reference)</small>' if base else ''}</div>
<div class='kv-badges'>{''.join(badges)}</div>{kept}{task_html(run, result)}
<div class='kv-text'>{prompt}{answer}</div>
<div class='kv-desc'>{html.escape(run.description)}{foot}</div></div>"""


CARD_LEGEND = ("<p class='kv-legend'>Shading: that step's KL against 16-bit (darker: the cache was less sure of "
               "16-bit's token, often before its text departs). Red underline: this card's text differs from 16-bit. "
               "Hover or tap a token for the 16-bit top-5 next tokens beside this cache's.</p>")


def refused_card(spec: str, why: str, badge: str = "not run on this model") -> str:
    """A cache that did not run: one the model's architecture refuses (its refusal's sentence), or one still
    calibrating while the others decode (badge "calibrating"), in no verdict colour."""
    return f"""<div class='kv-card kv-refused' style='border-top: 4px solid {colour_for(spec)}'>
<div class='kv-title'>{html.escape(spec)}</div>
<div class='kv-badges'>{_badge("", badge, "refused" if badge.startswith("not run") else "pending")}</div>
<div class='kv-desc'>{html.escape(why)}</div></div>"""


def cards_html(result: CompareResult) -> str:
    cards = ([card(r, result) for r in result.caches] + [refused_card(s, why) for s, why in result.refused.items()]
             + [refused_card(s, what, "calibrating") for s, what in result.calibrating.items()])
    return CARD_LEGEND + "<div class='kv-cards'>" + "".join(cards) + "</div>"


def snippets_markdown(result: CompareResult) -> str:
    return "\n".join(f"**{r.spec}**\n```python\n{r.label.snippet}```\n" for r in result.caches)
